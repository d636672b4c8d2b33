"""Tensors that travel with a streamed block without belonging to it: a host's per-block extras (ComfyUI's
LoRA adapters for the block's weights), packed once into a host buffer of their own (pinned where the
block's is), copied into the ring right after the block's bytes, on the copy stream, and handed to the host
as device views while the block runs (``BlockStreamer.companions``).

They are packed when the streamer starts and never written again: a host that changes them (another set of
patches) starts another streamer, whose blocks adopt their parked weights and pack only these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .layout import Part, aligned


@dataclass(frozen=True)
class CompanionLayout:
    """Where each companion tensor lives in its flat buffer, in the order given."""

    parts: tuple[Part, ...]
    nbytes: int

    @classmethod
    def of(cls, tensors: Sequence[torch.Tensor]) -> CompanionLayout:
        parts, offset = [], 0
        for tensor in tensors:
            offset = aligned(offset)
            parts.append(Part(offset, tensor.shape, tensor.dtype))
            offset += tensor.numel() * tensor.element_size()
        return cls(tuple(parts), aligned(offset))

    def pack_into(self, flat: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
        for part, tensor in zip(self.parts, tensors, strict=True):
            part.view(flat).copy_(tensor)

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(part.view(flat) for part in self.parts)


@dataclass
class PackedCompanions:
    """A block's companions in their host buffer, and the device views made of them in the ring."""

    layout: CompanionLayout
    host: torch.Tensor
    reserved: int  # the pinned bytes reserved for ``host``
    views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # by region start

    @classmethod
    def pack(
        cls,
        tensors: Sequence[torch.Tensor],
        buffer: Callable[[int, Callable[[torch.Tensor], None]], tuple[torch.Tensor, int, str | None]],
    ) -> PackedCompanions:
        """``tensors`` packed into a host buffer from ``buffer`` (``HostMemory.buffer``)."""
        layout = CompanionLayout.of(tensors)
        host, reserved, _ = buffer(layout.nbytes, lambda host: layout.pack_into(host, tensors))
        return cls(layout, host, reserved)
