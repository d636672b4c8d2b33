"""The engine's life on a loaded model: started as ComfyUI loads the resident part (a block streamer or the sequential
wrapper, with its file tier and the decision to bake its patches into host buffers), stopped or parked when ComfyUI
unloads the model or hands it to the next prompt's clone. The engine imports none of its readers; it tells an
``EngineWatcher`` (the panel) as it starts and stops."""

from __future__ import annotations

import functools
import logging
import os
import time
import weakref
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol, runtime_checkable

import torch
from comfy.model_patcher import ModelPatcher
from torch import nn

from ..offload import (
    GIB,
    PROCESS_STATE,
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
    entry_methods,
    host_tier,
    read_bandwidth,
    release_freed_host_memory,
    stream_blocks,
    stream_modules,
)
from ..offload.layout import BlockLayout, module_stored_bytes
from . import extension
from .blocks import Units, find_blocks, inside, read_by_parents
from .comfy_memory import PINNED_LIMIT_ENV, PINNED_MEMORY, host_buffer_room, outside_the_recording, pinning_enabled
from .device_patches import (
    AdapterStaging,
    ArrivalPatches,
    patch_scratch_bytes,
    patch_streamed_weights,
    twin_patches_as_cast,
    write_patches_to_host,
)
from .dynamic_vram import file_slice, on_fast_disk, recorded_dtype
from .placement import (
    Placement,
    bake,
    block_names,
    least_read_ms,
    pack_progress,
    packing_clause,
    pageable_clause,
    pinning_notices,
    tiers_clause,
)
from .request import OffloadRequest

#: Starts the log line that background packing is over, so readers tell it from the plan line.
PACKING_DONE = "background packing done:"

#: Unit ("block", "module"), unit count, order.
CallOrder = tuple[str, int, tuple[int, ...]]


@dataclass(frozen=True)
class PatchHistory:
    """How many steps the model's streamed blocks have run one set of patches, across consecutive engines: what
    decides whether baking pays."""

    patches: Hashable
    steps: int
    read_bandwidth: float | None = None  # the last engine's file-tier reads, bytes/s


@dataclass
class Engine:
    """The streaming state of one loaded model: what was asked, where it was placed, what streams it, and what it
    recorded. Kept on the model, which ComfyUI's clones share."""

    request: OffloadRequest
    placement: Placement
    runner: Runner
    recorder: TimelineRecorder
    notices: list[str] = field(default_factory=list)  # logged once, shown by the panel
    summary: str = ""  # the plan line as logged
    read_bandwidth: float | None = None  # bytes/s, measured at start; None: no file tier
    cold_reads_noted: bool = False
    patches: Hashable = None  # ComfyUI's ``patches_uuid`` of the streamed blocks' patches; None: none
    baked: frozenset[int] = frozenset()
    packing_s: float = 0.0  # the start's packing and pinning
    packing_noted: bool = False

    def note(self, notices: list[str]) -> None:
        for notice in notices:
            if notice not in self.notices:
                logging.warning(f"Block Offload ({self.request.node}): {notice}")
                self.notices.append(notice)

    def note_packing(self) -> None:
        """Once background packing is done, logs what was packed and pinned, and the driver's refusals the start
        could not know yet. A short prompt may end first; the next one tells."""
        if self.packing_noted:
            return
        report = self.runner.report()
        packed, later = report.background_packing
        if not later or report.waiting_bytes:
            return
        self.packing_noted = True
        pinned, _ = report.pinning_progress
        buffers = report.host_bytes - report.companion_bytes - report.staging_bytes
        logging.info(
            f"Block Offload ({self.request.node}): {PACKING_DONE} {packed / GIB:.2f} GiB of streamed blocks, "
            f"{pinned / GIB:.2f} GiB of them pinned; {buffers / GIB:.2f} GiB copied into host buffers, the rest kept "
            "where the loader put them"
        )
        self.note(pinning_notices(report))

    def patch_history(self, before: PatchHistory | None) -> PatchHistory | None:
        """This engine's steps added to the earlier engines' that ran the same patches."""
        if self.patches is None:
            return None
        steps = self.recorder.steps_ended
        if before is not None and before.patches == self.patches:
            steps += before.steps
        return PatchHistory(self.patches, steps, self.read_bandwidth)

    def note_cold_reads(self) -> None:
        """Warns once when the last step read the file at under half the bandwidth measured at start: the page cache
        no longer holds the checkpoint. The tiers stay; the next load measures again."""
        step = self.recorder.latest()
        if not self.read_bandwidth or step is None or step.read_gbps is None:
            return
        if step.read_gbps * 1e9 >= self.read_bandwidth / 2 or self.cold_reads_noted:
            return
        notice = (
            f"The checkpoint file was read at {step.read_gbps:.2f} GB/s in the last step, under half the "
            f"{self.read_bandwidth / 1e9:.2f} GB/s measured as the model was placed: the page cache no longer "
            f"holds it (cold), so steps wait for the disk. Free RAM, or a larger {PINNED_LIMIT_ENV}, keeps "
            "more blocks in host memory."
        )
        logging.warning(f"Block Offload ({self.request.node}): {notice}")
        self.notices.append(notice)
        self.cold_reads_noted = True

    @property
    def read_ms(self) -> float | None:
        return least_read_ms(self.runner.report(), self.read_bandwidth)

    @property
    def predicted_ms(self) -> float | None:
        """The planner's step time, or the reads' least step time where longer: the reader runs beside copies and
        compute, so the slowest sets the pace."""
        predictions = [ms for ms in (self.placement.predicted_ms, self.read_ms) if ms is not None]
        return max(predictions) if self.placement.predicted_ms is not None and predictions else None

    @property
    def plan(self) -> OffloadPlan | None:
        return self.placement.plan

    def stop(self, park: bool = False) -> None:
        """``park``: the streamed blocks keep their host buffers for the next engine to adopt."""
        self.runner.disable(park)
        _live_runners().discard(self.runner)
        watcher = _engine_watcher()
        if watcher is not None:
            watcher.engine_stopped(self)


@runtime_checkable
class EngineWatcher(Protocol):
    """Follows every engine's life, called on the thread that starts or stops it."""

    def engine_started(self, engine: Engine) -> None: ...

    def engine_stopped(self, engine: Engine) -> None: ...


def _engine_watcher() -> EngineWatcher | None:
    watcher = extension.installed()
    return watcher if isinstance(watcher, EngineWatcher) else None


def _live_runners() -> weakref.WeakSet[Runner]:
    return PROCESS_STATE.entry(
        "live runners", weakref.WeakSet, "the host buffers every streaming engine holds count against one host cap"
    )


def start_engine(
    model: ModelPatcher,
    request: OffloadRequest,
    placement: Placement,
    device: torch.device,
    parking: ParkingLot,
    load_resident: Callable[[], None],
    last_order: CallOrder | None = None,
    history: PatchHistory | None = None,
) -> Engine:
    """Streams ``placement``'s blocks of ``model``: patches set up, blocks packed, device buffers allocated where
    ComfyUI counted them. ``load_resident`` runs once the engine is enabled, so the packing thread pins the
    streamed blocks while ComfyUI loads the rest, and the first step does not race the pinning. Whatever it raises
    stops the engine."""
    # Unpin through ComfyUI what it pinned: packing frees the originals, and ComfyUI would later unpin memory
    # that is gone, its pinned total never coming down.
    for key in [key for key in model.pinned if inside(key, placement.streamed)]:
        model.unpin_weight(key)
    streamed = Units.streamed(model.model.diffusion_model, placement.plan)
    units, recurse = streamed.modules, streamed.recurse
    fast_disk = on_fast_disk(model)
    held = sum(runner.report().host_bytes for runner in _live_runners() if runner.enabled)
    file_options, in_host = file_tier_options(request, units, recurse, fast_disk, held)
    baking = decide_baking(model, request, placement, units, file_options.read_each_step, in_host, history, parking)
    baked = baking.blocks if baking is not None else frozenset()
    baked_names = frozenset(block_names(model)[index] for index in baked) if baked else frozenset()
    as_cast = twin_patches_as_cast(model, request)
    patching = patch_streamed_weights(model, placement.streamed, device, baked_names, as_cast)
    patches = model.patches_uuid if patching.loaded or patching.on_host else None
    contents = dict.fromkeys(baked, patches)
    adapters = AdapterStaging.of(patching, units, recurse)
    arrival = ArrivalPatches(patching, units, recurse)
    recorder = TimelineRecorder(device)
    spec = StreamSpec(
        host=host_options(request, placement.plan, parking, adapters.companions, contents),
        ring=RingOptions(
            scratch_bytes=patch_scratch_bytes(model, placement.streamed, device, as_cast),
            persistent_allocations=outside_the_recording(),
        ),
        files=file_options,
        transforms=arrival.transforms(),
        recorder=recorder,
    )
    runner = make_runner(model, request, placement.plan, device, units, last_order, spec)
    adapters.bind(runner)
    started = time.perf_counter()
    runner.enable(pack_progress())
    packing_s = time.perf_counter() - started
    release_freed_host_memory()  # the originals, now packed
    try:
        load_resident()
        if contents:  # before the ring is allocated, one weight at a time
            needs = runner.report().needs_content
            runner.wrote_content(write_patches_to_host(patching, units, recurse, needs, device))
        runner.allocate_device_buffers()
    except BaseException:
        # No engine is recorded, so give back every pin and buffer now.
        runner.disable()
        raise
    _live_runners().add(runner)
    bandwidth = read_bandwidth(runner.report().file_slices)
    report = runner.report()  # after the measurement: packing went on meanwhile
    summary = placement.summary + patching.describe() + packing_clause(report, packing_s) + pageable_clause(report)
    if request.dynamic_vram_twin:
        summary += tiers_clause(report, bandwidth, fast_disk)
    if baking is not None and (baking.blocks or baking.saving_ms > 0):
        summary += baking.describe()
    engine = Engine(
        request,
        placement,
        runner,
        recorder,
        notices=[request.notice] if request.notice else [],
        summary=summary,
        read_bandwidth=bandwidth,
        patches=patches,
        baked=baked,
        packing_s=packing_s,
    )
    # The driver's refusals are final only once every block is packed (``note_packing`` tells them then).
    engine.note(pinning_notices(report, driver=not report.waiting_bytes))
    watcher = _engine_watcher()
    if watcher is not None:
        watcher.engine_started(engine)
    logging.info(f"Block Offload ({request.node}): {summary}")
    return engine


def call_order_of(engine: Engine) -> CallOrder:
    report = engine.runner.report()
    return report.unit, report.units, report.last_order


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
