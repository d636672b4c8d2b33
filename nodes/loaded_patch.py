"""A streamed weight patched exactly as ComfyUI patches a loaded one (``LoadedPatch``, ``as_loaded``), and plain
LoRAs computed in the engine's scratch (``patch_plain_loras``).

A ``LoadedPatch`` repeats ``ModelPatcher.patch_weight_to_device`` on a fresh ring copy, on the compute stream, with the
same dtypes and seeded rounding. The layer then needs no weight function, so it computes as a loaded one, bit for bit,
where ComfyUI's lowvram path would round differently.

Plain LoRAs run in scratch allocated with the ring, so a streamed step allocates no more than a resident one (the
compiler replays each call's allocations). The operations and dtypes are ``calculate_weight``'s; a fused ``addmm_``
would round differently. Anything else goes through ComfyUI's own code."""

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

# comfy.model_patcher's name warns at each call on 0.33; 0.3.75 has only that one.
string_to_seed = getattr(comfy.utils, "string_to_seed", None) or comfy.model_patcher.string_to_seed


#: Ring positions whose rebuilt patches are kept; they repeat from step to step.
_POSITIONS_KEPT = 16


def _lora_dtype(device: torch.device) -> torch.dtype:
    """The dtype ComfyUI patches a loaded weight in (0.33 may choose fp16 on a GPU; 0.3.75: fp32)."""
    chooser = getattr(comfy.model_management, "lora_compute_dtype", None)
    return chooser(device) if chooser is not None else torch.float32


class LoadedPatch:
    """A module's weight patched as ComfyUI patches a loaded weight, computed where it is streamed to.

    It patches the module's own stored tensor, not the ops' cast, which may already have rounded. The module is held
    weakly because it holds this function: a cycle would keep a dropped model alive until the collector ran."""

    def __init__(
        self, key: str, patches: dict, module: torch.nn.Module, param: str, dynamic_vram: torch.dtype | None = None
    ) -> None:
        self.key, self.patches, self.param = key, patches, param
        self.dynamic_vram = dynamic_vram
        self._module = weakref.ref(module)
        # Seeded from the key as a loaded weight is, from the layer's name as Dynamic VRAM's.
        self._seed = string_to_seed(key if dynamic_vram is None else key.rpartition(".")[0])
        # Where the adapters are staged (``stage``); the engine is held weakly.
        self._runner: weakref.ref | None = None
        self._unit = 0
        self._positions: tuple[int, ...] = ()
        # Keyed by the views' identity: the engine keeps one tuple per ring position.
        self._staged: dict[int, tuple[tuple[torch.Tensor, ...], list]] = {}
        self._form: TensorForm | None = None

    @property
    def module(self) -> torch.nn.Module | None:
        return self._module()

    def _live_module(self) -> torch.nn.Module:
        """The module; raises ``ReferenceError`` if it was freed before its patch ran."""
        module = self._module()
        if module is None:
            raise ReferenceError(f"Block Offload: the layer of {self.key} was freed before its patch ran")
        return module

    def adapters(self) -> list[torch.Tensor]:
        """The host tensors of this weight's patches, in the order ``_staged_patches`` replaces them."""
        return list(host_tensors(self.patches[self.key]))

    def stage(self, runner: object, unit: int, positions: tuple[int, ...]) -> None:
        self._runner, self._unit, self._positions = weakref.ref(runner), unit, positions

    def _staged_patches(self) -> list:
        """The patches rebuilt around the adapters' ring copies, once staged."""
        runner = self._runner() if self._runner is not None else None
        views = runner.companions(self._unit) if runner is not None else None
        if views is None:
            return self.patches[self.key]
        staged = self._staged.get(id(views))
        if staged is None or staged[0] is not views:
            if len(self._staged) >= _POSITIONS_KEPT:
                self._staged.clear()
            replaced = iter([views[position] for position in self._positions])
            staged = self._staged[id(views)] = (views, with_host_tensors(self.patches[self.key], replaced))
        return staged[1]

    def __call__(self, weight: torch.Tensor) -> torch.Tensor:
        """As a weight function: ``weight``, the ops' cast, patched."""
        module = self._live_module()
        stored = getattr(module, self.param)
        patches = self._staged_patches()
        dynamic = weight.dtype if self.dynamic_vram is not None else None
        patched = as_loaded(module, self.param, stored, self.key, patches, self._seed, weight, dynamic)
        return patched.to(weight.dtype)

    def write_in_place(self) -> None:
        """Writes the patched weight over the module's tensor in the ring, as ComfyUI's load leaves it (re-quantized
        by ``set_``, or rounded), so the layer computes as a loaded one with no weight function."""
        module = self._live_module()
        current = getattr(module, self.param)
        patches = self._staged_patches()
        runner = self._runner() if self._runner is not None else None
        scratch = runner.scratch if runner is not None else None
        if scratch is not None and self._patched_in_scratch(module, current, patches, scratch):
            return
        # The ring's copy is ours and recopied anyway, so a plain weight is patched where it lies.
        work = current if is_plain(current) and not stored_by_layer(module) else None
        patched = as_loaded(
            module, self.param, current, self.key, patches, self._seed, work, self.dynamic_vram, scratch
        )
        self._form = overwrite_in_place(current, patched, self.key)
        self.put_back()

    def _patched_in_scratch(
        self, module: torch.nn.Module, current: torch.Tensor, patches: list, scratch: torch.Tensor
    ) -> bool:
        """Patches plain LoRAs of a plain weight in ``scratch``; False where ``as_loaded`` must do it."""
        plan = in_scratch(module, self.param, current, patches, self.dynamic_vram)
        if plan is None:
            return False
        loras, work_dtype, intermediate = plan
        layout = layout_in(scratch, current, loras, work_dtype, intermediate)
        if layout is None:
            return False
        patched = patch_plain_loras(current, loras, layout, scratch)
        if not round_into(current, patched):  # fp8: ComfyUI's seeded stochastic rounding
            rounded = comfy.float.stochastic_rounding(patched, current.dtype, seed=self._seed)
            overwrite_in_place(current, rounded, self.key)
        self._form = None
        return True

    def put_back(self) -> None:
        """Restores the stored description where re-quantizing changed it (0.3.75 records the source dtype), since
        the engine points the module at its bytes under the stored one."""
        if self._form is not None:
            module = self._live_module()
            current = getattr(module, self.param)
            module._parameters[self.param] = self._form.assemble(TensorForm.of(current, self.key).parts_of(current))

    def write_to_host(self, device: torch.device) -> None:
        """Bakes the patch into the host buffer, computed on ``device`` as at each call, so the block computes the
        same bits without patching."""
        module = self._live_module()
        host = getattr(module, self.param)
        on_device = host.to(device, copy=True)
        patches, handed = self.patches[self.key], on_device if self.dynamic_vram is None else None
        host.copy_(as_loaded(module, self.param, on_device, self.key, patches, self._seed, handed, self.dynamic_vram))


def in_scratch(
    module: torch.nn.Module, param: str, current: torch.Tensor, patches: list, dynamic_vram: torch.dtype | None
) -> tuple[list[PlainLora], torch.dtype, torch.dtype] | None:
    """The plain LoRAs, work dtype and product dtype for patching in scratch, as ``as_loaded`` would; None where
    ``as_loaded`` must do it."""
    if not is_plain(current) or stored_by_layer(module) or hasattr(module, f"set_{param}"):
        return None
    if dynamic_vram is None and hasattr(module, f"convert_{param}"):
        return None
    loras = plain_loras(patches, current.shape)
    return (loras, *_patch_dtypes(current.device, dynamic_vram)) if loras else None


def _patch_dtypes(device: torch.device, dynamic_vram: torch.dtype | None) -> tuple[torch.dtype, torch.dtype]:
    """The work dtype and the LoRA product dtype (fp32 as in ``calculate_weight``; under Dynamic VRAM its compute
    dtype for both)."""
    if dynamic_vram is None:
        return _lora_dtype(device), torch.float32
    return dynamic_vram, dynamic_vram


def scratch_bytes(
    module: torch.nn.Module, param: str, key: str, patches: dict, device: torch.device, dynamic_vram: torch.dtype | None
) -> int:
    """The scratch ``write_in_place`` needs for ``module``'s ``param`` on ``device`` (0: none)."""
    weight = getattr(module, param)
    work_dtype, intermediate = _patch_dtypes(device, dynamic_vram)  # for the target device, not the host
    plan = in_scratch(module, param, weight, patches[key], dynamic_vram)
    if plan is None:  # ``as_loaded`` patches a working copy
        loras = plain_loras(patches[key], weight.shape)
        return ScratchLayout.of(weight, loras, work_dtype, intermediate, True).nbytes if loras else 0
    loras = plan[0]
    # A Dynamic VRAM twin's weight may arrive in another dtype: room for a working copy.
    in_place = weight.dtype == work_dtype and dynamic_vram is None
    return ScratchLayout.of(weight, loras, work_dtype, intermediate, in_place).nbytes


def compute_dtype(model: ModelPatcher) -> torch.dtype:
    """The dtype ComfyUI's ops cast a weight to for compute, which ``LoadedPatch`` receives."""
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
    """``module``'s ``param`` patched from ``stored`` as ``patch_weight_to_device`` does: cast, ``convert_``,
    ``calculate_weight``, then ``set_`` or seeded rounding to the stored dtype.

    ``handed``: a copy the caller owns, patched in place when already in the patch dtype, as ComfyUI does its own.
    ``dynamic_vram``: patch as ``ModelPatcherDynamic``'s ``LowVramPatch`` does, in this compute dtype, so the twin
    computes what the MODEL does. ``scratch``: where plain LoRAs are computed, when large enough."""
    set_func = getattr(module, f"set_{param}", None)
    convert_func = getattr(module, f"convert_{param}", None) if dynamic_vram is None else None
    lora_dtype = _lora_dtype(stored.device) if dynamic_vram is None else dynamic_vram
    if (
        handed is not None
        and handed.dtype == lora_dtype
        and convert_func is None
        and (dynamic_vram is not None or handed.dtype == stored.dtype)
    ):
        temp = handed
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
        patched = patch_plain_loras(temp, loras, layout, scratch)
    else:
        patched = comfy.lora.calculate_weight(patches, temp, key, intermediate_dtype=intermediate)
    if set_func is None:
        return comfy.float.stochastic_rounding(patched, stored.dtype, seed=seed)
    patched = set_func(patched, seed=seed, return_weight=True)
    if handed is not None and hasattr(patched, "dequantize"):
        patched = patched.dequantize()
    return patched


# -- a plain LoRA in the engine's scratch


_ALIGN = 256  # the caching allocator's smallest alignment

# Dtypes ``comfy.float.stochastic_rounding`` rounds to nearest, as ``copy_`` does; fp8 it rounds stochastically.
_ROUNDED_TO_NEAREST = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class PlainLora:
    """A plain LoRA patch: ``strength * alpha / rank * up @ down``, added after scaling by ``strength_model``."""

    strength: float
    strength_model: float
    up: torch.Tensor
    down: torch.Tensor
    alpha: float | None

    @property
    def scale(self) -> float:
        """Computed as ``LoRAAdapter.calculate_weight`` computes it, for the same rounding."""
        alpha = self.alpha / self.down.shape[0] if self.alpha is not None else 1.0
        return self.strength * alpha


def plain_loras(patches: Sequence, weight_shape: torch.Size) -> list[PlainLora] | None:
    """The patches as plain LoRAs, or None if any is something ``calculate_weight`` would not add as is."""
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
    """(offset, dtype, shape) of each intermediate of one weight's patch in the scratch."""

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
    """The layout for ``weight``, or None where ``scratch`` is too small or the adapters are not on its device (host
    adapters are ComfyUI's code's to cast)."""
    layout = ScratchLayout.of(weight, loras, work_dtype, intermediate, weight.dtype == work_dtype)
    on_device = all(t.device == scratch.device for lora in loras for t in (lora.up, lora.down))
    return layout if on_device and layout.nbytes <= scratch.numel() else None


def _as(
    tensor: torch.Tensor, dtype: torch.dtype, layout: ScratchLayout, scratch: torch.Tensor, name: str
) -> torch.Tensor:
    """``tensor`` as 2-D in ``dtype``: itself, or its cast into the scratch."""
    flat = tensor.flatten(1)
    if flat.dtype == dtype:
        return flat
    return layout.view(scratch, name, flat.shape).copy_(flat)


def patch_plain_loras(
    current: torch.Tensor, loras: Sequence[PlainLora], layout: ScratchLayout, scratch: torch.Tensor
) -> torch.Tensor:
    """``current`` patched by ``loras`` as ``calculate_weight`` would, in ``scratch``. Returns ``current`` itself or
    a scratch view for the caller to round."""
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
    """Writes ``patched`` into ``current`` with round-to-nearest where ComfyUI does; False for fp8, which ComfyUI
    rounds stochastically."""
    if current.dtype not in _ROUNDED_TO_NEAREST:
        return False
    if patched is not current:
        current.copy_(patched)
    return True
