"""What a host uses of a streaming engine, ``BlockStreamer`` or ``SequentialOffloader``: the verbs and live reads of
``Runner``, and its numbers as one ``StreamReport``. Units are blocks or modules, numbered as the engine lists them."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from .file_source import FileSlice

#: ``progress(done, total, packed_bytes)``: units gone through, units to go through, and bytes copied into host
#: buffers so far (0 while every unit was taken over or left in its file).
PackProgress = Callable[[int, int, int], None]


@dataclass(frozen=True)
class StreamReport:
    """An engine's numbers at one moment, for a host to log and show.

    ``unit``: what one unit is, "block" or "module". ``read_each_step``: units read from their file at each step (no
    host buffer). ``needs_content``: units whose host buffers lack their named ``contents``: write them after
    ``enable`` and before the first step, then call ``wrote_content``. ``last_order``: the units' calls in the last
    finished step (list order before the first). ``packed_bytes``: bytes ``enable`` itself copied into host buffers.
    ``waiting_bytes``: host bytes of units still waiting for background packing. ``background_packing``: bytes packed
    in the background so far, and all left to it at start. ``pinning_progress``: bytes pinned so far, and pinned once
    background packing is done. ``refused_pinning`` and ``failed_pinning``: streamed units (index: host bytes) left
    pageable because the pin budget was spent, or because the driver refused."""

    unit: str
    units: int
    streamed: frozenset[int]
    read_each_step: frozenset[int]
    needs_content: frozenset[int]
    last_order: tuple[int, ...]
    host_bytes: int
    companion_bytes: int
    staging_bytes: int
    device_buffer_bytes: int
    packed_bytes: int
    background_packing: tuple[int, int]
    waiting_bytes: int
    pinning_progress: tuple[int, int]
    refused_pinning: dict[int, int]
    failed_pinning: dict[int, int]
    file_tier_bytes: int
    bytes_read: int
    file_slices: tuple[FileSlice, ...]


class Runner(Protocol):
    @property
    def enabled(self) -> bool: ...

    def report(self) -> StreamReport: ...

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        """Unit ``index``'s companions as device views while it is in the ring, else None."""
        ...

    @property
    def scratch(self) -> torch.Tensor | None:
        """The transforms' device scratch; None when none was asked, before the first call and after a release."""
        ...

    def enable(self, progress: PackProgress | None = None) -> None:
        """Starts streaming; ``progress`` hears each unit before it returns."""
        ...

    def finish_packing(self) -> None: ...

    def disable(self, park: bool = False) -> None: ...

    def allocate_device_buffers(self) -> None: ...

    def close_open_step(self) -> None: ...

    def wrote_content(self, indices: Iterable[int]) -> None: ...
