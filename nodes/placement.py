"""Turns a node's request and ComfyUI's budget into a placement (which blocks stay, which stream, with what prefetch
and device memory), and writes the plan line. An automatic placement is measured on its first run and planned from
the next load on."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import comfy.utils
import folder_paths
from comfy.model_patcher import ModelPatcher

from ..offload import (
    GIB,
    PREFETCH_CHOICES,
    BakeDecision,
    CostCache,
    OffloadPlan,
    PackProgress,
    StackCosts,
    StepTimeline,
    StreamReport,
    bake_decision,
    buffer_bytes,
    cache_key,
    cached_best_plan,
    can_pin_memory,
    device_name,
    file_source,
    module_bytes,
)
from ..offload.layout import aligned, module_stored_bytes
from .blocks import Units, find_blocks, read_by_parents
from .comfy_memory import PINNED_LIMIT_ENV, PINNED_MEMORY, host_ram, pinning_enabled
from .device_patches import patch_ms_per_unit, patch_scratch_bytes, twin_patches_as_cast
from .dynamic_vram import recorded_dtype, stored_as_computed
from .patches import adapter_bytes
from .request import OffloadRequest


@dataclass(frozen=True)
class Placement:
    """What streams and what stays, read by the engine, the log line, the panel and the benchmark."""

    plan: OffloadPlan | None  # None: the sequential wrapper
    streamed: frozenset[str]  # hidden from ComfyUI's loader
    summary: str
    buffer_bytes: int  # ComfyUI counts them as offload buffers
    predicted_ms: float | None = None
    measuring: bool = False  # placed by the policy, measured for the next load
    patch_ms: tuple[float, ...] = ()  # per block, the cost of patches applied at each streamed call
    costs: StackCosts | None = None
    over_budget: bool = False  # even every block streamed does not fit

    @classmethod
    def of_plan(cls, plan: OffloadPlan) -> Placement:
        """A plan alone, for a stack outside any ComfyUI model (benchmarks, tests)."""
        return cls(plan, frozenset(), plan.describe(), plan.slot_bytes)


@dataclass(frozen=True)
class Fallback:
    """A placement that ran out of device memory and the smaller one that fit, kept on the model so later clones
    start from the one that fit."""

    request: OffloadRequest
    asked: OffloadPlan
    placed: OffloadPlan
    notice: str


#: The plan line's clause where the node streams a model ComfyUI would prefetch itself: the default until both are
#: timed on a GPU (docs/benchmarks.md, "Against ComfyUI's own block prefetch").
IN_PLACE_OF_CORE_PREFETCH = (
    "; streamed in place of ComfyUI's own block prefetch (off for this copy): about as many bytes copied per step, "
    "less host memory pinned; not yet measured on a GPU"
)


def place(
    request: OffloadRequest, model: ModelPatcher, budget: float, loader_need: Callable[[frozenset[str]], int]
) -> Placement:
    """The placement of ``model`` for ``request`` within ``budget`` device bytes (inf: no limit)."""
    staging = _cast_staging(request, model)
    placement = _place(request, model, budget - staging, loader_need)
    patches = _room_for_patches(request, model, placement)
    if patches:  # placed again: more blocks may stream, so recounted
        placement = _place(request, model, budget - staging - patches, loader_need)
        patches = _room_for_patches(request, model, placement)
    buffers = placement.buffer_bytes + staging + patches
    over = _over_budget(request, placement, budget, lambda: loader_need(placement.streamed) + buffers)
    summary = f"{placement.summary}{over}; weights from {request.loader}"
    if request.core_prefetch:
        summary += IN_PLACE_OF_CORE_PREFETCH
    if request.pin_memory and not pinning_enabled():
        summary += "; streamed from pageable memory: ComfyUI runs with --disable-pinned-memory"
    return dataclasses.replace(placement, summary=summary, buffer_bytes=buffers, over_budget=bool(over))


def _over_budget(request: OffloadRequest, placement: Placement, budget: float, needed: Callable[[], int]) -> str:
    """The plan line's clause when the budget is below the least placement (every block streamed). ``needed()`` walks
    ComfyUI's module list, so it is asked only then. The buffers are allocated anyway."""
    asked = request.budget_bytes or math.inf
    limit = min(budget, asked)
    if placement.plan is None or placement.plan.resident or math.isinf(limit):
        return ""
    need = needed()
    if need <= limit:
        return ""
    held = math.ceil(need / GIB * 100) / 100  # rounded up, so that budget suffices
    if asked <= budget:
        whose, remedy = "the budget", f"give at least {held:.2f} GiB"
    else:
        whose, remedy = "what ComfyUI grants this model", "free device memory (other models, other programs)"
    return (
        f"; over {whose} of {limit / GIB:.2f} GiB: every block streamed, the device holds {held:.2f} GiB (the "
        f"stream buffers, and what ComfyUI loads outside the blocks); {remedy}, lower prefetch_blocks, or stream "
        "module by module with the Sequential Offload Wrapper"
    )


def _room_for_patches(request: OffloadRequest, model: ModelPatcher, placement: Placement) -> int:
    return _adapters_in_ring(request, model, placement) + patch_scratch_bytes(
        model, placement.streamed, model.load_device, twin_patches_as_cast(model, request)
    )


def _adapters_in_ring(request: OffloadRequest, model: ModelPatcher, placement: Placement) -> int:
    """Device bytes the patch adapters add to a ring sized in units; none for a ring the planner sized in bytes,
    where they take room among the blocks."""
    plan = placement.plan
    if plan is not None and plan.ring_bytes:
        return 0
    largest = max(adapter_bytes(model, placement.streamed, recurse=plan is not None).values(), default=0)
    # The sequential wrapper also holds a unit running inside another.
    slots = plan.prefetch + 1 if plan is not None else request.prefetch + 2
    return slots * aligned(largest) if largest else 0


def _cast_staging(request: OffloadRequest, model: ModelPatcher) -> int:
    """Device bytes of the staging buffer for casting file-tier units of a Dynamic VRAM twin stored in another dtype.
    Counted whenever that may be needed: the file tier is chosen only when the engine starts."""
    if not request.dynamic_vram_twin:
        return 0
    units = Units.every(model.model.diffusion_model, request.sequential)
    casting = [
        module_stored_bytes(unit, units.recurse)
        for unit in units.modules.values()
        if not stored_as_computed(unit, units.recurse)
    ]
    return aligned(max(casting, default=0))


def _place(
    request: OffloadRequest, model: ModelPatcher, budget: float, loader_need: Callable[[frozenset[str]], int]
) -> Placement:
    """The placement of ``model`` for ``request`` within ``budget`` device bytes (inf: no limit). It leaves ComfyUI's
    loader the room ``loader_need`` says, or ComfyUI would cast the last resident modules per layer on its own
    streams, competing with the engine's copies."""
    diffusion_model = model.model.diffusion_model
    if request.sequential:
        names = Units.every(diffusion_model, sequential=True).qualified
        limit = request.vram_limit_bytes / GIB
        dtype = request.storage_dtype or "the model's dtype"
        summary = f"every module streamed, copied as {dtype}, modules kept on device up to {limit:.2f} GiB"
        if request.notice:
            summary = f"{type(diffusion_model).__name__}, no block lists: {summary}"
        slots = buffer_bytes(diffusion_model, request.prefetch, request.storage_dtype, read_by_parents(diffusion_model))
        return Placement(None, names, summary, slots)
    found = find_blocks(diffusion_model)
    # A Dynamic VRAM twin's weights are counted in the dtypes the device will hold.
    sizes = [module_bytes(block, recorded_dtype if request.dynamic_vram_twin else None) for _, block in found.blocks]
    outside = model.model_size() - sum(sizes)
    room = budget - outside
    if request.budget_bytes:
        room = min(room, request.budget_bytes - outside)
    if request.resident_blocks is not None or math.isinf(room):
        count = len(sizes) if request.resident_blocks is None else request.resident_blocks
        return _blocks(request, model, sizes, count=count)
    while True:
        placement = _blocks(request, model, sizes, budget_bytes=int(max(0, room)))
        plan = placement.plan
        assert plan is not None, "a block placement has a plan"
        shortfall = loader_need(placement.streamed) + placement.buffer_bytes - budget
        if shortfall <= 0 or not plan.resident:
            return placement
        # At least one resident block less each turn, so the loop ends.
        room = min(room - shortfall, plan.resident_bytes + plan.slot_bytes - 1)


def _blocks(
    request: OffloadRequest,
    model: ModelPatcher,
    sizes: list[int],
    count: int | None = None,
    budget_bytes: int | None = None,
) -> Placement:
    """The block placement for ``count`` resident blocks, or the best within ``budget_bytes``: the planner's for an
    automatic placement with known costs, the request's policy otherwise."""
    pin_memory = request.pin_memory and can_pin_memory() and pinning_enabled()
    measuring, unplanned = False, ""  # unplanned: why the planner was not used, for the plan line
    patch_ms: tuple[float, ...] = ()
    if request.auto_placement and (budget_bytes is not None or request.resident_blocks is not None):
        untimed: list[str] = []
        patch_ms = _patch_ms(model, untimed)
        if untimed:
            unplanned = (
                f"; {len(untimed)} patched weights could not be timed ({untimed[0]}, ...): planned without their cost"
            )
        cache, key = cost_cache(), _costs_key(model, sizes)
        costs = cache.get(key)
        if costs is None or costs.block_bytes != tuple(sizes):
            measuring = True
            unplanned += "; not measured on this device yet, so this run measures it and the next one is planned"
        else:
            costs = dataclasses.replace(costs, patch_ms=patch_ms)
            try:
                predicted = cached_best_plan(
                    cache,
                    key,
                    costs,
                    sys.maxsize if budget_bytes is None else budget_bytes,
                    resident_count=None if budget_bytes is not None else count,
                    prefetch_choices=_prefetch_choices(request),
                    pin_memory=pin_memory,
                    inline_copies=copies_inline(model),
                )
            except ValueError:  # not even the stream buffers fit
                unplanned += "; no placement fits the budget"
            else:
                planned = describe(predicted.plan, model)
                summary = f"{planned.summary}; chosen by the planner, {predicted.describe(costs)}{unplanned}"
                streamed, step_ms = planned.streamed, predicted.step_ms
                buffers = planned.buffer_bytes
                return Placement(predicted.plan, streamed, summary, buffers, step_ms, patch_ms=patch_ms, costs=costs)
    plan = OffloadPlan.build(
        sizes,
        resident_count=count,
        budget_bytes=budget_bytes,
        policy=request.policy,
        prefetch=request.prefetch,
        pin_memory=pin_memory,
    )
    described = describe(plan, model)
    summary = described.summary + unplanned
    return Placement(plan, described.streamed, summary, plan.slot_bytes, measuring=measuring, patch_ms=patch_ms)


def bake(
    placement: Placement, model: ModelPatcher, candidates: frozenset[int], steps_run: int, least_step_ms: float
) -> BakeDecision | None:
    """Whether the patches of ``candidates`` are baked into their host buffers; only a planned placement has the
    costs to decide."""
    if placement.costs is None or placement.plan is None:
        return None
    return bake_decision(
        placement.costs,
        placement.plan,
        candidates,
        steps_run,
        least_step_ms=least_step_ms,
        inline_copies=copies_inline(model),
    )


def _patch_ms(model: ModelPatcher, untimed: list[str]) -> tuple[float, ...]:
    return patch_ms_per_unit(model, block_names(model), model.load_device, untimed)


def block_names(model: ModelPatcher) -> list[str]:
    names = Units.every(model.model.diffusion_model, sequential=False).names
    return [f"diffusion_model.{names[index]}" for index in sorted(names)]


def _prefetch_choices(request: OffloadRequest) -> tuple[int, ...]:
    """Prefetch depths an automatic placement may pick; Async Block Offload's ``prefetch_blocks`` is an upper limit,
    since the user counted on that device memory."""
    if request.resident_blocks is None:
        return PREFETCH_CHOICES
    return tuple(depth for depth in PREFETCH_CHOICES if depth <= request.prefetch)


def describe(plan: OffloadPlan, model: ModelPatcher, patch_ms: tuple[float, ...] = ()) -> Placement:
    diffusion_model = model.model.diffusion_model
    streamed = Units.streamed(diffusion_model, plan).qualified
    summary = f"{find_blocks(diffusion_model).describe()}: {plan.describe(model.model_size() - sum(plan.block_bytes))}"
    return Placement(plan, streamed, summary, plan.slot_bytes, patch_ms=patch_ms)


def remember_costs(
    request: OffloadRequest, placement: Placement, step: StepTimeline | None, model: ModelPatcher
) -> None:
    """Records an automatic placement's last step as this model's costs on this device, if none are recorded yet.
    Patch costs are taken out: another model has its own LoRAs."""
    plan = placement.plan
    if not request.auto_placement or plan is None:
        return
    cache = cost_cache()
    key = _costs_key(model, plan.block_bytes)
    bandwidth = None if step is None else step.packed_bandwidth_gbps
    if step is None or bandwidth is None or cache.get(key) is not None:
        # Copies from blocks not yet packed are pageable and slower, so no bandwidth is learnt from them.
        return
    if len({span.block for span in step.spans}) < len(plan.block_bytes):
        return  # an interrupted step would make every later plan wrong
    recorded = StackCosts.from_timeline(step, plan.block_bytes, bandwidth, inline_copies=copies_inline(model))
    costs = dataclasses.replace(recorded, patch_ms=placement.patch_ms).without_patches(plan.streamed)
    cache.put(key, costs)
    logging.info(
        f"Block Offload ({request.node}): measured {_model_class(model)} on {device_name(model.load_device)}: "
        f"{sum(costs.compute_ms):.1f} ms of block compute per step, {costs.bandwidth_gbps:.2f} GB/s "
        f"host to device; the next load plans the placement from them ({cache.path})"
    )


def _model_class(model: ModelPatcher) -> str:
    """The diffusion model's class, without ``find_blocks``'s tree walk."""
    return type(model.model.diffusion_model).__name__


def _costs_key(model: ModelPatcher, block_bytes: Sequence[int]) -> str:
    return cache_key(device_name(model.load_device), _model_class(model), block_bytes)


def copies_inline(model: ModelPatcher) -> bool:
    """Whether copies run inline on the host (no accelerator). Public so tests can patch it."""
    return model.load_device.type == "cpu"


def cost_cache() -> CostCache:
    """Measured block costs in ComfyUI's user folder, kept across restarts. Public for the tests."""
    return CostCache(Path(folder_paths.get_user_directory()) / "block_offload" / "block_costs.json")


# -- the plan line


def packing_clause(report: StreamReport, seconds: float) -> str:
    """The plan line's clause on what the start packed and how long it took, and what is still being packed in the
    background, so a slow first step explains itself."""
    packed = report.packed_bytes
    clause = f"; packed {packed / GIB:.2f} GiB into host buffers in {seconds:.2f} s" if packed else ""
    _, later = report.background_packing
    if later:
        clause += f"; {later / GIB:.2f} GiB pinned or packed in the background while the first steps run"
        progress = pinning_progress(report)
        clause += f" ({progress} so far)" if progress else ""
    return clause


def pinning_progress(report: StreamReport) -> str | None:
    """How far background pinning has got ("pinned 6.20 of 11.90 GiB"); None once done or when nothing is to be
    pinned."""
    pinned, total = report.pinning_progress
    if not report.waiting_bytes or not total:
        return None
    return f"pinned {pinned / GIB:.2f} of {total / GIB:.2f} GiB"


def pageable_clause(report: StreamReport) -> str:
    reasons = {"the pinned-memory cap": report.refused_pinning, "the driver refused to pin": report.failed_pinning}
    said = [f"{len(units)} from pageable memory ({reason})" for reason, units in reasons.items() if units]
    return f"; of {len(report.streamed)} streamed {report.unit}s, {', '.join(said)}" if said else ""


def tiers_clause(report: StreamReport, bandwidth: float | None, fast_disk: bool) -> str:
    read = report.read_each_step
    streamed = len(report.streamed)
    host = report.host_bytes / GIB
    in_ram = streamed - len(read)
    held = f"{in_ram} of the {streamed} streamed {report.unit}s in host memory ({host:.2f} GiB of host buffers)"
    if fast_disk:
        kept = f"{PINNED_LIMIT_ENV} keeps" if os.environ.get(PINNED_LIMIT_ENV) else f"set {PINNED_LIMIT_ENV} to keep"
        held += f" (ComfyUI chose fast-disk for this checkpoint: no host buffers; {kept} some in RAM)"
    if not read:
        return f"; {held}, none read from the checkpoint file"
    cgroup = host_ram().cgroup
    if cgroup is not None and not fast_disk:
        held += f" (within this process's memory limit, {cgroup.limit / GIB:.2f} GiB: cgroup {cgroup.path})"
    read_from = (
        f"{len(read)} read from the checkpoint file each step through {report.staging_bytes / GIB:.2f} GiB of "
        f"staging slots ({report.file_tier_bytes / GIB:.2f} GiB as stored"
    )
    threads = file_source.read_threads(source.handle for source in report.file_slices)
    read_from += f", read by {threads_said(threads)}"
    read_ms = least_read_ms(report, bandwidth)
    if read_ms is not None and bandwidth:
        read_from += f", {bandwidth / 1e9:.2f} GB/s as the page cache holds it now: {read_ms:.1f} ms per step at least"
    return f"; {held}, {read_from})"


def threads_said(threads: int) -> str:
    if threads > 1:
        return f"{threads} threads at once"
    if file_source.POSITIONAL_READ is None:
        return "one thread copying from the file's mapping, this system having no positional read"
    return "one thread, the file's disk being rotational (several readers would make it seek)"


def least_read_ms(report: StreamReport, bandwidth: float | None) -> float | None:
    return report.file_tier_bytes / bandwidth * 1e3 if bandwidth else None


def pinning_notices(report: StreamReport, driver: bool = True) -> list[str]:
    """A notice for each reason some streamed weights went to pageable RAM; the caller logs each once."""
    notices = []
    of = f"of {len(report.streamed)} streamed {report.unit}s"
    refused = report.refused_pinning
    if refused:
        notices.append(
            f"Pinned memory cap reached ({(PINNED_MEMORY.limit or 0) / GIB:.2f} GiB, shared with ComfyUI and the "
            f"other streaming models): {len(refused)} {of} ({sum(refused.values()) / GIB:.2f} GiB) stream from "
            f"pageable RAM, which copies more slowly. Unloading other models frees pinned memory; "
            f"{PINNED_LIMIT_ENV} sets the pack's own cap."
        )
    failed = report.failed_pinning if driver else {}
    if failed:
        notices.append(
            f"The driver refused to pin {len(failed)} {of} ({sum(failed.values()) / GIB:.2f} GiB): they stream from "
            "pageable RAM, which copies more slowly (the error was cleared, the run goes on). Too much pinned "
            f"memory system-wide is the usual cause: close other GPU programs, or lower {PINNED_LIMIT_ENV}."
        )
    return notices


# -- a first load's packing, as a progress bar on the node, before ComfyUI's own bar counts steps

#: The sequential wrapper packs thousands of modules, and 0.3.75 sends every update to every browser tab.
UPDATES = 50


def pack_progress() -> PackProgress:
    """A ``progress`` for ``Runner.enable``: a ComfyUI progress bar, shown only once something was really packed,
    updated at most ``UPDATES`` times."""
    bar: comfy.utils.ProgressBar | None = None
    shown = 0

    def progress(done: int, total: int, packed_bytes: int) -> None:
        nonlocal bar, shown
        if bar is None:
            if not packed_bytes:
                return  # taken over or left in its file: no bar
            bar = comfy.utils.ProgressBar(total)
        step = max(1, total // UPDATES)
        if done == total or done - shown >= step:
            bar.update_absolute(done, total)
            shown = done

    return progress
