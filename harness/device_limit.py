"""A device smaller than it is, for the out-of-memory tests (test support, never the pack's code).

``limit_device(patcher, limit)`` makes the pack's patcher start an engine only while the weights ComfyUI
loaded plus the engine's stream buffers fit in ``limit`` bytes, and raise ``torch.OutOfMemoryError``
beyond it, as the allocator would: the pack's fallback then streams more. In-process tests install it
with a monkeypatch; a test server loads ``tests/support/block_offload_device_limit`` as a custom node,
which installs it when ``BLOCK_OFFLOAD_TEST_DEVICE_LIMIT_BYTES`` is set.

In a server the pack is not ``block_offload``: ComfyUI names a custom node folder's module after its
path. So the patcher module is found by its file, once a prompt arrives (both nodes are loaded then).
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

LIMIT_ENV = "BLOCK_OFFLOAD_TEST_DEVICE_LIMIT_BYTES"
PACK_ROOT = Path(__file__).resolve().parents[1]


def limited(start: Callable, limit: int) -> Callable:
    """``start`` (the patcher's ``start_engine``), checking once ComfyUI has loaded the resident part (the engine
    enabled, its blocks pinning in the background) that the simulated device has room for it and the stream
    buffers, before they are allocated."""

    def start_within_limit(model, request, placement, device, parking, load_resident, *args, **kwargs):
        def load_within_limit() -> None:
            load_resident()
            needed = model.model.model_loaded_weight_memory + placement.buffer_bytes
            if needed > limit:
                raise torch.OutOfMemoryError(
                    f"simulated device limit: {needed} bytes of resident weights and stream buffers, {limit} available"
                )

        return start(model, request, placement, device, parking, load_within_limit, *args, **kwargs)

    return start_within_limit


def limit_device(patcher: ModuleType, limit: int) -> None:
    patcher.start_engine = limited(patcher.start_engine, limit)


def install_from_env() -> None:
    """In a test server: limits the device when ``LIMIT_ENV`` says so, before the first prompt runs."""
    if not os.environ.get(LIMIT_ENV):
        return
    limit = int(os.environ[LIMIT_ENV])
    patcher_file = (PACK_ROOT / "nodes" / "patcher.py").resolve()
    installed: list[ModuleType] = []

    def on_prompt(prompt: dict) -> dict:
        if not installed:
            for module in list(sys.modules.values()):
                if getattr(module, "__file__", None) and Path(module.__file__).resolve() == patcher_file:
                    limit_device(module, limit)
                    installed.append(module)
        return prompt

    server = importlib.import_module("server")  # ComfyUI's
    server.PromptServer.instance.add_on_prompt_handler(on_prompt)
