"""What weight patches cost at each call of a streamed block, timed on the device as a placement is planned.

``patch_ms_per_unit`` times each kind of patched weight once per process, as ``LoadedPatch`` patches it (a
weight function at compute time, or written in place where it arrives), and the planner adds it to a block's
compute when it streams (``StackCosts.patch_ms``). It only plans: nothing it does may fail a prompt, nor change
the model it measures.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Sequence

import torch
from comfy.model_patcher import ModelPatcher

from ..offload import PROCESS_STATE, device_ms
from ..offload.layout import TensorForm
from .dynamic_vram import recorded_dtype
from .loaded_patch import as_loaded, compute_dtype, string_to_seed
from .patches import (
    host_tensors,
    is_plain,
    overwrite_in_place,
    patched_parameters,
    stored_by_layer,
    unit_named,
    with_host_tensors,
)

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
