"""The few device operations the engine needs, against torch's generic accelerator API so CUDA, XPU and others share
one path, and the state that belongs to the process rather than to an engine.

On the CPU there are no streams or events: copies run inline, clocks read the host, and callers handle ``None`` streams
so. Each call uses ``torch.accelerator`` where it has the function, else the device's own module; ``unsupported_torch``
names what neither has before any work starts. ``PROCESS_STATE`` is one registry of named process-wide entries, each
with why it cannot live on an object."""

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


# torch.accelerator's name -> the device modules' name.
_DEVICE_MODULE_NAMES = MappingProxyType(
    {
        "current_device_index": "current_device",
        "get_memory_info": "mem_get_info",
    }
)
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
    if function is None:  # unsupported_torch refuses such a device earlier
        raise RuntimeError(f"torch {torch.__version__} has no {name} for {device.type}")
    return function(*args)


def accelerator_available() -> bool:
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is not None:
        return bool(accelerator.is_available())
    return torch.cuda.is_available()


def unsupported_torch(device: torch.device) -> str | None:
    """What this torch lacks for streaming on ``device``, for a person; None: nothing."""
    if not is_accelerator(device):
        return None
    missing = [f"torch.{name}" for name in ("Stream", "Event") if not hasattr(torch, name)]
    # Not ``_resolved``: asks of torch as it is now.
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
    """The dedicated copy stream of ``device`` (None on the CPU)."""
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
    """The device's name, for keying measurements made on it."""
    backend = getattr(torch, device.type, None)
    if is_accelerator(device) and backend is not None and hasattr(backend, "get_device_name"):
        return str(backend.get_device_name(device))
    return device.type


def synchronize(device: torch.device) -> None:
    if is_accelerator(device):
        _call(device, "synchronize", device)


def reset_peak_memory(device: torch.device) -> None:
    if is_accelerator(device):
        _call(device, "reset_peak_memory_stats", device)


def peak_allocated(device: torch.device) -> int | None:
    """The most device memory allocated since ``reset_peak_memory`` (None on the CPU).

    Read from the allocator's nested statistics: the public ``max_memory_allocated`` flattens and sorts all of them
    first, too slow for once per step."""
    if not is_accelerator(device):
        return None
    device_stats = getattr(torch._C, "_accelerator_getDeviceStats", None)  # private, not in every torch
    if device_stats is None:
        return int(_call(device, "max_memory_allocated", device))
    if not torch._C._accelerator_isAllocatorInitialized():
        return 0  # as the public function answers
    index = device.index if device.index is not None else _call(device, "current_device_index")
    return int(device_stats(index)["allocated_bytes"]["all"]["peak"])


def free_device_bytes(device: torch.device) -> int | None:
    """What the device can still allocate, counting torch's cached memory (None on the CPU). With the driver's
    system-memory fallback (Windows) a larger allocation would not fail but spill into host memory, slower than
    streaming."""
    if not is_accelerator(device):
        return None
    free, _ = _call(device, "get_memory_info", device)
    return int(free + _call(device, "memory_reserved", device) - _call(device, "memory_allocated", device))


@dataclass(frozen=True)
class MemorySnapshot:
    """Device memory in bytes; None where the device does not report it."""

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


# On the CPU, a one-element list holding the host time.
Marker: TypeAlias = "torch.Event | list[float]"  # a string: torch.Event is not in every torch ComfyUI runs on


class Clock:
    """Timestamps on a stream: device events on an accelerator, host time on the CPU.

    Marking never blocks the host; a marker is read once the device has reached it. One object makes every device call
    the recorder makes, so a subclass can count them."""

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
        """Whether the device has passed ``marker``, without waiting."""
        return isinstance(marker, list) or marker.query()

    def wait(self, marker: Marker) -> None:
        if not isinstance(marker, list):
            marker.synchronize()

    def since(self, start: Marker) -> Callable[[Marker], float]:
        """A reader of milliseconds from ``start`` to a reached marker; each read neither waits nor synchronizes."""
        if not isinstance(start, list):
            return cast("Callable[[Marker], float]", start.elapsed_time)
        origin = start[0]
        return lambda marker: (cast(list[float], marker)[0] - origin) * 1000.0

    def elapsed_ms(self, start: Marker, end: Marker) -> float:
        self.wait(end)
        return self.since(start)(end)


def device_ms(work: Callable[[], object], device: torch.device, repeats: int = 3) -> float:
    """The least time ``work`` takes on the current stream over ``repeats`` runs after a warm-up. Each run waits for
    the device, so this is for one-off measurements, never inside a step."""
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
        # First use may come from the streamer's, the packing or the server's threads.
        self._lock = threading.Lock()

    def entry(self, name: str, make: Callable[[], T], why: str) -> T:
        found = self._entries.get(name)
        if found is None:
            with self._lock:
                found = self._entries.get(name)
                if found is None:
                    found = self._entries[name] = _Entry(make(), why)
        return cast(T, found.value)

    def made(self, name: str) -> object | None:
        found = self._entries.get(name)
        return found.value if found is not None else None

    def reasons(self) -> dict[str, str]:
        return {name: entry.why for name, entry in self._entries.items()}


PROCESS_STATE = ProcessState()
