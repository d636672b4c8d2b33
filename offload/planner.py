"""Predicts the step time of a placement, and picks the fastest placement that fits a budget.

The prediction replays what ``BlockStreamer`` does in one step, call by call: the
same ring (``ByteRing``, the plan's bytes) placing each copy where the engine does,
the same functions choosing what to copy ahead (``look_ahead``: the next streamed
blocks of the call order, wrapping into the next step; ``copy_ahead``: in order,
until one has no room), the same on-demand copy when a block arrives without a
region. Device time follows the streams the engine uses:

* one copy stream, copies in the order they are issued; a copy starts when the
  stream is free and every block whose bytes it overwrites has finished
  computing (their *released* events);
* one compute stream; call ``i`` arrives ``gap_ms[i]`` after the previous call
  ended, starts when its copy is ready, and computes ``compute_ms[i]``;
* resident blocks need no copy.

With ``inline_copies`` (the CPU, where there is no copy stream) every copy runs on
the host between two computes, as the engine really does there.

The host is assumed to run ahead of the device, which is what the engine's
event-only synchronisation allows (with pinned memory): even a copy issued when its
block is called (prefetch 0) starts as soon as its slot is free, during the compute
of the resident blocks before it. The step is taken in steady state (the third
step), because the first step starts with empty slots and later ones start with
copies the previous step issued for them.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .layout import aligned
from .plan import GIB, OffloadPlan
from .residency import ResidencyPolicy, resident_indices
from .ring import ByteRing, copy_ahead, look_ahead, ring_capacity, ring_granule
from .timeline import StepTimeline

#: The events a simulation replays, as the engine would run them (``simulate``'s ``trace``).
Trace = list[tuple[object, ...]]

#: Predictions this close (relative) count as equal.
TIE = 1e-6
#: Placements predicted within this of the fastest are close enough to be chosen between on their slack:
#: how they fare with copies slower than measured (``SLOW_COPIES``).
NEAR = 0.01
#: The copy speed a placement is checked against, relative to the measured one. On the H100, Flux's
#: ``auto`` row ran 11.6 % slower than predicted (docs/benchmarks.md); a placement at its copy limit with
#: one block of prefetch loses all of such a shortfall, one whose ring runs further ahead absorbs it.
SLOW_COPIES = 0.85
#: Prefetch depths the search tries. Deeper costs a block of device memory per step for little gain.
PREFETCH_CHOICES = (0, 1, 2, 3)
#: Within a budget, the deepest prefetch whose slots the greedy search fills block by block: the rings
#: sized in bytes copy further ahead, and each greedy search costs seconds on a 57-block stack.
GREEDY_PREFETCH_IN_A_BUDGET = 1
#: A greedy search at a prefetch depth whose policy plans all come out this much slower than the fastest placement
#: found is not run within a budget: block by block it gained at most a few percent over the best policy.
GREEDY_REACH = 0.1


@dataclass(frozen=True)
class StackCosts:
    """What one step of a block stack costs, measured once and reused to predict any placement.

    ``calls`` are the block indices in the order one step calls them; ``compute_ms`` and
    ``gap_ms`` are per call: the block's own compute, and the compute-stream time between
    the previous call's end (the step's start, for the first call) and this call's arrival.
    ``tail_ms`` runs from the last call's end to the step's end.

    ``patch_ms`` (per block; empty: none) is what a block's weight patches cost on the compute stream when
    the block streams: a host applies them to the streamed copy at every call, where a resident block was
    patched once as it was loaded. A placement where copies dominate hides it; where compute dominates it is
    paid at every call, and each block kept resident saves its copy and its patches.
    """

    block_bytes: tuple[int, ...]
    calls: tuple[int, ...]
    compute_ms: tuple[float, ...]
    gap_ms: tuple[float, ...]
    tail_ms: float
    bandwidth_gbps: float
    patch_ms: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not len(self.calls) == len(self.compute_ms) == len(self.gap_ms):
            raise ValueError("calls, compute_ms and gap_ms must have one entry per call")
        if self.patch_ms and len(self.patch_ms) != len(self.block_bytes):
            raise ValueError("patch_ms must have one entry per block, or none")
        if any(not 0 <= block < len(self.block_bytes) for block in self.calls):
            raise ValueError(f"a call names a block outside 0..{len(self.block_bytes) - 1}")
        if not self.bandwidth_gbps > 0:
            raise ValueError(f"the host-to-device bandwidth must be positive, got {self.bandwidth_gbps}")

    @classmethod
    def uniform(cls, num_blocks: int, compute_ms: float, block_bytes: int, bandwidth_gbps: float) -> StackCosts:
        """``num_blocks`` equal blocks called once each, in list order, back to back."""
        return cls(
            (block_bytes,) * num_blocks,
            tuple(range(num_blocks)),
            (compute_ms,) * num_blocks,
            (0.0,) * num_blocks,
            0.0,
            bandwidth_gbps,
        )

    @classmethod
    def from_timeline(
        cls,
        step: StepTimeline,
        block_bytes: Sequence[int],
        bandwidth_gbps: float | None = None,
        inline_copies: bool = False,
    ) -> StackCosts:
        """Costs read from one recorded step; the bandwidth is the step's own unless given.

        With ``inline_copies`` (a CPU recording) the copies a call issued ahead ran on the
        host inside that call's compute span; their time is taken out of it.
        """
        bandwidth = bandwidth_gbps or step.bandwidth_gbps
        if bandwidth is None:
            raise ValueError("the step copied nothing, so it cannot tell the bandwidth; give bandwidth_gbps")
        copies = [(s.copy_start, s.copy_end) for s in step.spans if s.copy_start is not None and s.copy_end is not None]
        calls: list[int] = []
        compute: list[float] = []
        gaps: list[float] = []
        previous_end = 0.0
        for span in step.spans:
            arrive = span.compute_start - span.stall
            inside = 0.0
            if inline_copies:
                inside = sum(
                    end - start for start, end in copies if span.compute_start <= start and end <= span.compute_end
                )
            calls.append(span.block)
            compute.append(max(0.0, span.compute_end - span.compute_start - inside))
            gaps.append(max(0.0, arrive - previous_end))
            previous_end = span.compute_end
        return cls(
            tuple(block_bytes),
            tuple(calls),
            tuple(compute),
            tuple(gaps),
            max(0.0, step.duration_ms - previous_end),
            bandwidth,
        )

    def copy_ms(self, block: int) -> float:
        return self.block_bytes[block] / (self.bandwidth_gbps * 1e6)

    def patch_of(self, block: int) -> float:
        """What a call of ``block`` adds to its compute when the block streams."""
        return self.patch_ms[block] if self.patch_ms else 0.0

    def patches_per_step_ms(self, streamed: frozenset[int]) -> float:
        """The patches' compute in one step where the ``streamed`` blocks stream."""
        return sum(self.patch_of(block) for block in self.calls if block in streamed)

    def without_patches(self, streamed: frozenset[int]) -> StackCosts:
        """Costs recorded from a step where the ``streamed`` blocks were patched at each call, as they would be
        unpatched: the patch time taken out of their calls' compute and ``patch_ms`` cleared. What is kept
        for later placements, which add the patches of their own model (another LoRA, or none)."""
        compute = tuple(
            max(0.0, ms - self.patch_of(block)) if block in streamed else ms
            for block, ms in zip(self.calls, self.compute_ms, strict=True)
        )
        return replace(self, compute_ms=compute, patch_ms=())

    @property
    def resident_step_ms(self) -> float:
        """The step with every block resident: nothing to wait for."""
        return sum(self.gap_ms) + sum(self.compute_ms) + self.tail_ms

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StackCosts:
        return cls(
            tuple(int(b) for b in data["block_bytes"]),
            tuple(int(c) for c in data["calls"]),
            tuple(float(c) for c in data["compute_ms"]),
            tuple(float(g) for g in data["gap_ms"]),
            float(data["tail_ms"]),
            float(data["bandwidth_gbps"]),
            tuple(float(p) for p in data.get("patch_ms", ())),
        )


@dataclass(frozen=True)
class Prediction:
    """One steady-state step of ``plan``, as the pipeline model sees it."""

    plan: OffloadPlan
    step_ms: float
    stall_ms: float
    bytes_copied: int
    #: Per call of the step: whether it consumed a copy (False: resident, or still in its ring).
    copied: tuple[bool, ...]
    #: The step with copies ``SLOW_COPIES`` as fast as measured, for a placement the search chose on it.
    slow_step_ms: float | None = None

    def describe(self, costs: StackCosts) -> str:
        bound = lower_bound_ms(costs, self.plan.streamed_bytes)
        slow = ""
        if self.slow_step_ms is not None:
            slow = f", {self.slow_step_ms:.1f} ms with copies {1 - SLOW_COPIES:.0%} slower"
        patches = costs.patches_per_step_ms(self.plan.streamed)
        if patches:
            slow += f"; patches on the streamed blocks {patches:.1f} ms of compute"
        return (
            f"predicted {self.step_ms:.1f} ms per step (stalls {self.stall_ms:.1f} ms{slow}; all resident "
            f"{costs.resident_step_ms:.1f} ms, lower bound {bound:.1f} ms at {costs.bandwidth_gbps:.1f} GB/s)"
        )


def least_step_ms(costs: StackCosts, plan: OffloadPlan, inline_copies: bool = False) -> float:
    """No step of ``plan`` is shorter: its compute with the streamed blocks' patches, and the copies of the
    streamed blocks a step calls, each once, unless the ring holds them all (then they stay in it). With
    ``inline_copies`` the copies run between the computes, so the two add up; else they overlap at best."""
    return _StepFloor.of(costs, plan).least_ms(plan, inline_copies)


@dataclass(frozen=True)
class _StepFloor:
    """``least_step_ms``'s terms for a set of streamed blocks, from which one block is taken out cheaply (the
    greedy search bounds every candidate of a round so)."""

    compute_ms: float  # every call's compute, and the patches of the streamed blocks' calls
    copy_ms: float  # a copy of each streamed block a step calls
    called: frozenset[int]  # the streamed blocks a step calls
    called_bytes: int  # their bytes as a ring sized in bytes places them

    @classmethod
    def of(cls, costs: StackCosts, plan: OffloadPlan) -> _StepFloor:
        streamed = plan.streamed
        called = frozenset(costs.calls) & streamed
        patches = sum(costs.patch_of(block) for block in costs.calls if block in streamed)
        return cls(
            costs.resident_step_ms + patches,
            sum(costs.copy_ms(block) for block in called),
            called,
            sum(aligned(costs.block_bytes[block]) for block in called),
        )

    def without(self, costs: StackCosts, block: int) -> _StepFloor:
        """The terms with ``block`` resident too."""
        if block not in self.called:
            return self
        patches = sum(costs.patch_of(block) for call in costs.calls if call == block) if costs.patch_ms else 0.0
        return _StepFloor(
            self.compute_ms - patches,
            self.copy_ms - costs.copy_ms(block),
            self.called - {block},
            self.called_bytes - aligned(costs.block_bytes[block]),
        )

    def least_ms(self, plan: OffloadPlan, inline_copies: bool) -> float:
        # A ring sized in bytes places regions of their own size; a default ring one block in each slot.
        stays = self.called_bytes <= plan.slot_bytes if plan.ring_bytes else len(self.called) <= plan.prefetch + 1
        copies = 0.0 if stays else self.copy_ms
        return self.compute_ms + copies if inline_copies else max(self.compute_ms, copies)


def slow_copies(costs: StackCosts) -> StackCosts:
    """``costs`` with copies ``SLOW_COPIES`` as fast as measured: what a placement is checked against."""
    return replace(costs, bandwidth_gbps=costs.bandwidth_gbps * SLOW_COPIES)


def predict(costs: StackCosts, plan: OffloadPlan, *, inline_copies: bool = False) -> Prediction:
    """The step of ``plan``, and with ``slow_copies``, as the search reports the placement it chose."""
    return with_slow_step(simulate(costs, plan, inline_copies=inline_copies), slow_copies(costs), inline_copies)


def with_slow_step(found: Prediction, slow_costs: StackCosts, inline_copies: bool) -> Prediction:
    """``found`` with its step under ``slow_costs`` (``slow_copies`` of the costs it was simulated with)."""
    return replace(found, slow_step_ms=simulate(slow_costs, found.plan, inline_copies=inline_copies).step_ms)


def lower_bound_ms(costs: StackCosts, streamed_bytes: int) -> float:
    """No placement streaming ``streamed_bytes`` per step beats this: compute, or the copies alone."""
    return max(costs.resident_step_ms, streamed_bytes / (costs.bandwidth_gbps * 1e6))


@dataclass
class _Step:
    start: float
    stall: float = 0.0
    bytes_copied: int = 0
    copied: list[bool] = field(default_factory=list)


class _Pipeline:
    """BlockStreamer's bookkeeping, with clocks instead of tensors (see the module docstring).

    It runs thousands of times per search, so each block's figures are read into lists once."""

    def __init__(self, costs: StackCosts, plan: OffloadPlan, inline_copies: bool, trace: Trace | None) -> None:
        self.costs = costs
        self.trace = trace
        self.streamed = plan.streamed
        self.prefetch = plan.prefetch
        self.inline = inline_copies
        self.sizes = costs.block_bytes
        self.copy_ms = [costs.copy_ms(block) for block in range(len(self.sizes))]
        # What a call adds to its block's compute: the block's patches when it streams.
        self.extra_ms = [costs.patch_of(block) if block in self.streamed else 0.0 for block in range(len(self.sizes))]
        self.calls = list(zip(costs.gap_ms, costs.compute_ms, costs.calls, strict=True))
        largest = max((self.sizes[i] for i in plan.streamed), default=0)
        self.ring = ByteRing(plan.slot_bytes, ring_granule(largest, plan.ring_bytes))
        self.ready_at: dict[int, float] = {}
        self.released_at: dict[int, float] = {}
        self.pending_bytes: dict[int, int] = {}  # copies not yet consumed by a call
        self.expected = list(range(len(self.sizes)))  # the first step assumes list order
        self.order: list[int] = []
        self.clock = 0.0  # the compute stream (the host, with inline copies)
        self.copy_free = 0.0  # the copy stream

    def run_step(self) -> tuple[float, _Step]:
        step = _Step(start=self.clock)
        self.order = []
        self._prefetch(held=set())
        for gap, compute, block in self.calls:
            self._call(block, gap, compute, step)
        if self.order:
            self.expected = self.order
        self.clock += self.costs.tail_ms
        return self.clock - step.start, step

    def state(self) -> tuple[object, ...]:
        """What the next step depends on, its times taken from the clock (to a picosecond, so that sums
        which differ in their last bits compare equal)."""

        def since(moment: float) -> float:
            return round(moment - self.clock, 9)

        in_ring = sorted(self.ring.regions.items())
        return (
            self.ring.head,
            tuple(in_ring),
            tuple(sorted(self.pending_bytes)),
            tuple((since(self.ready_at[b]), since(self.released_at.get(b, -math.inf))) for b, _ in in_ring),
            0.0 if self.inline else since(self.copy_free),  # inline, copies run on the clock
            tuple(self.expected),
        )

    def _call(self, block: int, gap: float, compute: float, step: _Step) -> None:
        self.clock += gap
        arrive = self.clock
        self.order.append(block)
        if self.trace is not None:
            self.trace.append(("begin", block))
        streamed = block in self.streamed
        if streamed:
            if block not in self.ring.regions:
                self._load(block, held=set())
            self.clock = max(self.clock, self.ready_at[block])
            copied = self.pending_bytes.pop(block, 0)
            step.bytes_copied += copied
            step.copied.append(copied > 0)
        else:
            step.copied.append(False)
        step.stall += self.clock - arrive
        self._prefetch(held={block})
        self.clock += compute + self.extra_ms[block]
        if streamed:
            self.released_at[block] = self.clock
        if self.trace is not None:
            self.trace.append(("end", block))

    def _prefetch(self, held: set[int]) -> None:
        if len(self.ring.regions) == len(self.streamed):
            return  # every streamed block stays in the ring: nothing left to copy
        upcoming = look_ahead(self.expected, len(self.order), self.streamed, self.prefetch)
        copy_ahead(upcoming, held, self.ring.regions, self._load)

    def _load(self, block: int, held: set[int]) -> bool:
        nbytes = self.sizes[block]
        placed = self.ring.place(block, nbytes, held)
        if placed is None:
            return False
        first, overwritten = placed
        if self.trace is not None:
            self.trace.append(("copy", block, first, first + nbytes))
        duration = self.copy_ms[block]
        if self.inline:
            start = self.clock
            self.clock += duration
        else:
            start = self.copy_free
            for other in overwritten:
                start = max(start, self.released_at.get(other, 0.0))
            self.copy_free = start + duration
        self.ready_at[block] = start + duration
        self.pending_bytes[block] = nbytes
        return True


def simulate(
    costs: StackCosts, plan: OffloadPlan, *, inline_copies: bool = False, steps: int = 3, trace: Trace | None = None
) -> Prediction:
    """The ``steps``-th step of ``plan`` (the first ``steps - 1`` warm the ring up).

    ``trace`` hears every step's events in order, as the engine would run them: ``("copy", block, first
    byte, end)`` into the ring, ``("begin", block)`` and ``("end", block)`` of each call."""
    if plan.block_bytes != costs.block_bytes:
        raise ValueError("the plan and the costs describe different stacks")
    pipeline = _Pipeline(costs, plan, inline_copies, trace)
    state = None
    for _ in range(steps):
        duration, step = pipeline.run_step()
        if trace is None:
            # A step that ends in the state the previous one ended in is the steady step: every later one repeats it.
            state, previous = pipeline.state(), state
            if state == previous:
                break
    return Prediction(plan, duration, step.stall, step.bytes_copied, tuple(step.copied))


#: A resident set's plan in one family of plans, or None when it does not fit the budget.
PlanFor = Callable[[frozenset[int]], OffloadPlan | None]


def _pool_plans(sizes: Sequence[int], prefetch: int, budget_bytes: int, pin_memory: bool) -> PlanFor:
    """Plans of ``prefetch`` with the default ring, as large as the largest block is ``prefetch + 1`` times
    (``OffloadPlan.build``'s budget rule), for the resident sets that fit ``budget_bytes``."""
    ring = ring_capacity(max(sizes, default=0), prefetch)

    def plan(resident: frozenset[int]) -> OffloadPlan | None:
        if sum(sizes[i] for i in resident) + ring > budget_bytes:
            return None
        return OffloadPlan(tuple(sizes), resident, prefetch, pin_memory, None)

    return plan


def _greedy(
    costs: StackCosts,
    plan_for: PlanFor,
    inline_copies: bool,
    count: int | None = None,
    grown: list[frozenset[int]] | None = None,
) -> Prediction | None:
    """Adds, one at a time, the block whose residency shortens the predicted step most: the best set of
    any size that fits, or the set once it holds ``count`` blocks (None if it cannot). ``grown`` hears
    the set after each block added.

    Lazily: a block's gain (how much its residency shortened the step) is taken to shrink as the set grows,
    so the gain it last showed bounds what it can show now. Each round simulates blocks in the order of the
    step they could reach at best (that, or the step no placement streaming their bytes beats), and stops
    once no block left could beat the best one simulated."""
    sizes = costs.block_bytes
    start = plan_for(frozenset())
    if start is None:
        return None
    resident: frozenset[int] = frozenset()
    best = current = simulate(costs, start, inline_copies=inline_copies)
    gains: dict[int, float] = {}  # the gain each block showed when last simulated
    while count is None or len(resident) < count:
        plans = {i: plan_for(resident | {i}) for i in range(len(sizes)) if i not in resident}
        terms = _StepFloor.of(costs, current.plan)
        floor = {
            i: max(current.step_ms - gains.get(i, math.inf), terms.without(costs, i).least_ms(plan, inline_copies))
            for i, plan in plans.items()
            if plan is not None
        }
        fitting = {i: plan for i, plan in plans.items() if plan is not None}
        if not floor:
            return best if count is None else None
        chosen: Prediction | None = None
        for i in sorted(floor, key=lambda i: (floor[i], i)):
            if chosen is not None and floor[i] >= chosen.step_ms * (1 - TIE):
                break
            option = simulate(costs, fitting[i], inline_copies=inline_copies)
            gains[i] = current.step_ms - option.step_ms
            if chosen is None or option.step_ms < chosen.step_ms * (1 - TIE):
                chosen = option
        assert chosen is not None
        current = chosen
        resident = chosen.plan.resident
        if grown is not None:
            grown.append(resident)
        if count is not None or _better(chosen, best):
            best = chosen
    return best


def _better(a: Prediction, b: Prediction) -> bool:
    """Faster with slower copies (when both were predicted so), then faster; when as fast, the one
    streaming less (its copies have more time to spare if the bandwidth or the compute drift from what
    was measured), then the smaller ring, then the shallower prefetch."""
    for a_ms, b_ms in ((a.slow_step_ms, b.slow_step_ms), (a.step_ms, b.step_ms)):
        if a_ms is None or b_ms is None:
            continue
        if a_ms < b_ms * (1 - TIE):
            return True
        if b_ms < a_ms * (1 - TIE):
            return False
    return (a.plan.streamed_bytes, a.plan.slot_bytes, a.plan.prefetch) < (
        b.plan.streamed_bytes,
        b.plan.slot_bytes,
        b.plan.prefetch,
    )


def best_plan(
    costs: StackCosts,
    budget_bytes: int,
    *,
    resident_count: int | None = None,
    prefetch_choices: Sequence[int] = PREFETCH_CHOICES,
    pin_memory: bool = True,
    inline_copies: bool = False,
) -> Prediction:
    """The fastest placement whose resident blocks and ring fit ``budget_bytes`` (with exactly
    ``resident_count`` resident blocks, when given: which ones, and the prefetch depth, are chosen).

    Candidates, for every prefetch depth with its default ring: the three residency policies at
    the largest count that fits (or at ``resident_count``), and a greedy set grown block by block
    on the predicted step time (it finds the positions where residency hides the most copy time,
    which the fixed policies cannot when blocks differ in size or compute). Within a budget (no
    ``resident_count``), also each policy at every count with a ring of every byte its blocks leave,
    copies going as far ahead as the ring has room: which blocks stay and how large the ring is are
    chosen together; so are the sets the greedy searches grew, each with such a ring. (A greedy search
    with such rings found 1 % more on a Flux-shaped stack at half its size, for 30 times the search
    time.) Everything resident is a candidate too when it fits.

    Of the candidates predicted within ``NEAR`` of the fastest, the one fastest with copies ``SLOW_COPIES``
    as fast as measured is chosen: a placement with no slack loses every bit of a copy-speed shortfall.
    """
    sizes = costs.block_bytes
    choice = _Choice(costs, inline_copies)
    if sum(sizes) <= budget_bytes and resident_count in (None, len(sizes)):
        choice.consider(OffloadPlan(sizes, frozenset(range(len(sizes))), min(prefetch_choices), pin_memory, None))
    # Each policy's plan: as many blocks as fit the budget, or the count asked for.
    size = {"budget_bytes": budget_bytes} if resident_count is None else {"resident_count": resident_count}
    grown: list[frozenset[int]] = []  # the greedy searches' sets, tried with a ring too
    by_policy: dict[int, float] = {}  # the fastest policy plan at each prefetch depth
    for prefetch in prefetch_choices:
        for policy in ResidencyPolicy:
            plan = OffloadPlan.build(sizes, **size, policy=policy, prefetch=prefetch, pin_memory=pin_memory)
            if plan.device_bytes() <= budget_bytes:
                predicted = simulate(costs, plan, inline_copies=inline_copies)
                by_policy[prefetch] = min(by_policy.get(prefetch, math.inf), predicted.step_ms)
                choice.add(predicted)
    greedy_depths = [p for p in prefetch_choices if resident_count is not None or p <= GREEDY_PREFETCH_IN_A_BUDGET]
    for prefetch in sorted(greedy_depths, key=lambda p: by_policy.get(p, math.inf)):
        if by_policy.get(prefetch, math.inf) > choice.fastest * (1 + GREEDY_REACH) and resident_count is None:
            continue
        pool = _pool_plans(sizes, prefetch, budget_bytes, pin_memory)
        greedy = _greedy(costs, pool, inline_copies, resident_count, grown)
        if greedy is not None:
            choice.add(greedy)
    if resident_count is None:
        # Each policy at every count (fewer resident blocks leave a larger ring, which may hide more), and
        # every set the greedy searches grew block by block.
        sets: list[tuple[frozenset[int], ResidencyPolicy | None]] = [
            (frozenset(resident_indices(len(sizes), count, policy)), policy)
            for policy in ResidencyPolicy
            for count in range(len(sizes))
        ]
        for resident, placed_by in [*sets, *dict.fromkeys((resident, None) for resident in grown)]:
            ring_plan = OffloadPlan.with_ring(sizes, resident, budget_bytes, pin_memory, placed_by)
            if ring_plan is not None:
                choice.consider(ring_plan)
    if choice.best is None:
        smallest = ring_capacity(max(sizes, default=0), min(prefetch_choices))
        raise ValueError(
            f"a budget of {budget_bytes / GIB:.2f} GiB holds no placement: streaming needs at least "
            f"{smallest / GIB:.2f} GiB of slots"
        )
    return choice.best


class _Choice:
    """The candidates of one search, and the one it chooses: of those predicted within ``NEAR`` of the
    fastest, in the order they came, each replacing the one chosen so far when ``_better``.

    A candidate is simulated only if it could change the choice: its lower bound (``least_step_ms``: the
    compute, and its copies) must come within ``NEAR`` of the fastest so far; and once the chosen one is
    within ``NEAR`` of the compute (no later candidate can then push it out), that bound, with copies as fast
    as measured and ``SLOW_COPIES`` as fast, must beat it."""

    def __init__(self, costs: StackCosts, inline_copies: bool) -> None:
        self.costs = costs
        self.slow_costs = slow_copies(costs)
        self.inline = inline_copies
        self.fastest = math.inf
        self.near: list[Prediction] = []  # within NEAR of the fastest, with their slow step
        self.best: Prediction | None = None

    def consider(self, plan: OffloadPlan) -> None:
        bound = least_step_ms(self.costs, plan, self.inline)
        if bound > self.fastest * (1 + NEAR):
            return
        if self.best is not None and self.best.step_ms <= self.costs.resident_step_ms * (1 + NEAR):
            at_best = Prediction(plan, bound, 0.0, 0, (), least_step_ms(self.slow_costs, plan, self.inline))
            if not _better(at_best, self.best):
                return
        self.add(simulate(self.costs, plan, inline_copies=self.inline))

    def add(self, candidate: Prediction) -> None:
        if candidate.step_ms > self.fastest * (1 + NEAR):
            return
        candidate = with_slow_step(candidate, self.slow_costs, self.inline)
        if candidate.step_ms < self.fastest:
            self.fastest = candidate.step_ms
            kept = [c for c in self.near if c.step_ms <= self.fastest * (1 + NEAR)]
            if len(kept) < len(self.near):
                self.near, self.best = [], None
                for earlier in kept:
                    self._fold(earlier)
        self._fold(candidate)

    def _fold(self, candidate: Prediction) -> None:
        self.near.append(candidate)
        if self.best is None or _better(candidate, self.best):
            self.best = candidate


#: Patches applied once into blocks' host buffers instead of at each call must save at least this share of a step:
#: below it the saving is within what steps vary by, and the buffers could no longer be shared.
BAKE_MIN_SAVING = 0.02
#: ... and the steps the patches have run so far must have saved this many times what baking costs. A LoRA that
#: stayed for some steps is taken to stay about as long again; the margin covers that guess.
BAKE_PAYBACK = 2.0
#: What baking a block costs, in copies of its bytes: to the device and back as it is patched, and one more pass
#: (read from its file again, at about the copy speed from the page cache) when the patches change.
BAKE_COPIES = 3


@dataclass(frozen=True)
class BakeDecision:
    """Whether the patches of some streamed blocks are applied once, into their host buffers, rather than at
    each call; and the figures it was decided on."""

    blocks: frozenset[int]  # the blocks to bake; empty: none
    saving_ms: float  # per step
    cost_ms: float  # once
    steps_run: int

    def describe(self) -> str:
        figures = (
            f"{self.saving_ms:.1f} ms per step for {self.cost_ms:.1f} ms once, after {self.steps_run} steps with "
            "these patches"
        )
        if self.blocks:
            return f"; patches baked once into the host buffers of {len(self.blocks)} streamed blocks ({figures})"
        return f"; patches applied at each call: baking them into the host buffers would save {figures}"


def bake_decision(
    costs: StackCosts,
    plan: OffloadPlan,
    candidates: frozenset[int],
    steps_run: int,
    *,
    least_step_ms: float = 0.0,
    inline_copies: bool = False,
) -> BakeDecision:
    """Whether to apply the patches of the ``candidates`` (streamed blocks whose host buffers may hold them) once,
    instead of at every call: where copies dominate, their patches are hidden and baking saves nothing; where
    compute dominates it saves their patch time at every step, for a cost paid again at each change of patches.
    Baked when the step is at least ``BAKE_MIN_SAVING`` shorter and the ``steps_run`` the patches have run so
    far saved ``BAKE_PAYBACK`` times the cost (``BAKE_COPIES`` copies of the blocks and their patch time).
    ``least_step_ms``: a bound no placement beats (the reads of blocks streamed from their file)."""
    candidates = frozenset(block for block in candidates if costs.patch_of(block) > 0)
    if not candidates:
        return BakeDecision(frozenset(), 0.0, 0.0, steps_run)
    baked = replace(costs, patch_ms=tuple(0.0 if b in candidates else ms for b, ms in enumerate(costs.patch_ms)))
    patched_ms = max(least_step_ms, simulate(costs, plan, inline_copies=inline_copies).step_ms)
    baked_ms = max(least_step_ms, simulate(baked, plan, inline_copies=inline_copies).step_ms)
    saving = patched_ms - baked_ms
    cost = sum(costs.patch_of(block) + BAKE_COPIES * costs.copy_ms(block) for block in candidates)
    worth = saving >= BAKE_MIN_SAVING * patched_ms and saving * steps_run >= BAKE_PAYBACK * cost
    return BakeDecision(candidates if worth else frozenset(), saving, cost, steps_run)
