"""The pack's memory in ComfyUI's own books: the page-locked host memory it takes, under one budget with
ComfyUI's, the RAM the process may use, and the device allocations kept out of ComfyUI's compiler's recording.

Where ComfyUI pins (NVIDIA, AMD) it has a budget, ``MAX_PINNED_MEMORY``, and counts what it pinned in
``TOTAL_PINNED_MEMORY``. The pack counts its pinned bytes there too, so ComfyUI's later pins see them (the
two together never exceed ComfyUI's cap) and 0.33's eviction of its own pins, which reads that total, makes
room for them. ComfyUI 0.3.75 resets the total to 0 whenever its table of pinned tensors (``PINNED_MEMORY``)
empties; the pack keeps an entry of its own in that table, holding its bytes, so the table never empties
while the pack pins. Before pinning, ComfyUI's available-RAM check is asked (0.33's ``ensure_pin_budget``;
on 0.3.75, which has none, the same headroom rule). ``--disable-pinned-memory`` means the pack pins
nothing either; ``BLOCK_OFFLOAD_MAX_PINNED_GB`` caps the pack's share further. On Intel XPU, where ComfyUI
pins nothing and sets no budget, the pack caps itself as ComfyUI caps NVIDIA. A failed registration's CUDA
error is cleared by ComfyUI's own ``discard_cuda_async_error`` where it has one (0.33), by the engine's
equivalent elsewhere.

ComfyUI's compiler (0.35 and later, on by default with Dynamic VRAM on CUDA): comfy-aimdo records the device
allocations of each block call of a model that brackets its block loop (``comfy.model_prefetch.
malloc_graph_begin`` ... ``malloc_graph_end``) and replays them at the next step. An
allocation made inside the recording must be freed by the end of its block; one that outlives it aborts the
process, natively, unless it is made under ``pause_malloc_graph``. The engine's own device memory outlives
every call (its ring, its staging buffer, a module the sequential wrapper makes resident inside a call), and a
released ring is allocated again inside the next block call: the engine makes and frees all of them under this
pause (``persistent_allocations``). What a streamed step allocates otherwise is what the same step of the
model resident allocates (``tests/test_steady_allocations.py``), plus, for a LoRA on a streamed weight,
ComfyUI's own patch arithmetic, the same at every step and freed within the block.
"""

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

# A cap, in GiB, on the page-locked RAM the pack takes (below ComfyUI's own pinned-memory budget).
PINNED_LIMIT_ENV = "BLOCK_OFFLOAD_MAX_PINNED_GB"
# The pack's entry in ComfyUI's table of pinned tensors (keyed by address there: a string never clashes).
COMFY_TABLE_KEY = "block_offload"
# Available RAM kept free when pinning, where ComfyUI has no check of its own (0.33's minimum headroom).
RAM_HEADROOM = 2 * GIB


def pinning_enabled() -> bool:
    return not args.disable_pinned_memory


def host_ram() -> HostRam:
    """The RAM this process may use: psutil's figures, clamped to the limits of its memory cgroups (a container's
    limit, which psutil does not see; ComfyUI 0.33 and 0.3.75 do not either)."""
    memory = psutil.virtual_memory()
    return clamp_to_cgroups(memory.total, memory.available)


def _comfyui_like_cap() -> int:
    """ComfyUI 0.33's pinned budget for NVIDIA and AMD, for a device it sets none for (Intel XPU)."""
    ram = host_ram().total
    if comfy.model_management.WINDOWS:
        return int(ram * 0.40)
    return int(max(ram * 0.40, min(ram * 0.90, ram - 4 * GIB)))


def _pinned_limit() -> int | None:
    """How many bytes all streaming models together may pin now; None: no cap known."""
    if not pinning_enabled():
        return 0
    limits = []
    mm = comfy.model_management
    comfy_max = getattr(mm, "MAX_PINNED_MEMORY", -1)
    if comfy_max > 0:
        # ComfyUI's total counts the pack's bytes too: what ComfyUI pinned itself leaves the rest.
        limits.append(int(comfy_max - (mm.TOTAL_PINNED_MEMORY - PINNED_MEMORY.used)))
    elif mm.is_intel_xpu():
        limits.append(_comfyui_like_cap())
    setting = os.environ.get(PINNED_LIMIT_ENV)
    if setting:
        limits.append(int(float(setting) * GIB))
    return min(limits, default=None)


def host_buffer_room(held: int) -> int:
    """Bytes of host buffers a model whose weights stay in their file (Dynamic VRAM) may take now for its
    streamed blocks, the pack already holding ``held`` for others: the available RAM less a headroom, the
    pinned budget's room where the pack pins, and ``BLOCK_OFFLOAD_MAX_PINNED_GB``, which there caps every
    host buffer, pinned or not (what does not fit is read from the file at each step)."""
    rooms = [host_ram().available - RAM_HEADROOM]
    setting = os.environ.get(PINNED_LIMIT_ENV)
    if setting:
        rooms.append(int(float(setting) * GIB) - held)
    limit = PINNED_MEMORY.limit if pinning_enabled() and can_pin_memory() else None
    if limit is not None:
        rooms.append(limit - PINNED_MEMORY.used)
    return max(0, min(rooms))


def ram_admits(nbytes: int) -> bool:
    """ComfyUI's available-RAM check before pinning (it may unpin its own Dynamic VRAM buffers to pass). Public for
    the tests, which call it and patch it (the budget below looks the name up at each call, so a patch takes)."""
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
    """CUDA's registration, its failures cleared as ComfyUI clears its own where it can (0.33)."""
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
    """A context that keeps allocations out of the compiler's recording: ``pause_malloc_graph(sync=True)`` (as
    ComfyUI's own code wraps persistent allocations) where this ComfyUI has it, else a context that does
    nothing (0.33 and earlier record nothing)."""
    try:
        prefetch = importlib.import_module("comfy.model_prefetch")
    except ImportError:  # ComfyUI 0.3.x
        return nullcontext
    pause = getattr(prefetch, "pause_malloc_graph", None)
    return functools.partial(pause, sync=True) if pause is not None else nullcontext
