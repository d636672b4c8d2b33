"""A device smaller than it is, for the out-of-memory tests (test support, never the pack's code).

``limit_device(patcher, limit)`` makes the pack's patcher start an engine only while the weights ComfyUI
loaded plus the engine's stream buffers fit in ``limit`` bytes, and raise ``torch.OutOfMemoryError``
beyond it, as the allocator would: the pack's fallback then streams more. In-process tests install it
with a monkeypatch; a test server loads ``tests/support/block_offload_device_limit`` as a custom node,
which installs it when ``BLOCK_OFFLOAD_TEST_DEVICE_LIMIT_BYTES`` is set.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from types import ModuleType

import torch

LIMIT_ENV = "BLOCK_OFFLOAD_TEST_DEVICE_LIMIT_BYTES"


def limited(start: Callable, limit: int) -> Callable:
    """``start`` (the patcher's ``start_engine``), checking first that the simulated device has room."""

    def start_within_limit(model, request, placement, device):
        needed = model.model.model_loaded_weight_memory + placement.buffer_bytes
        if needed > limit:
            raise torch.OutOfMemoryError(
                f"simulated device limit: {needed} bytes of resident weights and stream buffers, {limit} available"
            )
        return start(model, request, placement, device)

    return start_within_limit


def limit_device(patcher: ModuleType, limit: int) -> None:
    patcher.start_engine = limited(patcher.start_engine, limit)


def install_from_env() -> None:
    """In a test server: limits the device when ``LIMIT_ENV`` says so."""
    if os.environ.get(LIMIT_ENV):
        limit_device(importlib.import_module("block_offload.nodes.patcher"), int(os.environ[LIMIT_ENV]))
