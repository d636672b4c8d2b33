"""What one step of a block stack costs, and the bounds on what a placement's step can be.

``StackCosts`` are measured once (from a recorded step, ``from_timeline``) and reused to predict any
placement; ``Prediction`` is one predicted step (``simulator.simulate``). The floors (``least_step_ms``,
``StepFloor``, ``lower_bound_ms``) bound a step from the costs alone, without replaying it: the search
(``planner.best_plan``) skips the candidates whose bound cannot beat what it has found, and the panel
``Prediction.describe`` says how far a placement's step is from the lower bound. ``slow_copies`` is the same
stack with copies slower than measured, which every placement the search chooses is checked against.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from .layout import aligned
from .plan import OffloadPlan
from .timeline import StepTimeline

#: The copy speed a placement is checked against, relative to the measured one: real copies run slower than
#: predicted at times, and a placement at its copy limit with one block of prefetch loses all of such a
#: shortfall, while one whose ring runs further ahead absorbs it.
SLOW_COPIES = 0.85


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
    return StepFloor.of(costs, plan).least_ms(plan, inline_copies)


@dataclass(frozen=True)
class StepFloor:
    """``least_step_ms``'s terms for a set of streamed blocks, from which one block is taken out cheaply (the
    greedy search bounds every candidate of a round so)."""

    compute_ms: float  # every call's compute, and the patches of the streamed blocks' calls
    copy_ms: float  # a copy of each streamed block a step calls
    called: frozenset[int]  # the streamed blocks a step calls
    called_bytes: int  # their bytes as a ring sized in bytes places them

    @classmethod
    def of(cls, costs: StackCosts, plan: OffloadPlan) -> StepFloor:
        streamed = plan.streamed
        called = frozenset(costs.calls) & streamed
        patches = sum(costs.patch_of(block) for block in costs.calls if block in streamed)
        return cls(
            costs.resident_step_ms + patches,
            sum(costs.copy_ms(block) for block in called),
            called,
            sum(aligned(costs.block_bytes[block]) for block in called),
        )

    def without(self, costs: StackCosts, block: int) -> StepFloor:
        """The terms with ``block`` resident too."""
        if block not in self.called:
            return self
        patches = sum(costs.patch_of(block) for call in costs.calls if call == block) if costs.patch_ms else 0.0
        return StepFloor(
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


def lower_bound_ms(costs: StackCosts, streamed_bytes: int) -> float:
    """No placement streaming ``streamed_bytes`` per step beats this: compute, or the copies alone."""
    return max(costs.resident_step_ms, streamed_bytes / (costs.bandwidth_gbps * 1e6))
