"""One streamed block's record (``StreamedBlock``), kept by ``HostBlocks`` from packing to restoring: its host side
(the packed tensors, where they came from, their pinning), the device side's few per-block fields (events,
cached views, the copy that filled its region), and its companions.

Companions are tensors that travel with a block without belonging to it: a host's per-block extras (ComfyUI's
LoRA adapters for the block's weights), packed once into a host buffer of their own (pinned where the block's
is), copied into the ring right after the block's bytes and handed to the host as device views while the block
runs. Companions of at least ``IN_PLACE_SHARE`` of their block's bytes are copied from where they lie instead:
a model merge's are the other model's weights, and a second copy would take as much host memory as the
streamed blocks. They are never written again: a host that changes them starts another streamer.
"""

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
    """The host side of a streamed block: its packed tensors and where they came from."""

    layout: BlockLayout
    storage: BlockLayout
    host: torch.Tensor
    host_views: Views
    origin_device: torch.device
    # Kept with a lossy storage dtype (restoring from the rounded copy would change the model), and for a
    # block whose weights are views of their file (they cost no memory, and restoring copies nothing).
    originals: tuple[torch.Tensor, ...] | None = None
    pinned: bool = False
    pinned_bytes: int = 0  # reserved in the pin budget (an allocator may round the buffer up)
    # Why a block that wanted pinned memory has pageable memory: the budget refused it ("cap") or the
    # driver refused to register it ("driver").
    pageable_because: str | None = None
    # The device side: events made once, with the ring; the copy that filled its region, until its call.
    ready: torch.Event | None = None
    released: torch.Event | None = None
    released_once: bool = False
    copy: CopyRecord | None = None
    device_views: dict[int, Views] = field(default_factory=dict)  # by region start
    # A file-tier block (no host buffer): its stored bytes' sources, read into a staging slot for each copy.
    read: BlockRead | None = None
    file_backed: bool = False  # ``originals`` are views of the file
    # Tensors copied with the block, after its bytes in its region.
    companions: PackedCompanions | None = None
    # What the host wrote into the host buffer over the weights as packed (``contents``); None: nothing.
    content: Hashable = None
    # Its region holds a copy no call has used yet: its ``transforms`` entry has not transformed it.
    fresh: bool = False
    # A block waiting to be packed (``HostBlocks.pack_later``): its parts where they were when streaming began
    # (the loader's tensors, its file's views), copied from until its host buffer replaces them; None once packed.
    sources: tuple[torch.Tensor, ...] | None = None
    in_call: bool = False  # its tensors point at the ring (a call is open), not at ``host_views``
    # Kept where its ``sources`` lie instead of packed (``BackgroundPacking``): the block streams from its own
    # tensors, with no host buffer; ``pinned_in_place``: their storages, page-locked there (() if pageable).
    in_place: bool = False
    pinned_in_place: tuple[torch.Tensor, ...] = ()

    @classmethod
    def on_its_own_tensors(cls, layout: BlockLayout, **state: Any) -> StreamedBlock:
        """A block streamed from its module's own CPU tensors as they are, with no host buffer (one waiting to be
        packed, or one pinned in place); ``state``: the rest of its record."""
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
        """A block read from its file for each copy, in its stored dtypes (``stored``: its layout as stored):
        no host buffer, the module keeps the file's views. Its parts not in the file (a host's converted tensors)
        are copied from memory."""
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
        """Points the block's tensors back at its originals: its file's views, or the copy a storage dtype kept."""
        assert self.originals is not None, "only a block read from its file, from a file or cast to a storage dtype"
        self.layout.point_at(self.layout.assemble(self.originals))

    def restore(self, device: torch.device) -> None:
        """Points the block's tensors at their own memory on ``device`` again. A pageable host buffer already on
        ``device`` in the tensors' dtypes becomes their storage as it is: copying it out would hold the block
        twice while another model waits for the memory. A pinned one is copied, not to leave the model
        page-locked."""
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
        """Not packed yet (nor kept in place): copied from its ``sources``."""
        return self.sources is not None and not self.in_place

    @property
    def region_bytes(self) -> int:
        """The ring bytes the block takes: its own, then its companions'."""
        extra = self.companions.layout.nbytes if self.companions is not None else 0
        return aligned(self.layout.nbytes) + extra


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
