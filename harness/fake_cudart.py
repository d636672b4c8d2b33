"""CUDA's runtime for a machine without CUDA (``torch.cuda.cudart()`` replaced by ``FakeCudart``): page-locking
succeeds or fails as a test says, behind the engine's real registrar, and each registration notes how much of the
memory was already faulted in (``resident_share``)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from block_offload.offload import CudaHostRegistrar, use_host_registrar

PAGE = mmap.PAGESIZE
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_share(pointer: int, nbytes: int) -> float:
    """The share of the pages under ``[pointer, pointer + nbytes)`` that are in memory now (Linux ``mincore``):
    0 for fresh anonymous memory nothing has touched yet. Reading a page maps it too: ask before reading."""
    start = pointer - pointer % PAGE
    length = pointer + nbytes - start
    pages = -(-length // PAGE)
    vector = (ctypes.c_ubyte * pages)()
    if _LIBC.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) != 0:
        raise OSError(ctypes.get_errno(), "mincore failed")
    return sum(byte & 1 for byte in vector) / pages


class FakeCudart:
    """``torch.cuda.cudart()`` for a machine without CUDA: registrations succeed until ``fail`` is set."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.flags: set[int] = set()
        self.fail = False
        self.failures = 0
        self.calls = 0  # cudaHostRegister calls, refused ones included
        # By pointer, at each registration: the share of its pages already faulted in. Nothing of the memory is
        # copied: the peak-memory tests sample the process while the fake registers.
        self.resident_at_registration: dict[int, float] = {}

    def cudaHostRegister(self, pointer: int, nbytes: int, flags: int) -> int:  # noqa: N802 (CUDA's name)
        self.calls += 1
        self.flags.add(flags)
        self.resident_at_registration[pointer] = resident_share(pointer, nbytes)
        if self.fail:
            self.failures += 1
            return 2  # cudaErrorMemoryAllocation
        if any(pointer < start + size and start < pointer + nbytes for start, size in self.registered.items()):
            self.failures += 1
            return 712  # cudaErrorHostMemoryAlreadyRegistered: the driver refuses a range registered already
        self.registered[pointer] = nbytes
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:  # noqa: N802
        return 0 if self.registered.pop(pointer, None) is not None else 1

    @property
    def pinned(self) -> int:
        return sum(self.registered.values())


@pytest.fixture(name="cudart")
def cudart_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    """CUDA's runtime faked behind the engine's own registrar; a module testing the nodes overrides it with
    ComfyUI's registrar and books (``tests/test_pinned_memory.py``)."""
    with engine_on_fake_cudart(monkeypatch) as fake:
        yield fake


@contextmanager
def engine_on_fake_cudart(monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    """The engine's own registrar (CUDA's, its errors' clearing left out) over a ``FakeCudart``, while it lasts."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    use_host_registrar(CudaHostRegistrar(discard_error=lambda: None))
    try:
        yield fake
    finally:
        use_host_registrar(None)
