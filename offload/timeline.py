"""The recorder: each block call's copy and compute span, timed on the device (``TimelineRecorder``), and a recorded
step (``StepTimeline``, in ms from the step's start).

A call costs two event records on the compute stream and, for a copied block, two on the copy stream; none blocks the
host. The compute start is not marked: compute waits only on the ready event recorded right after the copy, so it
started at the later of its arrival and the copy's end. File-tier reads run off any stream and are timed on the host.
Steps are read only when asked, and records are pooled, so a steady run allocates none. While nobody watches, only the
first steps and then one per ``unwatched_period_s`` are recorded, decided a step ahead so copies issued ahead are
recorded with their step."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from .device import Clock, Marker, peak_allocated, reset_peak_memory


# Not frozen: frozen dataclasses build several times slower, and spans are built on the sampling thread.
@dataclass(slots=True)
class BlockSpan:
    """A resolved call, in milliseconds from the start of its step."""

    block: int
    compute_start: float
    compute_end: float
    stall: float
    copy_start: float | None = None
    copy_end: float | None = None
    bytes_copied: int = 0


@dataclass(slots=True)
class ReadSpan:
    """A file-tier block read from its file into a staging slot, in milliseconds from the step's start."""

    block: int
    start: float
    end: float
    bytes_read: int


@dataclass(frozen=True)
class StepTimeline:
    step: int
    duration_ms: float
    spans: tuple[BlockSpan, ...]
    peak_allocated: int | None = None
    reads: tuple[ReadSpan, ...] = ()
    # Copies from blocks not yet packed, which do not show later steps' bandwidth.
    unpacked_bytes: int = 0
    unpacked_copy_ms: float = 0.0
    copy_ms: float = field(init=False)
    stall_ms: float = field(init=False)
    bytes_copied: int = field(init=False)

    def __post_init__(self) -> None:
        copies = [s.copy_end - s.copy_start for s in self.spans if s.copy_start is not None and s.copy_end is not None]
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

    @property
    def packed_bandwidth_gbps(self) -> float | None:
        """Bandwidth of this step's copies from packed blocks, in GB/s: what steps copy at once packing is done (None
        if it copied none)."""
        copy_ms = self.copy_ms - self.unpacked_copy_ms
        if copy_ms <= 0 or self.bytes_copied <= self.unpacked_bytes:
            return None
        return (self.bytes_copied - self.unpacked_bytes) / (copy_ms / 1000.0) / 1e9

    @property
    def bytes_read(self) -> int:
        return sum(read.bytes_read for read in self.reads)

    @property
    def read_gbps(self) -> float | None:
        """Bandwidth of this step's file reads, in GB/s (None when nothing was read)."""
        read_ms = sum(read.end - read.start for read in self.reads)
        if read_ms <= 0:
            return None
        return self.bytes_read / (read_ms / 1000.0) / 1e9

    def as_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["overlap"] = self.overlap
        data["bandwidth_gbps"] = self.bandwidth_gbps
        data["read_gbps"] = self.read_gbps
        return data


@dataclass(slots=True, eq=False)
class CopyRecord:
    """One host-to-device copy, from its issue on the copy stream to its end (pooled)."""

    start: Marker
    end: Marker
    nbytes: int = 0
    # From a block not yet packed: slower than later steps' copies.
    unpacked: bool = False


@dataclass(slots=True, eq=False)
class CallRecord:
    """One block call: compute arrival, end, and the copy it waited for (pooled)."""

    arrive: Marker
    end: Marker
    block: int = 0
    copy: CopyRecord | None = None


@dataclass(slots=True, eq=False)
class _StepRecord:
    """One step's markers and calls until read (pooled)."""

    start: Marker
    end: Marker
    index: int = 0
    calls: list[CallRecord] = field(default_factory=list)
    peak: int | None = None
    host_start: float = 0.0  # time.perf_counter(), for the reads
    reads: list[tuple[int, float, float, int]] = field(default_factory=list)


class TimelineListener(Protocol):
    """Hears the recorder's progress on the sampling thread, and must return at once."""

    def block_called(self, step: int, block: int) -> None: ...

    def step_resolved(self, timeline: StepTimeline) -> None: ...


#: Recorded watched or not: the planner's costs come from a step after the first.
FIRST_STEPS_RECORDED = 3
UNWATCHED_PERIOD_S = 2.0


def always_watched() -> bool:
    return True


class TimelineRecorder:
    """Collects the spans of each step; keeps the last ``keep`` read steps.

    ``listener`` hears every recorded call and each step once read. ``watched`` answers, a step ahead, whether every
    step must be recorded. ``clock`` makes every device call the recorder makes."""

    def __init__(self, device: torch.device, keep: int = 1, clock: Clock | None = None) -> None:
        self.clock = clock if clock is not None else Clock(device)
        self.device = device
        self.enabled = True
        self.listener: TimelineListener | None = None
        self.watched: Callable[[], bool] = always_watched
        self.unwatched_period_s = UNWATCHED_PERIOD_S
        self._in_step = False
        self._next_recorded = True  # decided as the open step began
        self._last_recorded_at = -float("inf")
        self._keep = keep
        self._steps: deque[StepTimeline] = deque(maxlen=keep)
        self._step_index = 0
        self._open: _StepRecord | None = None
        self._pending: deque[_StepRecord] = deque()  # ended on the host, not read yet
        self._free_steps: list[_StepRecord] = []
        self._free_calls: list[CallRecord] = []
        self._free_copies: list[CopyRecord] = []
        self._reads: list[tuple[int, float, float, int]] = []  # since the last step boundary

    @property
    def steps_ended(self) -> int:
        return self._step_index

    @property
    def steps(self) -> tuple[StepTimeline, ...]:
        """The last ``keep`` finished steps, oldest first; waits for the device."""
        self._resolve(wait=True)
        return tuple(self._steps)

    def begin_step(self, stream: torch.Stream | None) -> None:
        if not self.enabled:
            return
        if self._open is not None:  # never ended (the recorder was off meanwhile)
            self._recycle(self._open)
            self._open = None
        self._settle()
        recorded, now = self._next_recorded, time.perf_counter()
        if recorded:
            self._last_recorded_at = now
        self._next_recorded = self._records(self._step_index + 1, now)
        self._in_step = True
        if not recorded:
            return
        reset_peak_memory(self.device)
        step = self._free_steps.pop() if self._free_steps else _StepRecord(*self._new_markers())
        step.index = self._step_index
        step.host_start = now
        self.clock.mark(step.start, stream)
        self._open = step

    def end_step(self, stream: torch.Stream | None) -> None:
        if not self.enabled or not self._in_step:
            return
        self._in_step = False
        self._step_index += 1
        step = self._open
        if step is None:
            self._reads = []
            return
        self.clock.mark(step.end, stream)
        step.peak = peak_allocated(self.device)
        # Swapped, not copied: the reader's thread appends to whichever list it finds.
        step.reads, self._reads = self._reads, []
        self._pending.append(step)
        self._open = None
        self._settle()

    def _records(self, index: int, now: float) -> bool:
        if index < FIRST_STEPS_RECORDED or self.watched():
            return True
        return now - self._last_recorded_at >= self.unwatched_period_s

    def read_done(self, block: int, start: float, end: float, nbytes: int) -> None:
        """A file-tier read ended; called on the reader's thread, with ``time.perf_counter`` times."""
        if self.enabled:
            self._reads.append((block, start, end, nbytes))

    def copy_started(self, stream: torch.Stream | None, nbytes: int) -> CopyRecord | None:
        # A copy is for the open step or the next: recorded if either is.
        if not self.enabled or (self._open is None and not self._next_recorded):
            return None
        record = self._free_copies.pop() if self._free_copies else CopyRecord(*self._new_markers())
        record.nbytes, record.unpacked = nbytes, False  # the issuer sets unpacked
        self.clock.mark(record.start, stream)
        return record

    def copy_finished(self, record: CopyRecord | None, stream: torch.Stream | None) -> None:
        if record is not None:
            self.clock.mark(record.end, stream)

    def call_arrived(self, block: int, stream: torch.Stream | None) -> CallRecord | None:
        step = self._open
        if not self.enabled or step is None:
            return None
        record = self._free_calls.pop() if self._free_calls else CallRecord(*self._new_markers())
        record.block = block
        record.copy = None
        self.clock.mark(record.arrive, stream)
        step.calls.append(record)
        if self.listener is not None:
            self.listener.block_called(self._step_index, block)
        return record

    def call_started(self, record: CallRecord | None, copy: CopyRecord | None, stream: torch.Stream | None) -> None:
        """The call's compute is queued after waiting for ``copy``. Nothing is marked: the start is derived from the
        arrival and the copy's end."""
        if record is not None:
            record.copy = copy
        elif copy is not None:  # copied ahead for an unrecorded step
            self._free_copies.append(copy)

    def call_finished(self, record: CallRecord | None, stream: torch.Stream | None) -> None:
        if record is not None:
            self.clock.mark(record.end, stream)

    def latest(self) -> StepTimeline | None:
        """The last finished step; waits for the device."""
        self._resolve(wait=True)
        return self._steps[-1] if self._steps else None

    def _new_markers(self) -> tuple[Marker, Marker]:
        return self.clock.new_marker(), self.clock.new_marker()

    def _settle(self) -> None:
        """At a step boundary: the listener hears the finished steps; without one, steps older than the last ``keep``
        are recycled unread."""
        if self.listener is not None:
            self._resolve(wait=False)
            return
        while len(self._pending) > self._keep:
            self._recycle(self._pending.popleft())

    def _resolve(self, wait: bool) -> None:
        while self._pending:
            step = self._pending[0]
            if wait:
                self.clock.wait(step.end)
            elif not self.clock.reached(step.end):
                return
            self._pending.popleft()
            timeline = self._read(step)
            self._recycle(step)
            self._steps.append(timeline)
            if self.listener is not None:
                self.listener.step_resolved(timeline)

    def _read(self, step: _StepRecord) -> StepTimeline:
        """The step's spans, each marker read once. All were reached once the end was: a call's copy ended before the
        compute stream passed its wait."""
        at = self.clock.since(step.start)
        spans = []
        unpacked_bytes, unpacked_ms = 0, 0.0
        for call in step.calls:
            arrive, end, copy = at(call.arrive), at(call.end), call.copy
            if copy is None:
                spans.append(BlockSpan(call.block, arrive, end, 0.0))
                continue
            copy_start, copy_end = at(copy.start), at(copy.end)
            start = max(arrive, copy_end)
            spans.append(BlockSpan(call.block, start, end, start - arrive, copy_start, copy_end, copy.nbytes))
            if copy.unpacked:
                unpacked_bytes, unpacked_ms = unpacked_bytes + copy.nbytes, unpacked_ms + copy_end - copy_start
        reads = tuple(
            ReadSpan(block, (start - step.host_start) * 1e3, (end - step.host_start) * 1e3, nbytes)
            for block, start, end, nbytes in step.reads
        )
        return StepTimeline(step.index, at(step.end), tuple(spans), step.peak, reads, unpacked_bytes, unpacked_ms)

    def _recycle(self, step: _StepRecord) -> None:
        for call in step.calls:
            if call.copy is not None:
                self._free_copies.append(call.copy)
            self._free_calls.append(call)
        step.calls.clear()
        step.reads = []
        self._free_steps.append(step)
