"""The host side of streamed blocks: each block packed once into a host buffer (pinned where allowed) or left in its
checkpoint file (the file tier), its companions beside it, and what happens when streaming stops: restored to
memory of its own, or parked for the next streamer of the same modules."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Mapping

import torch
from torch import nn

from .background_packing import BackgroundPacking
from .layout import BlockLayout
from .parking import ParkedBuffer, ParkedInPlace, leave, signature
from .pinning import HostMemory, pinned_allocation_bytes, unpin_host_buffer
from .runner import PackProgress
from .spec import FileOptions, HostOptions
from .streamed_block import PackedCompanions, StreamedBlock


class HostBlocks:
    """The host side of a streamer's blocks: ``blocks`` holds each record from ``pack`` to ``take`` or ``let_go``.

    A storage dtype is cast back on the copy stream right after the copy, so both are ordered on one stream, and the
    originals are kept: a rounded copy must never replace them. Host buffers hold compute dtypes; file-tier bytes are
    cast on the device. Only a block packed from its file may hold ``contents`` (written between ``enable`` and the
    first step), since it can be repacked from the file."""

    def __init__(
        self, device: torch.device, memory: HostMemory, options: HostOptions, files: FileOptions, *, recurse: bool
    ) -> None:
        self.device = device
        self.options = options
        self.files = files
        self.recurse = recurse
        self.memory = memory
        self.read_each_step = files.read_each_step
        self.parking = BlockParking(self.memory, options, files, recurse=recurse)
        self.blocks: dict[int, StreamedBlock] = {}
        # Copied by ``pack_all`` itself; the packing thread counts its own.
        self.packed_bytes = 0
        self.modules: dict[int, nn.Module] = {}
        # Held while a record or its module's tensors change: by the streamer around each copy and re-pointing,
        # by the packing thread around handing a block over.
        self.lock = threading.Lock()
        self.background = BackgroundPacking(self.blocks, self.memory, self.lock, device)

    @property
    def unit(self) -> str:
        return "block" if self.recurse else "module"

    def pack_all(self, blocks: Mapping[int, nn.Module], progress: PackProgress | None, later: bool = False) -> None:
        """Packs ``blocks`` in index order; ``progress`` hears each. On any failure (including a host
        interrupt raised from ``progress``) every block packed so far gets its own memory back. ``later``: blocks
        that can wait are left to the packing thread."""
        self.packed_bytes = self.background.packed_bytes = self.background.total_bytes = 0
        order = sorted(blocks)
        try:
            for done, index in enumerate(order, 1):
                if not (later and self.pack_later(index, blocks[index])):
                    self.pack(index, blocks[index])
                if progress is not None:
                    progress(done, len(order), self.packed_bytes)
        except BaseException:
            self.let_go(park=False)
            raise

    def pack(self, index: int, block: nn.Module) -> StreamedBlock:
        """Block ``index`` moved into its host buffer, a parked one taken over, or left in its file."""
        state = self.blocks[index] = self._packed(index, block)
        self.modules[index] = block
        self._pack_companions(index, state)
        return state

    def pack_later(self, index: int, block: nn.Module) -> bool:
        """Records block ``index`` as waiting for the packing thread, or adopts its parked buffer. False, doing
        nothing, for a block that must be ready by the first step: file tier, storage dtype, content, or not in
        CPU memory."""
        if self.options.storage_dtype is not None or index in self.read_each_step or index in self.options.contents:
            return False
        adopted = self.parking.adopt(index, block)
        if adopted is not None:
            self.blocks[index], self.modules[index] = adopted, block
            self._pack_companions(index, adopted)
            return True
        layout = BlockLayout.of(block, recurse=self.recurse, dtype_of=self.files.dtype_of)
        current = layout.current()
        if any(part.device.type != "cpu" for part in current):
            return False
        file_slice = self.files.file_slice
        file_backed = file_slice is not None and any(file_slice(part) is not None for part in current)
        reserved = pinned_allocation_bytes(layout.nbytes) if self.memory.pin_memory else 0
        wants_pin = self.memory.pin_memory and (self.memory.share is None or self.memory.share.reserve(reserved))
        self.blocks[index] = StreamedBlock.on_its_own_tensors(
            layout,
            originals=current if file_backed else None,
            pinned=False,
            pinned_bytes=reserved if wants_pin else 0,
            pageable_because=None if wants_pin or not self.memory.pin_memory else "cap",
            file_backed=file_backed,
            sources=current,
        )
        self.modules[index] = block
        self._pack_companions(index, self.blocks[index])
        return True

    def take(self, index: int) -> StreamedBlock | None:
        """Drops block ``index``'s record and companions; the caller restores it."""
        self.modules.pop(index, None)
        state = self.blocks.pop(index, None)
        if state is not None:
            self._drop_companions(state)
        return state

    def check_can_park(self, park: bool) -> None:
        """Raises before anything is let go if ``park`` is asked with no lot."""
        if park and self.options.parking is None:
            raise ValueError("parking needs a ParkingLot: give the streamer one (parking=...) to park into")

    def let_go(self, park: bool) -> None:
        """Gives every block memory of its own again; with ``park``, blocks from the CPU stay on their host buffers
        in the lot. One block at a time, so an unload never holds the streamed bytes twice just when another model
        wants the RAM."""
        self.check_can_park(park)
        self.background.stop()
        for index in sorted(self.blocks):
            module = self.modules[index]
            state = self.take(index)
            assert state is not None
            if state.waiting:  # nothing packed to park
                state.layout.point_at(state.host_views)
                self.unpin(state)
            elif state.in_place:
                state.layout.point_at(state.host_views)
                if park and state.pinned_in_place:
                    self.parking.park_in_place(module, state)
                else:
                    self.unpin(state)
            elif park and state.origin_device.type == "cpu":
                self.parking.park(module, state, self.unpin)
            elif state.file_backed:
                state.point_at_originals()
                self.unpin(state)
            else:
                state.restore(state.origin_device)
                self.unpin(state)

    def unpin_some(self, nbytes: int) -> int:
        """Unpins host buffers, last block first, until ``nbytes`` are free; returns how many. The caller ensures no
        copy reads them meanwhile."""
        freed = 0
        for state in reversed([self.blocks[index] for index in sorted(self.blocks)]):
            if freed >= nbytes:
                break
            if state.waiting and state.pinned_bytes:
                freed += state.pinned_bytes  # it will be packed pageable
                self.unpin(state)
                state.pageable_because = "cap"
            elif state.pinned_in_place or (state.pinned and unpin_host_buffer(state.host)):
                freed += state.pinned_bytes
                self.unpin(state)
                state.pinned, state.pageable_because = False, "cap"
        return freed

    def pageable_because(self, reason: str) -> dict[int, int]:
        return {i: state.storage.nbytes for i, state in sorted(self.blocks.items()) if state.pageable_because == reason}

    @property
    def buffer_bytes(self) -> int:
        """The blocks' host buffers, waiting blocks included; blocks pinned in place have none."""
        return sum(
            state.storage.nbytes if state.waiting else state.host.numel()
            for state in self.blocks.values()
            if not state.in_place
        )

    @property
    def companion_bytes(self) -> int:
        return sum(state.companions.host.numel() for state in self.blocks.values() if state.companions is not None)

    def _packed(self, index: int, block: nn.Module) -> StreamedBlock:
        adopted = self.parking.adopt(index, block)
        if adopted is not None:
            return adopted
        file_slice, dtype_of, storage_dtype = self.files.file_slice, self.files.dtype_of, self.options.storage_dtype
        layout = BlockLayout.of(block, recurse=self.recurse, dtype_of=dtype_of)
        current = layout.current()
        slices = [file_slice(part) for part in current] if file_slice is not None else []
        file_backed = any(source is not None for source in slices)
        if index in self.read_each_step:
            if not file_backed:
                raise ValueError(f"{self.unit} {index} is to be read from its file each step, but has no weight in one")
            stored = BlockLayout.of(block, recurse=self.recurse)
            return StreamedBlock.read_from_file(layout, stored, current, slices, layout.device or self.device)
        storage = layout
        if storage_dtype is not None:
            storage = BlockLayout.of(block, storage_dtype, recurse=self.recurse, dtype_of=dtype_of)
        origin = layout.device or self.device
        host, reserved, pageable_because = self.memory.buffer(storage.nbytes, storage.pack_into)
        pinned = self.memory.pin_memory and pageable_because is None
        self.packed_bytes += storage.nbytes
        host_views = storage.views(host)
        originals = None
        if file_backed:
            originals = current  # file views cost no memory
        elif storage_dtype is not None:
            # On the host: originals left on the device would keep the whole block there.
            originals = tuple(t.to("cpu") for t in current)
        layout.point_at(host_views)
        return StreamedBlock(
            layout,
            storage,
            host,
            host_views,
            origin,
            originals,
            pinned,
            reserved,
            pageable_because=pageable_because,
            file_backed=file_backed,
        )

    def _pack_companions(self, index: int, state: StreamedBlock) -> None:
        tensors = self.options.companions.get(index)
        if tensors:
            state.companions = PackedCompanions.pack(tensors, state.layout.nbytes, self.memory.buffer)

    def _drop_companions(self, state: StreamedBlock) -> None:
        if state.companions is not None:
            self.memory.release(state.companions.reserved)
            state.companions = None

    @property
    def needs_content(self) -> frozenset[int]:
        return frozenset(
            index
            for index, content in self.options.contents.items()
            if index in self.blocks and self.blocks[index].content != content
        )

    def wrote_content(self, indices: Iterable[int]) -> None:
        """Marks ``contents`` written; raises for a block with no file originals to go back to."""
        for index in indices:
            state = self.blocks[index]
            if state.read is not None or not state.file_backed:
                raise ValueError(
                    f"{self.unit} {index} has no originals in a file to go back to: only a host buffer packed from "
                    "its file may hold other content"
                )
            state.content = self.options.contents[index]

    def unpin(self, state: StreamedBlock) -> None:
        """Returns the block's pinned bytes (or a waiting block's reservation) to the budget, and unregisters blocks
        pinned in place."""
        for storage in state.pinned_in_place:
            unpin_host_buffer(storage)
        state.pinned_in_place = ()
        if state.pinned or state.waiting:
            self.memory.release(state.pinned_bytes)
            state.pinned_bytes = 0


class BlockParking:
    """Parks and adopts the host buffers of one streamer's blocks. A buffer is adopted only where this streamer would
    have packed the same bytes."""

    def __init__(self, memory: HostMemory, options: HostOptions, files: FileOptions, *, recurse: bool) -> None:
        self.memory = memory
        self.options = options
        self.files = files
        self.recurse = recurse

    def park(self, module: nn.Module, state: StreamedBlock, unpin: Callable[[StreamedBlock], None]) -> None:
        """Leaves ``module`` on its host buffer, without a copy. File-tier and lossy storage-dtype blocks go back to
        their originals instead."""
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
        """Parks a block pinned in place: it stays registered, and its reservation counted until it is adopted or
        freed."""
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
        """The block's parked buffer or in-place pins, taken over as they are. One not taken over is given back: a
        file-packed block points at its file views again, so it never repacks from a buffer holding other content."""
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
        """A block pinned in place as this streamer would have pinned it."""
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
        """A parked buffer as block ``index``'s, if it fits and its pinned bytes can move into this share."""
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
