"""What a node asks for, handed to the patcher: it becomes a placement when ComfyUI loads the model."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from ..offload import ResidencyPolicy

# Set by the tests and the CPU demo: exercise the whole streaming path with the CPU as "device".
ALLOW_CPU_ENV = "BLOCK_OFFLOAD_ALLOW_CPU"
# "0": stream even a model that fits (the GPU tests' tiny models; a user keeping VRAM free for other work).
STEP_ASIDE_ENV = "BLOCK_OFFLOAD_STEP_ASIDE"


@dataclass(frozen=True)
class OffloadRequest:
    """A node's settings. The budget and device are known only when ComfyUI loads the model, so the placement is made
    then, from this."""

    node: str
    resident_blocks: int | None = None
    budget_bytes: int | None = None  # 0: what ComfyUI's budget leaves after the rest of the model
    policy: ResidencyPolicy = ResidencyPolicy.LEADING
    prefetch: int = 1
    pin_memory: bool = True
    sequential: bool = False
    storage_dtype: torch.dtype | None = None
    vram_limit_bytes: int = 0
    auto_placement: bool = False  # planned from measured costs; ``policy`` until measured
    dynamic_vram_twin: bool = False
    own_classic_path: str = ""  # the patcher class that makes its own classic clone (ComfyUI-GGUF's)
    core_prefetch: str = ""  # the diffusion model's class where ComfyUI would prefetch its blocks itself
    notice: str = ""  # why a block node streams module by module

    def module_by_module(self, notice: str) -> OffloadRequest:
        """This request for a model without block lists: streamed as the Sequential Offload Wrapper does, Partial GPU
        Residency's budget kept as the modules' device limit."""
        return dataclasses.replace(
            self, sequential=True, resident_blocks=None, vram_limit_bytes=self.budget_bytes or 0, notice=notice
        )

    @property
    def automatic_budget(self) -> bool:
        """Partial GPU Residency at 0 GiB: the budget is what ComfyUI leaves for weights."""
        return not self.sequential and self.resident_blocks is None and not self.budget_bytes

    @property
    def loader(self) -> str:
        if self.dynamic_vram_twin:
            return "a Dynamic VRAM model, streamed from its checkpoint file"
        if self.own_classic_path:
            return f"the classic reload that the Dynamic VRAM model's {self.own_classic_path} makes of it"
        return "ComfyUI's classic loader"


def may_step_aside() -> bool:
    return os.environ.get(STEP_ASIDE_ENV) != "0"


def streaming_allowed(device: torch.device) -> bool:
    """On the CPU there is no device memory to save, unless tests or the demo ask."""
    return device.type != "cpu" or os.environ.get(ALLOW_CPU_ENV) == "1"
