"""Predicts a placement's step time by replaying its step with clocks (``simulate``, ``predict``).

The replay uses the engine's own ring books and copy-ahead functions, so copies land where the engine puts them. Device
time follows the engine's streams: one copy stream, in issue order, each copy waiting for the *released* time of every
block it overwrites; one compute stream, each call arriving ``gap_ms`` after the last and starting once its copy is
ready. With ``inline_copies`` (the CPU) copies run on the host between computes.

The host is assumed to run ahead of the device, as event-only synchronisation with pinned memory allows. The steady step
is reported, since the first starts with an empty ring and later ones with copies issued for them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from .costs import Prediction, StackCosts, slow_copies
from .plan import OffloadPlan
from .ring import ByteRing, copy_ahead, look_ahead, ring_granule

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
