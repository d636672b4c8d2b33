"""Weight patches (LoRA and everything ``comfy.lora.calculate_weight`` applies) on streamed blocks, set up for the
engine and applied on the device as each block arrives, so the blocks' host buffers keep the weights as ComfyUI
loaded them: one copy per loaded model, shared by every clone, strength and branch of it, never re-packed nor
re-pinned when the patches change; and what they cost at each call, for the planner.

``patch_streamed_weights`` sets up each patched weight of the streamed modules by its route (``patches.py``):
a ``LoadedPatch`` (``loaded_patch.py``) run where its block arrives (``ArrivalPatches``, the engine's
``transforms``) or once into the host buffers of the units chosen to bake (``write_patches_to_host``), weight
functions at compute time, or a patch once before packing (``_bake``). ``AdapterStaging`` lists each unit's
patch adapters for the engine to stage with it, and tells each ``LoadedPatch`` where its own are among them.

``patch_ms_per_unit`` times each kind of patched weight once per process, as ``LoadedPatch`` patches it, and the
planner adds it to a block's compute when it streams (``StackCosts.patch_ms``). It only plans: nothing it does
may fail a prompt, nor change the model it measures.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, cast

import comfy.utils
import torch
from comfy.model_patcher import ModelPatcher

from ..offload import PROCESS_STATE, device_ms
from ..offload.layout import TensorForm
from . import dynamic_vram
from .blocks import inside
from .dynamic_vram import recorded_dtype
from .loaded_patch import LoadedPatch, as_loaded, compute_dtype, scratch_bytes, string_to_seed
from .patches import (
    host_tensors,
    is_plain,
    overwrite_in_place,
    patched_parameters,
    stored_by_layer,
    unit_named,
    with_host_tensors,
)
from .request import OffloadRequest


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


class _CastLayer(Protocol):
    """A layer of ComfyUI's ops (``comfy.ops.CastWeightBiasOp``), with the attributes ComfyUI's lowvram load
    sets on it: the functions its forward applies to the weight and bias it casts, and whether it casts them."""

    comfy_cast_weights: bool
    comfy_force_cast_weights: bool
    prev_comfy_cast_weights: bool
    weight_function: list[Callable[[torch.Tensor], torch.Tensor]]
    bias_function: list[Callable[[torch.Tensor], torch.Tensor]]


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
    force_casts(model, streamed)
    return DevicePatching(on_device, carried, baked, tuple(loaded), tuple(on_host), tuple(on_arrival))


def force_casts(model: ModelPatcher, streamed: frozenset[str]) -> None:
    """Sets on each layer of the ``streamed`` modules what ComfyUI's load sets on each layer it loads, which it
    never sees: whether the MODEL forces its layers to cast (``force_cast_weights``: a compute dtype set on it, as
    ModelComputeDtype sets one). A forced layer casts its weights to the compute dtype at each call (and runs no
    quantized kernel), as ComfyUI's do; its unpatch gives the layer back its own setting."""
    force = bool(getattr(model, "force_cast_weights", False))
    for name, module in model.model.named_modules():
        if not hasattr(module, "comfy_cast_weights") or not inside(name, streamed):
            continue
        layer = cast(_CastLayer, module)
        layer.comfy_force_cast_weights = force
        if force:
            if not hasattr(layer, "prev_comfy_cast_weights"):
                layer.prev_comfy_cast_weights = layer.comfy_cast_weights
            layer.comfy_cast_weights = True


def twin_patches_as_cast(model: ModelPatcher, request: OffloadRequest) -> Callable[[str, torch.nn.Module], bool] | None:
    """For a Dynamic VRAM model's twin, which of its modules that model patches as it casts them (by name)."""
    return functools.partial(dynamic_vram.patched_as_cast, model.model) if request.dynamic_vram_twin else None


def patch_scratch_bytes(
    model: ModelPatcher,
    streamed: frozenset[str],
    device: torch.device,
    patched_as_cast: Callable[[str, torch.nn.Module], bool] | None,
) -> int:
    """The engine's scratch for the ``streamed`` modules' patches where they arrive (``LoadedPatch.write_in_place``
    of plain LoRAs): the largest weight's, as they run one at a time."""
    twin_dtype = compute_dtype(model) if patched_as_cast is not None else None
    largest = 0
    for name, module, routes in patched_parameters(model, streamed):
        computed_in = twin_dtype if patched_as_cast is not None and patched_as_cast(name, module) else None
        for param, _, route in routes:
            if route == "arrival":
                need = scratch_bytes(module, param, f"{name}.{param}", model.patches, device, computed_in)
                largest = max(largest, need)
    return largest


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


# -- what the patches cost at each call of a streamed block, timed on the device as a placement is planned --


_PATCH_KINDS_KEPT = 256


class PatchTimings:
    """Measured patch costs (ms) by device and kind of patched weight (``_patch_kind``), and the kinds the probe
    failed on (logged once, not timed again)."""

    def __init__(self) -> None:
        self.ms: dict[tuple, float] = {}
        self.untimable: set[tuple] = set()


def patch_timings() -> PatchTimings:
    return PROCESS_STATE.entry(
        "patch timings",
        PatchTimings,
        "the same LoRA plans the same placement at every load, not one that moves with a new measurement's noise",
    )


def patch_ms_per_unit(
    model: ModelPatcher, units: Sequence[str], device: torch.device, untimed: list[str] | None = None
) -> tuple[float, ...]:
    """Per unit (a module with its submodules, by name), what its patches cost on ``device`` at each call when
    it streams: each weight ``patch_streamed_weights`` would patch on the device, timed as ``LoadedPatch``
    patches it from a copy on the device (one weight at a time), once per kind of weight. () when no unit has
    such patches. Not counted: GGUF patches, applied at compute time whether the block streams or not, and
    the weights baked once before packing.

    Only a plan needs the figure, so no failure of the probe fails a prompt: a weight it cannot time (an
    adapter type of another custom node, a format it does not know) is placed without its cost, logged once,
    and its key added to ``untimed`` for the plan line."""
    costs = [0.0] * len(units)
    index_of = {unit: index for index, unit in enumerate(units)}
    # Modules resident now count as if they streamed: the costs, so the plan, stay what they were.
    for name, module, routes in patched_parameters(model, frozenset(units), patched_too=True):
        unit_name = unit_named(name, index_of)
        assert unit_name is not None, f"{name} lies in no unit"  # patched_parameters yields the units' modules only
        unit = index_of[unit_name]
        for param, tensor, route in routes:
            key = f"{name}.{param}"
            if route not in ("device", "arrival") or key not in model.patches:
                continue
            ms = _cost(model, module, param, tensor, key, device)
            if ms is None:
                if untimed is not None:
                    untimed.append(key)
                continue
            costs[unit] += ms
    return tuple(costs) if any(costs) else ()


def _cost(
    model: ModelPatcher, module: torch.nn.Module, param: str, tensor: torch.Tensor, key: str, device: torch.device
) -> float | None:
    """The patch cost of ``key``'s kind of weight, timed the first time; None where it cannot be timed."""
    try:
        kind = (str(device), _patch_kind(module, param, tensor, model.patches[key]), compute_dtype(model))
    except Exception as error:  # noqa: BLE001 - any failure of a planning probe: planned without it
        _warn_untimable(key, error)
        return None
    timings = patch_timings()
    if kind in timings.untimable:
        return None
    if kind not in timings.ms:
        if len(timings.ms) >= _PATCH_KINDS_KEPT:
            timings.ms.clear()
        try:
            timings.ms[kind] = _time_patch(model, module, param, key, device)
        except torch.OutOfMemoryError:
            # The device is full as the model is placed: the plan goes without this cost (counted as none, as
            # before the planner knew it), and the next placement times it again.
            logging.info(f"Block Offload: no device memory to time the patches of {key}; not counted")
            return None
        except Exception as error:  # noqa: BLE001 - any failure of a planning probe: planned without it
            if len(timings.untimable) >= _PATCH_KINDS_KEPT:
                timings.untimable.clear()
            timings.untimable.add(kind)
            _warn_untimable(key, error)
            return None
    return timings.ms[kind]


def _warn_untimable(key: str, error: Exception) -> None:
    logging.warning(
        f"Block Offload: could not time the patches of {key} to plan the placement "
        f"({type(error).__name__}: {error}); planned without their cost, streamed as usual"
    )


def _streamed_dtype(module: torch.nn.Module, param: str, tensor: torch.Tensor) -> torch.dtype:
    """The dtype a weight streams in, wherever it is now: a Dynamic VRAM twin's plain weight in the one ComfyUI
    recorded for it (its file may store another, a resident one was cast), any other weight in its own."""
    return (recorded_dtype(module, param) if is_plain(tensor) else None) or tensor.dtype


def _patch_kind(module: torch.nn.Module, param: str, tensor: torch.Tensor, patches: list) -> tuple:
    """What a patch's cost depends on: the weight's shape and the dtype it streams in, its class (a quantized
    format's), and each patch's kind, adapter shapes and dtypes (not its strengths nor its values, nor where the
    weight is now: a block kept resident by one placement must cost what it did for the next one to plan)."""
    adapters = tuple((tuple(t.shape), t.dtype) for t in host_tensors(patches))
    kinds = tuple(type(patch[1]).__name__ for patch in patches)
    stored = (type(tensor).__name__, getattr(tensor, "_layout_cls", None))
    return tuple(tensor.shape), _streamed_dtype(module, param, tensor), stored, kinds, adapters


def _time_patch(model: ModelPatcher, module: torch.nn.Module, param: str, key: str, device: torch.device) -> float:
    """The device time of patching one weight at a call: from a copy of it on ``device`` as it streams (a
    quantized one as stored: no arithmetic on its bytes but ComfyUI's own), the adapters copied there too (the
    engine stages them). A weight function also pays for the weight ComfyUI's ops cast to the compute dtype and
    copy for it; a weight patched where it arrives, for the copy of its new form over the old."""
    tensor = getattr(module, param)
    if is_plain(tensor):
        stored = tensor.to(device, _streamed_dtype(module, param, tensor), copy=True)
    else:  # part by part: a quantized tensor's own ``to`` may hand back its memory even when asked to copy
        form = TensorForm.of(tensor, key)
        stored = form.assemble(part.to(device, copy=True) for part in form.parts_of(tensor))
    patches = model.patches[key]
    staged = with_host_tensors(patches, iter([t.to(device) for t in host_tensors(patches)]))
    seed = string_to_seed(key)
    if stored_by_layer(module) or is_plain(tensor):
        # The layer's set_ function re-stores from the layer's own weight: a stand-in holds the device copy.
        layer = copy.copy(module)
        layer._parameters = {**module._parameters, param: stored}

        work = stored if is_plain(stored) and not stored_by_layer(module) else None  # as ``write_in_place``

        def at_a_call() -> torch.Tensor:
            patched = as_loaded(layer, param, stored, key, staged, seed, work)
            overwrite_in_place(stored, patched, key)
            return stored

    else:
        weight = stored.to(compute_dtype(model), copy=True)

        def at_a_call() -> torch.Tensor:
            stored.clone()  # ComfyUI's ops copy a weight that has weight functions before calling them
            return as_loaded(module, param, stored, key, staged, seed, weight).to(weight.dtype)

    return device_ms(at_a_call, device)
