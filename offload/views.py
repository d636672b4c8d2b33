"""What a host, the panel and tests see of a ``BlockStreamer``: read-only views over its parts, the members
``offload.runner.Runner`` declares (and documents) among them. Nothing here changes any state."""

from __future__ import annotations

import torch
from torch import nn

from .calls import StepCalls
from .file_source import FileSlice
from .file_tier import FileTier
from .host_blocks import HostBlocks
from .ring import DeviceRing


class StreamerViews:
    """The views, over the parts a streamer wires (``offload/streamer.py``)."""

    blocks: list[nn.Module]
    host: HostBlocks
    ring: DeviceRing
    files: FileTier
    calls: StepCalls

    @property
    def last_order(self) -> tuple[int, ...]:
        return tuple(self.calls.expected)

    def holds(self, tensor: torch.Tensor) -> bool:
        return self.ring.holds(tensor)

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        return self.ring.companions(index)

    @property
    def scratch(self) -> torch.Tensor | None:
        return self.ring.scratch

    @property
    def ring_memory(self) -> torch.Tensor | None:
        """The ring's device memory (None before the first call and after a release): what the streamed
        blocks' weights are views of while they run."""
        return self.ring.memory

    @property
    def running(self) -> tuple[int, ...]:
        """The blocks whose calls are open, outermost first (empty between calls)."""
        return tuple(call.block for call in self.calls.open)

    def region_of(self, index: int) -> tuple[int, int] | None:
        """The bytes of the ring (start, end) holding streamed block ``index``, or None while it is only on
        the host."""
        return self.ring.region_of(index)

    @property
    def capacity(self) -> int:
        """The ring's bytes: as asked, and never less than the blocks running inside each other need."""
        return self.ring.capacity

    @property
    def unit(self) -> str:
        return self.host.unit

    @property
    def units(self) -> int:
        return len(self.blocks)

    @property
    def packed_bytes(self) -> int:
        return self.host.packed_bytes

    @property
    def waiting_bytes(self) -> int:
        return self.host.background.waiting_bytes

    @property
    def background_packing(self) -> tuple[int, int]:
        return self.host.background.progress

    @property
    def pinning_progress(self) -> tuple[int, int]:
        return self.host.background.pinning_progress

    @property
    def host_bytes(self) -> int:
        """Host memory the streamer holds: its blocks' host buffers, their companions, the staging slots."""
        return self.host.buffer_bytes + self.companion_bytes + self.staging_bytes

    @property
    def companion_bytes(self) -> int:
        return self.host.companion_bytes

    @property
    def staging_bytes(self) -> int:
        return self.files.staging_bytes

    @property
    def staging_pinned(self) -> bool:
        return self.files.pinned

    @property
    def device_buffer_bytes(self) -> int:
        return self.ring.device_buffer_bytes

    @property
    def refused_pinning(self) -> dict[int, int]:
        return self.host.pageable_because("cap")

    @property
    def failed_pinning(self) -> dict[int, int]:
        return self.host.pageable_because("driver")

    @property
    def file_tier_bytes(self) -> int:
        return self.files.file_bytes

    def file_slices(self) -> tuple[FileSlice, ...]:
        return self.files.file_slices()

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    @property
    def read_each_step(self) -> frozenset[int]:
        return self.host.read_each_step

    @property
    def needs_content(self) -> frozenset[int]:
        return self.host.needs_content
