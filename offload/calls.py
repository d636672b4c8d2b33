"""The block calls of a step, as an engine's hooks see them: the calls open now (running inside each other,
outermost first), the order this step has called blocks in so far, and the order the next calls are
expected in.

The call order is learned: the first step assumes the order it is given (an earlier engine's, else list
order), later steps the order the previous step really used, so blocks that run twice, run out of order or
are skipped cost a miss (an unhidden copy) at most once. A step that raised or was interrupted teaches
nothing: the blocks after where it stopped would not be copied ahead in the next.
"""

from __future__ import annotations

from collections.abc import Container, Iterator, Sequence
from dataclasses import dataclass

from .ring import look_ahead
from .timeline import CallRecord


@dataclass
class OpenCall:
    block: int
    streamed: bool
    record: CallRecord | None


class StepCalls:
    def __init__(self, units: int, call_order: Sequence[int] | None = None) -> None:
        known = call_order is not None and all(0 <= index < units for index in call_order)
        self.expected: list[int] = list(call_order) if known and call_order else list(range(units))
        self.order: list[int] = []  # this step's calls so far
        self.open: list[OpenCall] = []

    @property
    def in_step(self) -> bool:
        """Whether a step has begun calling blocks and not ended."""
        return bool(self.open or self.order)

    def running(self, block: int) -> bool:
        """Whether ``block`` has a call open now."""
        return any(call.block == block for call in self.open)

    def held(self) -> set[int]:
        """The blocks running now: their memory must not be overwritten."""
        return {call.block for call in self.open}

    def upcoming(self, streamed: Container[int], count: int) -> Iterator[int]:
        """The next ``count`` ``streamed`` blocks expected to be called, wrapping into the next step."""
        return look_ahead(self.expected, len(self.order), streamed, count)

    def arrived(self, block: int) -> None:
        self.order.append(block)

    def opened(self, call: OpenCall) -> None:
        self.open.append(call)

    def closed(self, block: int) -> Iterator[OpenCall]:
        """The calls that end with ``block``'s: its own and any an exception left open inside it, innermost
        first."""
        while self.open:
            call = self.open.pop()
            yield call
            if call.block == block:
                return

    def close_all(self) -> Iterator[OpenCall]:
        """Every open call, innermost first: those an exception left open."""
        while self.open:
            yield self.open.pop()

    def step_began(self) -> None:
        self.order = []

    def step_ended(self, learn: bool = True) -> None:
        """The next step is expected to call blocks in this one's order (if it called any, and ``learn``)."""
        if self.order and learn:
            self.expected = self.order
        self.order = []
