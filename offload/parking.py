"""Parked host buffers: a stopped streamer's blocks left on the host buffers they streamed from, for the next
streamer of the same modules to take over without packing or pinning again.

A ``ParkingLot`` is keyed weakly by block module, so a deleted model takes its parked buffers and reservations with it.
The pack keeps one lot per model, so one model's unload never frees another's buffers."""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layout import BlockLayout
from .pinning import byte_view, unpin_host_buffer, whole_storages

#: Name, parameter or not, offset, shape, dtype of each part. No owner modules: a value of the weak lot must not
#: keep its key alive.
Signature = tuple[tuple[str, bool, int, torch.Size, torch.dtype], ...]


def signature(layout: BlockLayout) -> Signature:
    return tuple(
        (slot.name, slot.is_parameter, part.offset, part.shape, part.dtype)
        for slot in layout.slots
        for part in slot.parts
    )


def same_memory(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        tensor.device == view.device
        and tensor.data_ptr() == view.data_ptr()
        and tensor.dtype == view.dtype
        and tensor.shape == view.shape
        and tensor.stride() == view.stride()
    )


@dataclass(frozen=True)
class ParkedBuffer:
    """A parked block's host buffer, known weakly: the module's tensors keep it alive."""

    storage: weakref.ref[torch.UntypedStorage]
    nbytes: int
    signature: Signature
    pinned: bool
    recurse: bool
    reservation: weakref.finalize[..., Any] | None  # released when the buffer is freed, unless adopted
    originals: tuple[torch.Tensor, ...] | None = None  # file views, for a block packed from its file
    content: Hashable = None

    def host(self) -> torch.Tensor | None:
        storage = self.storage()
        if storage is None:
            return None
        return byte_view(storage, self.nbytes)

    def parts_for(
        self, layout: BlockLayout, pinned: bool, content: Hashable
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The buffer and its views as ``layout``'s parts, if it can be taken over as it is: alive, pinned as asked,
        holding no content or ``content``, and the block still on exactly its views (a weight replaced while
        parked means packing again)."""
        if self.pinned != pinned or self.content not in (None, content):
            return None
        host = self.host()
        if host is None or self.signature != signature(layout):
            return None
        parts = layout.part_views(host)
        if not all(same_memory(tensor, view) for tensor, view in zip(layout.current(), parts, strict=True)):
            return None
        return host, parts


@dataclass(frozen=True)
class ParkedInPlace:
    """A parked block pinned where its tensors lie: its storages stay registered, known weakly, each unregistered
    when freed."""

    storages: tuple[weakref.ref[torch.UntypedStorage], ...]
    nbytes: int
    signature: Signature
    recurse: bool
    reservation: weakref.finalize[..., Any] | None

    def whole(self) -> tuple[torch.Tensor, ...] | None:
        alive = self.alive()
        return alive if len(alive) == len(self.storages) else None

    def alive(self) -> tuple[torch.Tensor, ...]:
        return tuple(byte_view(storage) for storage in (ref() for ref in self.storages) if storage is not None)

    def parts_for(self, layout: BlockLayout) -> tuple[torch.Tensor, ...] | None:
        """Its storages, if the block's tensors are still exactly on them."""
        whole = self.whole()
        if whole is None or self.signature != signature(layout):
            return None
        current = {storage.data_ptr() for storage in whole_storages(layout.current())}
        return whole if current == {storage.data_ptr() for storage in whole} else None


Parked = ParkedBuffer | ParkedInPlace


class ParkingLot:
    def __init__(self) -> None:
        self._parked: weakref.WeakKeyDictionary[nn.Module, Parked] = weakref.WeakKeyDictionary()

    def park(self, block: nn.Module, parked: Parked) -> None:
        self._parked[block] = parked

    def take(self, block: nn.Module) -> Parked | None:
        """Removes and returns the block's parked buffer; the taker adopts it or calls ``leave``."""
        return self._parked.pop(block, None)

    def from_file(self, block: nn.Module) -> bool:
        parked = self._parked.get(block)
        return isinstance(parked, ParkedBuffer) and parked.originals is not None and parked.host() is not None

    def unpark(self, modules: Iterable[nn.Module]) -> None:
        """A host's real unload: gives the parked blocks among ``modules`` memory of their own, so their host
        buffers, pinned ones included, are freed."""
        for module in modules:
            parked = self._parked.pop(module, None)
            if parked is not None:
                leave(module, parked)

    def unpin_in_place(self, modules: Iterable[nn.Module]) -> None:
        """Unpins the blocks among ``modules`` parked in place, for blocks the host now loads itself. Blocks parked
        on a buffer need nothing: it is freed once the host moves their tensors."""
        for module in modules:
            if isinstance(self._parked.get(module), ParkedInPlace):
                leave(module, self._parked.pop(module))


def leave(module: nn.Module, parked: Parked) -> None:
    """Points ``module``'s parts that view its parked buffer at memory of their own (file views, else a copy). A
    block pinned in place is unpinned and its reservation returned."""
    if isinstance(parked, ParkedInPlace):
        # Each live one: a freed one (a replaced weight) must not leave the others registered.
        for storage in parked.alive():
            unpin_host_buffer(storage)
        if parked.reservation is not None:
            parked.reservation()
        return
    host = parked.host()
    if host is None:
        return
    start, end = host.data_ptr(), host.data_ptr() + parked.nbytes
    layout = BlockLayout.of(module, recurse=parked.recurse)
    current = layout.current()
    originals = parked.originals or current
    parts = tuple(
        (original if parked.originals else part.clone())
        if part.device.type == "cpu" and start <= part.data_ptr() < end
        else part
        for part, original in zip(current, originals, strict=True)
    )
    layout.point_at(layout.assemble(parts))
