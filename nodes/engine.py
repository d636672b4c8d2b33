"""The engine's life on a loaded model: started as ComfyUI loads the resident part (the streamed blocks pin and
pack in the background meanwhile), stopped or parked when ComfyUI unloads the model or hands it to the next
prompt's clone.

``Engine`` is the pack's main interface between ComfyUI and ``offload/``: the patcher keeps one per
loaded model, the panel (``nodes/panel.py``) and the benchmark read it. The engine imports none of its
readers: it tells the panel the extension set up (``nodes/extension.py``), an ``EngineWatcher``, as each
engine starts and stops.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

import torch
from comfy.model_patcher import ModelPatcher

from ..offload import (
    GIB,
    PROCESS_STATE,
    OffloadPlan,
    ParkingLot,
    Runner,
    TimelineRecorder,
    read_bandwidth,
    release_freed_host_memory,
)
from . import extension
from .blocks import Units, inside
from .comfy_memory import PINNED_LIMIT_ENV
from .device_patches import (
    AdapterStaging,
    ArrivalPatches,
    patch_scratch_bytes,
    patch_streamed_weights,
    twin_patches_as_cast,
    write_patches_to_host,
)
from .dynamic_vram import on_fast_disk
from .engine_runner import CallOrder, PatchHistory, decide_baking, file_tier_options, host_options, make_runner
from .placement import (
    Placement,
    block_names,
    least_read_ms,
    pack_progress,
    packing_clause,
    pageable_clause,
    pinning_notices,
    tiers_clause,
)
from .request import OffloadRequest

#: How the log line that packing in the background is over begins (after the node's name), apart from the plan line.
PACKING_DONE = "background packing done:"


@dataclass
class Engine:
    """The streaming state of one loaded model: what was asked, where it was placed, what streams it,
    and what it recorded. It lives on the model (``nodes/patcher.py``), which ComfyUI's clones share."""

    request: OffloadRequest
    placement: Placement
    runner: Runner
    recorder: TimelineRecorder
    # Things the user should know about this run (a fallback taken, a cap reached): logged once, shown by the panel.
    notices: list[str] = field(default_factory=list)
    # The plan line as logged: the placement's summary, and what went to pageable memory.
    summary: str = ""
    # The file tier's read bandwidth, measured as the engine started (bytes/s; None: no file tier).
    read_bandwidth: float | None = None
    cold_reads_noted: bool = False  # the notice of ``note_cold_reads`` is given once per engine
    # The set of patches its streamed blocks apply (ComfyUI's ``patches_uuid``; None: none), and which blocks
    # hold them baked into their host buffers.
    patches: Hashable = None
    baked: frozenset[int] = frozenset()
    # What its start copied into host buffers, in seconds, packing and pinning included (a first load's cost).
    packing_s: float = 0.0
    packing_noted: bool = False  # ``note_packing`` told that packing in the background is done

    def note(self, notices: list[str]) -> None:
        """Logs the notices not given yet, and keeps them for the panel."""
        for notice in notices:
            if notice not in self.notices:
                logging.warning(f"Block Offload ({self.request.node}): {notice}")
                self.notices.append(notice)

    def note_packing(self) -> None:
        """Once the blocks left to pack in the background are packed (the engine's thread may still be at it when
        a short prompt ends: the next one tells): a log line on what was packed and pinned, and a notice for each
        reason some blocks went to pageable memory that the start could not tell yet (the driver refusing)."""
        packed, later = self.runner.background_packing
        if self.packing_noted or not later or self.runner.waiting_bytes:
            return
        self.packing_noted = True
        pinned, _ = self.runner.pinning_progress
        runner = self.runner
        buffers = runner.host_bytes - runner.companion_bytes - runner.staging_bytes
        logging.info(
            f"Block Offload ({self.request.node}): {PACKING_DONE} {packed / GIB:.2f} GiB of streamed blocks, "
            f"{pinned / GIB:.2f} GiB of them pinned; {buffers / GIB:.2f} GiB copied into host buffers, the rest kept "
            "where the loader put them"
        )
        self.note(pinning_notices(self.runner))

    def patch_history(self, before: PatchHistory | None) -> PatchHistory | None:
        """The model's patch history once this engine stops: its steps added to those of the engines before it
        that ran the same patches."""
        if self.patches is None:
            return None
        steps = self.recorder.steps_ended
        if before is not None and before.patches == self.patches:
            steps += before.steps
        return PatchHistory(self.patches, steps, self.read_bandwidth)

    def note_cold_reads(self) -> None:
        """A notice (once per engine) when the last step read the file at under half the bandwidth measured
        as the engine started: the page cache no longer holds the checkpoint, and each step waits for the
        disk. The tiers stay as placed; the next load measures again."""
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
        """The least a step can take while the file tier is read at the measured bandwidth."""
        return least_read_ms(self.runner, self.read_bandwidth)

    @property
    def predicted_ms(self) -> float | None:
        """The planner's step time (a planned automatic placement), or the reads' least step time where that
        is longer: the reader runs beside the copies and the compute, so the slower of them sets the pace."""
        predictions = [ms for ms in (self.placement.predicted_ms, self.read_ms) if ms is not None]
        return max(predictions) if self.placement.predicted_ms is not None and predictions else None

    @property
    def plan(self) -> OffloadPlan | None:
        return self.placement.plan

    def stop(self, park: bool = False) -> None:
        """``park``: the streamed blocks keep their host buffers, for the next engine to adopt."""
        self.runner.disable(park)
        _live_runners().discard(self.runner)
        watcher = _engine_watcher()
        if watcher is not None:
            watcher.engine_stopped(self)


@runtime_checkable
class EngineWatcher(Protocol):
    """Follows every engine's life (the panel), called on the thread that starts or stops the engine."""

    def engine_started(self, engine: Engine) -> None: ...

    def engine_stopped(self, engine: Engine) -> None: ...


def _engine_watcher() -> EngineWatcher | None:
    """The panel, when the extension has set one up (a process that never set the pack up has none)."""
    watcher = extension.installed()
    return watcher if isinstance(watcher, EngineWatcher) else None


def _live_runners() -> weakref.WeakSet[Runner]:
    """Every engine's runner while it streams."""
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
    """Streams ``placement``'s blocks of ``model``: their weight patches applied, packed into host buffers, the
    device buffers allocated where ComfyUI counted them. ``load_resident`` is ComfyUI's load of the rest, run once
    the engine is enabled: the packing thread pins the streamed blocks (in place, for a classic loader's tensors)
    and packs them while ComfyUI copies the resident ones to the device, so the first step finds them pinned
    rather than waiting for ComfyUI's load and then racing the pinning. Whatever it raises stops the engine.
    ``last_order``: the model's last engine's call order (``call_order_of``), where the first step starts;
    ``history``: the patches its last engines ran, which may make baking them pay (``decide_baking``); ``parking``: the
    model's parked host buffers, which the engine takes over and parks into."""
    # Weights ComfyUI page-locked in place (its partial unload registers what it moves to the host) are
    # unregistered through ComfyUI before the engine packs them: packing frees the originals, and
    # ComfyUI would later try to unpin memory that is gone, its pinned total never coming down.
    for key in [key for key in model.pinned if inside(key, placement.streamed)]:
        model.unpin_weight(key)
    streamed = Units.streamed(model.model.diffusion_model, placement.plan)
    units, recurse = streamed.modules, streamed.recurse
    fast_disk = on_fast_disk(model)
    held = sum(runner.host_bytes for runner in _live_runners() if runner.enabled)
    file_options, in_host = file_tier_options(request, units, recurse, fast_disk, held)
    baking = decide_baking(model, request, placement, units, file_options.read_each_step, in_host, history, parking)
    baked = baking.blocks if baking is not None else frozenset()
    # Only a block plan bakes: the sequential wrapper's model may have no block list.
    baked_names = frozenset(block_names(model)[index] for index in baked) if baked else frozenset()
    as_cast = twin_patches_as_cast(model, request)
    patching = patch_streamed_weights(model, placement.streamed, device, baked_names, as_cast)
    patches = model.patches_uuid if patching.loaded or patching.on_host else None
    contents = dict.fromkeys(baked, patches)
    adapters = AdapterStaging.of(patching, units, recurse)
    arrival = ArrivalPatches(patching, units, recurse)
    recorder = TimelineRecorder(device)
    host = host_options(request, placement.plan, parking, adapters.companions, contents)
    scratch_bytes = patch_scratch_bytes(model, placement.streamed, device, as_cast)
    runner = make_runner(
        model,
        request,
        placement.plan,
        device,
        recorder,
        units,
        last_order,
        host,
        file_options,
        arrival.transforms(),
        scratch_bytes,
    )
    adapters.bind(runner)
    started = time.perf_counter()
    runner.enable(pack_progress(lambda: runner.packed_bytes))
    packing_s = time.perf_counter() - started
    release_freed_host_memory()  # the streamed weights' originals, now packed into host buffers
    try:
        load_resident()
        if contents:  # each weight patched on the device before the ring is allocated, one at a time
            runner.wrote_content(write_patches_to_host(patching, units, recurse, runner.needs_content, device))
        runner.allocate_device_buffers()
    except BaseException:
        # Out of memory (the caller falls back), an interrupt, or ComfyUI's load failing: no engine is recorded,
        # so this one gives back every pin and buffer now; half-written buffers go with it, the blocks point at
        # their file again.
        runner.disable()
        raise
    _live_runners().add(runner)
    bandwidth = read_bandwidth(runner.file_slices())
    summary = placement.summary + patching.describe() + packing_clause(runner, packing_s) + pageable_clause(runner)
    if request.dynamic_vram_twin:
        summary += tiers_clause(runner, bandwidth, fast_disk)
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
    # The cap's refusals are final once the blocks are recorded; the driver's, once every block is packed: while
    # the thread packs, a count so far would be a second notice beside the final one (``note_packing``).
    engine.note(pinning_notices(runner, driver=not runner.waiting_bytes))
    watcher = _engine_watcher()
    if watcher is not None:
        watcher.engine_started(engine)
    logging.info(f"Block Offload ({request.node}): {summary}")
    return engine


def call_order_of(engine: Engine) -> CallOrder:
    runner = engine.runner
    return runner.unit, runner.units, runner.last_order
