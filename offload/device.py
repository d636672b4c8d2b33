"""The few device operations the engine needs, written against torch's generic accelerator API so CUDA, XPU and
others share one code path, and the state that belongs to the process rather than to any engine.

On the CPU there are no streams or events: copies run inline and clocks are read from the host. Every caller
handles ``None`` streams that way. Each call takes ``torch.accelerator`` where it has the function and the
device's own module (``torch.cuda``, ``torch.xpu``) where it does not; ``unsupported_torch`` names what neither
has, before any work starts.

``PROCESS_STATE`` is one registry of named entries, each with why it cannot live on an object of its own: the
driver's page locks, one copy stream per device, a host's pin budget. A host adapter adds its own entries the
same way, so ``PROCESS_STATE.reasons()`` lists all of it.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, TypeAlias, TypeVar, cast

import torch


def is_accelerator(device: torch.device) -> bool:
    return device.type not in ("cpu", "meta")


# torch.accelerator's name for a function -> the name the device modules (torch.cuda, torch.xpu) give it.
_DEVICE_MODULE_NAMES = MappingProxyType(
    {
        "current_device_index": "current_device",
        "get_memory_info": "mem_get_info",
    }
)
# What the engine calls on an accelerator.
_DEVICE_FUNCTIONS = (
    "current_device_index",
    "current_stream",
    "synchronize",
    "memory_allocated",
    "memory_reserved",
    "max_memory_allocated",
    "reset_peak_memory_stats",
    "get_memory_info",
)


def _device_function(device_type: str, name: str) -> Callable[..., Any] | None:
    accelerator = getattr(torch, "accelerator", None)
    function = getattr(accelerator, name, None)
    if function is None:
        function = getattr(getattr(torch, device_type, None), _DEVICE_MODULE_NAMES.get(name, name), None)
    return function


# Looked up once per device type and function: ``current_stream`` runs several times per block call.
_resolved = functools.cache(_device_function)


def _call(device: torch.device, name: str, *args: object) -> Any:
    function = _resolved(device.type, name)
    if function is None:  # unsupported_torch refuses such a device before any engine starts
        raise RuntimeError(f"torch {torch.__version__} has no {name} for {device.type}")
    return function(*args)


def accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def unsupported_torch(device: torch.device) -> str | None:
    """What this torch lacks that streaming on ``device`` needs (None: nothing), said for a person."""
    if not is_accelerator(device):
        return None
    missing = [f"torch.{name}" for name in ("Stream", "Event") if not hasattr(torch, name)]
    # Looked up afresh (not ``_resolved``): what is asked is this torch as it is now.
    absent = [name for name in _DEVICE_FUNCTIONS if _device_function(device.type, name) is None]
    missing += [f"torch.accelerator.{name}" for name in absent]
    if not missing:
        return None
    return (
        f"torch {torch.__version__} lacks {', '.join(missing)} for {device.type}, which block streaming needs. "
        "Update torch (2.7 or newer, as ComfyUI recommends), or leave the offloading to ComfyUI."
    )


_COPY_STREAMS_WHY = (
    "one copy stream per device, shared by every engine on it: a new stream per engine would come from torch's "
    "round-robin pool, which ComfyUI's own offload streams share (and they wait on the compute stream)"
)


def copy_stream(device: torch.device) -> torch.Stream | None:
    """The dedicated host-to-device copy stream of ``device`` (None on the CPU, where copies run inline)."""
    if not is_accelerator(device):
        return None
    if device.index is None:
        device = torch.device(device.type, _call(device, "current_device_index"))
    streams: dict[torch.device, torch.Stream] = PROCESS_STATE.entry("copy streams", dict, _COPY_STREAMS_WHY)
    if device not in streams:
        streams[device] = torch.Stream(device=device)
    return streams[device]


def current_stream(device: torch.device) -> torch.Stream | None:
    if not is_accelerator(device):
        return None
    return cast(torch.Stream, _call(device, "current_stream", device))


def device_name(device: torch.device) -> str:
    """What the device is (``NVIDIA H100 80GB HBM3``), for keying measurements made on it."""
    backend = getattr(torch, device.type, None)
    if is_accelerator(device) and backend is not None and hasattr(backend, "get_device_name"):
        return str(backend.get_device_name(device))
    return device.type


def synchronize(device: torch.device) -> None:
    if is_accelerator(device):
        _call(device, "synchronize", device)


def reset_peak_memory(device: torch.device) -> None:
    """Starts a new peak of allocated device memory (the allocator keeps one per process otherwise)."""
    if is_accelerator(device):
        _call(device, "reset_peak_memory_stats", device)


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
        return int(_call(device, "max_memory_allocated", device))
    if not torch._C._accelerator_isAllocatorInitialized():
        return 0  # nothing was ever allocated (what the public function answers too)
    index = device.index if device.index is not None else _call(device, "current_device_index")
    return int(device_stats(index)["allocated_bytes"]["all"]["peak"])


def free_device_bytes(device: torch.device) -> int | None:
    """What the device can still allocate: its free memory and what torch's allocator holds unused (None on
    the CPU). Checked before the ring is allocated: with the driver's system-memory fallback (Windows) an
    allocation beyond it would not fail but spill into shared host memory, slower than streaming itself."""
    if not is_accelerator(device):
        return None
    free, _ = _call(device, "get_memory_info", device)
    return int(free + _call(device, "memory_reserved", device) - _call(device, "memory_allocated", device))


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
    free, total = _call(device, "get_memory_info", device)
    return MemorySnapshot(
        allocated=_call(device, "memory_allocated", device),
        reserved=_call(device, "memory_reserved", device),
        peak_allocated=peak_allocated(device),
        free=free,
        total=total,
    )


# What a clock marks: a device event on an accelerator, a one-element list holding the host time on the CPU.
Marker: TypeAlias = "torch.Event | list[float]"  # a string: torch.Event is not in every torch ComfyUI runs on


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
        if isinstance(marker, list):
            marker[0] = time.perf_counter()
        else:
            marker.record(stream)

    def reached(self, marker: Marker) -> bool:
        """Whether the device has passed ``marker`` (a query; the host clock is always there)."""
        return isinstance(marker, list) or marker.query()

    def wait(self, marker: Marker) -> None:
        """Blocks the host until the device has passed ``marker``."""
        if not isinstance(marker, list):
            marker.synchronize()

    def since(self, start: Marker) -> Callable[[Marker], float]:
        """A reader of the milliseconds from ``start`` to a marker the device has reached: each read is one
        elapsed-time call on a device, which neither waits nor synchronizes."""
        if not isinstance(start, list):
            return cast("Callable[[Marker], float]", start.elapsed_time)
        origin = start[0]
        return lambda marker: (cast(list[float], marker)[0] - origin) * 1000.0

    def elapsed_ms(self, start: Marker, end: Marker) -> float:
        """Milliseconds from ``start`` to ``end``, waiting for the device to reach ``end``."""
        self.wait(end)
        return self.since(start)(end)


def device_ms(work: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The least time ``work`` takes on ``device``'s current stream over ``repeats`` runs, after one run that
    warms caches and kernels up. Each run waits for the device: a measurement taken once, never in a step."""
    clock, stream = Clock(device), current_stream(device)
    work()
    times = []
    for _ in range(repeats):
        start, end = clock.new_marker(), clock.new_marker()
        clock.mark(start, stream)
        work()
        clock.mark(end, stream)
        times.append(clock.elapsed_ms(start, end))
    return min(times)


T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    value: object
    why: str


class ProcessState:
    """Named process-wide values, each made once on first use, with why it is process-wide."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # Entries are first used from the streamer's thread, the packing thread and the server's threads.
        self._lock = threading.Lock()

    def entry(self, name: str, make: Callable[[], T], why: str) -> T:
        """The value named ``name``: the one ``make`` returns on the first call, the same one after."""
        found = self._entries.get(name)
        if found is None:
            with self._lock:
                found = self._entries.get(name)
                if found is None:
                    found = self._entries[name] = _Entry(make(), why)
        return cast(T, found.value)

    def made(self, name: str) -> object | None:
        """The value named ``name`` if it was made; None before its first ``entry``."""
        found = self._entries.get(name)
        return found.value if found is not None else None

    def reasons(self) -> dict[str, str]:
        """Every entry made so far, by name: why it is process-wide."""
        return {name: entry.why for name, entry in self._entries.items()}


PROCESS_STATE = ProcessState()
