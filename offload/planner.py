"""Decisions from predicted steps: the fastest placement within a budget (``best_plan``), and whether to bake
streamed blocks' patches into their host buffers once (``bake_decision``).

Each candidate is replayed by ``costs.simulate``; lower bounds skip candidates that cannot change the choice. A
greedy search grows resident sets block by block, finding the positions that hide the most copy time, which fixed
policies miss when blocks differ."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .costs import Prediction, StackCosts, StepFloor, least_step_ms, simulate, slow_copies, with_slow_step
from .plan import GIB, OffloadPlan, ResidencyPolicy, resident_indices
from .ring import ring_capacity

#: Predictions this close (relative) count as equal.
TIE = 1e-6
#: Placements within this of the fastest are chosen between on their slack (``SLOW_COPIES``).
NEAR = 0.01
#: Deeper prefetch costs a block of device memory for little gain.
PREFETCH_CHOICES = (0, 1, 2, 3)
#: Within a budget, the deepest prefetch the greedy search runs at: rings sized in bytes copy further ahead
#: anyway, and each greedy search is slow on a long stack.
GREEDY_PREFETCH_IN_A_BUDGET = 1
#: Within a budget, no greedy search at a depth whose policy plans are all this much slower than the fastest:
#: it gains little over the best policy.
GREEDY_REACH = 0.1


#: A resident set's plan in one family of plans, or None when it does not fit the budget.
PlanFor = Callable[[frozenset[int]], OffloadPlan | None]


def _pool_plans(sizes: Sequence[int], prefetch: int, budget_bytes: int, pin_memory: bool) -> PlanFor:
    """Plans with the default ring at ``prefetch``, for resident sets that fit ``budget_bytes``."""
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
    """Adds, one at a time, the block whose residency shortens the predicted step most: the best set of any size, or
    the set of ``count`` blocks (None if it cannot). ``grown`` hears each set.

    Lazy: a block's gain is assumed to shrink as the set grows, so its last gain bounds its next. Each round simulates
    blocks in order of their best reachable step and stops once none left could beat the best simulated."""
    sizes = costs.block_bytes
    start = plan_for(frozenset())
    if start is None:
        return None
    resident: frozenset[int] = frozenset()
    best = current = simulate(costs, start, inline_copies=inline_copies)
    gains: dict[int, float] = {}  # the gain each block showed when last simulated
    while count is None or len(resident) < count:
        plans = {i: plan_for(resident | {i}) for i in range(len(sizes)) if i not in resident}
        terms = StepFloor.of(costs, current.plan)
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
    """Faster with slow copies, then faster; on a tie the one streaming less (more slack if bandwidth or compute
    drift), then the smaller ring, then the shallower prefetch."""
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
    """The fastest placement whose resident blocks and ring fit ``budget_bytes`` (with exactly ``resident_count``
    resident blocks, if given).

    Candidates at each prefetch depth: the three policies and a greedy set, with the default ring. Within a budget, also
    each policy at every count and each greedy set with a ring of every byte left, since which blocks stay and how large
    the ring is interact. Among those within ``NEAR`` of the fastest, the one fastest with ``SLOW_COPIES`` wins: a
    placement with no slack loses every bit of a copy shortfall.

    Raises ``ValueError`` when not even the stream buffers fit."""
    sizes = costs.block_bytes
    choice = _Choice(costs, inline_copies)
    if sum(sizes) <= budget_bytes and resident_count in (None, len(sizes)):
        choice.consider(OffloadPlan(sizes, frozenset(range(len(sizes))), min(prefetch_choices), pin_memory, None))
    size = {"budget_bytes": budget_bytes} if resident_count is None else {"resident_count": resident_count}
    grown: list[frozenset[int]] = []  # tried with a ring too
    by_policy: dict[int, float] = {}  # the fastest policy plan per prefetch depth
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
        # Fewer resident blocks leave a larger ring, which may hide more.
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
    """One search's candidates and its choice: among those within ``NEAR`` of the fastest, each replaces the current
    one when ``_better``.

    A candidate is simulated only if its lower bound comes within ``NEAR`` of the fastest, and, once the choice is
    within ``NEAR`` of pure compute, only if that bound with slow copies beats it."""

    def __init__(self, costs: StackCosts, inline_copies: bool) -> None:
        self.costs = costs
        self.slow_costs = slow_copies(costs)
        self.inline = inline_copies
        self.fastest = math.inf
        self.near: list[Prediction] = []
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


#: Baking must save this share of a step: less is within step noise, and baked buffers can no longer be shared.
BAKE_MIN_SAVING = 0.02
#: ... and the steps run so far must have saved this many times the cost: a LoRA that stayed some steps is
#: assumed to stay as long again, and the margin covers that guess.
BAKE_PAYBACK = 2.0
#: Baking's cost in copies of the block: to the device and back, and a re-read when the patches change.
BAKE_COPIES = 3


@dataclass(frozen=True)
class BakeDecision:
    """Whether to bake some streamed blocks' patches into their host buffers, and the figures behind it."""

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
    """Whether to apply the ``candidates``' patches once instead of at every call. Where copies dominate the patches
    are hidden and baking saves nothing; where compute dominates it saves their time every step, for a cost paid
    again at each change of patches. ``least_step_ms``: a bound no placement beats (file-tier reads)."""
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
