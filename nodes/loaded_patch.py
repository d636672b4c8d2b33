"""A streamed weight patched as ComfyUI patches a loaded one (``LoadedPatch``, ``as_loaded``), and a plain LoRA
patched in the engine's scratch (``patch_plain_loras``).

A patched weight of a streamed ComfyUI op gets a ``LoadedPatch``, run on the compute stream when a fresh copy
of its block is first used, which repeats ComfyUI's patch of a loaded weight
(``ModelPatcher.patch_weight_to_device``) on the streamed weight: the same dtype for the arithmetic, the same
seeded stochastic rounding to the stored dtype (or the quantized format's own ``set_weight``), written over
the copy in the ring. The layer then has no weight function: ComfyUI's ops compute from it as from a loaded
weight (a weight function would make them copy the weight at every call, an allocation the resident model
never makes), and a block that stays in the ring is patched once. A streamed block so computes exactly what a
loaded one does, in every stored dtype, where ComfyUI's lowvram path would round differently. A weight with
only wrapper patches, or of a format with no ``set_weight``, gets weight functions instead.

A plain LoRA is patched in scratch memory allocated with the ring, so a streamed step allocates what the
resident one does, nothing more (ComfyUI's compiler records and replays each block call's allocations).
``comfy.lora.calculate_weight`` allocates at each weight: the cast of the weight to the dtype the patch is
computed in, the product of up and down, its scaling (and a cast of it, where that dtype differs from the
weight's). Here the same operations, in the same order and dtypes, write into views of one scratch buffer the
engine keeps (``BlockStreamer``'s ``scratch_bytes``): ``mm(out=)``, in-place scaling, ``copy_`` for each cast,
then the add into the weight's copy, bit for bit what ComfyUI computes (a fused ``addmm_`` would round
differently). Anything else (a LoHa, DoRA, a LoRA with a mid weight or an offset, a layer's own ``convert_``
or ``set_`` function) is patched by ComfyUI's own code.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils
import comfy.weight_adapter
import torch
from comfy.model_patcher import ModelPatcher

from ..offload.layout import TensorForm
from .patches import host_tensors, is_plain, overwrite_in_place, stored_by_layer, with_host_tensors

# The seed of a weight's stochastic rounding: in comfy.utils since 0.33 (where comfy.model_patcher's name
# warns at each call), only in comfy.model_patcher before.
string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


#: Ring positions a LoadedPatch keeps its patches rebuilt for (they repeat from step to step).
_POSITIONS_KEPT = 16


def _lora_dtype(device: torch.device) -> torch.dtype:
    """The dtype ComfyUI patches a loaded weight in (0.33 may choose fp16 on a GPU; 0.3.75: fp32)."""
    chooser = getattr(comfy.model_management, "lora_compute_dtype", None)
    return chooser(device) if chooser is not None else torch.float32


class LoadedPatch:
    """A module's weight patched as ComfyUI patches a loaded weight, computed where the weight is streamed to.

    ComfyUI's ops call it with their cast of the weight to the compute dtype, which may already have rounded
    it: it patches the module's own tensor (the stored dtype, on the device) instead. The module is held
    weakly: it holds this function, and a cycle would keep a dropped model alive until the cycle collector
    came by."""

    def __init__(
        self, key: str, patches: dict, module: torch.nn.Module, param: str, dynamic_vram: torch.dtype | None = None
    ) -> None:
        self.key, self.patches, self.param = key, patches, param
        # A Dynamic VRAM twin's weight: patched as Dynamic VRAM patches it, in this compute dtype (``as_loaded``).
        self.dynamic_vram = dynamic_vram
        self._module = weakref.ref(module)
        # A CRC, once, not at every step: of the key, as a loaded weight's rounding; of the layer's name (its
        # ``seed_key``), as Dynamic VRAM's.
        self._seed = string_to_seed(key if dynamic_vram is None else key.rpartition(".")[0])
        # Where the adapters are staged (``stage``, from ``AdapterStaging.bind``): the engine (weakly), the unit and
        # the positions of this weight's tensors among the unit's companions; the patches last rebuilt around them.
        self._runner: weakref.ref | None = None
        self._unit = 0
        self._positions: tuple[int, ...] = ()
        # By the views' identity (the engine keeps one tuple per ring position): the views, the patches.
        self._staged: dict[int, tuple[tuple[torch.Tensor, ...], list]] = {}
        # How ``write_in_place`` left the weight described, where that differs from how it is stored.
        self._form: TensorForm | None = None

    @property
    def module(self) -> torch.nn.Module | None:
        return self._module()

    def _live_module(self) -> torch.nn.Module:
        """The module, when this patch runs: the module that holds it (as a weight function) or the unit it is
        patched into is in use, so alive."""
        module = self._module()
        if module is None:
            raise ReferenceError(f"Block Offload: the layer of {self.key} was freed before its patch ran")
        return module

    def adapters(self) -> list[torch.Tensor]:
        """The host tensors this weight's patches hold, in the order ``_staged_patches`` replaces them."""
        return list(host_tensors(self.patches[self.key]))

    def stage(self, runner: object, unit: int, positions: tuple[int, ...]) -> None:
        self._runner, self._unit, self._positions = weakref.ref(runner), unit, positions

    def _staged_patches(self) -> list:
        """The weight's patches around its adapters' copies in the ring, when the engine staged them."""
        runner = self._runner() if self._runner is not None else None
        views = runner.companions(self._unit) if runner is not None else None
        if views is None:
            return self.patches[self.key]
        staged = self._staged.get(id(views))
        if staged is None or staged[0] is not views:  # a ring position not seen yet: rebuilt around its views
            if len(self._staged) >= _POSITIONS_KEPT:
                self._staged.clear()
            replaced = iter([views[position] for position in self._positions])
            staged = self._staged[id(views)] = (views, with_host_tensors(self.patches[self.key], replaced))
        return staged[1]

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """As a weight function: ``weight`` (ComfyUI's ops' cast of the module's tensor) patched, in its dtype."""
        module = self._live_module()
        stored = getattr(module, self.param)
        patches = self._staged_patches()
        dynamic = weight.dtype if self.dynamic_vram is not None else None
        patched = as_loaded(module, self.param, stored, self.key, patches, self._seed, weight, dynamic)
        return patched.to(weight.dtype)

    def write_in_place(self) -> None:
        """Writes the patched weight over the module's own tensor where it is now (a streamed block's region of
        the ring, as it arrives), in the form ComfyUI's load leaves it: re-quantized in the module's format by
        its ``set_`` function, or rounded to its dtype. The layer then computes as a loaded one, with its
        format's own kernel, and no weight function. A plain LoRA is computed in the engine's scratch
        (``patch_plain_loras``): on a plain weight allocating nothing, on a quantized one only what the format's own
        code allocates (its dequantized copy, its re-quantization)."""
        module = self._live_module()
        current = getattr(module, self.param)
        patches = self._staged_patches()
        runner = self._runner() if self._runner is not None else None
        scratch = runner.scratch if runner is not None else None
        if scratch is not None and self._patched_in_scratch(module, current, patches, scratch):
            return
        # A plain weight is patched where it lies when it is in the dtype its patches are computed in (``as_loaded``
        # takes it as its working copy): the copy in the ring is the engine's own, to be copied afresh anyway.
        work = current if is_plain(current) and not stored_by_layer(module) else None
        patched = as_loaded(
            module, self.param, current, self.key, patches, self._seed, work, self.dynamic_vram, scratch
        )
        self._form = overwrite_in_place(current, patched, self.key)
        self.put_back()

    def _patched_in_scratch(
        self, module: torch.nn.Module, current: torch.Tensor, patches: list, scratch: torch.Tensor
    ) -> bool:
        """A plain weight's plain LoRAs, patched and rounded in ``scratch``; False where ``as_loaded`` patches."""
        plan = in_scratch(module, self.param, current, patches, self.dynamic_vram)
        if plan is None:
            return False
        loras, work_dtype, intermediate = plan
        layout = layout_in(scratch, current, loras, work_dtype, intermediate)
        if layout is None:
            return False  # counted for another dtype than it arrived in, or unstaged adapters: ComfyUI's code
        patched = patch_plain_loras(current, loras, layout, scratch)
        if not round_into(current, patched):  # fp8: ComfyUI's seeded stochastic rounding
            rounded = comfy.float.stochastic_rounding(patched, current.dtype, seed=self._seed)
            overwrite_in_place(current, rounded, self.key)
        self._form = None
        return True

    def put_back(self) -> None:
        """Where the re-quantized weight's own description differs from the stored one's (0.3.75 records the
        dtype it was quantized from), the module holds the weight under it again: the engine points the module
        at its bytes under the stored description at each call."""
        if self._form is not None:
            module = self._live_module()
            current = getattr(module, self.param)
            module._parameters[self.param] = self._form.assemble(TensorForm.of(current, self.key).parts_of(current))

    def write_to_host(self, device: torch.device) -> None:
        """Writes the patched weight over the module's own tensor (a view of its host buffer), computed on
        ``device`` as at each call: the block computes with the same weight, bit for bit, without patching."""
        module = self._live_module()
        host = getattr(module, self.param)
        on_device = host.to(device, copy=True)
        patches, handed = self.patches[self.key], on_device if self.dynamic_vram is None else None
        host.copy_(as_loaded(module, self.param, on_device, self.key, patches, self._seed, handed, self.dynamic_vram))


def in_scratch(
    module: torch.nn.Module, param: str, current: torch.Tensor, patches: list, dynamic_vram: torch.dtype | None
) -> tuple[list[PlainLora], torch.dtype, torch.dtype] | None:
    """How ``write_in_place`` patches ``module``'s ``param`` (``current``, stored as it streams) in the engine's
    scratch: its plain LoRAs, the dtype the weight is patched in and the one the products are computed in, as
    ``as_loaded`` would compute them; None where ``as_loaded`` does it (not plain LoRAs only, a layer's own
    ``convert_``/``set_`` function, a weight that is not plain)."""
    if not is_plain(current) or stored_by_layer(module) or hasattr(module, f"set_{param}"):
        return None
    if dynamic_vram is None and hasattr(module, f"convert_{param}"):
        return None
    loras = plain_loras(patches, current.shape)
    return (loras, *_patch_dtypes(current.device, dynamic_vram)) if loras else None


def _patch_dtypes(device: torch.device, dynamic_vram: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """The dtype ``as_loaded`` patches a weight on ``device`` in, and the one its LoRA products are computed in
    (``calculate_weight``'s own, fp32, for a loaded weight; Dynamic VRAM's compute dtype for both)."""
    if dynamic_vram is None:
        return _lora_dtype(device), torch.float32
    return dynamic_vram, dynamic_vram


def scratch_bytes(
    module: torch.nn.Module, param: str, key: str, patches: dict, device: torch.device, dynamic_vram: torch.dtype | None
) -> int:
    """The scratch ``write_in_place`` needs for ``module``'s ``param`` on ``device`` (0: none)."""
    weight = getattr(module, param)
    work_dtype, intermediate = _patch_dtypes(device, dynamic_vram)  # for the device it streams to, not the host
    plan = in_scratch(module, param, weight, patches[key], dynamic_vram)
    if plan is None:  # patched by ``as_loaded`` in its own working copy (a quantized format's dequantized one)
        loras = plain_loras(patches[key], weight.shape)
        return ScratchLayout.of(weight, loras, work_dtype, intermediate, True).nbytes if loras else 0
    loras = plan[0]
    # A Dynamic VRAM twin's weight may arrive cast from its file's dtype: room for a working copy all the same.
    in_place = weight.dtype == work_dtype and dynamic_vram is None
    return ScratchLayout.of(weight, loras, work_dtype, intermediate, in_place).nbytes


def compute_dtype(model: ModelPatcher) -> torch.dtype:
    """The dtype ComfyUI's ops cast a weight to for the compute, which ``LoadedPatch`` receives."""
    return model.model.manual_cast_dtype or model.model_dtype()


def as_loaded(
    module: torch.nn.Module,
    param: str,
    stored: torch.Tensor,
    key: str,
    patches: list,
    seed: int,
    handed: torch.Tensor | None = None,
    dynamic_vram: torch.dtype | None = None,
    scratch: torch.Tensor | None = None,
) -> torch.Tensor:
    """``module``'s ``param`` patched from ``stored`` (its own tensor on the device) as ComfyUI's
    ``ModelPatcher.patch_weight_to_device`` patches a loaded weight: cast to the dtype patches are computed in,
    the module's ``convert_`` function, ``calculate_weight``, then its ``set_`` function (a quantized format
    re-quantizes) or the seeded rounding to the stored dtype. ``handed``: a copy of the weight the caller owns
    (ComfyUI's ops' cast for a weight function, the ring's copy where it arrives), patched where it lies when it
    is in the dtype the patch is computed in, as ComfyUI patches its own copy; a weight function gets a
    quantized result dequantized, and ComfyUI's ops then compute with it as with a loaded weight.

    ``dynamic_vram``: the weight's model runs under Dynamic VRAM, which patches as it casts
    (``ModelPatcherDynamic``'s ``LowVramPatch``): in this compute dtype (``handed``'s at a call), the
    arithmetic included, no ``convert_`` function; then the same rounding to the stored dtype, which is what
    the weight resident in its VRAM holds. The twin the nodes stream computes what the MODEL computes.

    ``scratch``: the engine's scratch, where plain LoRAs are computed (``patch_plain_loras``) in place of
    ``calculate_weight``, the same operations in the same dtypes, when it is large enough."""
    set_func = getattr(module, f"set_{param}", None)
    convert_func = getattr(module, f"convert_{param}", None) if dynamic_vram is None else None
    lora_dtype = _lora_dtype(stored.device) if dynamic_vram is None else dynamic_vram
    if (
        handed is not None
        and handed.dtype == lora_dtype
        and convert_func is None
        and (dynamic_vram is not None or handed.dtype == stored.dtype)
    ):
        temp = handed  # a copy the caller owns (ComfyUI's ops' cast, the ring's), in the dtype the patch needs
    else:
        temp = comfy.model_management.cast_to_device(stored, stored.device, lora_dtype, copy=True)
    if convert_func is not None:
        temp = convert_func(temp, inplace=True)
    if dynamic_vram is not None:
        temp = temp if is_plain(temp) else temp.dequantize()
    intermediate = torch.float32 if dynamic_vram is None else temp.dtype  # ``calculate_weight``'s
    loras = plain_loras(patches, temp.shape) if scratch is not None and is_plain(temp) else None
    layout = layout_in(scratch, temp, loras, temp.dtype, intermediate) if scratch is not None and loras else None
    if scratch is not None and loras and layout is not None:
        # The LoRA's arithmetic in the engine's scratch (the format's own casts stay as they are).
        patched = patch_plain_loras(temp, loras, layout, scratch)
    else:
        patched = comfy.lora.calculate_weight(patches, temp, key, intermediate_dtype=intermediate)
    if set_func is None:
        return comfy.float.stochastic_rounding(patched, stored.dtype, seed=seed)
    patched = set_func(patched, seed=seed, return_weight=True)
    if handed is not None and hasattr(patched, "dequantize"):  # a quantized format's own tensor
        patched = patched.dequantize()
    return patched


# -- a plain LoRA in the engine's scratch ---------------------------------------------------------------


_ALIGN = 256  # each view's offset in the scratch: what the caching allocator gives a tensor, at the least

# The stored dtypes ComfyUI's rounding (``comfy.float.stochastic_rounding``) rounds to nearest, as ``copy_``
# does; it rounds the others (fp8) stochastically, by its own code.
_ROUNDED_TO_NEAREST = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class PlainLora:
    """One patch of a weight that is a plain LoRA: ``strength * alpha / rank * up @ down``, after the weight is
    scaled by ``strength_model``."""

    strength: float
    strength_model: float
    up: torch.Tensor
    down: torch.Tensor
    alpha: float | None

    @property
    def scale(self) -> float:
        """``strength * alpha``, computed as ``LoRAAdapter.calculate_weight`` computes it."""
        alpha = self.alpha / self.down.shape[0] if self.alpha is not None else 1.0
        return self.strength * alpha


def plain_loras(patches: Sequence, weight_shape: torch.Size) -> list[PlainLora] | None:
    """The weight's patches as plain LoRAs, or None if any is something else, or a LoRA that
    ``calculate_weight`` would not add as it is (a mid weight, DoRA, a reshape, an offset, a function, a shape
    that does not match the weight's)."""
    loras = []
    for patch in patches:
        strength, adapter, strength_model, offset, function = patch[:5]
        if offset is not None or function is not None or type(adapter) is not comfy.weight_adapter.LoRAAdapter:
            return None
        up, down, alpha, mid, dora_scale, reshape = adapter.weights[:6]
        if mid is not None or dora_scale is not None or reshape is not None:
            return None
        rows, rank = up.shape[0], up[0].numel()
        if down.shape[0] != rank or rows * down[0].numel() != weight_shape.numel():
            return None
        loras.append(PlainLora(strength, strength_model, up, down, alpha))
    return loras


@dataclass(frozen=True)
class ScratchLayout:
    """Where each intermediate of one weight's patch lies in the scratch, by (offset, dtype, shape); the dtype the
    weight is patched in and the one the products are computed in."""

    parts: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]
    nbytes: int
    work_dtype: torch.dtype
    intermediate: torch.dtype

    @classmethod
    def of(
        cls,
        weight: torch.Tensor,
        loras: Sequence[PlainLora],
        work_dtype: torch.dtype,
        intermediate: torch.dtype,
        in_place: bool,
    ) -> ScratchLayout:
        """The layout for ``weight`` patched in ``work_dtype`` (``in_place``: in the weight itself), the
        products computed in ``intermediate``."""
        sizes: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        if not in_place:
            sizes.append(("work", work_dtype, tuple(weight.shape)))
        up_rows = max(lora.up.shape[0] for lora in loras)
        sizes.append(("product", intermediate, (up_rows, weight.numel() // up_rows)))
        if intermediate != work_dtype:
            sizes.append(("cast", work_dtype, tuple(weight.shape)))
        for name, tensors in (("up", [lora.up for lora in loras]), ("down", [lora.down for lora in loras])):
            cast = [tensor.flatten(1) for tensor in tensors if tensor.dtype != intermediate]
            if cast:
                sizes.append((name, intermediate, (max(t.shape[0] for t in cast), max(t.shape[1] for t in cast))))
        parts, offset = {}, 0
        for name, dtype, shape in sizes:
            parts[name] = (offset, dtype, shape)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return cls(parts, offset, work_dtype, intermediate)

    def view(self, scratch: torch.Tensor, name: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Part ``name`` of ``scratch``, at ``shape`` (its full shape if None)."""
        offset, dtype, full = self.parts[name]
        shape = tuple(full if shape is None else shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return scratch[offset : offset + nbytes].view(dtype).view(shape)


def layout_in(
    scratch: torch.Tensor,
    weight: torch.Tensor,
    loras: Sequence[PlainLora],
    work_dtype: torch.dtype,
    intermediate: torch.dtype,
) -> ScratchLayout | None:
    """The layout ``patch_plain_loras`` patches ``weight`` by (in place where it is in ``work_dtype``), or None
    where ``scratch`` cannot take it: too small, or the adapters not where it is (staged with their block; a
    host copy is ComfyUI's code's to cast)."""
    layout = ScratchLayout.of(weight, loras, work_dtype, intermediate, weight.dtype == work_dtype)
    on_device = all(t.device == scratch.device for lora in loras for t in (lora.up, lora.down))
    return layout if on_device and layout.nbytes <= scratch.numel() else None


def _as(
    tensor: torch.Tensor, dtype: torch.dtype, layout: ScratchLayout, scratch: torch.Tensor, name: str
) -> torch.Tensor:
    """``tensor`` flattened to two dimensions in ``dtype``: itself, or its cast into the scratch (as
    ``cast_to_device`` casts the adapters)."""
    flat = tensor.flatten(1)
    if flat.dtype == dtype:
        return flat
    return layout.view(scratch, name, flat.shape).copy_(flat)


def patch_plain_loras(
    current: torch.Tensor, loras: Sequence[PlainLora], layout: ScratchLayout, scratch: torch.Tensor
) -> torch.Tensor:
    """``current`` (a weight's copy where it arrived) patched by ``loras`` as ``calculate_weight`` patches it,
    all in ``scratch`` as ``layout`` (``layout_in``) lays it out. Returns the patched weight in the layout's work
    dtype: ``current`` itself, or a view of the scratch for the caller to round into it."""
    work_dtype, intermediate = layout.work_dtype, layout.intermediate
    work = layout.view(scratch, "work").copy_(current) if "work" in layout.parts else current
    for lora in loras:
        if lora.strength_model != 1.0:
            work.mul_(lora.strength_model)
        up, down = (
            _as(lora.up, intermediate, layout, scratch, "up"),
            _as(lora.down, intermediate, layout, scratch, "down"),
        )
        product = layout.view(scratch, "product", (up.shape[0], down.shape[1]))
        torch.mm(up, down, out=product)
        product.mul_(lora.scale)
        change = product.view(work.shape)
        if intermediate != work_dtype:
            change = layout.view(scratch, "cast").copy_(change)
        work.add_(change)
    return work


def round_into(current: torch.Tensor, patched: torch.Tensor) -> bool:
    """Writes ``patched`` into ``current`` as ComfyUI's rounding to the stored dtype would (to nearest), where it
    is one of those dtypes; False for a dtype ComfyUI rounds stochastically (the caller rounds it as ComfyUI
    does)."""
    if current.dtype not in _ROUNDED_TO_NEAREST:
        return False
    if patched is not current:
        current.copy_(patched)
    return True
