"""Small but real transformer stacks for the engine tests: attention + MLP blocks."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TransformerBlock(nn.Module):
    """Pre-norm self-attention and MLP, with a rotary-style buffer and a learned gate."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.gate = nn.Parameter(torch.rand(dim))
        self.register_buffer("phase", torch.linspace(0, 1, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        # Reads its own parameter's device, as some model code does. Its own: in sequential mode a child's
        # (self.qkv.weight) is still a host view until that child runs.
        x = x.to(self.phase.device) + self.phase
        q, k, v = self.qkv(self.norm1(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, n, d)
        x = x + self.gate * self.proj(attn)
        return x + self.mlp(self.norm2(x))


class Fp8Linear(nn.Module):
    """An fp8 weight with a separate scale, dequantised at call time."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        weight = torch.randn(dim, dim) * 0.05
        scale = weight.abs().max() / 448.0
        self.weight = nn.Parameter((weight / scale).to(torch.float8_e4m3fn), requires_grad=False)
        self.register_buffer("scale", scale.reshape(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight.to(x.dtype) * self.scale.to(x.dtype))


class Fp8Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.linear = Fp8Linear(dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.linear(self.norm(x))


class Stack(nn.Module):
    """Embedding in, blocks, head out; ``schedule`` says which blocks run in which order."""

    def __init__(self, blocks: list[nn.Module], dim: int, schedule: list[int] | None = None) -> None:
        super().__init__()
        self.embed = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(dim, dim)
        self.schedule = schedule if schedule is not None else list(range(len(blocks)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for i in self.schedule:
            x = self.blocks[i](x)
        return self.head(x)


def transformer_stack(num_blocks: int = 4, dim: int = 32, heads: int = 4, seed: int = 0, **kwargs) -> Stack:
    torch.manual_seed(seed)
    return Stack([TransformerBlock(dim, heads) for _ in range(num_blocks)], dim, **kwargs).eval()


def fp8_stack(num_blocks: int = 3, dim: int = 32, seed: int = 0) -> Stack:
    torch.manual_seed(seed)
    return Stack([Fp8Block(dim) for _ in range(num_blocks)], dim).eval()


def snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def assert_same_tensors(module: nn.Module, expected: dict[str, torch.Tensor], device: torch.device) -> None:
    actual = module.state_dict()
    assert actual.keys() == expected.keys()
    for key, value in actual.items():
        assert value.device == device, f"{key} is on {value.device}, expected {device}"
        assert value.dtype == expected[key].dtype, key
        assert torch.equal(value.view(torch.uint8), expected[key].view(torch.uint8)), f"{key} changed"


def forward_steps(model: nn.Module, x: torch.Tensor, steps: int = 2) -> list[torch.Tensor]:
    """``steps`` forward passes (a streaming engine learns the call order in the first)."""
    with torch.inference_mode():
        return [model(x) for _ in range(steps)]
