"""Predicts the step time of a placement, by replaying its step with clocks (``simulate``, ``predict``).

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
from dataclasses import dataclass, field, replace

from .costs import Prediction, StackCosts, slow_copies
from .plan import OffloadPlan
from .ring import ByteRing, copy_ahead, look_ahead, ring_granule

#: The events a simulation replays, as the engine would run them (``simulate``'s ``trace``).
Trace = list[tuple[object, ...]]


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


def predict(costs: StackCosts, plan: OffloadPlan, *, inline_copies: bool = False) -> Prediction:
    """The step of ``plan``, and with ``slow_copies``, as the search reports the placement it chose."""
    return with_slow_step(simulate(costs, plan, inline_copies=inline_copies), slow_copies(costs), inline_copies)


def with_slow_step(found: Prediction, slow_costs: StackCosts, inline_copies: bool) -> Prediction:
    """``found`` with its step under ``slow_costs`` (``slow_copies`` of the costs it was simulated with)."""
    return replace(found, slow_step_ms=simulate(slow_costs, found.plan, inline_copies=inline_copies).step_ms)
