"""What one step of a block stack costs, and what any placement's step would take.

``StackCosts`` are measured once from a recorded step and reused to predict any placement: ``simulate`` replays its
step with clocks, using the engine's own ring books and copy-ahead functions, so copies land where the engine puts
them. Device time follows the engine's streams: one copy stream, in issue order, each copy waiting for the *released*
time of every block it overwrites; one compute stream, each call arriving ``gap_ms`` after the last and starting once
its copy is ready. With ``inline_copies`` (the CPU) copies run on the host between computes. The host is assumed to
run ahead of the device, as event-only synchronisation with pinned memory allows. The steady step is reported, since
the first starts with an empty ring and later ones with copies issued for them.

The floors bound a step from the costs alone, so the search skips candidates that cannot win. ``slow_copies`` is the
same stack with slower copies, which every chosen placement is checked against."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from .layout import aligned
from .plan import OffloadPlan
from .ring import ByteRing, copy_ahead, look_ahead, ring_granule
from .timeline import StepTimeline

#: Copies sometimes run slower than measured; a placement at its copy limit loses all of that, one whose ring runs
#: further ahead absorbs it. Placements are checked against this share of the measured speed.
SLOW_COPIES = 0.85


@dataclass(frozen=True)
class StackCosts:
    """What one step of a block stack costs, measured once and reused to predict any placement.

    ``calls``: block indices in call order; ``compute_ms`` and ``gap_ms`` per call: the block's compute, and the
    compute-stream time since the previous call's end. ``tail_ms``: from the last call to the step's end.

    ``patch_ms`` (per block; empty: none): what a streamed block's weight patches cost at every call, where a resident
    block was patched once at load. Hidden where copies dominate, paid at every call where compute does."""

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
        """Costs read from one recorded step; the bandwidth is the step's unless given.

        With ``inline_copies`` (a CPU recording) copies issued ahead ran inside a call's compute span, so their time is
        taken out."""
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
        """What a call of ``block`` adds to its compute when it streams."""
        return self.patch_ms[block] if self.patch_ms else 0.0

    def patches_per_step_ms(self, streamed: frozenset[int]) -> float:
        return sum(self.patch_of(block) for block in self.calls if block in streamed)

    def without_patches(self, streamed: frozenset[int]) -> StackCosts:
        """These costs as if the ``streamed`` blocks were unpatched: what is kept, since a later model adds its own
        patches."""
        compute = tuple(
            max(0.0, ms - self.patch_of(block)) if block in streamed else ms
            for block, ms in zip(self.calls, self.compute_ms, strict=True)
        )
        return replace(self, compute_ms=compute, patch_ms=())

    @property
    def resident_step_ms(self) -> float:
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
    #: Per call: whether it consumed a copy (False: resident, or still in the ring).
    copied: tuple[bool, ...]
    #: The step with copies at ``SLOW_COPIES``.
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
    """No step of ``plan`` is shorter: its compute with patches, and one copy of each streamed block unless the ring
    holds them all. With ``inline_copies`` the two add up; else they overlap at best."""
    return StepFloor.of(costs, plan).least_ms(plan, inline_copies)


@dataclass(frozen=True)
class StepFloor:
    """``least_step_ms``'s terms, from which one block can be taken out cheaply, as the greedy search does for every
    candidate of a round."""

    compute_ms: float  # with the streamed blocks' patches
    copy_ms: float  # one copy of each streamed block a step calls
    called: frozenset[int]
    called_bytes: int  # aligned, as a byte-sized ring places them

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
        stays = self.called_bytes <= plan.slot_bytes if plan.ring_bytes else len(self.called) <= plan.prefetch + 1
        copies = 0.0 if stays else self.copy_ms
        return self.compute_ms + copies if inline_copies else max(self.compute_ms, copies)


def slow_copies(costs: StackCosts) -> StackCosts:
    return replace(costs, bandwidth_gbps=costs.bandwidth_gbps * SLOW_COPIES)


def lower_bound_ms(costs: StackCosts, streamed_bytes: int) -> float:
    """No placement streaming ``streamed_bytes`` per step beats this: compute, or the copies alone."""
    return max(costs.resident_step_ms, streamed_bytes / (costs.bandwidth_gbps * 1e6))


# -- the replay

Trace = list[tuple[object, ...]]


@dataclass
class _Step:
    start: float
    stall: float = 0.0
    bytes_copied: int = 0
    copied: list[bool] = field(default_factory=list)


class _Pipeline:
    """``BlockStreamer``'s bookkeeping with clocks instead of tensors. It runs thousands of times per search, so each
    block's figures are read into lists once."""

    def __init__(self, costs: StackCosts, plan: OffloadPlan, inline_copies: bool, trace: Trace | None) -> None:
        self.costs = costs
        self.trace = trace
        self.streamed = plan.streamed
        self.prefetch = plan.prefetch
        self.inline = inline_copies
        self.sizes = costs.block_bytes
        self.copy_ms = [costs.copy_ms(block) for block in range(len(self.sizes))]
        self.extra_ms = [costs.patch_of(block) if block in self.streamed else 0.0 for block in range(len(self.sizes))]
        self.calls = list(zip(costs.gap_ms, costs.compute_ms, costs.calls, strict=True))
        largest = max((self.sizes[i] for i in plan.streamed), default=0)
        self.ring = ByteRing(plan.slot_bytes, ring_granule(largest, plan.ring_bytes))
        self.ready_at: dict[int, float] = {}
        self.released_at: dict[int, float] = {}
        self.pending_bytes: dict[int, int] = {}  # copies not yet consumed by a call
        self.expected = list(range(len(self.sizes)))
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
        """What the next step depends on, times relative to the clock and rounded so that sums differing in their
        last bits compare equal."""

        def since(moment: float) -> float:
            return round(moment - self.clock, 9)

        in_ring = sorted(self.ring.regions.items())
        return (
            self.ring.head,
            tuple(in_ring),
            tuple(sorted(self.pending_bytes)),
            tuple((since(self.ready_at[b]), since(self.released_at.get(b, -math.inf))) for b, _ in in_ring),
            0.0 if self.inline else since(self.copy_free),
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
            return  # every streamed block stays in the ring
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
    """The ``steps``-th step of ``plan``, or, without ``trace``, the first that
    repeats the one before.

    ``trace`` hears every step's events as the engine would run them: ``("copy", block, first byte, end)``, ``("begin",
    block)`` and ``("end", block)``."""
    if plan.block_bytes != costs.block_bytes:
        raise ValueError("the plan and the costs describe different stacks")
    pipeline = _Pipeline(costs, plan, inline_copies, trace)
    state = None
    for _ in range(steps):
        duration, step = pipeline.run_step()
        if trace is None:
            # A step ending in the previous step's state is the steady one.
            state, previous = pipeline.state(), state
            if state == previous:
                break
    return Prediction(plan, duration, step.stall, step.bytes_copied, tuple(step.copied))


def predict(costs: StackCosts, plan: OffloadPlan, *, inline_copies: bool = False) -> Prediction:
    """The step of ``plan``, with its slow-copies step, as the search reports a chosen placement."""
    return with_slow_step(simulate(costs, plan, inline_copies=inline_copies), slow_copies(costs), inline_copies)


def with_slow_step(found: Prediction, slow_costs: StackCosts, inline_copies: bool) -> Prediction:
    return replace(found, slow_step_ms=simulate(slow_costs, found.plan, inline_copies=inline_copies).step_ms)
