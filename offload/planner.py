"""Decisions from predicted steps: the fastest placement that fits a budget (``best_plan``), and whether to bake
the weight patches of streamed blocks into their host buffers once rather than apply them at each call
(``bake_decision``).

Each candidate's step is predicted by replaying it (``simulator.simulate``); the floors of ``costs`` skip the
candidates that cannot change the choice, and the greedy search grows resident sets block by block where the
fixed residency policies cannot find the positions that hide the most copy time. Baking is decided on the step
predicted with and without the patches, and on how long the patches have run so far.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from .costs import Prediction, StackCosts, StepFloor, least_step_ms, slow_copies
from .plan import GIB, OffloadPlan, ResidencyPolicy, resident_indices
from .ring import ring_capacity
from .simulator import simulate, with_slow_step

#: Predictions this close (relative) count as equal.
TIE = 1e-6
#: Placements predicted within this of the fastest are close enough to be chosen between on their slack:
#: how they fare with copies slower than measured (``SLOW_COPIES``).
NEAR = 0.01
#: Prefetch depths the search tries. Deeper costs a block of device memory per step for little gain.
PREFETCH_CHOICES = (0, 1, 2, 3)
#: Within a budget, the deepest prefetch whose slots the greedy search fills block by block: the rings
#: sized in bytes copy further ahead, and each greedy search costs seconds on a 57-block stack.
GREEDY_PREFETCH_IN_A_BUDGET = 1
#: A greedy search at a prefetch depth whose policy plans all come out this much slower than the fastest placement
#: found is not run within a budget: block by block it gained at most a few percent over the best policy.
GREEDY_REACH = 0.1


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
