"""Reads file-tier blocks (streamed blocks with no host buffer) into a few host staging slots, on a thread
of its own, ahead of the copy stream: file -> staging slot (pinned where the device pins) -> device ring.

The streamer decides everything that touches a stream: it schedules the next file-tier blocks while slots
are free, and copies a block out of its slot only once its read is done (``is_read``), so the thread that
launches the model's kernels waits for a read only when the block is needed now (``take``). A slot is
given back (``release``) as soon as the copy out of it is issued; the reader waits for that copy's event
before it reads another block into the slot. A block's file slices are read in chunks by several threads at
once, unless the disk seeks (``SliceReader``, ``read_threads``); file reads release the GIL, so the sampling
thread runs on.

A block needed before it was scheduled (the first step, before the call order is known, or a model that
changes it) is read at once on the calling thread, into a spare pageable buffer: the reads under way for
later blocks are kept, so no byte is read twice for it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch

from .file_source import FileSlice, SliceReader
from .layout import Part

#: How a read is reported, from the reader's thread: block, start and end (``time.perf_counter``), bytes
#: read from the file.
ReadListener = Callable[[int, float, float, int], None]


@dataclass(frozen=True, eq=False)
class BlockRead:
    """How one block's stored bytes are put together in a staging slot: each part of its stored layout,
    with the file slice it is read from, or the tensor (kept in memory by the host) it is copied from."""

    parts: tuple[tuple[Part, FileSlice | torch.Tensor], ...]
    nbytes: int  # the slot bytes the block takes

    @property
    def file_bytes(self) -> int:
        return sum(source.nbytes for _, source in self.parts if isinstance(source, FileSlice))

    def slices(self) -> tuple[FileSlice, ...]:
        return tuple(source for _, source in self.parts if isinstance(source, FileSlice))


@dataclass(eq=False)
class _Slot:
    buffer: torch.Tensor
    block: int | None = None
    read: Future[None] | None = None
    freed: torch.Event | None = None  # the copy out of it, which the next read into it waits for


class FileReader:
    """Reads blocks into ``buffers`` (the staging slots, each as large as the largest file-tier block), each block's
    file slices with ``threads`` at once."""

    def __init__(self, buffers: list[torch.Tensor], on_read: ReadListener | None, threads: int) -> None:
        self._slots = [_Slot(buffer) for buffer in buffers]
        self._on_read = on_read
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="block-offload-read")
        self._slices = SliceReader(threads)
        # Pageable, so a copy out of it has read it by the time the copy call returns: reusable at once.
        self._spare: torch.Tensor | None = None
        self.file_bytes = 0  # bytes read from files so far

    @property
    def pinned(self) -> bool:
        return bool(self._slots) and all(slot.buffer.is_pinned() for slot in self._slots)

    @property
    def slot_bytes(self) -> int:
        return sum(slot.buffer.numel() for slot in self._slots)

    def holds(self, block: int) -> bool:
        return self._holding(block) is not None

    def schedule(self, block: int, read: BlockRead) -> bool:
        """Starts reading ``block`` into a free slot; False when every slot is taken."""
        if self._holding(block) is not None:
            return True
        slot = next((slot for slot in self._slots if slot.block is None), None)
        if slot is None:
            return False
        self._start(slot, block, read)
        return True

    def is_read(self, block: int) -> bool:
        slot = self._holding(block)
        return slot is not None and slot.read is not None and slot.read.done()

    def take(self, block: int, read: BlockRead) -> torch.Tensor:
        """``block``'s bytes: its slot once its read is done, or, when it was not scheduled, the spare buffer
        it is read into now; raises what its read raised."""
        slot = self._holding(block)
        if slot is not None and slot.read is not None:
            slot.read.result()
            return slot.buffer
        if self._spare is None or self._spare.numel() < read.nbytes:
            self._spare = torch.empty(read.nbytes, dtype=torch.uint8)
        self._read(self._spare, None, block, read)
        return self._spare

    def release(self, block: int, stream: torch.Stream | None) -> None:
        """The copy out of ``block``'s slot is issued (on ``stream``): the slot may take the next read."""
        slot = self._holding(block)
        if slot is None:
            return
        slot.block, slot.read = None, None
        slot.freed = None
        if stream is not None:
            slot.freed = torch.Event(device=stream.device)
            slot.freed.record(stream)

    def close(self) -> None:
        """Waits for the reads under way (their slots are about to be freed) and stops the thread."""
        self._pool.shutdown(wait=True)
        self._slices.close()
        for slot in self._slots:
            slot.block, slot.read = None, None
        self._spare = None

    def _holding(self, block: int) -> _Slot | None:
        return next((slot for slot in self._slots if slot.block == block), None)

    def _start(self, slot: _Slot, block: int, read: BlockRead) -> None:
        slot.block = block
        slot.read = self._pool.submit(self._read, slot.buffer, slot.freed, block, read)

    def _read(self, buffer: torch.Tensor, freed: torch.Event | None, block: int, read: BlockRead) -> None:
        if freed is not None:
            freed.synchronize()  # the copy out of the slot's last block has read it
        start = time.perf_counter()
        in_file = []
        for part, source in read.parts:
            if isinstance(source, FileSlice):
                in_file.append((source, buffer[part.offset : part.offset + part.nbytes]))
            else:
                part.view(buffer).copy_(source)
        from_file = self._slices.read(in_file)
        self.file_bytes += from_file
        if self._on_read is not None:
            self._on_read(block, start, time.perf_counter(), from_file)
