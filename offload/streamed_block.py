"""One streamed block's record (``StreamedBlock``), kept by ``HostBlocks`` from packing to restoring, and its
companions.

Companions travel with a block without belonging to it (ComfyUI's LoRA adapters for its weights): packed once beside it,
copied into the ring right after its bytes, handed to the host as device views while it runs. Large ones
(``IN_PLACE_SHARE``) are copied from where they lie, since a model merge's companions are another model's weights and a
second copy would double host memory. They are never written again; a host that changes them starts another streamer."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .file_source import BlockRead, FileSlice
from .layout import BlockLayout, Part, Views, aligned
from .timeline import CopyRecord


@dataclass
class StreamedBlock:
    """The host side of a streamed block, and the device side's few per-block fields."""

    layout: BlockLayout
    storage: BlockLayout
    host: torch.Tensor
    host_views: Views
    origin_device: torch.device
    # Kept with a lossy storage dtype (restoring the rounded copy would change the model), and for file views,
    # which cost no memory.
    originals: tuple[torch.Tensor, ...] | None = None
    pinned: bool = False
    pinned_bytes: int = 0  # reserved; an allocator may round the buffer up
    pageable_because: str | None = None  # "cap" or "driver", where pinning was asked
    # The device side: events made once with the ring; the copy that filled its region, until its call.
    ready: torch.Event | None = None
    released: torch.Event | None = None
    released_once: bool = False
    copy: CopyRecord | None = None
    device_views: dict[int, Views] = field(default_factory=dict)  # by region start
    read: BlockRead | None = None  # file tier only
    file_backed: bool = False  # ``originals`` are views of the file
    companions: PackedCompanions | None = None
    content: Hashable = None  # what the host wrote over the packed weights; None: nothing
    fresh: bool = False  # its region holds a copy no call has transformed yet
    # Until packed: the parts where they were when streaming began, copied from meanwhile.
    sources: tuple[torch.Tensor, ...] | None = None
    in_call: bool = False  # its tensors point at the ring, not at ``host_views``
    # Streamed from its own tensors instead of packed; ``pinned_in_place``: their storages, if page-locked.
    in_place: bool = False
    pinned_in_place: tuple[torch.Tensor, ...] = ()

    @classmethod
    def on_its_own_tensors(cls, layout: BlockLayout, **state: Any) -> StreamedBlock:
        """A block streamed from its module's own CPU tensors, with no host buffer (waiting to be packed, or pinned
        in place)."""
        return cls(layout, layout, torch.empty(0, dtype=torch.uint8), layout.held(), torch.device("cpu"), **state)

    @classmethod
    def read_from_file(
        cls,
        layout: BlockLayout,
        stored: BlockLayout,
        current: tuple[torch.Tensor, ...],
        slices: Sequence[FileSlice | None],
        origin: torch.device,
    ) -> StreamedBlock:
        """A file-tier block: no host buffer, the module keeps its file views, and parts not in the file are copied
        from memory."""
        storage = layout if stored.parts == layout.parts else stored
        sources = tuple(
            (part, tensor if source is None else source)
            for part, source, tensor in zip(storage.parts, slices, current, strict=True)
        )
        host = torch.empty(0, dtype=torch.uint8)
        views = layout.assemble(current)
        return cls(
            layout, storage, host, views, origin, current, read=BlockRead(sources, storage.nbytes), file_backed=True
        )

    def point_at_originals(self) -> None:
        """Points the tensors back at their file views or the copy a storage dtype kept."""
        assert self.originals is not None, "only a block read from its file, from a file or cast to a storage dtype"
        self.layout.point_at(self.layout.assemble(self.originals))

    def restore(self, device: torch.device) -> None:
        """Gives the tensors their own memory on ``device`` again. A pageable host buffer already there in the right
        dtypes becomes their storage, since copying it would hold the block twice while another model waits; a
        pinned one is copied, so the model is not left page-locked."""
        sources = self.originals if self.originals is not None else self._host_parts()
        adopt_host = (
            self.originals is None
            and not self.pinned
            and self.host.device == device
            and all(source.dtype == part.dtype for part, source in zip(self.layout.parts, sources, strict=True))
        )
        restored = tuple(
            source if adopt_host else source.to(device=device, dtype=part.dtype, copy=True)
            for part, source in zip(self.layout.parts, sources, strict=True)
        )
        self.layout.point_at(self.layout.assemble(restored))

    def _host_parts(self) -> tuple[torch.Tensor, ...]:
        return self.sources if self.sources is not None else self.storage.part_views(self.host)

    @property
    def waiting(self) -> bool:
        """Not packed yet nor kept in place: copied from its ``sources``."""
        return self.sources is not None and not self.in_place

    @property
    def region_bytes(self) -> int:
        extra = self.companions.layout.nbytes if self.companions is not None else 0
        return aligned(self.layout.nbytes) + extra


IN_PLACE_SHARE = 0.5


@dataclass(frozen=True)
class CompanionLayout:
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
    """A block's companions in their host buffer or where they lie, and their ring views."""

    layout: CompanionLayout
    host: torch.Tensor
    reserved: int
    pinned: bool  # every byte is copied from page-locked memory
    sources: tuple[torch.Tensor, ...] | None = None  # kept where they lie
    views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # by region start

    @classmethod
    def pack(
        cls,
        tensors: Sequence[torch.Tensor],
        block_bytes: int,
        buffer: Callable[[int, Callable[[torch.Tensor], None]], tuple[torch.Tensor, int, str | None]],
    ) -> PackedCompanions:
        """Packs ``tensors`` into a buffer from ``buffer``, or keeps them where they lie when they weigh
        ``IN_PLACE_SHARE`` of the block or more."""
        layout = CompanionLayout.of(tensors)
        if layout.nbytes >= IN_PLACE_SHARE * block_bytes:
            sources = tuple(tensors)
            pinned = all(tensor.is_pinned() for tensor in sources)
            return cls(layout, torch.empty(0, dtype=torch.uint8), 0, pinned, sources)
        host, reserved, _ = buffer(layout.nbytes, lambda host: layout.pack_into(host, tensors))
        return cls(layout, host, reserved, host.is_pinned())

    def copy_into(self, target: torch.Tensor) -> None:
        if self.sources is None:
            target[: self.host.numel()].copy_(self.host, non_blocking=self.pinned)
            return
        for view, source in zip(self.layout.views(target), self.sources, strict=True):
            view.copy_(source, non_blocking=True)
