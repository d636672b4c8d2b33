"""Tensors that travel with a streamed block without belonging to it: a host's per-block extras (ComfyUI's
LoRA adapters for the block's weights), packed once into a host buffer of their own (pinned where the
block's is), copied into the ring right after the block's bytes, on the copy stream, and handed to the host
as device views while the block runs (``BlockStreamer.companions``).

Companions of at least ``IN_PLACE_SHARE`` of their block's bytes are not packed but copied from where they lie,
part by part: a model merge's are the other model's weights, held already by whoever holds that model, and a
second copy of them would take as much host memory as the streamed blocks themselves (ComfyUI's own partial
load copies them from where they lie too, at each use).

They are packed when the streamer starts and never written again: a host that changes them (another set of
patches) starts another streamer, whose blocks adopt their parked weights and pack only these.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from .layout import Part, aligned

#: The share of its block's bytes from which a block's companions are copied from where they lie, not packed.
IN_PLACE_SHARE = 0.5


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
    """A block's companions in their host buffer, or where they lie (``sources``), and the device views made of
    them in the ring."""

    layout: CompanionLayout
    host: torch.Tensor
    reserved: int  # the pinned bytes reserved for ``host``
    pinned: bool  # every byte of them is copied from page-locked memory
    sources: tuple[torch.Tensor, ...] | None = None  # kept where they lie: copied from these, part by part
    views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # by region start

    @classmethod
    def pack(
        cls,
        tensors: Sequence[torch.Tensor],
        block_bytes: int,
        buffer: Callable[[int, Callable[[torch.Tensor], None]], tuple[torch.Tensor, int, str | None]],
    ) -> PackedCompanions:
        """``tensors`` packed into a host buffer from ``buffer`` (``HostMemory.buffer``), or kept where they lie
        where they weigh ``IN_PLACE_SHARE`` of their block's ``block_bytes`` or more."""
        layout = CompanionLayout.of(tensors)
        if layout.nbytes >= IN_PLACE_SHARE * block_bytes:
            sources = tuple(tensors)
            pinned = all(tensor.is_pinned() for tensor in sources)
            return cls(layout, torch.empty(0, dtype=torch.uint8), 0, pinned, sources)
        host, reserved, _ = buffer(layout.nbytes, lambda host: layout.pack_into(host, tensors))
        return cls(layout, host, reserved, host.is_pinned())

    def copy_into(self, target: torch.Tensor) -> None:
        """Issues the copy of the companions into ``target``, their place in the ring."""
        if self.sources is None:
            target[: self.host.numel()].copy_(self.host, non_blocking=self.pinned)
            return
        for view, source in zip(self.layout.views(target), self.sources, strict=True):
            view.copy_(source, non_blocking=True)
