"""The runner an engine starts on a loaded model (``nodes/engine.py``): the block streamer of a placement, or the
sequential wrapper, with its file tier (a Dynamic VRAM twin's blocks read from their checkpoint at each step)
and the decision to bake its patches into host buffers.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

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
    RingOptions,
    Runner,
    SequentialOptions,
    StreamSpec,
    TimelineRecorder,
    Transform,
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
    outside_the_recording,
    pinning_enabled,
)
from .dynamic_vram import file_slice, recorded_dtype
from .placement import Placement, bake
from .request import OffloadRequest

#: An engine's call order, with what it counts: its unit ("block", "module"), how many units, the order.
CallOrder = tuple[str, int, tuple[int, ...]]


@dataclass(frozen=True)
class PatchHistory:
    """How long the model's streamed blocks have run one set of patches (ComfyUI's ``patches_uuid``), through
    the engines that ran it in a row: what decides whether baking them once pays (``offload.bake_decision``)."""

    patches: Hashable
    steps: int
    read_bandwidth: float | None = None  # the last engine's file-tier read bandwidth (bytes/s)


def file_tier_options(
    request: OffloadRequest, units: dict[int, nn.Module], recurse: bool, fast_disk: bool, held: int
) -> tuple[FileOptions, frozenset[int]]:
    """The engine's file options for a Dynamic VRAM twin, whose weights are views of their checkpoint file:
    where each weight's bytes are, the dtypes ComfyUI computes in, and the streamed units read from the file
    at each step, those that get no host buffer within ``host_buffer_room``; and the units in the file that
    get one. Nothing for other models.

    ``fast_disk``: ComfyUI chose to read this model's offloaded weights from its file at each step rather than
    hold them in RAM (``on_fast_disk``), so the twin holds no host buffer for a weight in the file either (it
    would take more RAM than ComfyUI alone), unless ``BLOCK_OFFLOAD_MAX_PINNED_GB`` asks for some. ``held``: the host
    bytes the other engines' runners hold now."""
    if not request.dynamic_vram_twin:
        return FileOptions(), frozenset()
    in_file, elsewhere = [], 0
    for index, unit in sorted(units.items()):
        nbytes = module_stored_bytes(unit, recurse, recorded_dtype)
        if any(file_slice(part) is not None for part in BlockLayout.of(unit, recurse=recurse).current()):
            in_file.append((index, nbytes))
        else:
            elsewhere += nbytes  # converted by ComfyUI's loader: only a host buffer can hold it
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
    """Whether this engine bakes its streamed blocks' patches into their host buffers (``placement.bake``). Only
    a Dynamic VRAM twin's blocks held in host memory can: their originals are views of the checkpoint file, to
    pack from again when the patches change; any other block would need a second host copy of its weights. The
    file tier's reads bound the step as the last engine measured them."""
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
    """How the engine keeps the units on the host: pinned as the plan (or, for the sequential wrapper, the
    request) asks within the pack's pin budget, packed in the background, parked into the model's ``parking``,
    with the patches' ``companions`` and the ``contents`` baked into host buffers (blocks only)."""
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
    recorder: TimelineRecorder,
    units: dict[int, nn.Module],
    last_order: CallOrder | None,
    host: HostOptions,
    files: FileOptions,
    transforms: Mapping[int, Transform],
    scratch_bytes: int,
) -> Runner:
    """The engine of ``units`` (``Units.streamed``: modules for the sequential wrapper, else the plan's
    streamed blocks), from one ``StreamSpec``: ``host_options``' host part, ``file_tier_options``' file part,
    and the patches' ``transforms`` with the ``scratch_bytes`` they work in."""
    diffusion_model = model.model.diffusion_model
    persistent = outside_the_recording()
    if plan is None:
        spec = StreamSpec(
            host=host,
            ring=RingOptions(prefetch=request.prefetch, scratch_bytes=scratch_bytes, persistent_allocations=persistent),
            files=files,
            calls=CallOptions(
                call_order=order_for(last_order, "module", len(units)), holders=read_by_parents(diffusion_model)
            ),
            transforms=transforms,
            recorder=recorder,
        )
        promotion = SequentialOptions(
            vram_limit_bytes=request.vram_limit_bytes, on_promote=functools.partial(_count_promoted, model.model)
        )
        return stream_modules(diffusion_model, device, spec, promotion)
    found = find_blocks(diffusion_model)
    blocks = found.blocks
    spec = StreamSpec(
        host=host,
        ring=RingOptions(
            prefetch=plan.prefetch,
            ring_bytes=plan.ring_bytes or None,
            scratch_bytes=scratch_bytes,
            persistent_allocations=persistent,
        ),
        files=files,
        calls=CallOptions(
            root=diffusion_model,
            call_order=order_for(last_order, "block", len(blocks)),
            entry_methods=entry_methods(diffusion_model, found),
        ),
        transforms=transforms,
        recorder=recorder,
    )
    return stream_blocks([block for _, block in blocks], device, plan.streamed, spec)


def order_for(last: CallOrder | None, unit: str, units: int) -> tuple[int, ...] | None:
    """The last engine's call order, when it streamed the same units."""
    return last[2] if last is not None and last[:2] == (unit, units) else None


def _count_promoted(model: torch.nn.Module, nbytes: int) -> None:
    """ComfyUI counts the modules the sequential wrapper keeps on the device. A function of the model,
    not a method of the patcher: the engine lives on the model, and a patcher it referred to could not
    be freed (nor stop the engine as it goes) until Python's cycle collector came by."""
    # A plain int attribute of ComfyUI's BaseModel (in the module's __dict__, where nn.Module keeps attributes
    # that are no parameter, buffer or submodule); its annotations would read it as a tensor or module.
    model.__dict__["model_loaded_weight_memory"] += nbytes
