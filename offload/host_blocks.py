"""The host side of streamed blocks: each block's tensors packed once into a host buffer (pinned where the pin
budget and the driver allow) or left in their checkpoint file to be read at each copy (the file tier), the
companions packed beside them, and what becomes of them when streaming stops: restored to memory of their own,
or parked in a ``ParkingLot`` (``BlockParking``) for the next streamer of the same modules to take over as they
are.

``BlockStreamer`` owns one and runs the device side (ring, copies, hooks) from the ``StreamedBlock`` records it
keeps.
"""

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
from .spec import FileOptions, HostOptions
from .streamed_block import PackedCompanions, StreamedBlock


class HostBlocks:
    """The host side of a streamer's blocks (see the module docstring): ``blocks`` holds each streamed block's
    record by index, from ``pack`` to ``take`` or ``let_go``.

    ``memory``: where host buffers come from (pinned as the streamer may, within its share of a pin budget);
    ``options`` and ``files``: the spec's parts (``offload/spec.py``).
    A storage dtype is cast back on the copy stream, right after the copy, so the cast and the copy are ordered on
    one stream; the originals are kept too, because a rounded copy must never replace them.
    Weights that are views of their checkpoint file are never copied into memory of the process: a block read
    from the file each step has no host buffer (``offload/file_tier.py``); other blocks pack their host buffer
    from the file. Host buffers hold the dtype each tensor is computed in; file-tier bytes are cast to it on the
    device, after the copy.
    A host writes a block's ``contents`` through its tensors between ``enable`` and the first step
    (``needs_content`` says which, ``wrote_content`` that it is done). A parked buffer is adopted only by a
    streamer naming the same content, or none; one holding other content is dropped and the block packed again
    from its originals, so only a block packed from its file may hold content."""

    def __init__(
        self, device: torch.device, memory: HostMemory, options: HostOptions, files: FileOptions, *, recurse: bool
    ) -> None:
        self.device = device
        self.options = options
        self.files = files
        self.recurse = recurse
        self.memory = memory
        # Narrowed by ``BlockStreamer.make_resident`` as blocks leave the host side.
        self.read_each_step = files.read_each_step
        self.parking = BlockParking(self.memory, options, files, recurse=recurse)
        self.blocks: dict[int, StreamedBlock] = {}
        # Copied into host buffers by ``pack_all`` before it returned (adopted, file-tier or left to the packing
        # thread: none; the thread counts its own in ``background.packed_bytes``).
        self.packed_bytes = 0
        self.modules: dict[int, nn.Module] = {}  # the module of each block in ``blocks``
        # Held while a block's record or its module's tensors change: by the streamer's thread around each copy
        # from a block and each re-pointing of its tensors, by the packing thread around handing a block over.
        self.lock = threading.Lock()
        self.background = BackgroundPacking(self.blocks, self.memory, self.lock, device)

    @property
    def unit(self) -> str:
        return "block" if self.recurse else "module"

    def pack_all(
        self, blocks: Mapping[int, nn.Module], progress: Callable[[int, int], None] | None, later: bool = False
    ) -> None:
        """Every block of ``blocks`` (index: module) packed, in index order, ``packed_bytes`` counting this
        start's copies; ``progress(done, total)`` hears each. A failure (a host's interrupt raised from
        ``progress``, a fill that raises) leaves every block packed so far on memory of its own again.
        ``later``: a block that can wait (``pack_later``) is not packed now but by ``background``'s thread."""
        self.packed_bytes = self.background.packed_bytes = self.background.total_bytes = 0
        order = sorted(blocks)
        try:
            for done, index in enumerate(order, 1):
                if not (later and self.pack_later(index, blocks[index])):
                    self.pack(index, blocks[index])
                if progress is not None:
                    progress(done, len(order))
        except BaseException:
            self.let_go(park=False)
            raise

    def pack(self, index: int, block: nn.Module) -> StreamedBlock:
        """Block ``index`` (``block``) moved into its host buffer, a parked one taken over, or left in its file."""
        state = self.blocks[index] = self._packed(index, block)
        self.modules[index] = block
        self._pack_companions(index, state)
        return state

    def pack_later(self, index: int, block: nn.Module) -> bool:
        """Block ``index`` recorded as waiting, its tensors left where they are (its ``sources``), to be packed
        by the packing thread, or its parked buffer taken over (nothing to pack); False (nothing done) for a
        block that cannot wait: one read from its file each step (never packed), cast to a storage dtype or to
        hold other content (both need its host buffer before the first step), or not in CPU memory."""
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
        """Block ``index``'s record, no longer kept (its companions dropped): the caller restores it."""
        self.modules.pop(index, None)
        state = self.blocks.pop(index, None)
        if state is not None:
            self._drop_companions(state)
        return state

    def check_can_park(self, park: bool) -> None:
        """Raises before anything is let go if ``park`` is asked without a lot to park into."""
        if park and self.options.parking is None:
            raise ValueError("parking needs a ParkingLot: give the streamer one (parking=...) to park into")

    def let_go(self, park: bool) -> None:
        """Every block back on memory of its own (its file's views, a copy, or, pageable and in its tensors'
        dtypes, its host buffer as it is); with ``park``, blocks that came from the CPU stay on their host
        buffers, in ``parking``. Block by block, each record dropped as its block gets its memory back:
        restoring every block before dropping any would hold the streamed bytes twice, on unload, exactly when
        another model is waiting for the RAM."""
        self.check_can_park(park)
        self.background.stop()
        for index in sorted(self.blocks):
            module = self.modules[index]
            state = self.take(index)
            assert state is not None
            if state.waiting:  # nothing was packed to park: its own tensors again, as it held them
                state.layout.point_at(state.host_views)
                self.unpin(state)
            elif state.in_place:  # its own tensors: parked as they are where pinned there, or unpinned
                state.layout.point_at(state.host_views)
                if park and state.pinned_in_place:
                    self.parking.park_in_place(module, state)
                else:
                    self.unpin(state)
            elif park and state.origin_device.type == "cpu":
                self.parking.park(module, state, self.unpin)
            elif state.file_backed:
                state.point_at_originals()  # the file's views, as they were
                self.unpin(state)
            else:
                state.restore(state.origin_device)
                self.unpin(state)

    def unpin_some(self, nbytes: int) -> int:
        """Unpins blocks' host buffers, last first, until ``nbytes`` of the pin budget are free again; returns
        how many. The caller makes sure no copy reads them meanwhile."""
        freed = 0
        for state in reversed([self.blocks[index] for index in sorted(self.blocks)]):
            if freed >= nbytes:
                break
            if state.waiting and state.pinned_bytes:
                freed += state.pinned_bytes  # its reservation: it will be packed pageable
                self.unpin(state)
                state.pageable_because = "cap"
            elif state.pinned_in_place or (state.pinned and unpin_host_buffer(state.host)):  # the same memory, pageable
                freed += state.pinned_bytes
                self.unpin(state)
                state.pinned, state.pageable_because = False, "cap"
        return freed

    def pageable_because(self, reason: str) -> dict[int, int]:
        """Blocks (index: host bytes) whose host buffer is pageable for ``reason`` ("cap" or "driver")."""
        return {i: state.storage.nbytes for i, state in sorted(self.blocks.items()) if state.pageable_because == reason}

    @property
    def buffer_bytes(self) -> int:
        """The blocks' host buffers, those of blocks still waiting to be packed included (a block pinned in place
        has none: its own tensors)."""
        return sum(
            state.storage.nbytes if state.waiting else state.host.numel()
            for state in self.blocks.values()
            if not state.in_place
        )

    @property
    def companion_bytes(self) -> int:
        """The host buffers of the blocks' companions (packed once, copied with their blocks; none for those kept
        where they lie)."""
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
            originals = current  # views of the file: they cost no memory
        elif storage_dtype is not None:
            # Kept on the host: originals left on the device would keep the whole block there.
            originals = tuple(t.to("cpu") for t in current)
        # Otherwise the block's only copy of its weights is now the host buffer.
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
        """The streamed blocks whose host buffers do not hold the content ``contents`` names for them yet."""
        return frozenset(
            index
            for index, content in self.options.contents.items()
            if index in self.blocks and self.blocks[index].content != content
        )

    def wrote_content(self, indices: Iterable[int]) -> None:
        """The host has written their ``contents`` into these blocks' host buffers (their tensors, on the host)."""
        for index in indices:
            state = self.blocks[index]
            if state.read is not None or not state.file_backed:
                raise ValueError(
                    f"{self.unit} {index} has no originals in a file to go back to: only a host buffer packed from "
                    "its file may hold other content"
                )
            state.content = self.options.contents[index]

    def unpin(self, state: StreamedBlock) -> None:
        """Gives the block's pinned bytes (or a waiting block's reservation) back to the budget (its host buffer
        is dropped with it); a block pinned in place is unregistered, its tensors left as they are."""
        for storage in state.pinned_in_place:
            unpin_host_buffer(storage)
        state.pinned_in_place = ()
        if state.pinned or state.waiting:
            self.memory.release(state.pinned_bytes)
            state.pinned_bytes = 0


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
