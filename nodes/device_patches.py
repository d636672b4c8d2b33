"""Weight patches on streamed blocks, applied on the device as each block arrives, so the host buffers keep the
weights as ComfyUI loaded them: one copy per model, shared by every clone and strength, never repacked when
patches change; and what the patches cost per call, for the planner, timed without ever failing a prompt."""

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
    on_host: tuple[LoadedPatch, ...] = field(default=(), compare=False)  # baked into host buffers
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
    """A layer of ComfyUI's ops with the attributes ComfyUI's lowvram load sets on it."""

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
    """Sets up the patches of the ``streamed`` modules' weights before the engine packs them; plain weights of
    ``bake`` units are left for ``write_patches_to_host``. ``patched_as_cast``: for a Dynamic VRAM twin, the
    modules that model patches as it casts them."""
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
                own = [LoadedPatch(key, model.patches, module, param, computed_in)] if key in model.patches else []
                functions[param] = own + list(model.weight_wrapper_patches.get(key, []))
                on_device += len(own)
                loaded += own
            else:
                bake_now.append(key)
        if functions or arriving:
            layer = cast(_CastLayer, module)
            layer.weight_function = functions.get("weight", [])
            layer.bias_function = functions.get("bias", [])
            if not hasattr(layer, "prev_comfy_cast_weights"):  # as ComfyUI's lowvram load marks a module
                layer.prev_comfy_cast_weights = layer.comfy_cast_weights
                counted += len(arriving) + sum(
                    isinstance(f, LoadedPatch) for f in (*layer.weight_function, *layer.bias_function)
                )
            if layer.weight_function or layer.bias_function:
                layer.comfy_cast_weights = True
            on_arrival += arriving
            loaded += arriving
        for key in bake_now:
            _bake(model, key, device)
        if bake_now:
            # A clone taking these weights over must not patch them again. (torch types __setattr__'s value as
            # Tensor | Module; it takes any.)
            module.comfy_patched_weights = True  # type: ignore[assignment]
            baked += len(bake_now)
    # As ComfyUI's lowvram load counts: once per module it marks; its unpatch resets it.
    model.model.lowvram_patch_counter += counted
    force_casts(model, streamed)
    return DevicePatching(on_device, carried, baked, tuple(loaded), tuple(on_host), tuple(on_arrival))


def force_casts(model: ModelPatcher, streamed: frozenset[str]) -> None:
    """Sets ``comfy_force_cast_weights`` on streamed layers, as ComfyUI's load does on the layers it loads (and never
    sees these), so a MODEL with a forced compute dtype casts them too. ComfyUI's unpatch restores them."""
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
    return functools.partial(dynamic_vram.patched_as_cast, model.model) if request.dynamic_vram_twin else None


def patch_scratch_bytes(
    model: ModelPatcher,
    streamed: frozenset[str],
    device: torch.device,
    patched_as_cast: Callable[[str, torch.nn.Module], bool] | None,
) -> int:
    """The scratch for arrival patches of plain LoRAs: the largest weight's, as they run one at a time."""
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
    """The engine's ``transforms``: each unit's arrival patches, run when a fresh copy is first used; at later calls
    the re-quantized weights are only put back."""

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
    """Bakes the host-bound patches into the units in ``needing``, each computed on ``device`` as at compute time.
    Returns the units written."""
    unit_of = _unit_of(units, recurse)
    written = set()
    for patch in patching.on_host:
        unit = unit_of.get(id(patch.module))
        if unit in needing:
            patch.write_to_host(device)
            written.add(unit)
    return frozenset(written)


def _unit_of(units: dict[int, torch.nn.Module], recurse: bool) -> dict[int, int]:
    return {id(module): index for index, unit in units.items() for module in (unit.modules() if recurse else (unit,))}


@dataclass(frozen=True)
class AdapterStaging:
    """The engine's companions (each unit's adapters, each tensor once) and where each ``LoadedPatch``'s own are
    among them, told to it by ``bind``."""

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
    """Patches one weight once on the device, as ComfyUI patches a loaded weight, and brings it back."""
    weight = comfy.utils.get_attr(model.model, key)
    if weight.untyped_storage().nbytes() > weight.nbytes:
        # A view of a parked host buffer: ComfyUI's backup must not keep the whole pinned buffer alive.
        weight.data = weight.data.clone()
    model.patch_weight_to_device(key, device_to=device)
    weight = comfy.utils.get_attr(model.model, key)
    weight.data = weight.data.to(model.offload_device)


# -- what patches cost at each call of a streamed block, for the planner


_PATCH_KINDS_KEPT = 256


class PatchTimings:
    """Measured patch costs (ms) by device and patch kind, and the kinds that failed (logged once)."""

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
    """Per unit, what its patches cost on ``device`` at each streamed call, timed once per kind of weight; () when
    none. GGUF patches and baked weights cost the same streamed or not, so they are left out. A weight the probe
    cannot time is planned without its cost and added to ``untimed``."""
    costs = [0.0] * len(units)
    index_of = {unit: index for index, unit in enumerate(units)}
    # Resident modules count as if streamed, so the plan does not change with the placement.
    for name, module, routes in patched_parameters(model, frozenset(units), patched_too=True):
        unit_name = unit_named(name, index_of)
        assert unit_name is not None, f"{name} lies in no unit"
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
    """The patch cost of ``key``'s kind, timed the first time; None where it cannot be timed."""
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
            # Planned without this cost; the next placement times it again.
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
    """The dtype a weight streams in: for a plain weight the recorded one, since its file or a resident cast may hold
    another."""
    return (recorded_dtype(module, param) if is_plain(tensor) else None) or tensor.dtype


def _patch_kind(module: torch.nn.Module, param: str, tensor: torch.Tensor, patches: list) -> tuple:
    """What a patch's cost depends on. Not strengths, values, or where the weight is now: a block kept resident by
    one placement must cost the same for the next to plan."""
    adapters = tuple((tuple(t.shape), t.dtype) for t in host_tensors(patches))
    kinds = tuple(type(patch[1]).__name__ for patch in patches)
    stored = (type(tensor).__name__, getattr(tensor, "_layout_cls", None))
    return tuple(tensor.shape), _streamed_dtype(module, param, tensor), stored, kinds, adapters


def _time_patch(model: ModelPatcher, module: torch.nn.Module, param: str, key: str, device: torch.device) -> float:
    """The device time of patching one weight at a call, from a device copy as it streams, with staged adapters.
    Includes the ops' copy for a weight function, or the overwrite for an arrival patch."""
    tensor = getattr(module, param)
    if is_plain(tensor):
        stored = tensor.to(device, _streamed_dtype(module, param, tensor), copy=True)
    else:  # part by part: a quantized tensor's ``to`` may share memory even when asked to copy
        form = TensorForm.of(tensor, key)
        stored = form.assemble(part.to(device, copy=True) for part in form.parts_of(tensor))
    patches = model.patches[key]
    staged = with_host_tensors(patches, iter([t.to(device) for t in host_tensors(patches)]))
    seed = string_to_seed(key)
    if stored_by_layer(module) or is_plain(tensor):
        # set_ re-stores from the layer's own weight, so a stand-in layer holds the device copy.
        layer = copy.copy(module)
        layer._parameters = {**module._parameters, param: stored}

        work = stored if is_plain(stored) and not stored_by_layer(module) else None

        def at_a_call() -> torch.Tensor:
            patched = as_loaded(layer, param, stored, key, staged, seed, work)
            overwrite_in_place(stored, patched, key)
            return stored

    else:
        weight = stored.to(compute_dtype(model), copy=True)

        def at_a_call() -> torch.Tensor:
            stored.clone()  # ComfyUI's ops copy a weight before calling its weight functions
            return as_loaded(module, param, stored, key, staged, seed, weight).to(weight.dtype)

    return device_ms(at_a_call, device)
