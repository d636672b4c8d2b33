"""What a recorded step is: each block call's copy and compute span and each file read, in milliseconds from the
step's start, with the step's totals (stall, overlap, bandwidths). ``TimelineRecorder`` (``offload/timeline.py``)
makes them; the planner's measured costs, the report and the panel read them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


# Not frozen, though nothing changes a span once it is read: a frozen dataclass sets each field through
# object.__setattr__, which made a span five times as slow to build (2.5 against 0.5 us on the 2-core
# machine), and the panel has every step's spans built on the sampling thread.
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
    """One forward pass of the model through its blocks."""

    step: int
    duration_ms: float
    spans: tuple[BlockSpan, ...]
    peak_allocated: int | None = None
    reads: tuple[ReadSpan, ...] = ()
    # Of its copies, those from blocks still waiting to be packed: bytes and milliseconds. They do not show the
    # bandwidth of the later steps (pageable memory, part by part).
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
        """The host-to-device bandwidth of this step's copies from packed blocks, in GB/s: what the steps copy at
        once packing is done (None when it copied none)."""
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
