"""The few device operations the engine needs, written against torch's generic
accelerator API so CUDA, XPU and others share one code path.

On the CPU there are no streams or events: copies run inline and clocks are
read from the host. Every caller handles ``None`` streams that way.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch


def is_accelerator(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


# One copy stream per device, shared by every engine on it: a new stream per engine would come from
# torch's round-robin pool, which ComfyUI's own offload streams share (and they wait on the compute stream).
_COPY_STREAMS: dict[torch.device, torch.Stream] = {}


def copy_stream(device: torch.device) -> torch.Stream | None:
    """The dedicated host-to-device copy stream of ``device`` (None on the CPU, where copies run inline)."""
    if not is_accelerator(device):
        return None
    if device.index is None:
        device = torch.device(device.type, torch.accelerator.current_device_index())
    if device not in _COPY_STREAMS:
        _COPY_STREAMS[device] = torch.Stream(device=device)
    return _COPY_STREAMS[device]


def current_stream(device: torch.device) -> torch.Stream | None:
    if not is_accelerator(device):
        return None
    return torch.accelerator.current_stream(device)


def device_name(device: torch.device) -> str:
    """What the device is (``NVIDIA H100 80GB HBM3``), for keying measurements made on it."""
    backend = getattr(torch, device.type, None)
    if is_accelerator(device) and hasattr(backend, "get_device_name"):
        return backend.get_device_name(device)
    return device.type


def can_pin_memory() -> bool:
    """Page-locked host memory needs a driver; without an accelerator there is nothing to pin for."""
    return torch.accelerator.is_available()


# Bytes of host memory the engine has page-locked itself and not yet given back (see pinned_host_buffer).
_registered_bytes = 0


def pinned_bytes() -> int:
    """Host bytes page-locked by ``pinned_host_buffer`` and still alive: what this process really pins for
    the engine (torch's caching host allocator, used by others, is not in it)."""
    return _registered_bytes


def pinned_host_buffer(nbytes: int) -> torch.Tensor | None:
    """Exactly ``nbytes`` of page-locked host memory, or None when the driver refuses it.

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
    every request up to a power of two (a 702 MB block pins 1 GiB) and keeps freed blocks pinned until
    its cache is emptied. On CUDA the buffer is ordinary memory registered with the driver instead, as
    ComfyUI pins its weights, and unregistered just before it is freed: when the last tensor viewing it
    goes, torch finalizes the storage's weak references before it releases the memory.
    """
    global _registered_bytes
    if not torch.cuda.is_available():
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)  # other accelerators: torch's way
    host = torch.empty(nbytes, dtype=torch.uint8)
    if nbytes == 0:
        return host
    pointer = host.data_ptr()
    if torch.cuda.cudart().cudaHostRegister(pointer, nbytes, 0) != 0:
        return None
    _registered_bytes += nbytes
    weakref.finalize(host.untyped_storage(), _unregister, pointer, nbytes)
    return host


def _unregister(pointer: int, nbytes: int) -> None:
    global _registered_bytes
    torch.cuda.cudart().cudaHostUnregister(pointer)
    _registered_bytes -= nbytes


def synchronize(device: torch.device) -> None:
    if is_accelerator(device):
        torch.accelerator.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak of allocated device memory (the allocator keeps one per process otherwise)."""
    if is_accelerator(device):
        torch.accelerator.reset_peak_memory_stats(device)


def peak_allocated(device: torch.device) -> int | None:
    """The most device memory allocated since the last ``reset_peak_memory`` (None on the CPU).

    Read from the allocator's nested statistics: ``torch.accelerator.max_memory_allocated`` reads the
    same number, but flattens and sorts all of the allocator's statistics (over a hundred) into a new dict first,
    which is too slow for once per step (the recorder reads a peak at the end of every step).
    """
    if not is_accelerator(device):
        return None
    device_stats = getattr(torch._C, "_accelerator_getDeviceStats", None)  # private: absent from other torch versions
    if device_stats is None:
        return torch.accelerator.max_memory_allocated(device)
    if not torch._C._accelerator_isAllocatorInitialized():
        return 0  # nothing was ever allocated (what the public function answers too)
    index = device.index if device.index is not None else torch.accelerator.current_device_index()
    return device_stats(index)["allocated_bytes"]["all"]["peak"]


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory in bytes; ``None`` where the device does not report it (the CPU)."""

    allocated: int | None
    reserved: int | None
    peak_allocated: int | None
    free: int | None
    total: int | None


def memory_snapshot(device: torch.device) -> MemorySnapshot:
    if not is_accelerator(device):
        return MemorySnapshot(None, None, None, None, None)
    free, total = torch.accelerator.get_memory_info(device)
    return MemorySnapshot(
        allocated=torch.accelerator.memory_allocated(device),
        reserved=torch.accelerator.memory_reserved(device),
        peak_allocated=peak_allocated(device),
        free=free,
        total=total,
    )


# What a clock marks: a device event on an accelerator, a one-element list holding the host time on the CPU.
Marker = torch.Event | list[float]


class Clock:
    """Timestamps on a stream: device events on an accelerator, host time on the CPU.

    Marking costs one event record and never blocks the host; a marker is read once the device has
    reached it (``reached`` asks without waiting, ``wait`` blocks). One object makes every device
    call the timeline recorder makes, so a subclass can count them (bench/recorder_overhead.py).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_device = is_accelerator(device)

    def new_marker(self) -> Marker:
        if self.on_device:
            return torch.Event(device=self.device, enable_timing=True)
        return [0.0]

    def mark(self, marker: Marker, stream: torch.Stream | None) -> None:
        if self.on_device:
            marker.record(stream)
        else:
            marker[0] = time.perf_counter()

    def reached(self, marker: Marker) -> bool:
        """Whether the device has passed ``marker`` (a query; the host clock is always there)."""
        return not self.on_device or marker.query()

    def wait(self, marker: Marker) -> None:
        """Blocks the host until the device has passed ``marker``."""
        if self.on_device:
            marker.synchronize()

    def since(self, start: Marker) -> Callable[[Marker], float]:
        """A reader of the milliseconds from ``start`` to a marker the device has reached: each read is one
        elapsed-time call on a device, which neither waits nor synchronizes."""
        if self.on_device:
            return start.elapsed_time
        origin = start[0]
        return lambda marker: (marker[0] - origin) * 1000.0

    def elapsed_ms(self, start: Marker, end: Marker) -> float:
        """Milliseconds from ``start`` to ``end``, waiting for the device to reach ``end``."""
        self.wait(end)
        return self.since(start)(end)
