"""How much host memory the pack may page-lock: what ComfyUI's own pinned-memory budget leaves."""

from __future__ import annotations

import os

import comfy.model_management
from comfy.cli_args import args

from ..offload import GIB, PinnedMemoryBudget

# A cap, in GiB, on the page-locked RAM the pack takes (below ComfyUI's own pinned-memory budget).
PINNED_LIMIT_ENV = "BLOCK_OFFLOAD_MAX_PINNED_GB"


def _pinned_limit() -> int | None:
    """How many bytes all streaming models together may pin now; None: no cap known.

    Where ComfyUI pins (NVIDIA, AMD) it has a budget, MAX_PINNED_MEMORY, for the weights of the
    modules it casts on demand; the pack takes only what ComfyUI has left of it. It keeps its own
    count instead of adding to ComfyUI's TOTAL_PINNED_MEMORY, because ComfyUI sets that total to 0
    whenever its own list of pinned tensors empties, which would silently drop the pack's share.
    ``--disable-pinned-memory`` means none; ``BLOCK_OFFLOAD_MAX_PINNED_GB`` caps it further.
    """
    if args.disable_pinned_memory:
        return 0
    limits = []
    comfy_max = getattr(comfy.model_management, "MAX_PINNED_MEMORY", -1)
    if comfy_max > 0:
        limits.append(int(comfy_max - comfy.model_management.TOTAL_PINNED_MEMORY))
    setting = os.environ.get(PINNED_LIMIT_ENV)
    if setting:
        limits.append(int(float(setting) * GIB))
    return min(limits, default=None)


PINNED_MEMORY = PinnedMemoryBudget(_pinned_limit)
