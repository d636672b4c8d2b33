"""Weights that stay in their checkpoint file: where their bytes are, and how to read them.

A host that maps a checkpoint (ComfyUI's Dynamic VRAM loader) holds each weight as a view of the file's
mapping, pages that the kernel can drop and read again, not memory of the process. The engine keeps
such weights where they are: a streamed block without a host buffer of its own is read from the file
every step (``offload/reader.py``), in its stored bytes, with a positional read of an open descriptor
(``os.preadv``: no shared file position, the GIL released, a short read seen as the file having
shrunk), split into chunks that several threads read at once (``SliceReader``). Where Python has no
positional read (Windows), the bytes are copied from the mapping itself.

The host says which bytes are in a file (``FileSlice``); the engine does not know how the host opened it.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

#: Python's positional read of a descriptor (absent on Windows, where the mapping is copied instead).
POSITIONAL_READ = getattr(os, "preadv", None)

#: A slice is read as chunks of at most READ_CHUNK bytes, READ_THREADS of them at once: several threads copy
#: from the page cache on several cores, and keep several requests in flight to a solid-state disk, where one
#: thread keeps one readahead window. ComfyUI's own Dynamic VRAM reader (comfy-aimdo) reads a checkpoint with 8
#: threads too. A disk that seeks reads one stream fastest: a file on a device the kernel calls rotational is read
#: by one thread (``read_threads``). ``python -m bench.file_reads`` times the engine's reader both ways.
READ_THREADS = 8
READ_CHUNK = 8 * 2**20
#: Where Linux describes each block device (``/sys/dev/block/MAJOR:MINOR``).
SYS_BLOCK_DEVICES = Path("/sys/dev/block")


class FileChangedError(RuntimeError):
    """A checkpoint file that weights are streamed from changed (truncated, rewritten) while in use."""


#: What to do about a changed file, said by every ``FileChangedError``.
RELOAD = (
    "The model's weights are read from this file at every step: load the model again (unload models and free "
    "the node cache, then queue), or restore the file."
)


def file_name(handle: int) -> str:
    """The path of an open descriptor, where the system tells it (Linux), for messages."""
    try:
        return os.readlink(f"/proc/self/fd/{handle}")
    except OSError:
        return f"file descriptor {handle}"


@dataclass(frozen=True, eq=False)
class FileSlice:
    """``nbytes`` bytes at ``offset`` of an open file, and the same bytes as a view of its mapping.

    ``handle`` is an OS file descriptor where the platform reads by position (POSIX), else unused.
    ``mapped`` is the tensor that views those bytes in the host's mapping of the file."""

    handle: int
    offset: int
    nbytes: int
    mapped: torch.Tensor


def _byte_view(tensor: torch.Tensor) -> memoryview:
    """A writable memoryview of a contiguous CPU tensor's bytes (a region of a staging buffer)."""
    return memoryview((ctypes.c_ubyte * tensor.numel()).from_address(tensor.data_ptr())).cast("B")


def read_slice(source: FileSlice, destination: torch.Tensor) -> int:
    """Reads ``source`` into ``destination`` (a uint8 CPU tensor of its size) on this thread; returns the bytes
    read."""
    if POSITIONAL_READ is None:
        destination.copy_(source.mapped.reshape(-1).view(torch.uint8))
        return source.nbytes
    _read_range(source, _byte_view(destination), 0, source.nbytes)
    return source.nbytes


def _read_range(source: FileSlice, view: memoryview, start: int, end: int) -> None:
    """Reads bytes ``start`` to ``end`` of ``source`` into the same bytes of ``view`` (the slice's destination)."""
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
    """How many threads read from the files open as ``handles``: one where any lies on a device that Linux says is
    rotational (a partition's disk, or a device-mapper or RAID volume, says it of itself) or where there is no
    positional read, READ_THREADS elsewhere, and where the system does not say (a virtual file system, macOS)."""
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
    """Reads file slices into host memory, each split into chunks of ``chunk`` bytes that a pool of ``threads``
    reads at once (one thread, or no positional read: each slice in one go, on the calling thread)."""

    def __init__(self, threads: int, chunk: int = READ_CHUNK) -> None:
        parallel = POSITIONAL_READ is not None and threads > 1
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="block-offload-read-chunk") if parallel else None
        self.chunk = chunk

    def read(self, reads: Iterable[tuple[FileSlice, torch.Tensor]]) -> int:
        """Reads each ``(source, destination)`` pair as ``read_slice`` does; returns the bytes read. Returns or
        raises (the first chunk's error, a ``FileChangedError`` for a short read) only once no chunk is being
        read any more, so the destinations may be reused or freed right after."""
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
        except BaseException:  # an interrupt on the calling thread: the chunks under way still write
            for chunk in chunks:
                chunk.cancel()
            wait(chunks)
            raise
        for chunk in chunks:
            chunk.result()
        return sum(source.nbytes for source, _ in reads)

    def close(self) -> None:
        """Stops the threads (after the chunks under way)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)


@dataclass(frozen=True)
class FileStamp:
    """What a file looked like when streaming from it began (its size and modification time)."""

    handle: int
    size: int
    modified_ns: int

    @classmethod
    def of(cls, handle: int) -> FileStamp:
        status = os.fstat(handle)
        return cls(handle, status.st_size, status.st_mtime_ns)

    def check(self) -> None:
        """Raises ``FileChangedError`` when the file is no longer as stamped: reading on would stream other
        weights (rewritten) or fault on pages that are gone (truncated)."""
        now = FileStamp.of(self.handle)
        if now != self:
            raise FileChangedError(
                f"{file_name(self.handle)} changed while its weights were streamed from it (size {self.size} -> "
                f"{now.size} bytes, modified {(now.modified_ns - self.modified_ns) / 1e9:+.1f} s). {RELOAD}"
            )


def stamps(slices: Iterable[FileSlice]) -> tuple[FileStamp, ...]:
    """One stamp per file the slices are in, where the platform has descriptors to stamp (POSIX)."""
    if POSITIONAL_READ is None:
        return ()
    return tuple(FileStamp.of(handle) for handle in sorted({source.handle for source in slices}))


def read_bandwidth(slices: Iterable[FileSlice], limit: int = 256 * 2**20, threads: int | None = None) -> float | None:
    """Bytes per second reading ``slices`` (up to ``limit`` bytes of them) as the file tier reads them
    (``SliceReader`` with ``threads``, by default as many as ``read_threads`` gives their files), as the page cache
    holds them now: a file just loaded is mostly cached (warm), one mapped and never read is read from the disk
    (cold). None when there is nothing to read."""
    chosen, total = [], 0
    for source in slices:
        if total >= limit:
            break
        chosen.append(source)
        total += source.nbytes
    if not total:
        return None
    # Consecutive slices read at once as long as they fit the largest one's bytes: no more memory than that,
    # faulted in before the clock starts, as the staging slots are before their first read.
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
