"""A streamer's side of parking (``offload/parking.py``): what ``HostBlocks`` leaves in the lot when it lets its
blocks go with ``park``, and what it takes over from the lot instead of packing a block again."""

from __future__ import annotations

import weakref
from collections.abc import Callable

from torch import nn

from .layout import BlockLayout
from .page_lock import pinned_allocation_bytes
from .parking import ParkedBuffer, ParkedInPlace, leave, signature
from .pinning import HostMemory
from .spec import FileOptions, HostOptions
from .streamed_block import StreamedBlock


class BlockParking:
    """Parks and adopts the host buffers of one streamer's blocks.

    ``options.parking``: where they are parked and taken from (None: this streamer neither parks nor adopts). A
    buffer is adopted only where this streamer would have packed the same bytes (no storage dtype, not read from
    its file each step, the same ``contents``)."""

    def __init__(self, memory: HostMemory, options: HostOptions, files: FileOptions, *, recurse: bool) -> None:
        self.memory = memory
        self.options = options
        self.files = files
        self.recurse = recurse

    def park(self, module: nn.Module, state: StreamedBlock, unpin: Callable[[StreamedBlock], None]) -> None:
        """Leaves ``module`` on host memory without a copy (its tensors already point at the host views).
        A block from its file keeps its host buffer too (its file views kept beside it); one read from the
        file at each step, or stored in a lossy dtype, goes back to its originals (``unpin`` gives back its
        pinned bytes)."""
        if state.read is not None or (state.originals is not None and not state.file_backed):
            state.point_at_originals()  # the rounded copy must not replace them
            unpin(state)
            return
        storage = state.host.untyped_storage()
        reservation = self.memory.park(state.pinned_bytes, storage) if state.pinned else None
        lot = self.options.parking
        if lot is None:
            raise ValueError("parking needs a ParkingLot: give the streamer one (parking=...) to park into")
        lot.park(
            module,
            ParkedBuffer(
                weakref.ref(storage),
                state.host.numel(),
                signature(state.layout),
                state.pinned,
                self.recurse,
                reservation,
                state.originals if state.file_backed else None,
                state.content,
            ),
        )

    def park_in_place(self, module: nn.Module, state: StreamedBlock) -> None:
        """Leaves a block pinned in place (``StreamedBlock.pinned_in_place``) as it is: its tensors stay registered
        with the driver, and its reservation stays counted until it is adopted or its memory freed."""
        lot = self.options.parking
        if lot is None:
            raise ValueError("parking needs a ParkingLot: give the streamer one (parking=...) to park into")
        storages = tuple(storage.untyped_storage() for storage in state.pinned_in_place)
        reservation = self.memory.park(state.pinned_bytes, storages[0]) if storages else None
        lot.park(
            module,
            ParkedInPlace(
                tuple(weakref.ref(storage) for storage in storages),
                state.pinned_bytes,
                signature(state.layout),
                self.recurse,
                reservation,
            ),
        )
        state.pinned_in_place, state.pinned_bytes = (), 0

    def adopt(self, index: int, block: nn.Module) -> StreamedBlock | None:
        """The block's parked host buffer, taken over as it is (``_take_over``), or its tensors pinned in place as
        they are. One not taken over goes: a block packed from its file points at the file's views again, to be
        packed from them (never from a buffer that may hold other content, nor into a copy of its own that would
        outlive the streamer); one pinned in place is unpinned, to be pinned or packed again."""
        lot = self.options.parking
        parked = lot.take(block) if lot is not None else None
        if parked is None:
            return None
        layout = BlockLayout.of(block, recurse=self.recurse, dtype_of=self.files.dtype_of)
        if isinstance(parked, ParkedInPlace):
            adopted = self._take_over_in_place(parked, layout, index)
        else:
            adopted = self._take_over(parked, layout, index)
        if adopted is None and (isinstance(parked, ParkedInPlace) or parked.originals is not None):
            leave(block, parked)
        return adopted

    def _take_over_in_place(self, parked: ParkedInPlace, layout: BlockLayout, index: int) -> StreamedBlock | None:
        """A block pinned in place as this streamer would have pinned it: pinning asked, its own tensors streamed
        as they are (no storage dtype, not read from its file each step), still on the storages parked."""
        if self.options.storage_dtype is not None or index in self.files.read_each_step or not self.memory.pin_memory:
            return None
        storages = parked.parts_for(layout)
        if storages is None or not self.memory.adopt(parked.reservation, True):
            return None
        return StreamedBlock.on_its_own_tensors(
            layout,
            pinned=True,
            pinned_bytes=parked.nbytes,
            sources=layout.current(),
            in_place=True,
            pinned_in_place=storages,
        )

    def _take_over(self, parked: ParkedBuffer, layout: BlockLayout, index: int) -> StreamedBlock | None:
        """A parked host buffer as block ``index``'s, if it fits (``ParkedBuffer.parts_for``) and its pinned
        bytes can move into this streamer's share; never for a block to be read from its file at each step."""
        fits = (
            None
            if self.options.storage_dtype is not None or index in self.files.read_each_step
            else parked.parts_for(layout, self.memory.pin_memory, self.options.contents.get(index))
        )
        if fits is None:
            return None
        if not self.memory.adopt(parked.reservation, parked.pinned):
            return None
        host, parts = fits
        reserved = pinned_allocation_bytes(parked.nbytes) if parked.pinned else 0
        return StreamedBlock(
            layout,
            layout,
            host,
            layout.assemble(parts),
            host.device,
            parked.originals,
            parked.pinned,
            reserved,
            file_backed=parked.originals is not None,
            content=parked.content,
        )
