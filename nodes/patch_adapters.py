"""The host tensors a weight's patches hold (its adapters), found, replaced by their staged copies, and counted
per unit.

The adapters (the LoRA's up and down matrices, and whatever else a patch holds in host memory) travel with
their block: packed once per set of patches (an engine) into a host buffer of the block's (pinned where the
block's is; those as large as half the block or more, as a model merge's other weights, stay where they lie:
``offload/companions.py``), copied into the ring right after the block's weights on the copy stream, and read there by
``LoadedPatch`` (``AdapterStaging``); ComfyUI's lowvram path copies each from pageable memory on the
compute stream, layer by layer, at every step. ``adapter_bytes`` is the room they take in the ring.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Iterator
from typing import Any, Protocol, TypeGuard, overload

import torch
from comfy.model_patcher import ModelPatcher

from .patch_routes import patched_by_comfyui


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
    unless not ``recurse``): what staging them with their unit adds to it. A weight ComfyUI never patches
    (``patched_by_comfyui``) stages none."""
    held: dict[str, dict[int, int]] = {}
    for key, patches in model.patches.items():
        owner = key.rpartition(".")[0]
        unit = unit_named(owner, units) if recurse else (owner if owner in units else None)
        if unit is not None and patched_by_comfyui(model.model.get_submodule(owner)):
            tensors = held.setdefault(unit, {})
            for tensor in host_tensors(patches):
                tensors[id(tensor)] = tensor.numel() * tensor.element_size()
    return {unit: sum(tensors.values()) for unit, tensors in held.items()}
