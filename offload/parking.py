"""Parked host buffers: a stopped streamer's blocks left on the host buffers they streamed from, for the next
streamer of the same modules to take over without packing or pinning them again.

A ``ParkingLot`` holds them, keyed weakly by block module: a deleted model takes its parked buffers (and their
pinned reservations) with it. Its owner decides what the lot covers (the pack keeps one per model, on the
model's state, so one model's unload never frees another's buffers). ``BlockStreamer`` parks into the lot it
was given and takes over from it (whether a parked buffer fits a streamer is the streamer's to say).
"""

from __future__ import annotations

import weakref
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from .layout import BlockLayout
from .pinning import byte_view, unpin_host_buffer, whole_storages

#: What a parked buffer's parts must still be for a block to take it over: name, parameter or not, offset,
#: shape and dtype of each, in order. No owner modules: a value of the weak lot must not keep its key alive.
Signature = tuple[tuple[str, bool, int, torch.Size, torch.dtype], ...]


def signature(layout: BlockLayout) -> Signature:
    return tuple(
        (slot.name, slot.is_parameter, part.offset, part.shape, part.dtype)
        for slot in layout.slots
        for part in slot.parts
    )


def same_memory(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    """Whether ``tensor`` is exactly ``view``: same device, address, dtype, shape and strides."""
    return (
        tensor.device == view.device
        and tensor.data_ptr() == view.data_ptr()
        and tensor.dtype == view.dtype
        and tensor.shape == view.shape
        and tensor.stride() == view.stride()
    )


@dataclass(frozen=True)
class ParkedBuffer:
    """A parked block's host buffer, known only weakly: the module's tensors are what keep it alive."""

    storage: weakref.ref[torch.UntypedStorage]
    nbytes: int
    signature: Signature
    pinned: bool
    recurse: bool  # laid out with the block's submodules, or its own tensors only
    # Its pinned bytes' reservation, released when the buffer is freed, or taken back by an adopting share.
    reservation: weakref.finalize[..., Any] | None
    # A block packed from its file: its parts as views of the file, which a real unload points it back at.
    originals: tuple[torch.Tensor, ...] | None = None
    content: Hashable = None  # what the host wrote over the weights as packed

    def host(self) -> torch.Tensor | None:
        storage = self.storage()
        if storage is None:
            return None
        return byte_view(storage, self.nbytes)

    def parts_for(
        self, layout: BlockLayout, pinned: bool, content: Hashable
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The buffer and its views as ``layout``'s parts, if a streamer asking for ``pinned`` memory and ``content``
        can take it over as it is: it is still alive, pinned as asked, holds no content or that one, and the
        block still uses exactly its views (a weight replaced or patched while parked means packing again)."""
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
    """A parked block pinned where its own tensors lie (``StreamedBlock.pinned_in_place``): its storages stay
    registered with the driver, known weakly (the module's tensors keep them alive, and each is unregistered
    when freed)."""

    storages: tuple[weakref.ref[torch.UntypedStorage], ...]
    nbytes: int  # its pinned bytes, reserved in the pin budget
    signature: Signature
    recurse: bool
    # The reservation, released when its first storage is freed, or taken back by an adopting share.
    reservation: weakref.finalize[..., Any] | None

    def whole(self) -> tuple[torch.Tensor, ...] | None:
        """Its storages as byte tensors over each (``page_lock.whole_storages``), or None once one is freed."""
        alive = self.alive()
        return alive if len(alive) == len(self.storages) else None

    def alive(self) -> tuple[torch.Tensor, ...]:
        """Its storages not freed yet (a freed one was unregistered as it went), as byte tensors over each."""
        return tuple(byte_view(storage) for storage in (ref() for ref in self.storages) if storage is not None)

    def parts_for(self, layout: BlockLayout) -> tuple[torch.Tensor, ...] | None:
        """Its storages, if the block's tensors are still exactly on them (laid out as parked)."""
        whole = self.whole()
        if whole is None or self.signature != signature(layout):
            return None
        current = {storage.data_ptr() for storage in whole_storages(layout.current())}
        return whole if current == {storage.data_ptr() for storage in whole} else None


Parked = ParkedBuffer | ParkedInPlace


class ParkingLot:
    """The parked buffers of some blocks, by block module (weakly)."""

    def __init__(self) -> None:
        self._parked: weakref.WeakKeyDictionary[nn.Module, Parked] = weakref.WeakKeyDictionary()

    def park(self, block: nn.Module, parked: Parked) -> None:
        self._parked[block] = parked

    def take(self, block: nn.Module) -> Parked | None:
        """The block's parked buffer, no longer in the lot (the taker adopts it, or lets it go with ``leave``)."""
        return self._parked.pop(block, None)

    def from_file(self, block: nn.Module) -> bool:
        """Whether ``block`` is parked on a host buffer packed from its file (whose views it goes back to)."""
        parked = self._parked.get(block)
        return isinstance(parked, ParkedBuffer) and parked.originals is not None and parked.host() is not None

    def unpark(self, modules: Iterable[nn.Module]) -> None:
        """Gives the parked blocks among ``modules`` memory of their own again (their file's views, or a copy of
        what they hold), so that their host buffers, pinned ones included, are freed: a host's real unload."""
        for module in modules:
            parked = self._parked.pop(module, None)
            if parked is not None:
                leave(module, parked)

    def unpin_in_place(self, modules: Iterable[nn.Module]) -> None:
        """Lets go of the blocks among ``modules`` parked pinned in place: their tensors unregistered where they lie,
        their reservations given back. For blocks no streamer will take over (a host loads them itself); a block
        parked on a host buffer needs nothing of the kind, its buffer freed once the host has moved its tensors."""
        for module in modules:
            if isinstance(self._parked.get(module), ParkedInPlace):
                leave(module, self._parked.pop(module))


def leave(module: nn.Module, parked: Parked) -> None:
    """Points ``module``'s parts that are views of its parked buffer at memory of their own: its file's views
    for a block packed from its file, else a copy. A block pinned in place keeps its tensors, unpinned, and its
    reservation goes back to the budget."""
    if isinstance(parked, ParkedInPlace):
        # Every storage still alive: one freed (a weight a host replaced) leaves the others registered otherwise.
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
