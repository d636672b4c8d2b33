"""Timing helpers the benchmarks share: milliseconds per call, each call's milliseconds, pinned
host-to-device bandwidth, and a checkpoint file's read bandwidth.

Times come from the engine's ``Clock``: device events on an accelerator, the host clock on the CPU
(smoke runs only: the figures mean nothing there).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import torch

import harness  # noqa: F401 - makes the pack importable as block_offload

from block_offload.offload.device import Clock, synchronize
from block_offload.offload.file_source import FileSlice, read_bandwidth
from block_offload.offload.pinning import pinned_host_buffer


def ms_per_call(fn: Callable[[], object], device: torch.device, steps: int, warmup: int) -> float:
    """Milliseconds per call of ``fn``, averaged over ``steps`` calls after ``warmup`` untimed ones."""
    clock = Clock(device)
    for _ in range(warmup):
        fn()
    start, end = clock.new_marker(), clock.new_marker()
    synchronize(device)
    clock.mark(start, None)
    for _ in range(steps):
        fn()
    synchronize(device)
    clock.mark(end, None)
    return clock.elapsed_ms(start, end) / steps


def ms_of_each_call(fn: Callable[[], object], device: torch.device, calls: int) -> list[float]:
    """Milliseconds of each of ``calls`` back-to-back calls of ``fn``: a marker between calls and one
    synchronisation at the end, so the calls queue as a sampler's steps do and each still has its own time
    (a median and a spread need them one by one)."""
    clock = Clock(device)
    markers = [clock.new_marker() for _ in range(calls + 1)]
    clock.mark(markers[0], None)
    for marker in markers[1:]:
        fn()
        clock.mark(marker, None)
    synchronize(device)
    return [clock.elapsed_ms(start, end) for start, end in zip(markers, markers[1:], strict=False)]


def h2d_bandwidth_gbps(device: torch.device, nbytes: int = 1 << 30) -> float:
    """Host-to-device copy bandwidth from page-locked memory pinned as the engine pins it (plain RAM on
    the CPU), in GB/s."""
    host = pinned_host_buffer(nbytes) if torch.accelerator.is_available() else None
    pinned = host is not None
    host = host if pinned else torch.empty(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    ms = ms_per_call(lambda: target.copy_(host, non_blocking=pinned), device, steps=3, warmup=1)
    return nbytes / (ms / 1000.0) / 1e9


def file_read_gbps(path: Path, nbytes: int = 1 << 30, chunk: int = 64 << 20) -> float | None:
    """Reading up to ``nbytes`` of ``path`` as the pack's file tier reads a checkpoint (``read_bandwidth``:
    positional reads of its slices), as the page cache holds the file now, in GB/s; None for an empty file."""
    size = min(nbytes, path.stat().st_size)
    handle = os.open(path, os.O_RDONLY)
    try:
        unused = torch.empty(0, dtype=torch.uint8)  # the mapping, read from only where there is no positional read
        slices = [FileSlice(handle, at, min(chunk, size - at), unused) for at in range(0, size, chunk)]
        bandwidth = read_bandwidth(slices, limit=size)
    finally:
        os.close(handle)
    return None if bandwidth is None else bandwidth / 1e9


def drop_from_cache(path: Path) -> None:
    """The file's clean pages out of the page cache (POSIX only; elsewhere a no-op)."""
    advise = getattr(os, "posix_fadvise", None)
    if advise is None:
        return
    handle = os.open(path, os.O_RDONLY)
    try:
        advise(handle, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(handle)
