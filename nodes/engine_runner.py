"""The runner an engine starts on a loaded model: a block streamer or the sequential wrapper, with its file tier and
the decision to bake its patches into host buffers."""

from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from comfy.model_patcher import ModelPatcher
from torch import nn

from ..offload import (
    BakeDecision,
    CallOptions,
    FileOptions,
    HostOptions,
    OffloadPlan,
    ParkingLot,
    Runner,
    SequentialOptions,
    StreamSpec,
    entry_methods,
    host_tier,
    stream_blocks,
    stream_modules,
)
from ..offload.layout import BlockLayout, module_stored_bytes
from .blocks import find_blocks, read_by_parents
from .comfy_memory import (
    PINNED_LIMIT_ENV,
    PINNED_MEMORY,
    host_buffer_room,
    pinning_enabled,
)
from .dynamic_vram import file_slice, recorded_dtype
from .placement import Placement, bake
from .request import OffloadRequest

#: Unit ("block", "module"), unit count, order.
CallOrder = tuple[str, int, tuple[int, ...]]


@dataclass(frozen=True)
class PatchHistory:
    """How many steps the model's streamed blocks have run one set of patches, across consecutive engines: what
    decides whether baking pays."""

    patches: Hashable
    steps: int
    read_bandwidth: float | None = None  # the last engine's file-tier reads, bytes/s


def file_tier_options(
    request: OffloadRequest, units: dict[int, nn.Module], recurse: bool, fast_disk: bool, held: int
) -> tuple[FileOptions, frozenset[int]]:
    """The file options for a Dynamic VRAM twin, and the file-backed units that get a host buffer. Units that do not
    fit ``host_buffer_room`` are read from the file each step. Nothing for other models.

    ``fast_disk``: ComfyUI reads this model from its file each step, so the twin keeps no host buffers either (it would
    take more RAM than ComfyUI alone) unless ``BLOCK_OFFLOAD_MAX_PINNED_GB`` asks. ``held``: host bytes other engines
    hold now."""
    if not request.dynamic_vram_twin:
        return FileOptions(), frozenset()
    in_file, elsewhere = [], 0
    for index, unit in sorted(units.items()):
        nbytes = module_stored_bytes(unit, recurse, recorded_dtype)
        if any(file_slice(part) is not None for part in BlockLayout.of(unit, recurse=recurse).current()):
            in_file.append((index, nbytes))
        else:
            elsewhere += nbytes  # converted by ComfyUI's loader, so it needs a host buffer
    room = 0 if fast_disk and not os.environ.get(PINNED_LIMIT_ENV) else host_buffer_room(held) - elsewhere
    kept = host_tier(in_file, room)
    read_each_step = frozenset(index for index, _ in in_file) - kept
    return FileOptions(file_slice=file_slice, dtype_of=recorded_dtype, read_each_step=read_each_step), kept


def decide_baking(
    model: ModelPatcher,
    request: OffloadRequest,
    placement: Placement,
    units: dict[int, nn.Module],
    read_each_step: frozenset[int],
    in_host: frozenset[int],
    history: PatchHistory | None,
    parking: ParkingLot,
) -> BakeDecision | None:
    """Whether this engine bakes its streamed blocks' patches into their host buffers. Only a Dynamic VRAM twin's
    blocks can: their originals are file views to repack from when patches change; any other block would need a
    second host copy."""
    if not request.dynamic_vram_twin or placement.plan is None:
        return None
    candidates = in_host | frozenset(index for index, unit in units.items() if parking.from_file(unit))
    same = history if history is not None and history.patches == model.patches_uuid else None
    steps = same.steps if same is not None else 0
    least_ms = 0.0
    if same is not None and same.read_bandwidth:
        read = sum(module_stored_bytes(units[index], True) for index in read_each_step)
        least_ms = read / same.read_bandwidth * 1e3
    return bake(placement, model, candidates - read_each_step, steps, least_ms)


def host_options(
    request: OffloadRequest,
    plan: OffloadPlan | None,
    parking: ParkingLot,
    companions: Mapping[int, Sequence[torch.Tensor]],
    contents: Mapping[int, Hashable],
) -> HostOptions:
    """How the engine keeps the units on the host: pinned within the pack's budget, packed in the background, parked
    into the model's ``parking``."""
    if plan is None:
        return HostOptions(
            pin_memory=request.pin_memory and pinning_enabled(),
            pin_budget=PINNED_MEMORY,
            storage_dtype=request.storage_dtype,
            pack_in_background=True,
            parking=parking,
            companions=companions,
        )
    return HostOptions(
        pin_memory=plan.pin_memory,
        pin_budget=PINNED_MEMORY,
        pack_in_background=True,
        parking=parking,
        contents=contents,
        companions=companions,
    )


def make_runner(
    model: ModelPatcher,
    request: OffloadRequest,
    plan: OffloadPlan | None,
    device: torch.device,
    units: dict[int, nn.Module],
    last_order: CallOrder | None,
    spec: StreamSpec,
) -> Runner:
    """The engine of ``units``: the sequential wrapper without a plan, else a block streamer. ``spec`` is complete but
    for what the plan and the model say: how far the ring copies ahead, its size, and how the blocks are called."""
    diffusion_model = model.model.diffusion_model
    if plan is None:
        spec = replace(
            spec,
            ring=replace(spec.ring, prefetch=request.prefetch),
            calls=CallOptions(
                call_order=order_for(last_order, "module", len(units)), holders=read_by_parents(diffusion_model)
            ),
        )
        promotion = SequentialOptions(
            vram_limit_bytes=request.vram_limit_bytes, on_promote=functools.partial(_count_promoted, model.model)
        )
        return stream_modules(diffusion_model, device, spec, promotion)
    found = find_blocks(diffusion_model)
    blocks = found.blocks
    spec = replace(
        spec,
        ring=replace(spec.ring, prefetch=plan.prefetch, ring_bytes=plan.ring_bytes or None),
        calls=CallOptions(
            root=diffusion_model,
            call_order=order_for(last_order, "block", len(blocks)),
            entry_methods=entry_methods(diffusion_model, found),
        ),
    )
    return stream_blocks([block for _, block in blocks], device, plan.streamed, spec)


def order_for(last: CallOrder | None, unit: str, units: int) -> tuple[int, ...] | None:
    return last[2] if last is not None and last[:2] == (unit, units) else None


def _count_promoted(model: torch.nn.Module, nbytes: int) -> None:
    """Counts modules the sequential wrapper keeps on the device in ComfyUI's books. A function of the model, not a
    patcher method: the engine lives on the model, and a reference to the patcher would keep it alive until the
    cycle collector ran."""
    # Through __dict__: nn.Module's annotations would type this plain int as a tensor or module.
    model.__dict__["model_loaded_weight_memory"] += nbytes
