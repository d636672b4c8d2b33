"""Host memory the allocator holds on to after a large free.

glibc keeps freed heap memory in its arenas instead of returning it to the system: after the first large
free it raises its mmap threshold (up to 32 MiB), so weights smaller than that (most of a DiT's linear
layers) come from the heap, and freeing a whole model's worth of them (a stored-dtype copy after a cast,
a block's original weights once packed into a host buffer) leaves the process's RSS as high as before.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    trim: Callable[[int], int] | None = getattr(library, "malloc_trim", None)  # glibc only
    return trim


def release_freed_host_memory() -> None:
    """Returns the heap memory freed so far to the system (glibc's ``malloc_trim``; a no-op elsewhere).
    Costs a walk over the allocator's free lists: call it after freeing many weights, not per step."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
