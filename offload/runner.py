"""What a host uses of a streaming engine, ``BlockStreamer`` or ``SequentialOffloader``. Units are blocks or modules,
numbered as the engine lists them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

import torch

from .file_source import FileSlice


class Runner(Protocol):
    @property
    def enabled(self) -> bool: ...

    @property
    def unit(self) -> str:
        """What one unit is: "block" or "module"."""
        ...

    @property
    def units(self) -> int: ...

    @property
    def streamed(self) -> frozenset[int]: ...

    @property
    def refused_pinning(self) -> dict[int, int]:
        """Streamed units (index: host bytes) left pageable because the pin budget was spent."""
        ...

    @property
    def failed_pinning(self) -> dict[int, int]:
        """Streamed units (index: host bytes) left pageable because the driver refused."""
        ...

    @property
    def device_buffer_bytes(self) -> int: ...

    @property
    def companion_bytes(self) -> int: ...

    @property
    def staging_bytes(self) -> int: ...

    @property
    def read_each_step(self) -> frozenset[int]:
        """Units read from their file at each step (no host buffer)."""
        ...

    @property
    def file_tier_bytes(self) -> int: ...

    @property
    def bytes_read(self) -> int: ...

    def file_slices(self) -> tuple[FileSlice, ...]: ...

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        """Unit ``index``'s companions as device views while it is in the ring, else None."""
        ...

    @property
    def scratch(self) -> torch.Tensor | None:
        """The transforms' device scratch; None when none was asked, before the first call and after a release."""
        ...

    @property
    def last_order(self) -> tuple[int, ...]:
        """The units' calls in the last finished step (list order before the first)."""
        ...

    @property
    def host_bytes(self) -> int: ...

    @property
    def packed_bytes(self) -> int:
        """Bytes ``enable`` itself copied into host buffers."""
        ...

    @property
    def waiting_bytes(self) -> int:
        """Host bytes of units still waiting for background packing."""
        ...

    @property
    def background_packing(self) -> tuple[int, int]:
        """Bytes packed in the background so far, and all left to it at start."""
        ...

    @property
    def pinning_progress(self) -> tuple[int, int]:
        """Bytes pinned so far, and pinned once background packing is done."""
        ...

    def enable(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Starts streaming; ``progress(done, total)`` hears each unit packed before it returns."""
        ...

    def finish_packing(self) -> None: ...

    def disable(self, park: bool = False) -> None: ...

    def allocate_device_buffers(self) -> None: ...

    def close_open_step(self) -> None: ...

    @property
    def needs_content(self) -> frozenset[int]:
        """Units whose host buffers lack their named ``contents``: write them after ``enable`` and before the first
        step, then call ``wrote_content``."""
        ...

    def wrote_content(self, indices: Iterable[int]) -> None: ...
