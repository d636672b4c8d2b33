"""The pack's memory in ComfyUI's own books: pinned host memory under one budget with ComfyUI's, the RAM the process
may use, and device allocations kept out of ComfyUI's compiler's recording.

The pack counts its pins in ComfyUI's ``TOTAL_PINNED_MEMORY``, so both stay under ComfyUI's cap, and keeps an entry in
``PINNED_MEMORY`` because 0.3.75 resets the total whenever that table empties.

ComfyUI's compiler (comfy-aimdo, 0.35 and later) replays each block call's allocations; one that outlives its block
aborts the process unless made under ``pause_malloc_graph``, so the engine's lasting buffers are made and freed under it
(``persistent_allocations``)."""

from __future__ import annotations

import functools
import importlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import comfy.model_management
import psutil
import torch
from comfy.cli_args import args

from ..offload import (
    GIB,
    PROCESS_STATE,
    CudaHostRegistrar,
    HostRam,
    PinnedMemoryBudget,
    can_pin_memory,
    clamp_to_cgroups,
    use_host_registrar,
)

# GiB; caps the pack's share below ComfyUI's own pinned budget.
PINNED_LIMIT_ENV = "BLOCK_OFFLOAD_MAX_PINNED_GB"
# ComfyUI's table is keyed by address, so a string never clashes.
COMFY_TABLE_KEY = "block_offload"
# 0.33's minimum headroom, for a ComfyUI with no check of its own.
RAM_HEADROOM = 2 * GIB


def pinning_enabled() -> bool:
    return not args.disable_pinned_memory


def host_ram() -> HostRam:
    """The RAM this process may use, clamped to its cgroups' limits, which psutil and ComfyUI do not see."""
    memory = psutil.virtual_memory()
    return clamp_to_cgroups(memory.total, memory.available)


def _comfyui_like_cap() -> int:
    """ComfyUI 0.33's pinned budget for NVIDIA and AMD, for a device it sets none for (Intel XPU)."""
    ram = host_ram().total
    if comfy.model_management.WINDOWS:
        return int(ram * 0.40)
    return int(max(ram * 0.40, min(ram * 0.90, ram - 4 * GIB)))


def _pinned_limit() -> int | None:
    """Bytes all streaming models together may pin now; None: no cap known."""
    if not pinning_enabled():
        return 0
    limits = []
    mm = comfy.model_management
    comfy_max = getattr(mm, "MAX_PINNED_MEMORY", -1)
    if comfy_max > 0:
        # ComfyUI's total includes the pack's bytes.
        limits.append(int(comfy_max - (mm.TOTAL_PINNED_MEMORY - PINNED_MEMORY.used)))
    elif mm.is_intel_xpu():
        limits.append(_comfyui_like_cap())
    setting = os.environ.get(PINNED_LIMIT_ENV)
    if setting:
        limits.append(int(float(setting) * GIB))
    return min(limits, default=None)


def host_buffer_room(held: int) -> int:
    """Bytes of host buffers a file-backed (Dynamic VRAM) model may take now, the pack holding ``held`` for others:
    available RAM less headroom, the pin budget's room, and ``BLOCK_OFFLOAD_MAX_PINNED_GB``, which here caps every
    host buffer. The rest is read from the file each step."""
    rooms = [host_ram().available - RAM_HEADROOM]
    setting = os.environ.get(PINNED_LIMIT_ENV)
    if setting:
        rooms.append(int(float(setting) * GIB) - held)
    limit = PINNED_MEMORY.limit if pinning_enabled() and can_pin_memory() else None
    if limit is not None:
        rooms.append(limit - PINNED_MEMORY.used)
    return max(0, min(rooms))


def ram_admits(nbytes: int) -> bool:
    """ComfyUI's available-RAM check before pinning. Public for the tests, which patch it; the budget looks it up at
    each call."""
    ensure_pin_budget = getattr(comfy.model_management, "ensure_pin_budget", None)
    if ensure_pin_budget is not None:
        return ensure_pin_budget(nbytes)
    return host_ram().available - nbytes >= RAM_HEADROOM


def _count_in_comfyui(nbytes: int) -> None:
    mm = comfy.model_management
    mm.TOTAL_PINNED_MEMORY += nbytes
    if PINNED_MEMORY.used > 0:
        mm.PINNED_MEMORY[COMFY_TABLE_KEY] = PINNED_MEMORY.used
    else:
        mm.PINNED_MEMORY.pop(COMFY_TABLE_KEY, None)


def comfyui_registrar() -> CudaHostRegistrar:
    """CUDA's registration, failures cleared as ComfyUI clears its own (0.33)."""
    return CudaHostRegistrar(getattr(comfy.model_management, "discard_cuda_async_error", None))


PINNED_MEMORY = PROCESS_STATE.entry(
    "pin budget",
    lambda: PinnedMemoryBudget(_pinned_limit, admit=lambda nbytes: ram_admits(nbytes), on_change=_count_in_comfyui),
    "ComfyUI's pinned-memory limit is one for the process, shared by the models that stream",
)
if torch.cuda.is_available():
    use_host_registrar(comfyui_registrar())


# -- ComfyUI's compiler: the engine's lasting device allocations kept out of its recording


def outside_the_recording() -> Callable[[], AbstractContextManager]:
    """A context keeping allocations out of the compiler's recording: ``pause_malloc_graph(sync=True)``, as ComfyUI
    wraps its own persistent allocations, or a no-op where nothing is recorded."""
    try:
        prefetch = importlib.import_module("comfy.model_prefetch")
    except ImportError:  # ComfyUI 0.3.x
        return nullcontext
    pause = getattr(prefetch, "pause_malloc_graph", None)
    return functools.partial(pause, sync=True) if pause is not None else nullcontext
