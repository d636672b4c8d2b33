"""A node's request and ComfyUI's budget, turned into a placement: which blocks stay on the device, which stream,
with what prefetch, and what that costs in device memory; and the plan line, which tells the user what was
placed and what the engine's start did with it, with a progress bar while a first load packs.

An automatic placement (Partial GPU Residency, ``auto``) is measured on its first run (block compute
times, copy bandwidth, kept per device and model in ComfyUI's user folder) and chosen by the planner
from the next load on.
"""

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
    Runner,
    StackCosts,
    StepTimeline,
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
    """What streams and what stays, as data: the engine, the log line, the panel and the benchmark read it."""

    plan: OffloadPlan | None  # None: the sequential wrapper, which streams every module
    streamed: frozenset[str]  # the streamed modules' names, hidden from ComfyUI's loader
    summary: str  # the log line
    buffer_bytes: int  # device bytes of the stream buffers, which ComfyUI counts as offload buffers
    predicted_ms: float | None = None  # the planner's step time, for a planned automatic placement
    measuring: bool = False  # an automatic placement's first run: placed by the policy, measured for the next
    # An automatic placement's per-block cost of patches applied at each call of a streamed block (the
    # planner's ``StackCosts.patch_ms``): what a measuring run's streamed calls spent beyond their compute.
    patch_ms: tuple[float, ...] = ()
    costs: StackCosts | None = None  # what the planner planned a planned automatic placement from
    # Not even every block streamed fits the budget: the stream buffers are taken all the same (``place``).
    over_budget: bool = False

    @classmethod
    def of_plan(cls, plan: OffloadPlan) -> Placement:
        """A plan alone, for a stack outside any ComfyUI model (the benchmarks' and the tests' engines)."""
        return cls(plan, frozenset(), plan.describe(), plan.slot_bytes)


@dataclass(frozen=True)
class Fallback:
    """A placement that ran out of device memory and the smaller one that fit. Kept on the model,
    so its later loads (each sampling run loads a new clone) start from the one that fit."""

    request: OffloadRequest
    asked: OffloadPlan
    placed: OffloadPlan
    notice: str


def place(
    request: OffloadRequest, model: ModelPatcher, budget: float, loader_need: Callable[[frozenset[str]], int]
) -> Placement:
    """The placement of ``model`` for ``request`` within ``budget`` device bytes (inf: no limit), its summary
    saying which of ComfyUI's loaders the weights came from (see ``_place``)."""
    staging = _cast_staging(request, model)
    placement = _place(request, model, budget - staging, loader_need)
    patches = _room_for_patches(request, model, placement)
    if patches:  # placed again with the room they take: more blocks may stream, so counted on that placement
        placement = _place(request, model, budget - staging - patches, loader_need)
        patches = _room_for_patches(request, model, placement)
    buffers = placement.buffer_bytes + staging + patches
    over = _over_budget(request, placement, budget, lambda: loader_need(placement.streamed) + buffers)
    summary = f"{placement.summary}{over}; weights from {request.loader}"
    if request.pin_memory and not pinning_enabled():
        summary += "; streamed from pageable memory: ComfyUI runs with --disable-pinned-memory"
    return dataclasses.replace(placement, summary=summary, buffer_bytes=buffers, over_budget=bool(over))


def _over_budget(request: OffloadRequest, placement: Placement, budget: float, needed: Callable[[], int]) -> str:
    """What the plan line says where the budget (the node's, or what ComfyUI grants the model) is below the least
    placement, every block streamed: ``needed()``, the stream buffers and the room ComfyUI's loader needs for what
    is outside the blocks (asked only then: it walks ComfyUI's module list). The buffers are allocated all the
    same; ComfyUI casts per layer what it then cannot load."""
    asked = request.budget_bytes or math.inf
    limit = min(budget, asked)
    if placement.plan is None or placement.plan.resident or math.isinf(limit):
        return ""
    need = needed()
    if need <= limit:
        return ""
    held = math.ceil(need / GIB * 100) / 100  # rounded up: a budget of that much holds it
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
    """Device bytes the streamed units' patches take: their adapters in the ring, and the scratch the engine
    patches plain LoRAs in where the weights arrive (``loaded_patch.py``)."""
    return _adapters_in_ring(request, model, placement) + patch_scratch_bytes(
        model, placement.streamed, model.load_device, twin_patches_as_cast(model, request)
    )


def _adapters_in_ring(request: OffloadRequest, model: ModelPatcher, placement: Placement) -> int:
    """Device bytes the streamed units' patch adapters add to the ring, which holds each unit with them
    (``nodes/device_patches.py``): as many of the largest unit's as the ring holds units by default, none
    for a ring the planner sized in bytes (its size stays; the adapters take room among the blocks)."""
    plan = placement.plan
    if plan is not None and plan.ring_bytes:
        return 0
    largest = max(adapter_bytes(model, placement.streamed, recurse=plan is not None).values(), default=0)
    # A block stream holds prefetch + 1 units; the sequential wrapper, its prefetch and a unit running inside
    # another too.
    slots = plan.prefetch + 1 if plan is not None else request.prefetch + 2
    return slots * aligned(largest) if largest else 0


def _cast_staging(request: OffloadRequest, model: ModelPatcher) -> int:
    """Device bytes for the engine to cast file-tier units through (``BlockStreamer``'s staging buffer): the
    largest unit as stored, where a Dynamic VRAM twin's file stores a dtype other than the one ComfyUI
    computes in (an fp32 checkpoint run in bf16). Counted whenever that is so, as which units end up read
    from the file is decided when the engine starts, by the host memory left then."""
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
    """The placement of ``model`` for ``request`` within ``budget`` device bytes (inf: no limit).

    ``loader_need(streamed)`` is the budget ComfyUI's own loader needs to load everything but the
    ``streamed`` modules: it keeps room for its cast buffers as it goes (a lookahead), and a placement
    that left it none would see its last resident modules cast per layer by ComfyUI instead, on
    ComfyUI's streams, competing with the engine's copies. Such a placement keeps fewer blocks.
    """
    diffusion_model = model.model.diffusion_model
    if request.sequential:
        names = Units.every(diffusion_model, sequential=True).qualified
        limit = request.vram_limit_bytes / GIB
        dtype = request.storage_dtype or "the model's dtype"
        summary = f"every module streamed, copied as {dtype}, modules kept on device up to {limit:.2f} GiB"
        if request.notice:  # a block node's model without block lists
            summary = f"{type(diffusion_model).__name__}, no block lists: {summary}"
        # The sequential wrapper's pool of stream buffers, sized by its largest modules.
        slots = buffer_bytes(diffusion_model, request.prefetch, request.storage_dtype, read_by_parents(diffusion_model))
        return Placement(None, names, summary, slots)
    found = find_blocks(diffusion_model)
    # A Dynamic VRAM twin's weights are as stored until cast: the device holds them in the recorded dtypes.
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
        # Less room, by at least one of the resident blocks: the loop ends within as many turns as blocks.
        room = min(room - shortfall, plan.resident_bytes + plan.slot_bytes - 1)


def _blocks(
    request: OffloadRequest,
    model: ModelPatcher,
    sizes: list[int],
    count: int | None = None,
    budget_bytes: int | None = None,
) -> Placement:
    """The block placement for ``count`` resident blocks, or the best within ``budget_bytes``: the
    planner's, from measured costs, for an automatic placement; the request's policy otherwise."""
    pin_memory = request.pin_memory and can_pin_memory() and pinning_enabled()
    measuring, unplanned = False, ""  # why an automatic placement fell back to the policy, or went without a cost
    # Partial GPU Residency plans within a budget; Async Block Offload plans which of its count of blocks stay.
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
            except ValueError:  # not even the stream buffers fit: the policy's placement, over the budget (``place``)
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
    """Whether the patches of ``candidates`` (streamed blocks whose host buffers may hold them) are applied once,
    into those buffers (``offload.bake_decision``): for a planned placement only, the one whose costs are known."""
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
    """Per block, what its patches cost at each call when it streams (``patch_ms_per_unit``)."""
    return patch_ms_per_unit(model, block_names(model), model.load_device, untimed)


def block_names(model: ModelPatcher) -> list[str]:
    """Each block's module name in the model (under ``diffusion_model``), in block order."""
    names = Units.every(model.model.diffusion_model, sequential=False).names
    return [f"diffusion_model.{names[index]}" for index in sorted(names)]


def _prefetch_choices(request: OffloadRequest) -> tuple[int, ...]:
    """The prefetch depths an automatic placement may pick: Async Block Offload's ``prefetch_blocks`` is an
    upper limit (the blocks it copies ahead cost device memory the user counted on); a budget bounds them
    for Partial GPU Residency."""
    if request.resident_blocks is None:
        return PREFETCH_CHOICES
    return tuple(depth for depth in PREFETCH_CHOICES if depth <= request.prefetch)


def describe(plan: OffloadPlan, model: ModelPatcher, patch_ms: tuple[float, ...] = ()) -> Placement:
    """The placement of a block plan: the streamed blocks' module names and the summary line (``patch_ms``: the
    blocks' patch costs, kept from the placement it replaces)."""
    diffusion_model = model.model.diffusion_model
    streamed = Units.streamed(diffusion_model, plan).qualified
    summary = f"{find_blocks(diffusion_model).describe()}: {plan.describe(model.model_size() - sum(plan.block_bytes))}"
    return Placement(plan, streamed, summary, plan.slot_bytes, patch_ms=patch_ms)


def remember_costs(
    request: OffloadRequest, placement: Placement, step: StepTimeline | None, model: ModelPatcher
) -> None:
    """Keeps what an automatic placement's last step cost, when this model has no measurements on this
    device yet: every block's compute time, the gaps between them, and the copy bandwidth. The patches its
    streamed blocks applied at each call are taken out: another model's are its own (another LoRA, or none)."""
    plan = placement.plan
    if not request.auto_placement or plan is None:
        return
    cache = cost_cache()
    key = _costs_key(model, plan.block_bytes)
    bandwidth = None if step is None else step.packed_bandwidth_gbps
    if step is None or bandwidth is None or cache.get(key) is not None:
        # Nothing ran yet, nothing was copied from a packed block (no bandwidth to learn: copies from blocks still
        # waiting to be packed are pageable, slower than the later steps'), or already measured.
        return
    if len({span.block for span in step.spans}) < len(plan.block_bytes):
        return  # a step cut short (an interrupted prompt) would make every later plan wrong
    recorded = StackCosts.from_timeline(step, plan.block_bytes, bandwidth, inline_copies=copies_inline(model))
    costs = dataclasses.replace(recorded, patch_ms=placement.patch_ms).without_patches(plan.streamed)
    cache.put(key, costs)
    logging.info(
        f"Block Offload ({request.node}): measured {_model_class(model)} on {device_name(model.load_device)}: "
        f"{sum(costs.compute_ms):.1f} ms of block compute per step, {costs.bandwidth_gbps:.2f} GB/s "
        f"host to device; the next load plans the placement from them ({cache.path})"
    )


def _model_class(model: ModelPatcher) -> str:
    """The diffusion model's class (``find_blocks``'s ``model_class``, without its search of the module tree)."""
    return type(model.model.diffusion_model).__name__


def _costs_key(model: ModelPatcher, block_bytes: Sequence[int]) -> str:
    """Where ``model``'s measured costs and kept placements are, for its blocks of ``block_bytes``: one device,
    one model class, one stack shape."""
    return cache_key(device_name(model.load_device), _model_class(model), block_bytes)


def copies_inline(model: ModelPatcher) -> bool:
    """Whether the engine copies inline, on the host, between two computes: without an accelerator. Public for
    the tests, which patch it to plan as for a device with a copy stream."""
    return model.load_device.type == "cpu"


def cost_cache() -> CostCache:
    """Measured block costs, per device and model, in ComfyUI's user folder (kept across restarts). Public for
    the tests, which clear it, seed it with given costs and read what a run measured."""
    return CostCache(Path(folder_paths.get_user_directory()) / "block_offload" / "block_costs.json")


# -- the plan line: what an engine's start tells the user, besides the placement's own summary


def packing_clause(runner: Runner, seconds: float) -> str:
    """The plan line's word on what the start copied into host buffers, and how long it took (what a first load
    pays and a later prompt taking the buffers over does not), and on what is packed in the background while
    the first steps stream those blocks from where they are: a first step slower than the next explains itself."""
    packed = runner.packed_bytes
    clause = f"; packed {packed / GIB:.2f} GiB into host buffers in {seconds:.2f} s" if packed else ""
    _, later = runner.background_packing
    if later:
        clause += f"; {later / GIB:.2f} GiB pinned or packed in the background while the first steps run"
        progress = pinning_progress(runner)
        clause += f" ({progress} so far)" if progress else ""
    return clause


def pinning_progress(runner: Runner) -> str | None:
    """How far pinning has got while blocks are still packed in the background ("pinned 6.20 of 11.90 GiB"); None
    once they are, or when none of them is to be pinned."""
    pinned, total = runner.pinning_progress
    if not runner.waiting_bytes or not total:
        return None
    return f"pinned {pinned / GIB:.2f} of {total / GIB:.2f} GiB"


def pageable_clause(runner: Runner) -> str:
    """The plan line's word on streamed units that wanted pinned memory and got pageable memory."""
    reasons = {"the pinned-memory cap": runner.refused_pinning, "the driver refused to pin": runner.failed_pinning}
    said = [f"{len(units)} from pageable memory ({reason})" for reason, units in reasons.items() if units]
    return f"; of {len(runner.streamed)} streamed {runner.unit}s, {', '.join(said)}" if said else ""


def tiers_clause(runner: Runner, bandwidth: float | None, fast_disk: bool) -> str:
    """The plan line's word on where the streamed weights wait: host buffers, or their checkpoint file."""
    read = runner.read_each_step
    streamed = len(runner.streamed)
    host = runner.host_bytes / GIB
    in_ram = streamed - len(read)
    held = f"{in_ram} of the {streamed} streamed {runner.unit}s in host memory ({host:.2f} GiB of host buffers)"
    if fast_disk:
        kept = f"{PINNED_LIMIT_ENV} keeps" if os.environ.get(PINNED_LIMIT_ENV) else f"set {PINNED_LIMIT_ENV} to keep"
        held += f" (ComfyUI chose fast-disk for this checkpoint: no host buffers; {kept} some in RAM)"
    if not read:
        return f"; {held}, none read from the checkpoint file"
    cgroup = host_ram().cgroup
    if cgroup is not None and not fast_disk:
        held += f" (within this process's memory limit, {cgroup.limit / GIB:.2f} GiB: cgroup {cgroup.path})"
    read_from = (
        f"{len(read)} read from the checkpoint file each step through {runner.staging_bytes / GIB:.2f} GiB of "
        f"staging slots ({runner.file_tier_bytes / GIB:.2f} GiB as stored"
    )
    threads = file_source.read_threads(source.handle for source in runner.file_slices())
    read_from += f", read by {threads_said(threads)}"
    read_ms = least_read_ms(runner, bandwidth)
    if read_ms is not None and bandwidth:
        read_from += f", {bandwidth / 1e9:.2f} GB/s as the page cache holds it now: {read_ms:.1f} ms per step at least"
    return f"; {held}, {read_from})"


def threads_said(threads: int) -> str:
    """How many threads read the checkpoint, and why, for the plan line."""
    if threads > 1:
        return f"{threads} threads at once"
    if file_source.POSITIONAL_READ is None:
        return "one thread copying from the file's mapping, this system having no positional read"
    return "one thread, the file's disk being rotational (several readers would make it seek)"


def least_read_ms(runner: Runner, bandwidth: float | None) -> float | None:
    """The least a step can take while the file tier is read at ``bandwidth`` (bytes/s; None: no file tier)."""
    return runner.file_tier_bytes / bandwidth * 1e3 if bandwidth else None


def pinning_notices(runner: Runner, driver: bool = True) -> list[str]:
    """A notice for each reason some streamed weights went to pageable RAM, which copies more slowly: the
    pinned-memory cap, or (``driver``) the driver refusing to pin (its caller logs each once)."""
    notices = []
    of = f"of {len(runner.streamed)} streamed {runner.unit}s"
    refused = runner.refused_pinning
    if refused:
        notices.append(
            f"Pinned memory cap reached ({(PINNED_MEMORY.limit or 0) / GIB:.2f} GiB, shared with ComfyUI and the "
            f"other streaming models): {len(refused)} {of} ({sum(refused.values()) / GIB:.2f} GiB) stream from "
            f"pageable RAM, which copies more slowly. Unloading other models frees pinned memory; "
            f"{PINNED_LIMIT_ENV} sets the pack's own cap."
        )
    failed = runner.failed_pinning if driver else {}
    if failed:
        notices.append(
            f"The driver refused to pin {len(failed)} {of} ({sum(failed.values()) / GIB:.2f} GiB): they stream from "
            "pageable RAM, which copies more slowly (the error was cleared, the run goes on). Too much pinned "
            f"memory system-wide is the usual cause: close other GPU programs, or lower {PINNED_LIMIT_ENV}."
        )
    return notices


# -- a first load's packing, shown the ComfyUI way: a progress bar on the node that loads the model
# Packing copies every streamed weight into host buffers once, and pins them, before ComfyUI's own progress bar
# starts counting steps. A model whose host buffers are taken over from the last prompt packs nothing and shows
# no bar.

#: The most updates one packing sends: the sequential wrapper packs modules by the thousand, and ComfyUI 0.3.75
#: sends every update to every open browser tab.
UPDATES = 50


def pack_progress(packed_bytes: Callable[[], int]) -> Callable[[int, int], None]:
    """A ``progress(done, total)`` for ``Runner.enable``: a progress bar over the units, from the first unit
    that ``packed_bytes`` (the runner's count of bytes copied) says was packed, at most ``UPDATES`` times."""
    bar: comfy.utils.ProgressBar | None = None
    shown = 0

    def progress(done: int, total: int) -> None:
        nonlocal bar, shown
        if bar is None:
            if not packed_bytes():
                return  # taken over, or left in its file, so far: nothing worth a bar yet
            bar = comfy.utils.ProgressBar(total)
        step = max(1, total // UPDATES)
        if done == total or done - shown >= step:
            bar.update_absolute(done, total)
            shown = done

    return progress
