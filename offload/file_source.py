"""Reading weights that stay in their checkpoint file (``FileSlice``), and the reader that fills host staging slots
ahead of the copy stream (``FileReader``).

Such weights are views of the file's mapping, not process memory. Their bytes are read with ``os.preadv`` (no shared
position, GIL released), in chunks several threads read at once unless the disk seeks; Windows copies from the mapping.

Stream rules: the reader thread only reads. The streamer copies out of a slot only once its read is done, waits for a
read only when the block is needed now (``take``), and calls ``release`` once the copy out is issued; the reader waits
for that copy's event before reusing the slot. An unscheduled block is read at once on the calling thread into a spare
pageable buffer."""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from .layout import Part

#: Absent on Windows, where the mapping is copied instead.
POSITIONAL_READ = getattr(os, "preadv", None)

#: Several threads copy from the page cache on several cores and keep several requests in flight to an SSD, where
#: one thread keeps one readahead window; comfy-aimdo uses 8 too. A seeking disk reads one stream fastest.
READ_THREADS = 8
READ_CHUNK = 8 * 2**20
SYS_BLOCK_DEVICES = Path("/sys/dev/block")


class FileChangedError(RuntimeError):
    """A checkpoint file being streamed from changed (truncated, rewritten) while in use."""


RELOAD = (
    "The model's weights are read from this file at every step: load the model again (unload models and free "
    "the node cache, then queue), or restore the file."
)


def file_name(handle: int) -> str:
    """The path of an open descriptor where the system tells it (Linux), for messages."""
    try:
        return os.readlink(f"/proc/self/fd/{handle}")
    except OSError:
        return f"file descriptor {handle}"


@dataclass(frozen=True, eq=False)
class FileSlice:
    """``nbytes`` at ``offset`` of an open file, and the same bytes as a view of its mapping. ``handle`` is a
    descriptor where the platform reads by position (POSIX), else unused."""

    handle: int
    offset: int
    nbytes: int
    mapped: torch.Tensor


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return memoryview((ctypes.c_ubyte * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


def read_slice(source: FileSlice, destination: torch.Tensor) -> int:
    if POSITIONAL_READ is None:
        destination.copy_(source.mapped.reshape(-1).view(torch.uint8))
        return source.nbytes
    _read_range(source, _byte_view(destination), 0, source.nbytes)
    return source.nbytes


def _read_range(source: FileSlice, view: memoryview, start: int, end: int) -> None:
    """Reads bytes ``start`` to ``end`` of ``source`` into ``view``. A short read means the file shrank:
    ``FileChangedError``."""
    assert POSITIONAL_READ is not None
    done = start
    while done < end:
        count = POSITIONAL_READ(source.handle, [view[done:end]], source.offset + done)
        if count <= 0:
            raise FileChangedError(
                f"{file_name(source.handle)} ended {source.nbytes - done} bytes early at offset "
                f"{source.offset + done}: the checkpoint was truncated or replaced while its weights were streamed "
                f"from it. {RELOAD}"
            )
        done += count


def read_threads(handles: Iterable[int]) -> int:
    """Threads to read these files with: one where any lies on a device Linux calls rotational, or without a
    positional read; ``READ_THREADS`` elsewhere, including where the system does not say."""
    if POSITIONAL_READ is None:
        return 1
    for handle in handles:
        number = os.fstat(handle).st_dev
        device = SYS_BLOCK_DEVICES / f"{os.major(number)}:{os.minor(number)}"
        for queue in (device / "queue", device / ".." / "queue"):
            try:
                rotational = (queue / "rotational").read_text().strip()
            except OSError:
                continue
            if rotational == "1":
                return 1
            break
    return READ_THREADS


class SliceReader:
    """Reads file slices in ``chunk``-byte pieces, ``threads`` at once (one thread: whole slices on the calling
    thread)."""

    def __init__(self, threads: int, chunk: int = READ_CHUNK) -> None:
        parallel = POSITIONAL_READ is not None and threads > 1
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="block-offload-read-chunk") if parallel else None
        self.chunk = chunk

    def read(self, reads: Iterable[tuple[FileSlice, torch.Tensor]]) -> int:
        """Reads each ``(source, destination)``; returns the bytes read. Returns or raises only once no chunk is
        still being read, so the destinations may be reused or freed right after."""
        reads = list(reads)
        if self._pool is None:
            return sum(read_slice(source, destination) for source, destination in reads)
        chunks = []
        for source, destination in reads:
            view = _byte_view(destination)
            for start in range(0, source.nbytes, self.chunk):
                end = min(start + self.chunk, source.nbytes)
                chunks.append(self._pool.submit(_read_range, source, view, start, end))
        try:
            wait(chunks)
        except BaseException:  # an interrupt: the chunks under way still write the destinations
            for chunk in chunks:
                chunk.cancel()
            wait(chunks)
            raise
        for chunk in chunks:
            chunk.result()
        return sum(source.nbytes for source, _ in reads)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class FileStamp:
    """A file's size and modification time when streaming from it began."""

    handle: int
    size: int
    modified_ns: int

    @classmethod
    def of(cls, handle: int) -> FileStamp:
        status = os.fstat(handle)
        return cls(handle, status.st_size, status.st_mtime_ns)

    def check(self) -> None:
        """Raises ``FileChangedError`` when the file changed: reading on would stream other weights or fault on pages
        that are gone."""
        now = FileStamp.of(self.handle)
        if now != self:
            raise FileChangedError(
                f"{file_name(self.handle)} changed while its weights were streamed from it (size {self.size} -> "
                f"{now.size} bytes, modified {(now.modified_ns - self.modified_ns) / 1e9:+.1f} s). {RELOAD}"
            )


def stamps(slices: Iterable[FileSlice]) -> tuple[FileStamp, ...]:
    if POSITIONAL_READ is None:
        return ()
    return tuple(FileStamp.of(handle) for handle in sorted({source.handle for source in slices}))


def read_bandwidth(slices: Iterable[FileSlice], limit: int = 256 * 2**20, threads: int | None = None) -> float | None:
    """Bytes per second reading ``slices`` (up to ``limit`` bytes) as the file tier would, from the page cache as it
    is now, warm or cold. None when there is nothing to read."""
    chosen, total = [], 0
    for source in slices:
        if total >= limit:
            break
        chosen.append(source)
        total += source.nbytes
    if not total:
        return None
    # No more memory than the largest slice, faulted in before timing, as staging slots are.
    scratch = torch.zeros(max(source.nbytes for source in chosen), dtype=torch.uint8)
    reader = SliceReader(read_threads(source.handle for source in chosen) if threads is None else threads)
    try:
        start = time.perf_counter()
        batch: list[tuple[FileSlice, torch.Tensor]] = []
        at = 0
        for source in chosen:
            if at + source.nbytes > scratch.numel():
                reader.read(batch)
                batch, at = [], 0
            batch.append((source, scratch[at : at + source.nbytes]))
            at += source.nbytes
        reader.read(batch)
        return total / max(time.perf_counter() - start, 1e-9)
    finally:
        reader.close()


#: Called on the reader's thread: block, start and end (``time.perf_counter``), bytes read from the file.
ReadListener = Callable[[int, float, float, int], None]


@dataclass(frozen=True, eq=False)
class BlockRead:
    """How one block's stored bytes are put together in a staging slot: each part with the file slice or host tensor
    it comes from."""

    parts: tuple[tuple[Part, FileSlice | torch.Tensor], ...]
    nbytes: int

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
    freed: torch.Event | None = None  # the copy out of it, which the next read waits for


class FileReader:
    """Reads blocks into the staging slots ``buffers`` on its own thread, each block's slices with ``threads`` at
    once."""

    def __init__(self, buffers: list[torch.Tensor], on_read: ReadListener | None, threads: int) -> None:
        self._slots = [_Slot(buffer) for buffer in buffers]
        self._on_read = on_read
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="block-offload-read")
        self._slices = SliceReader(threads)
        # Pageable, so a copy out of it is done when the call returns, and it is reusable at once.
        self._spare: torch.Tensor | None = None
        self.file_bytes = 0

    @property
    def pinned(self) -> bool:
        return bool(self._slots) and all(slot.buffer.is_pinned() for slot in self._slots)

    @property
    def slot_bytes(self) -> int:
        return sum(slot.buffer.numel() for slot in self._slots)

    def holds(self, block: int) -> bool:
        return self._holding(block) is not None

    def schedule(self, block: int, read: BlockRead) -> bool:
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
        """``block``'s bytes: its slot once read, or the spare buffer it is read into now when it was not scheduled;
        raises what its read raised."""
        slot = self._holding(block)
        if slot is not None and slot.read is not None:
            slot.read.result()
            return slot.buffer
        if self._spare is None or self._spare.numel() < read.nbytes:
            self._spare = torch.empty(read.nbytes, dtype=torch.uint8)
        self._read(self._spare, None, block, read)
        return self._spare

    def release(self, block: int, stream: torch.Stream | None) -> None:
        """The copy out of ``block``'s slot is issued on ``stream``; the slot may take the next read once that copy
        is done."""
        slot = self._holding(block)
        if slot is None:
            return
        slot.block, slot.read = None, None
        slot.freed = None
        if stream is not None:
            slot.freed = torch.Event(device=stream.device)
            slot.freed.record(stream)

    def close(self) -> None:
        """Waits for the reads under way, since their slots are about to be freed, and stops the thread."""
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
            freed.synchronize()
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
