"""Whether the weight patches of streamed blocks are applied once, into their host buffers, rather than at each
call (``bake_decision``): decided on the step the replay predicts with and without their patches, and on how
long the patches have run so far.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from .costs import StackCosts
from .plan import OffloadPlan
from .simulator import simulate

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
