"""What a node asks for, handed to the patcher: it becomes a placement when ComfyUI loads the model."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..offload import ResidencyPolicy

# Set by the tests and the CPU demo: exercise the whole streaming path with the CPU as "device".
ALLOW_CPU_ENV = "BLOCK_OFFLOAD_ALLOW_CPU"
# "0": stream a Dynamic VRAM model even where the rule of ``offload/plan.py`` would leave it to ComfyUI
# (the GPU tests' tiny models always fit; a user may want VRAM kept free for other work).
STEP_ASIDE_ENV = "BLOCK_OFFLOAD_STEP_ASIDE"


@dataclass(frozen=True)
class OffloadRequest:
    """A node's settings. Only when ComfyUI loads the model are its budget and device known, so the
    placement (``nodes/placement.py``) is made then, from this."""

    node: str
    resident_blocks: int | None = None
    budget_bytes: int | None = None  # 0: whatever ComfyUI's budget leaves after the rest of the model
    policy: ResidencyPolicy = ResidencyPolicy.LEADING
    prefetch: int = 1
    pin_memory: bool = True
    sequential: bool = False
    storage_dtype: torch.dtype | None = None
    vram_limit_bytes: int = 0
    # Resident blocks and prefetch chosen by offload.planner from measured costs (``policy`` until measured).
    auto_placement: bool = False
    # The MODEL came from ComfyUI's Dynamic VRAM: the pack streams its classic twin (``nodes/dynamic_vram.py``).
    dynamic_vram_twin: bool = False
    # The MODEL's Dynamic VRAM patcher class makes its classic clone itself (ComfyUI-GGUF's): its name; the pack
    # streams that clone, as a classic model.
    own_classic_path: str = ""
    # Why a block node streams module by module (its model has no block lists): logged, and shown by the panel.
    notice: str = ""

    def module_by_module(self, notice: str) -> OffloadRequest:
        """This block node's request for a model without block lists: streamed as the Sequential Offload Wrapper
        streams it (weights copied as loaded), Partial GPU Residency's budget kept as the modules' device limit."""
        return dataclasses.replace(
            self, sequential=True, resident_blocks=None, vram_limit_bytes=self.budget_bytes or 0, notice=notice
        )

    @property
    def automatic_budget(self) -> bool:
        """Partial GPU Residency at 0 GiB: the budget is what ComfyUI leaves for the model's weights."""
        return not self.sequential and self.resident_blocks is None and not self.budget_bytes

    @property
    def loader(self) -> str:
        """Which of ComfyUI's loaders the weights came from, for the plan line and the panel."""
        if self.dynamic_vram_twin:
            return "a Dynamic VRAM model, streamed from its checkpoint file"
        if self.own_classic_path:
            return f"the classic reload that the Dynamic VRAM model's {self.own_classic_path} makes of it"
        return "ComfyUI's classic loader"


def may_step_aside() -> bool:
    return os.environ.get(STEP_ASIDE_ENV) != "0"


def streaming_allowed(device: torch.device) -> bool:
    """On the CPU there is no device memory to save, unless the tests or the demo ask to stream anyway."""
    return device.type != "cpu" or os.environ.get(ALLOW_CPU_ENV) == "1"
