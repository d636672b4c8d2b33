"""Per-block copy and compute spans, timed on the device.

Marks are device events recorded on the stream that does the work, so they cost
one event record each and never block the host. A step is resolved (its events
read) only once it has finished on the device, or when someone asks for it.
Markers are recycled, so a long run allocates none after its first steps.
"""

from __future__ import annotations

from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Protocol

import torch

from .device import Clock, memory_snapshot, reset_peak_memory

Marker = torch.Event | list[float]


@dataclass
class CopyRecord:
    """One host-to-device copy of a block, from its issue on the copy stream to its end."""

    start: Marker
    end: Marker
    nbytes: int = 0


@dataclass
class CallRecord:
    """One call of one block: when compute reached it, when it could start, when it ended."""

    block: int
    arrive: Marker
    start: Marker
    end: Marker
    copy: CopyRecord | None = None


@dataclass(frozen=True)
class BlockSpan:
    """A resolved call, in milliseconds from the start of its step."""

    block: int
    compute_start: float
    compute_end: float
    stall: float
    copy_start: float | None = None
    copy_end: float | None = None
    bytes_copied: int = 0


@dataclass(frozen=True)
class StepTimeline:
    """One forward pass of the model through its blocks."""

    step: int
    duration_ms: float
    spans: tuple[BlockSpan, ...]
    peak_allocated: int | None = None
    copy_ms: float = field(init=False)
    stall_ms: float = field(init=False)
    bytes_copied: int = field(init=False)

    def __post_init__(self) -> None:
        copies = [s.copy_end - s.copy_start for s in self.spans if s.copy_start is not None]
        object.__setattr__(self, "copy_ms", sum(copies))
        object.__setattr__(self, "stall_ms", sum(s.stall for s in self.spans))
        object.__setattr__(self, "bytes_copied", sum(s.bytes_copied for s in self.spans))

    @property
    def overlap(self) -> float:
        """Share of copy time hidden behind compute (1.0 when nothing was copied)."""
        if self.copy_ms <= 0:
            return 1.0
        return max(0.0, 1.0 - self.stall_ms / self.copy_ms)

    @property
    def bandwidth_gbps(self) -> float | None:
        """Effective host-to-device bandwidth of this step's copies, in GB/s."""
        if self.copy_ms <= 0:
            return None
        return self.bytes_copied / (self.copy_ms / 1000.0) / 1e9

    def as_dict(self) -> dict:
        data = asdict(self)
        data["overlap"] = self.overlap
        data["bandwidth_gbps"] = self.bandwidth_gbps
        return data


class TimelineListener(Protocol):
    """Hears the recorder's progress, on the thread that runs the model: it must return at once."""

    def block_called(self, step: int, block: int) -> None: ...

    def step_resolved(self, timeline: StepTimeline) -> None: ...


class TimelineRecorder:
    """Collects the spans of each step; keeps the last ``keep`` resolved steps.

    ``listener``, when set, hears every block call and every resolved step (a live view's feed).
    """

    def __init__(self, device: torch.device, keep: int = 1) -> None:
        self.clock = Clock(device)
        self.device = device
        self.enabled = True
        self.steps: deque[StepTimeline] = deque(maxlen=keep)
        self.listener: TimelineListener | None = None
        self._free: list[Marker] = []
        self._step_index = 0
        self._step_start: Marker | None = None
        self._step_end: Marker | None = None
        self._calls: list[CallRecord] = []
        self._pending: deque[tuple[int, Marker, Marker, list[CallRecord], int | None]] = deque()

    def _marker(self) -> Marker:
        return self._free.pop() if self._free else self.clock.new_marker()

    def begin_step(self, stream: torch.Stream | None) -> None:
        if not self.enabled:
            return
        self._resolve(wait=False)
        reset_peak_memory(self.device)  # the step's own peak, not the process's
        self._step_start = self._marker()
        self.clock.mark(self._step_start, stream)
        self._calls = []

    def end_step(self, stream: torch.Stream | None) -> None:
        if not self.enabled or self._step_start is None:
            return
        end = self._marker()
        self.clock.mark(end, stream)
        peak = memory_snapshot(self.device).peak_allocated
        self._pending.append((self._step_index, self._step_start, end, self._calls, peak))
        self._step_index += 1
        self._step_start = None
        self._calls = []
        # On the CPU the step resolves now; on a device only if it already finished (one event query).
        self._resolve(wait=False)

    def copy_started(self, stream: torch.Stream | None, nbytes: int) -> CopyRecord | None:
        if not self.enabled:
            return None
        record = CopyRecord(self._marker(), self._marker(), nbytes)
        self.clock.mark(record.start, stream)
        return record

    def copy_finished(self, record: CopyRecord | None, stream: torch.Stream | None) -> None:
        if record is not None:
            self.clock.mark(record.end, stream)

    def call_arrived(self, block: int, stream: torch.Stream | None) -> CallRecord | None:
        if not self.enabled or self._step_start is None:
            return None
        record = CallRecord(block, self._marker(), self._marker(), self._marker())
        self.clock.mark(record.arrive, stream)
        self._calls.append(record)
        if self.listener is not None:
            self.listener.block_called(self._step_index, block)
        return record

    def call_started(self, record: CallRecord | None, copy: CopyRecord | None, stream: torch.Stream | None) -> None:
        if record is not None:
            record.copy = copy
            self.clock.mark(record.start, stream)

    def call_finished(self, record: CallRecord | None, stream: torch.Stream | None) -> None:
        if record is not None:
            self.clock.mark(record.end, stream)

    def latest(self) -> StepTimeline | None:
        """The last finished step, waiting for the device if it is still running."""
        self._resolve(wait=True)
        return self.steps[-1] if self.steps else None

    def _resolve(self, wait: bool) -> None:
        while self._pending:
            index, start, end, calls, peak = self._pending[0]
            if not wait and isinstance(end, torch.Event) and not end.query():
                return
            self._pending.popleft()
            timeline = self._resolved(index, start, end, calls, peak)
            self.steps.append(timeline)
            if self.listener is not None:
                self.listener.step_resolved(timeline)

    def _resolved(
        self, index: int, start: Marker, end: Marker, calls: list[CallRecord], peak: int | None
    ) -> StepTimeline:
        def at(marker: Marker) -> float:
            return self.clock.elapsed_ms(start, marker)

        spans = []
        for call in calls:
            copy = call.copy
            spans.append(
                BlockSpan(
                    block=call.block,
                    compute_start=at(call.start),
                    compute_end=at(call.end),
                    stall=max(0.0, at(call.start) - at(call.arrive)),
                    copy_start=at(copy.start) if copy else None,
                    copy_end=at(copy.end) if copy else None,
                    bytes_copied=copy.nbytes if copy else 0,
                )
            )
            self._free += (call.arrive, call.start, call.end)
            if copy is not None:
                self._free += (copy.start, copy.end)
        timeline = StepTimeline(index, at(end), tuple(spans), peak)
        self._free += (start, end)
        return timeline
