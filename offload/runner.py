"""What a host uses of a streaming engine, whichever it is: ``BlockStreamer`` (blocks of a list) or
``SequentialOffloader`` (every module). Units are blocks or modules, numbered as the engine lists them. Only
what a host reads or calls is declared here; tests reach the parts themselves (``ring``, ``host``, ``files``)."""

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
    def units(self) -> int:
        """How many units the engine knows, streamed or not."""
        ...

    @property
    def streamed(self) -> frozenset[int]:
        """The units streamed now (the others stay on the device)."""
        ...

    @property
    def refused_pinning(self) -> dict[int, int]:
        """Streamed units (index: host bytes) that wanted pinned memory and got pageable memory: the pin
        budget was spent."""
        ...

    @property
    def failed_pinning(self) -> dict[int, int]:
        """Streamed units (index: host bytes) that got pageable memory because the driver refused to pin."""
        ...

    @property
    def device_buffer_bytes(self) -> int: ...

    @property
    def companion_bytes(self) -> int:
        """Of ``host_bytes``, the units' companions (a host's per-unit extras, copied with them)."""
        ...

    @property
    def staging_bytes(self) -> int:
        """Of ``host_bytes``, the staging slots file-tier units are read into."""
        ...

    @property
    def read_each_step(self) -> frozenset[int]:
        """The streamed units read from their file at each step (the file tier: no host buffer)."""
        ...

    @property
    def file_tier_bytes(self) -> int:
        """The bytes one pass through the file tier reads."""
        ...

    @property
    def bytes_read(self) -> int:
        """The bytes read from files since the engine was enabled."""
        ...

    def file_slices(self) -> tuple[FileSlice, ...]: ...

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        """Unit ``index``'s companion tensors as device views while it runs (None: none, or not in the ring)."""
        ...

    @property
    def scratch(self) -> torch.Tensor | None:
        """The device bytes a host's transforms work in (``scratch_bytes``), allocated with the ring; None when
        none were asked for, before the first call and after a release."""
        ...

    @property
    def last_order(self) -> tuple[int, ...]:
        """The units' calls in the last finished step (list order before the first)."""
        ...

    @property
    def host_bytes(self) -> int: ...

    @property
    def packed_bytes(self) -> int:
        """The bytes ``enable`` copied into host buffers before it returned (none for units taken over as parked,
        left in a file, or left to be packed in the background)."""
        ...

    @property
    def waiting_bytes(self) -> int:
        """Host bytes of the units still waiting to be packed in the background (they stream from their sources)."""
        ...

    @property
    def background_packing(self) -> tuple[int, int]:
        """Host bytes packed in the background so far, and all those left to it as the engine started."""
        ...

    @property
    def pinning_progress(self) -> tuple[int, int]:
        """Host bytes of the units page-locked so far, and of those that will be once the units waiting to be
        packed in the background are (equal when packing is done, or nothing is pinned)."""
        ...

    def enable(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Starts streaming; ``progress(done, total)`` hears each unit packed (packed before it returns: with
        packing in the background, those that cannot wait)."""
        ...

    def finish_packing(self) -> None:
        """Waits until the units packed in the background are."""
        ...

    def disable(self, park: bool = False) -> None: ...

    def allocate_device_buffers(self) -> None: ...

    def close_open_step(self) -> None: ...

    @property
    def needs_content(self) -> frozenset[int]:
        """The units whose host buffers do not hold the content their host named yet (``HostOptions``'s
        ``contents``): to write after ``enable``, before the first step, then to declare with ``wrote_content``."""
        ...

    def wrote_content(self, indices: Iterable[int]) -> None:
        """The host has written the named content into these units' host buffers."""
        ...
