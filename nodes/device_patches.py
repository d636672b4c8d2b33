"""Weight patches (LoRA and everything ``comfy.lora.calculate_weight`` applies) on streamed blocks, applied on
the device as each block arrives, so the blocks' host buffers keep the weights as ComfyUI loaded them: one copy
per loaded model, shared by every clone, strength and branch of it, never re-packed nor re-pinned when the
patches change.

A patched weight of a streamed ComfyUI op gets a ``LoadedPatch``, run on the compute stream when a fresh copy
of its block is first used, which repeats ComfyUI's patch of a loaded weight
(``ModelPatcher.patch_weight_to_device``) on the streamed weight: the same dtype for the arithmetic, the same
seeded stochastic rounding to the stored dtype (or the quantized format's own ``set_weight``), written over
the copy in the ring. The layer then has no weight function: ComfyUI's ops compute from it as from a loaded
weight (a weight function would make them copy the weight at every call, an allocation the resident model
never makes), and a block that stays in the ring is patched once. A streamed block so computes exactly what a
loaded one does, in every stored dtype, where ComfyUI's lowvram path would round differently. A weight with
only wrapper patches, or of a format with no ``set_weight``, gets weight functions instead. GGUF weights carry
their patches to ComfyUI-GGUF's own ops (``tensor.patches``), which apply them at compute time. A weight
outside ComfyUI's ops (Wan's ``modulation``) is patched once before packing, as before: its block is packed
again when its patches change.

The adapters (the LoRA's up and down matrices, and whatever else a patch holds in host memory) travel with
their block: packed once per set of patches (an engine) into a host buffer of the block's (pinned where the
block's is), copied into the ring right after the block's weights on the copy stream, and read there by
``LoadedPatch`` (``stage_adapters``); ComfyUI's lowvram path copies each from pageable memory on the
compute stream, layer by layer, at every step.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeGuard, cast, overload

import comfy.float
import comfy.lora
import comfy.model_management
import comfy.model_patcher
import comfy.utils
import torch
from comfy.model_patcher import ModelPatcher

from ..offload.layout import TensorForm
from .blocks import inside

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
        # Where the adapters are staged (``stage_adapters``): the engine (weakly), the unit and the positions
        # of this weight's tensors among the unit's companions; the patches last rebuilt around them.
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
        format's own kernel, and no weight function."""
        module = self._live_module()
        current = getattr(module, self.param)
        patches = self._staged_patches()
        # A plain weight is patched where it lies when it is in the dtype its patches are computed in (``as_loaded``
        # takes it as its working copy): the copy in the ring is the engine's own, to be copied afresh anyway.
        work = current if is_plain(current) and not stored_by_layer(module) else None
        patched = as_loaded(module, self.param, current, self.key, patches, self._seed, work, self.dynamic_vram)
        self._form = overwrite_in_place(current, patched, self.key)
        self.put_back()

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
    the weight resident in its VRAM holds. The twin the nodes stream computes what the MODEL computes."""
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
    if dynamic_vram is None:
        patched = comfy.lora.calculate_weight(patches, temp, key)
    else:
        temp = temp if is_plain(temp) else temp.dequantize()
        patched = comfy.lora.calculate_weight(patches, temp, key, intermediate_dtype=temp.dtype)
    if set_func is None:
        return comfy.float.stochastic_rounding(patched, stored.dtype, seed=seed)
    patched = set_func(patched, seed=seed, return_weight=True)
    if handed is not None and hasattr(patched, "dequantize"):  # a quantized format's own tensor
        patched = patched.dequantize()
    return patched


def patched_shape(patches: list, weight: torch.Tensor, key: str) -> torch.Size:
    """The shape ``patches`` give ``weight``: ComfyUI's own ``calculate_shape`` (0.33 and later), else the one
    patch that changed a shape before it, a "diff" that pads the weight (``pad_weight``)."""
    calculate_shape = getattr(comfy.lora, "calculate_shape", None)
    if calculate_shape is not None:
        return calculate_shape(patches, weight, key)
    shape = weight.shape
    for patch in patches:
        value = patch[1]
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "diff":
            data = value[1]
            if len(data) > 1 and data[1].get("pad_weight"):
                shape = data[0].shape
    return shape


def refuse_reshaping_patches(model: ModelPatcher, streamed: frozenset[str], node: str) -> None:
    """Raises, before anything is loaded, where a patch changes the shape of a weight in a ``streamed`` module:
    the engine packs and streams each weight at the shape it is stored in, so it would compute with the wrong
    one."""
    for key, patches in model.patches.items():
        if not inside(key.rpartition(".")[0], streamed):
            continue
        weight = comfy.utils.get_attr(model.model, key)
        shape = patched_shape(patches, weight, key)
        if tuple(shape) != tuple(weight.shape):
            raise ValueError(
                f"{node}: a patch on this MODEL changes the shape of {key} from {tuple(weight.shape)} to "
                f"{tuple(shape)}, a weight of a block the node streams, and the node streams weights at the shape "
                "they are stored in. Apply that patch (a LoRA or merge that resizes layers) without the node, or "
                "save the patched model and load that instead."
            )


def overwrite_in_place(current: torch.Tensor, patched: torch.Tensor, key: str) -> TensorForm | None:
    """Copies ``patched`` into ``current``'s memory, part by part (a quantized tensor's data and scales).
    Returns ``patched``'s form where its description (class, context) differs from ``current``'s."""
    into, source = TensorForm.of(current, key), TensorForm.of(patched, key)
    targets, sources = list(into.parts_of(current)), list(source.parts_of(patched))
    same = len(targets) == len(sources) and all(
        t.shape == s.shape and t.dtype == s.dtype for t, s in zip(targets, sources, strict=False)
    )
    if not same or (into.kind is not source.kind and not (into.is_plain and source.is_plain)):
        raise RuntimeError(
            f"Block Offload: patching {key} changed how its weight is stored ({type(current).__name__}, "
            f"{[(tuple(t.shape), t.dtype) for t in targets]} -> {[(tuple(s.shape), s.dtype) for s in sources]}), "
            "so it cannot be patched where it streams to. Put this patch on a model without a streaming node, "
            "or load the checkpoint unquantized."
        )
    with torch.no_grad():
        for target, part in zip(targets, sources, strict=True):
            if (target.data_ptr(), target.stride()) != (part.data_ptr(), part.stride()):  # else patched where it lies
                target.copy_(part)
    return source if source.is_wrapper and source.context != into.context else None


@dataclass(frozen=True)
class DevicePatching:
    """How a streamed placement's patched weights were patched, for the plan line."""

    on_device: int = 0  # LoadedPatch at compute time, as a weight function
    carried: int = 0  # GGUF tensors carrying their patches to compute time
    baked: int = 0  # patched once before packing
    loaded: tuple[LoadedPatch, ...] = field(default=(), compare=False)
    # Patched once into their host buffers (``write_patches_to_host``), in the units chosen to bake.
    on_host: tuple[LoadedPatch, ...] = field(default=(), compare=False)
    # Patched where they arrive on the device, in their stored format (``LoadedPatch.write_in_place``): plain
    # weights and biases, and the weights of layers with a ``set_`` function (quantized formats).
    on_arrival: tuple[LoadedPatch, ...] = field(default=(), compare=False)

    def describe(self) -> str:
        said = [
            f"{count} {how}"
            for count, how in (
                (self.on_device, "on the device at compute time"),
                (len(self.on_arrival), "on the device as they arrive"),
                (len(self.on_host), "once into their host buffers"),
                (self.carried, "by ComfyUI-GGUF at compute time"),
                (self.baked, "once before packing"),
            )
            if count
        ]
        return f"; patched weights: {', '.join(said)}" if said else ""


def _carries_patches(weight: torch.Tensor) -> bool:
    """A GGUF tensor: quantized bytes whose patches ride on the tensor to ComfyUI-GGUF's ops."""
    return hasattr(weight, "tensor_type") and hasattr(weight, "patches")


class _CastLayer(Protocol):
    """A layer of ComfyUI's ops (``comfy.ops.CastWeightBiasOp``), with the attributes ComfyUI's lowvram load
    sets on it: the functions its forward applies to the weight and bias it casts, and whether it casts them."""

    comfy_cast_weights: bool
    prev_comfy_cast_weights: bool
    weight_function: list[Callable[[torch.Tensor], torch.Tensor]]
    bias_function: list[Callable[[torch.Tensor], torch.Tensor]]


def stored_by_layer(module: torch.nn.Module) -> bool:
    """A layer whose weight ComfyUI's load stores through the layer's own ``set_weight`` (a quantized format
    re-quantizes the patched weight): its ops compute from that form, with the format's kernel, only while it
    has no weight or bias function. Its patched weight and bias are written where they arrive instead."""
    return callable(getattr(module, "set_weight", None))


def patched_parameters(
    model: ModelPatcher, units: frozenset[str], patched_too: bool = False
) -> Iterator[tuple[str, torch.nn.Module, list[tuple[str, torch.Tensor, str]]]]:
    """The named units' modules with patched weights, each with its patched parameters and how each is patched:
    ``carried`` (a GGUF tensor, whose patches ride on it to ComfyUI-GGUF's ops), ``arrival`` (a plain weight or
    bias of ComfyUI's ops, or one of a layer that stores its weight itself: in place, where it arrives),
    ``device`` (any other weight of ComfyUI's ops, and one with only wrapper patches: weight functions at compute
    time), ``bake`` (outside ComfyUI's ops: once before packing).
    Modules ComfyUI has loaded and patched only with ``patched_too``."""
    for name, module in model.model.named_modules():
        # A module ComfyUI loaded and patched (resident in an earlier placement) holds these patches already,
        # as ComfyUI's own load trusts the flag (its unpatch clears it).
        if not inside(name, units) or (getattr(module, "comfy_patched_weights", False) and not patched_too):
            continue
        ops_module = hasattr(module, "comfy_cast_weights")
        routes = []
        for param, tensor in module.named_parameters(recurse=False):
            key = f"{name}.{param}"
            if key not in model.patches and not model.weight_wrapper_patches.get(key):
                continue
            if _carries_patches(tensor):  # ComfyUI-GGUF's layers read no weight functions
                routes.append((param, tensor, "carried"))
            elif ops_module and param in ("weight", "bias"):
                on_arrival = key in model.patches and (stored_by_layer(module) or is_plain(tensor))
                routes.append((param, tensor, "arrival" if on_arrival else "device"))
            elif key in model.patches:
                routes.append((param, tensor, "bake"))
        if routes:
            yield name, module, routes


def patch_streamed_weights(
    model: ModelPatcher,
    streamed: frozenset[str],
    device: torch.device,
    bake: frozenset[str] = frozenset(),
    patched_as_cast: Callable[[str, torch.nn.Module], bool] | None = None,
) -> DevicePatching:
    """Sets up the patches of every weight of the ``streamed`` modules, before the engine packs them. Those of
    the ``bake`` units' plain weights are left for ``write_patches_to_host``, once the engine has packed them.
    ``patched_as_cast``: ``model`` is a Dynamic VRAM model's twin, and these are the modules (by name) that
    model patches as it casts them, which their ``LoadedPatch`` does too (``as_loaded``)."""
    on_device = carried = baked = counted = 0
    loaded: list[LoadedPatch] = []
    on_host: list[LoadedPatch] = []
    on_arrival: list[LoadedPatch] = []
    twin_dtype = compute_dtype(model) if patched_as_cast is not None else None
    for name, module, routes in patched_parameters(model, streamed):
        computed_in = twin_dtype if patched_as_cast is not None and patched_as_cast(name, module) else None
        functions: dict[str, list[Callable[[torch.Tensor], torch.Tensor]]] = {}
        arriving = []
        bake_now = []  # outside ComfyUI's ops: patched once, before packing
        for param, tensor, route in routes:
            key = f"{name}.{param}"
            if route == "carried":
                model.patch_weight_to_device(key, device_to=tensor.device)  # records them on the tensor
                carried += 1
            elif route == "arrival":
                patch = LoadedPatch(key, model.patches, module, param, computed_in)
                if inside(name, bake) and is_plain(tensor) and not stored_by_layer(module):
                    on_host.append(patch)
                else:
                    arriving.append(patch)
                functions.setdefault(param, list(model.weight_wrapper_patches.get(key, [])))
            elif route == "device":
                # The weight's own LoadedPatch; none where it has only wrapper patches.
                own = [LoadedPatch(key, model.patches, module, param, computed_in)] if key in model.patches else []
                functions[param] = own + list(model.weight_wrapper_patches.get(key, []))
                on_device += len(own)
                loaded += own
            else:
                bake_now.append(key)
        if functions or arriving:
            # Only a layer of ComfyUI's ops has "arrival" and "device" routes (``patched_parameters``).
            layer = cast(_CastLayer, module)
            layer.weight_function = functions.get("weight", [])
            layer.bias_function = functions.get("bias", [])
            if not hasattr(layer, "prev_comfy_cast_weights"):  # as ComfyUI's lowvram load marks a module
                layer.prev_comfy_cast_weights = layer.comfy_cast_weights
                counted += len(arriving) + sum(
                    isinstance(f, LoadedPatch) for f in (*layer.weight_function, *layer.bias_function)
                )
            if layer.weight_function or layer.bias_function:
                layer.comfy_cast_weights = True  # a layer patched only where it arrives computes as loaded
            on_arrival += arriving
            loaded += arriving
        for key in bake_now:
            _bake(model, key, device)
        if bake_now:
            # A clone taking these weights over must not patch them again. (The ignore: torch annotates the value
            # nn.Module.__setattr__ takes as Tensor | Module; it takes any.)
            module.comfy_patched_weights = True  # type: ignore[assignment]
            baked += len(bake_now)
    # ComfyUI's count of per-layer patches, as its lowvram load keeps it: once per module it marks (a module it
    # marked already is not counted again), back to 0 when its unpatch clears the marks.
    model.model.lowvram_patch_counter += counted
    return DevicePatching(on_device, carried, baked, tuple(loaded), tuple(on_host), tuple(on_arrival))


class ArrivalPatches:
    """The engine's ``transforms``: each streamed unit's ``LoadedPatch.write_in_place`` patches, run as a fresh
    copy of the unit is first used (and the re-quantized weights put back at its later calls)."""

    def __init__(self, patching: DevicePatching, units: dict[int, torch.nn.Module], recurse: bool) -> None:
        unit_of = _unit_of(units, recurse)
        self._by_unit: dict[int, list[LoadedPatch]] = {}
        for patch in patching.on_arrival:
            unit = unit_of.get(id(patch.module))
            if unit is not None:
                self._by_unit.setdefault(unit, []).append(patch)

    def transforms(self) -> dict[int, Callable[[bool], None]]:
        return {unit: functools.partial(self._at_a_call, unit) for unit in self._by_unit}

    def _at_a_call(self, unit: int, copied: bool) -> None:
        for patch in self._by_unit[unit]:
            if copied:
                patch.write_in_place()
            else:
                patch.put_back()


def is_plain(tensor: torch.Tensor) -> bool:
    """A weight whose host buffer view holds it as computed from (no quantized format of its own)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_floating_point()


def write_patches_to_host(
    patching: DevicePatching,
    units: dict[int, torch.nn.Module],
    recurse: bool,
    needing: frozenset[int],
    device: torch.device,
) -> frozenset[int]:
    """Writes the patches ``patch_streamed_weights`` left for the host buffers into those of the units
    ``needing`` them (the engine's ``needs_content``: packed now, or adopted without them), each weight patched
    on ``device`` as at compute time. Returns the units written."""
    unit_of = _unit_of(units, recurse)
    written = set()
    for patch in patching.on_host:
        unit = unit_of.get(id(patch.module))
        if unit in needing:
            patch.write_to_host(device)
            written.add(unit)
    return frozenset(written)


def _unit_of(units: dict[int, torch.nn.Module], recurse: bool) -> dict[int, int]:
    """The unit index of each module of the ``units`` (with their submodules unless not ``recurse``), by id."""
    return {id(module): index for index, unit in units.items() for module in (unit.modules() if recurse else (unit,))}


class _WeightAdapter(Protocol):
    """A weight adapter of ``comfy.weight_adapter`` (a LoRA's, a LoHa's, ...): its tensors are in ``weights``."""

    weights: list[Any] | tuple[Any, ...]


def _is_weight_adapter(value: object) -> TypeGuard[_WeightAdapter]:
    return isinstance(getattr(value, "weights", None), (tuple, list))


def host_tensors(value: object) -> Iterator[torch.Tensor]:
    """The host tensors a patch holds (``comfy.lora``'s formats: tuples and lists of them, and the weight
    adapters of ``comfy.weight_adapter``, whose tensors are in ``weights``), in a fixed order."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from host_tensors(item)
    elif _is_weight_adapter(value):
        yield from host_tensors(value.weights)


# A list (a weight's patches) comes back a list; a list or tuple (an adapter's weights), a list or tuple.
@overload
def with_host_tensors(value: list[Any], replacements: Iterator[torch.Tensor]) -> list[Any]: ...
@overload
def with_host_tensors(
    value: list[Any] | tuple[Any, ...], replacements: Iterator[torch.Tensor]
) -> list[Any] | tuple[Any, ...]: ...
@overload
def with_host_tensors(value: object, replacements: Iterator[torch.Tensor]) -> object: ...


def with_host_tensors(value: object, replacements: Iterator[torch.Tensor]) -> object:
    """``value`` with its host tensors (in ``host_tensors``'s order) replaced from ``replacements``."""
    if isinstance(value, torch.Tensor):
        return next(replacements) if value.device.type == "cpu" else value
    if isinstance(value, list):
        return [with_host_tensors(item, replacements) for item in value]
    if isinstance(value, tuple):
        items = [with_host_tensors(item, replacements) for item in value]
        if hasattr(value, "_fields"):  # a namedtuple's class takes its fields as arguments
            namedtuple_class: Callable[..., tuple[Any, ...]] = type(value)
            return namedtuple_class(*items)
        return tuple(items)
    if _is_weight_adapter(value):
        adapter = copy.copy(value)  # the adapter's own code, around the copies
        adapter.weights = with_host_tensors(value.weights, replacements)
        return adapter
    return value


def unit_named(name: str, units: Container[str]) -> str | None:
    """The one of ``units`` (module names) that the module ``name`` is, or lies inside; None if none."""
    parts = name.split(".")
    return next((prefix for end in range(len(parts), 0, -1) if (prefix := ".".join(parts[:end])) in units), None)


def adapter_bytes(model: ModelPatcher, units: frozenset[str], recurse: bool) -> dict[str, int]:
    """The host bytes of the patch adapters of each of the named units' weights (with its submodules'
    unless not ``recurse``): what staging them with their unit adds to it."""
    held: dict[str, dict[int, int]] = {}
    for key, patches in model.patches.items():
        owner = key.rpartition(".")[0]
        unit = unit_named(owner, units) if recurse else (owner if owner in units else None)
        if unit is not None:
            tensors = held.setdefault(unit, {})
            for tensor in host_tensors(patches):
                tensors[id(tensor)] = tensor.numel() * tensor.element_size()
    return {unit: sum(tensors.values()) for unit, tensors in held.items()}


@dataclass(frozen=True)
class AdapterStaging:
    """The engine's companions (each streamed unit's patch adapters, each tensor once) and where each
    ``LoadedPatch``'s own are among its unit's, told to it once the engine exists (``bind``)."""

    companions: dict[int, tuple[torch.Tensor, ...]]
    places: tuple[tuple[LoadedPatch, int, tuple[int, ...]], ...]

    @classmethod
    def of(cls, patching: DevicePatching, units: dict[int, torch.nn.Module], recurse: bool) -> AdapterStaging:
        unit_of = _unit_of(units, recurse)
        companions: dict[int, list[torch.Tensor]] = {}
        positions: dict[int, dict[int, int]] = {}
        places = []
        for patch in patching.loaded:
            unit = unit_of.get(id(patch.module))
            if unit is None:
                continue
            tensors, where = companions.setdefault(unit, []), positions.setdefault(unit, {})
            for tensor in patch.adapters():
                if id(tensor) not in where:
                    where[id(tensor)] = len(tensors)
                    tensors.append(tensor)
            places.append((patch, unit, tuple(where[id(tensor)] for tensor in patch.adapters())))
        return cls({unit: tuple(tensors) for unit, tensors in companions.items()}, tuple(places))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for tensors in self.companions.values() for t in tensors)

    def bind(self, runner: object) -> None:
        for patch, unit, positions in self.places:
            patch.stage(runner, unit, positions)


def _bake(model: ModelPatcher, key: str, device: torch.device) -> None:
    """Patches one weight once, on the device as ComfyUI patches a loaded weight, and brings it back."""
    weight = comfy.utils.get_attr(model.model, key)
    if weight.untyped_storage().nbytes() > weight.nbytes:
        # A view of a parked host buffer: the backup ComfyUI keeps of it must not hold the whole block's
        # (pinned) buffer alive for as long as the patch is on.
        weight.data = weight.data.clone()
    model.patch_weight_to_device(key, device_to=device)
    weight = comfy.utils.get_attr(model.model, key)
    weight.data = weight.data.to(model.offload_device)
