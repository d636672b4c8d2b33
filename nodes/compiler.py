"""ComfyUI's compiler (0.35 and later, on by default with Dynamic VRAM on CUDA): comfy-aimdo records the device
allocations of each block call of a model that brackets its block loop (``comfy.model_prefetch.
malloc_graph_begin`` ... ``malloc_graph_end``) and replays them at the next step. An allocation made inside the
recording must be freed by the end of its block; one that outlives it (persistent state) aborts the process,
natively, unless it is made under ``pause_malloc_graph``.

The engine's own device memory outlives every call (its ring, its staging buffer, a module the sequential
wrapper makes resident after its first pass, inside a call), and a ring released with
``release_device_buffers`` is allocated again inside the next block call: the engine makes and frees all of
them under this pause (``persistent_allocations``). What a streamed step allocates otherwise is what
the same step of the model resident allocates (``tests/test_steady_allocations.py``), plus, for a LoRA on a
streamed weight, ComfyUI's own patch arithmetic, the same at every step and freed within the block.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext


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
