"""Weights that stay in their checkpoint file: where their bytes are, and how to read them.

A host that maps a checkpoint (ComfyUI's Dynamic VRAM loader) holds each weight as a view of the file's
mapping, pages that the kernel can drop and read again, not memory of the process. The engine keeps
such weights where they are: a streamed block without a host buffer of its own is read from the file
every step (``offload/reader.py``), in its stored bytes, with a positional read of an open descriptor
(``os.preadv``: no shared file position, the GIL released, a short read seen as the file having
shrunk). Where Python has no positional read (Windows), the bytes are copied from the mapping itself.

The host says which bytes are in a file (``FileSlice``); the engine does not know how the host opened it.
"""

from __future__ import annotations

import ctypes
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

#: Python's positional read of a descriptor (absent on Windows, where the mapping is copied instead).
POSITIONAL_READ = getattr(os, "preadv", None)


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
    """Reads ``source`` into ``destination`` (a uint8 CPU tensor of its size); returns the bytes read."""
    if POSITIONAL_READ is None:
        destination.copy_(source.mapped.reshape(-1).view(torch.uint8))
        return source.nbytes
    view = _byte_view(destination)
    done = 0
    while done < source.nbytes:
        count = POSITIONAL_READ(source.handle, [view[done:]], source.offset + done)
        if count <= 0:
            raise FileChangedError(
                f"{file_name(source.handle)} ended {source.nbytes - done} bytes early at offset "
                f"{source.offset + done}: the checkpoint was truncated or replaced while its weights were streamed "
                f"from it. {RELOAD}"
            )
        done += count
    return done


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


def read_bandwidth(slices: Iterable[FileSlice], limit: int = 256 * 2**20) -> float | None:
    """Bytes per second reading ``slices`` (up to ``limit`` bytes of them) as the page cache holds them now:
    a file just loaded is mostly cached (warm), one mapped and never read is read from the disk (cold).
    None when there is nothing to read."""
    chosen, total = [], 0
    for source in slices:
        if total >= limit:
            break
        chosen.append(source)
        total += source.nbytes
    if not total:
        return None
    scratch = torch.empty(max(source.nbytes for source in chosen), dtype=torch.uint8)
    start = time.perf_counter()
    for source in chosen:
        read_slice(source, scratch[: source.nbytes])
    return total / max(time.perf_counter() - start, 1e-9)
