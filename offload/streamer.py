"""Streams blocks that do not live on the device through one reusable device
buffer, the ring (``offload/ring.py``), each copy issued ahead of use on a
dedicated copy stream.

How one step runs:

* Each streamed block's tensors live once, in one flat (pinned) host buffer; the
  module's parameters point at views of it while the block is offloaded.
* The ring is allocated once, sized in bytes: by default as ``prefetch + 1``
  blocks as large as the largest streamed one; a planner may give it whatever
  its budget leaves. Before block ``i`` runs, the next streamed blocks of the
  expected call order are copied into it, each into a region of its own size,
  as far ahead as the ring has room and at most ``prefetch`` blocks.
* The compute stream waits on the block's *ready* event, not on the host, and
  the block's parameters are pointed at its region for the duration of its call.
* After the call the block records a *released* event on the compute stream; a
  copy that overwrites any of its bytes waits on it first on the copy stream.
  That ordering is what prevents the use-after-free race of overwriting memory
  the compute stream has not finished reading; later copies on the same stream
  come after it. Weights are only read, so nothing is copied back.

The call order is learned: the first step assumes list order, later steps
follow the order the previous step really used, so blocks that run twice, run
out of order or are skipped cost a miss (an unhidden copy) at most once.

Stopping can *park* instead of restoring: blocks that came from the CPU keep
their host buffers, which then are their only storage (valid CPU tensors holding
exactly the weights), in the streamer's ``ParkingLot`` (``offload/parking.py``).
The next streamer enabled on the same modules with the same lot adopts a parked
buffer while the modules still use exactly its views, so a host that hands a
model from one streamer to the next (ComfyUI loads a new clone for every prompt)
neither copies nor pins the streamed weights again.
"""

from __future__ import annotations

import itertools
import weakref
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .companions import CompanionLayout
from .device import (
    can_pin_memory,
    copy_stream,
    current_stream,
    free_device_bytes,
    is_accelerator,
    pinned_allocation_bytes,
    pinned_host_buffer,
    synchronize,
    unpin_host_buffer,
)
from .file_source import FileSlice, stamps
from .layout import BlockLayout, DtypeOf, TensorForm, aligned
from .parking import ParkedBuffer, ParkingLot, leave, same_memory, signature
from .pinning import PinnedMemoryBudget
from .reader import BlockRead, FileReader
from .ring import ByteRing, ring_capacity, ring_granule
from .timeline import CallRecord, CopyRecord, TimelineRecorder

#: Device views kept per streamed block, one per ring position it was copied to. Positions repeat from step
#: to step once the ring's cycle and the step's line up; when they drift, views are made again.
_VIEWS_KEPT = 16


def _cached_views(
    cache: dict[int, tuple[torch.Tensor, ...]], start: int, make: Callable[[], tuple[torch.Tensor, ...]]
) -> tuple[torch.Tensor, ...]:
    """The views of a region of the ring at ``start``, made once per position (see ``_VIEWS_KEPT``)."""
    views = cache.get(start)
    if views is None:
        if len(cache) == _VIEWS_KEPT:
            cache.clear()
        views = cache[start] = make()
    return views


def eager(hook: Callable) -> Callable:
    """``hook``, run as plain Python under ``torch.compile``: the engine's hooks issue copies, record events
    and repoint parameters, which a traced graph would bake in once; the compiler breaks the graph around
    them instead, and compiles the blocks' own code between them."""
    return torch.compiler.disable(hook, recursive=True)


def look_ahead(order: Sequence[int], position: int, streamed: Container[int], count: int) -> Iterator[int]:
    """The next ``count`` streamed blocks of the call ``order`` from ``position``, wrapping into the next step."""
    if count <= 0:
        return
    seen: set[int] = set()
    for index in itertools.chain(itertools.islice(order, position, None), itertools.islice(order, position)):
        if index in streamed and index not in seen:
            seen.add(index)
            yield index
            if len(seen) == count:
                return


def copy_ahead(
    upcoming: Iterable[int],
    held: set[int],
    loaded: Container[int],
    load: Callable[[int, set[int]], bool],
    skip: Callable[[int], bool] = lambda index: False,
) -> None:
    """Copies the ``upcoming`` blocks not ``loaded`` yet, in order, until one does not fit. Each is ``held``
    (not to be overwritten) from its turn on, so a nearer block is never overwritten for a further one;
    ``skip`` leaves a block for later without stopping. The engine and the planner's replay both copy so."""
    for index in upcoming:
        held.add(index)
        if index in loaded or skip(index):
            continue
        if not load(index, held):
            return


@dataclass
class _StreamedBlock:
    """The host side of a streamed block: its packed tensors and where they came from."""

    layout: BlockLayout
    storage: BlockLayout
    host: torch.Tensor
    host_views: tuple[torch.Tensor, ...]
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
    device_views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # by region start
    # A file-tier block (no host buffer): its stored bytes' sources, read into a staging slot for each copy.
    read: BlockRead | None = None
    file_backed: bool = False  # ``originals`` are views of the file
    # Tensors copied with the block, after its bytes in its region (``offload/companions.py``).
    companion_layout: CompanionLayout | None = None
    companion_host: torch.Tensor | None = None
    companion_reserved: int = 0
    companion_views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)  # by region start
    # What the host wrote into the host buffer over the weights as packed (``contents``); None: nothing.
    content: Hashable = None
    # Its region holds a copy no call has used yet: its ``transforms`` entry has not transformed it.
    fresh: bool = False

    @property
    def region_bytes(self) -> int:
        """The ring bytes the block takes: its own, then its companions'."""
        extra = self.companion_layout.nbytes if self.companion_layout is not None else 0
        return aligned(self.layout.nbytes) + extra


@dataclass
class _ActiveCall:
    block: int
    streamed: bool
    record: CallRecord | None


class BlockStreamer:
    """Streams ``blocks[i]`` for every ``i`` in ``streamed``; other blocks are left alone.

    ``prefetch=0`` is the synchronous mode kept for comparison: each copy is issued
    when its block is called and the compute waits for it at once.
    ``ring_bytes`` sizes the device ring (see the module docstring); ``prefetch`` then
    still caps how many blocks are copied ahead.
    ``storage_dtype`` keeps floating-point parameters in another dtype on the host;
    they are cast back on the copy stream, right after the copy, so the cast and
    the copy are ordered on one stream. It shrinks what each step copies; the
    originals are kept too, because a rounded copy must never replace them.
    ``pin_budget`` caps the pinned host memory: blocks it refuses stream from pageable memory.
    ``call_order``: the order the blocks were called in by an earlier streamer of the same model
    (``last_order``), so the first step copies and reads ahead in that order rather than the list's.
    ``companions``: per streamed block, tensors copied with it into the ring (packed once, pinned like its
    buffer), handed back as device views while it runs (``companions(index)``).
    ``contents``: per streamed block, a name for what the host writes over its weights in its host buffer
    (through the block's tensors, between ``enable`` and the first step: ``needs_content`` says which, and
    ``wrote_content`` that it is done), such as patches applied once instead of at every call. A parked buffer
    is adopted only by a streamer naming the same content, or none; one holding other content is dropped and
    the block packed again from its originals, so only a block packed from its file may hold content.
    ``transforms``: per streamed block, a host's transform of its weights where they are in the ring, called
    (``copied``) on the compute stream at each call, once the block's tensors point at the ring, as part of the
    call's compute; ``copied`` at the first call after each copy, when the region holds the bytes as packed
    (ComfyUI's patches of quantized weights are re-quantized in place then, as ComfyUI re-quantizes them at
    load; later calls only put the re-quantized tensors back). A transform that raises leaves the region to be
    copied afresh.
    ``holders``: per block, the module whose call brings it in, where that is not the block itself: a parent
    whose forward reads the block's tensors without calling it (ComfyUI's fused ops read a child's weights).
    ``persistent_allocations``: a context entered around each device allocation the engine keeps from one call
    to the next (its ring and staging buffer, a block made resident) and around their frees, some of which
    happen inside a block call (a ring released with ``release_device_buffers`` is allocated again by the next
    call): a host that records and replays the allocations of each call (ComfyUI's compiler) keeps them out.
    ``parking``: where ``disable(park=True)`` leaves the blocks' host buffers and ``enable`` takes them over from
    (``offload/parking.py``); without one the streamer neither parks nor adopts.

    Weights that are views of their checkpoint file (``file_slice`` says where a tensor's bytes are in
    it) are never copied into memory of the process: a block of ``read_each_step`` has no host buffer and
    is read from the file for each copy, through ``staging_slots`` host slots (``offload/reader.py``), in
    the dtypes it is stored in; other streamed blocks pack their host buffer from the file. ``dtype_of``
    gives the dtype each plain tensor is computed in (a file stored in fp32, run in bf16): the host buffers
    hold that dtype, and file-tier bytes are cast to it on the device, after the copy.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        streamed: Iterable[int],
        *,
        prefetch: int = 1,
        pin_memory: bool = True,
        storage_dtype: torch.dtype | None = None,
        recorder: TimelineRecorder | None = None,
        root: nn.Module | None = None,
        recurse: bool = True,
        nesting: int = 1,
        pin_budget: PinnedMemoryBudget | None = None,
        ring_bytes: int | None = None,
        file_slice: Callable[[torch.Tensor], FileSlice | None] | None = None,
        read_each_step: Iterable[int] = (),
        dtype_of: DtypeOf | None = None,
        staging_slots: int = 2,
        call_order: Sequence[int] | None = None,
        companions: Mapping[int, Sequence[torch.Tensor]] | None = None,
        contents: Mapping[int, Hashable] | None = None,
        transforms: Mapping[int, Callable[[bool], None]] | None = None,
        holders: Mapping[int, nn.Module] | None = None,
        persistent_allocations: Callable[[], AbstractContextManager] = nullcontext,
        parking: ParkingLot | None = None,
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {prefetch}")
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.streamed = frozenset(streamed)
        bad = sorted(i for i in self.streamed if not 0 <= i < len(self.blocks))
        if bad:
            raise ValueError(f"streamed block indices {bad} are outside 0..{len(self.blocks) - 1}")
        self.read_each_step = frozenset(read_each_step)
        if not self.read_each_step <= self.streamed:
            extra = sorted(self.read_each_step - self.streamed)
            raise ValueError(f"blocks {extra} are to be read from their file each step but are not streamed")
        if self.read_each_step and (file_slice is None or staging_slots < 1):
            raise ValueError("blocks read from their file each step need a file_slice and at least one staging slot")
        self.file_slice = file_slice
        self._companion_tensors = dict(companions or {})
        self.contents = {index: content for index, content in (contents or {}).items() if content is not None}
        self.dtype_of = dtype_of
        self.transforms = dict(transforms or {})
        self.holders = dict(holders or {})
        self.persistent_allocations = persistent_allocations
        self.parking = parking
        self.staging_slots = staging_slots
        self.prefetch = prefetch
        self.pin_memory = pin_memory and can_pin_memory()
        self._pinned = pin_budget.share(self.give_back_pinned) if pin_budget is not None else None
        self.storage_dtype = storage_dtype
        self.recorder = recorder
        self.root = root
        self.recurse = recurse
        # Nested streamed modules (a wrapped module inside another) each hold a region while they run.
        self.nesting = nesting
        self.ring_bytes = ring_bytes
        self.copy_stream = copy_stream(self.device)
        self._state: dict[int, _StreamedBlock] = {}
        self._ring: ByteRing | None = None
        self._holds_all = False  # the ring holds every streamed block (``_ring_holds_all``), set with the ring
        self._buffer: torch.Tensor | None = None  # the ring's memory
        self._staging: torch.Tensor | None = None  # a copy to cast (storage dtype, file tier) lands here first
        self._reader: FileReader | None = None
        self._slot_reservation = 0  # the staging slots' pinned bytes
        self._stamps: tuple = ()  # the files read from, as they were when streaming began
        self._handles: list[RemovableHandle] = []
        self._active: list[_ActiveCall] = []
        # The call order the first step expects: a host's earlier engine's ``last_order``, else list order.
        known = call_order is not None and all(0 <= index < len(self.blocks) for index in call_order)
        self._expected: list[int] = list(call_order) if known and call_order else list(range(len(self.blocks)))
        self._order: list[int] = []
        self._pageable_deferred = False  # some streamed block's copies wait for the post-hook
        self.enabled = False

    # -- lifecycle ---------------------------------------------------------------------------

    def enable(self) -> None:
        """Moves the streamed blocks into host buffers and installs the hooks."""
        if self.enabled:
            return
        for index in sorted(self.streamed):
            self._state[index] = self._offload(index, self.blocks[index])
            self._pack_companions(index, self._state[index])
        self._start_reader()
        # One pair of hooks per module called: a holder brings in every block it holds, and lets them go in the
        # reverse order, so a call ending never releases a call around it.
        callers: dict[int, tuple[nn.Module, list[int]]] = {}
        for index, block in enumerate(self.blocks):
            caller = self.holders.get(index, block)
            callers.setdefault(id(caller), (caller, []))[1].append(index)
        for caller, indices in callers.values():
            self._handles.append(caller.register_forward_pre_hook(eager(self._pre_hook(tuple(indices)))))
            post = eager(self._post_hook(tuple(reversed(indices))))
            self._handles.append(caller.register_forward_hook(post, always_call=True))
        if self.root is not None:
            # The step brackets every block call, the root's own included when it is a block too.
            begin, end = eager(lambda *_: self.begin_step()), eager(lambda *_: self.end_step())
            self._handles.append(self.root.register_forward_pre_hook(begin, prepend=True))
            self._handles.append(self.root.register_forward_hook(end, always_call=True))
        self._pageable_deferred = any(self._deferred(state) for state in self._state.values())
        self.enabled = True

    def disable(self, park: bool = False) -> None:
        """Puts every streamed tensor back on its original device, bit for bit, and frees all buffers.

        ``park``: blocks that came from the CPU keep their host buffer as their storage instead (with a
        storage dtype they point back at their originals), and a later ``enable`` on the same modules
        adopts it; a pinned buffer stays counted by the pin budget until it is adopted or freed.
        """
        if not self.enabled:
            return
        if park and self.parking is None:
            raise ValueError("parking needs a ParkingLot: give the streamer one (parking=...) to park into")
        self._finish_active()
        synchronize(self.device)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._free_ring()
        self._stop_reader()
        # Block by block, each block's state (so its host buffer) dropped as the block gets its memory back:
        # restoring every block before dropping any would hold the streamed bytes twice, on unload, exactly
        # when another model is waiting for the RAM.
        for index in sorted(self._state):
            state = self._state.pop(index)
            self._drop_companions(state)
            if park and state.origin_device.type == "cpu":
                self._park(index, state)
            elif state.file_backed:
                state.layout.point_at(state.layout.assemble(state.originals))  # the file's views, as they were
                self._unpin(state)
            else:
                self._restore(state, state.origin_device)
                self._unpin(state)
        self.enabled = False

    def release_device_buffers(self) -> None:
        """Frees the ring; it is allocated again by the next call that needs it."""
        self._finish_active()
        synchronize(self.device)
        self._free_ring()

    def _free_ring(self) -> None:
        for state in self._state.values():
            state.device_views.clear()  # views keep the memory they view alive
            state.companion_views.clear()
        with self.persistent_allocations():
            self._ring = self._buffer = self._staging = None

    def make_resident(self, indices: Iterable[int]) -> None:
        """Stops streaming these blocks: their tensors move to the device for good. Not for a block with
        ``transforms``: resident, its weights would be the module's only copy, and a transform in place would
        change them for good."""
        indices = list(indices)
        transformed = sorted(set(indices) & self.transforms.keys())
        if transformed:
            raise ValueError(f"blocks {transformed} are transformed where they arrive and cannot be made resident")
        self._finish_active()
        synchronize(self.device)
        for index in indices:
            state = self._state.pop(index, None)
            if state is not None:
                if self._ring is not None:
                    self._ring.drop(index)
                if self._reader is not None:
                    self._reader.release(index, None)  # a read made ahead for it goes unused
                self._drop_companions(state)
                with self.persistent_allocations():
                    self._restore(state, self.device)
                self._unpin(state)
        self.streamed = frozenset(self._state)
        self._holds_all = self._ring_holds_all()
        self.read_each_step &= self.streamed

    @property
    def last_order(self) -> tuple[int, ...]:
        """The block calls of the last finished step, in order (list order before the first step)."""
        return tuple(self._expected)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether every part of ``tensor`` (a quantized one's data and scales) lies in the engine's device
        buffers: a streamed unit's weights while it runs, copied there for the call."""
        if self._buffer is None:
            return False
        start, end = self._buffer.data_ptr(), self._buffer.data_ptr() + self._buffer.numel()
        parts = list(TensorForm.of(tensor, "tensor").parts_of(tensor))
        return all(start <= part.data_ptr() < end for part in parts)

    def region_of(self, index: int) -> tuple[int, int] | None:
        """The bytes of the ring (start, end) holding streamed block ``index``, or None while it is only on
        the host."""
        return None if self._ring is None else self._ring.regions.get(index)

    @property
    def capacity(self) -> int:
        """The ring's bytes: as asked, and never less than the blocks running inside each other need."""
        return ring_capacity(self._largest, self.prefetch, self.nesting, self.ring_bytes or 0)

    @property
    def _largest(self) -> int:
        return max((state.region_bytes for state in self._state.values()), default=0)

    @property
    def unit(self) -> str:
        return "block" if self.recurse else "module"

    @property
    def units(self) -> int:
        return len(self.blocks)

    @property
    def host_bytes(self) -> int:
        """Host memory the streamer holds: its blocks' host buffers, their companions, the staging slots."""
        return sum(state.host.numel() for state in self._state.values()) + self.companion_bytes + self.staging_bytes

    @property
    def companion_bytes(self) -> int:
        """Of ``host_bytes``, the blocks' companions (packed once, copied with their blocks)."""
        held = [state.companion_host for state in self._state.values() if state.companion_host is not None]
        return sum(host.numel() for host in held)

    @property
    def staging_bytes(self) -> int:
        """The reader's staging slots, the host memory file-tier blocks are read into."""
        return self._reader.slot_bytes if self._reader is not None else 0

    @property
    def device_buffer_bytes(self) -> int:
        """Device bytes the ring (and its staging buffer) hold now (0 before the first call and after a release)."""
        return sum(buffer.numel() for buffer in (self._buffer, self._staging) if buffer is not None)

    @property
    def refused_pinning(self) -> dict[int, int]:
        """Streamed blocks (index: host bytes) that wanted pinned memory but got pageable memory,
        because the pin budget was spent."""
        return self._pageable_because("cap")

    @property
    def failed_pinning(self) -> dict[int, int]:
        """Streamed blocks (index: host bytes) whose memory the driver refused to pin (they stream from
        pageable memory)."""
        return self._pageable_because("driver")

    def _pageable_because(self, reason: str) -> dict[int, int]:
        return {i: state.host.numel() for i, state in sorted(self._state.items()) if state.pageable_because == reason}

    def give_back_pinned(self, nbytes: int) -> int:
        """Unpins streamed blocks, last first, until ``nbytes`` of the pin budget are free again (for another
        model that gets none); returns how many. Nothing while a step runs: its copies read these buffers.
        The blocks go on streaming from the same memory, pageable."""
        if self._active or self._order or self._pinned is None:
            return 0
        synchronize(self.device)  # copies issued ahead (across the step boundary) read these buffers
        freed = 0
        for state in reversed([self._state[index] for index in sorted(self._state)]):
            if freed >= nbytes:
                break
            if state.pinned and unpin_host_buffer(state.host):
                freed += state.pinned_bytes
                self._unpin(state)
                state.pinned, state.pageable_because = False, "cap"
        self._pageable_deferred = any(self._deferred(state) for state in self._state.values())
        return freed

    @property
    def _casts(self) -> bool:
        return self.storage_dtype is not None

    # -- host side ---------------------------------------------------------------------------

    def _offload(self, index: int, block: nn.Module) -> _StreamedBlock:
        adopted = self._adopt(index, block)
        if adopted is not None:
            return adopted
        layout = BlockLayout.of(block, recurse=self.recurse, dtype_of=self.dtype_of)
        current = layout.current()
        slices = [self.file_slice(part) for part in current] if self.file_slice is not None else []
        file_backed = any(source is not None for source in slices)
        if index in self.read_each_step:
            if not file_backed:
                raise ValueError(f"{self.unit} {index} is to be read from its file each step, but has no weight in one")
            return self._file_tier(block, layout, current, slices)
        storage = layout
        if self._casts:
            storage = BlockLayout.of(block, self.storage_dtype, recurse=self.recurse, dtype_of=self.dtype_of)
        origin = layout.device or self.device
        host, reserved, pageable_because = self._host_buffer(storage.nbytes)
        pinned = self.pin_memory and pageable_because is None
        storage.pack_into(host)
        host_views = storage.views(host)
        originals = None
        if file_backed:
            originals = current  # views of the file: they cost no memory
        elif self._casts:
            # Kept on the host: originals left on the device would keep the whole block there.
            originals = tuple(t.to("cpu") for t in current)
        # Otherwise the block's only copy of its weights is now the host buffer.
        layout.point_at(host_views)
        return _StreamedBlock(
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

    def _file_tier(
        self,
        block: nn.Module,
        layout: BlockLayout,
        current: tuple[torch.Tensor, ...],
        slices: list[FileSlice | None],
    ) -> _StreamedBlock:
        """A block read from its file for each copy, in its stored dtypes: no host buffer, the module keeps
        the file's views. Its parts not in the file (a host's converted tensors) are copied from memory."""
        stored = BlockLayout.of(block, recurse=self.recurse)
        storage = layout if stored.parts == layout.parts else stored
        sources = tuple(
            (part, tensor if source is None else source)
            for part, source, tensor in zip(storage.parts, slices, current, strict=True)
        )
        views = layout.assemble(current)
        host = torch.empty(0, dtype=torch.uint8)
        origin = layout.device or self.device
        return _StreamedBlock(
            layout, storage, host, views, origin, current, read=BlockRead(sources, storage.nbytes), file_backed=True
        )

    def _start_reader(self) -> None:
        reads = [state.read for state in self._state.values() if state.read is not None]
        if not reads:
            return
        slot_bytes = max(read.nbytes for read in reads)
        slots = [self._staging_slot(slot_bytes) for _ in range(self.staging_slots)]
        self._reader = FileReader(slots, self.recorder.read_done if self.recorder else None)
        self._stamps = stamps(source for read in reads for source in read.slices())

    def _staging_slot(self, nbytes: int) -> torch.Tensor:
        """A host staging slot, pinned where the budget and the driver allow (counted like a host buffer)."""
        slot, reserved, _ = self._host_buffer(nbytes)
        self._slot_reservation += reserved
        return slot

    def _host_buffer(self, nbytes: int) -> tuple[torch.Tensor, int, str | None]:
        """Host memory for a block's bytes, a staging slot or companions, pinned where the budget and the
        driver allow: the buffer, the bytes reserved in the pin budget, and why it is pageable although
        pinning was asked ("cap": the budget refused; "driver": the driver refused to register it)."""
        reserved = pinned_allocation_bytes(nbytes) if self.pin_memory else 0
        pinned = self.pin_memory and (self._pinned is None or self._pinned.reserve(reserved))
        host = pinned_host_buffer(nbytes) if pinned else None
        if host is not None:
            return host, reserved, None
        if pinned and self._pinned is not None:
            self._pinned.release(reserved)  # the driver refused: pageable memory
        why = ("driver" if pinned else "cap") if self.pin_memory else None
        return torch.empty(nbytes, dtype=torch.uint8), 0, why

    def _pack_companions(self, index: int, state: _StreamedBlock) -> None:
        tensors = self._companion_tensors.get(index)
        if not tensors:
            return
        layout = CompanionLayout.of(tensors)
        host, reserved, _ = self._host_buffer(layout.nbytes)
        layout.pack_into(host, tensors)
        state.companion_layout, state.companion_host, state.companion_reserved = layout, host, reserved

    def _drop_companions(self, state: _StreamedBlock) -> None:
        if state.companion_reserved and self._pinned is not None:
            self._pinned.release(state.companion_reserved)
        state.companion_layout = state.companion_host = None
        state.companion_reserved = 0
        state.companion_views.clear()

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        """Block ``index``'s companions as device views, while it is in the ring (from its copy to its region
        being overwritten: a host reads them during the block's call); None when it has none or is elsewhere."""
        state = self._state.get(index)
        region = self.region_of(index)
        if state is None or state.companion_layout is None or region is None:
            return None
        start = region[0] + aligned(state.layout.nbytes)
        return _cached_views(state.companion_views, start, lambda: state.companion_layout.views(self._buffer[start:]))

    def _stop_reader(self) -> None:
        if self._reader is None:
            return
        self._reader.close()
        self._reader, self._stamps = None, ()
        if self._slot_reservation and self._pinned is not None:
            self._pinned.release(self._slot_reservation)
        self._slot_reservation = 0

    @property
    def file_tier_bytes(self) -> int:
        """The bytes read from files for one pass through every file-tier block."""
        return sum(state.read.file_bytes for state in self._state.values() if state.read is not None)

    def file_slices(self) -> tuple[FileSlice, ...]:
        """The file slices of the file-tier blocks, in block order."""
        return tuple(source for _, state in sorted(self._state.items()) if state.read for source in state.read.slices())

    @property
    def bytes_read(self) -> int:
        """The bytes read from files since the streamer was enabled."""
        return self._reader.file_bytes if self._reader is not None else 0

    def _park(self, index: int, state: _StreamedBlock) -> None:
        """Leaves block ``index`` on host memory without a copy (its tensors already point at the host views).
        A block from its file keeps its host buffer too (its file views kept beside it); one read from the
        file at each step, or stored in a lossy dtype, goes back to its originals."""
        if state.read is not None or (state.originals is not None and not state.file_backed):
            state.layout.point_at(state.layout.assemble(state.originals))  # the rounded copy must not replace them
            self._unpin(state)
            return
        storage = state.host.untyped_storage()
        reservation = (
            self._pinned.park(state.pinned_bytes, storage) if state.pinned and self._pinned is not None else None
        )
        assert self.parking is not None  # disable refuses to park without one
        self.parking.park(
            self.blocks[index],
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

    def _adopt(self, index: int, block: nn.Module) -> _StreamedBlock | None:
        """The block's parked host buffer, taken over as it is (``_take_over``). One not taken over goes: a block
        packed from its file points at the file's views again, to be packed from them (never from a buffer
        that may hold other content, nor into a copy of its own that would outlive the streamer)."""
        parked = self.parking.take(block) if self.parking is not None else None
        if parked is None:
            return None
        adopted = self._take_over(parked, BlockLayout.of(block, recurse=self.recurse, dtype_of=self.dtype_of), index)
        if adopted is None and parked.originals is not None:
            leave(block, parked)
        return adopted

    def _take_over(self, parked: ParkedBuffer, layout: BlockLayout, index: int) -> _StreamedBlock | None:
        """A parked host buffer as block ``index``'s, if the block still uses exactly its views (a weight replaced
        or patched while parked means it is packed again), it is pinned as asked, and it holds no content or
        the one asked for; never for a block to be read from its file at each step."""
        if self._casts or index in self.read_each_step or parked.pinned != self.pin_memory:
            return None
        if parked.content not in (None, self.contents.get(index)):
            return None
        host = parked.host()
        if host is None or parked.signature != signature(layout):
            return None
        parts = layout.part_views(host)
        if not all(same_memory(tensor, view) for tensor, view in zip(layout.current(), parts, strict=True)):
            return None
        if parked.reservation is not None:
            if self._pinned is None or not self._pinned.adopt(parked.reservation):
                return None
        elif parked.pinned and self._pinned is not None:
            return None  # pinned outside this budget: adopting it would leave the budget short
        reserved = pinned_allocation_bytes(parked.nbytes) if parked.pinned else 0
        views = layout.assemble(parts)
        file_backed = parked.originals is not None
        return _StreamedBlock(
            layout,
            layout,
            host,
            views,
            host.device,
            parked.originals,
            parked.pinned,
            reserved,
            file_backed=file_backed,
            content=parked.content,
        )

    @property
    def needs_content(self) -> frozenset[int]:
        """The streamed blocks whose host buffers do not hold the content ``contents`` names for them yet."""
        return frozenset(
            index
            for index, content in self.contents.items()
            if index in self._state and self._state[index].content != content
        )

    def wrote_content(self, indices: Iterable[int]) -> None:
        """The host has written their ``contents`` into these blocks' host buffers (their tensors, on the host)."""
        for index in indices:
            state = self._state[index]
            if state.read is not None or not state.file_backed:
                raise ValueError(
                    f"{self.unit} {index} has no originals in a file to go back to: only a host buffer packed from "
                    "its file may hold other content"
                )
            state.content = self.contents[index]

    def _unpin(self, state: _StreamedBlock) -> None:
        """Gives the block's pinned bytes back to the budget (its host buffer is dropped with it)."""
        if state.pinned and self._pinned is not None:
            self._pinned.release(state.pinned_bytes)

    def _restore(self, state: _StreamedBlock, device: torch.device) -> None:
        """Points the block's tensors at their own memory on ``device`` again. A pageable host buffer already on
        ``device`` in the tensors' dtypes becomes their storage as it is: copying it out would hold the block
        twice while another model waits for the memory. A pinned one is copied, not to leave the model
        page-locked."""
        sources = state.originals if state.originals is not None else state.storage.part_views(state.host)
        adopt_host = (
            state.originals is None
            and not state.pinned
            and state.host.device == device
            and all(source.dtype == part.dtype for part, source in zip(state.layout.parts, sources, strict=True))
        )
        restored = tuple(
            source if adopt_host else source.to(device=device, dtype=part.dtype, copy=True)
            for part, source in zip(state.layout.parts, sources, strict=True)
        )
        state.layout.point_at(state.layout.assemble(restored))

    # -- device side -------------------------------------------------------------------------

    def allocate_device_buffers(self) -> None:
        """Allocates the ring now rather than at the first block call, so running out of device
        memory shows while the model is being placed, where the caller can still fall back."""
        if self._state and self._ring is None:
            self._allocate_ring()

    def _allocate_ring(self) -> None:
        capacity = self.capacity
        casting = [state.storage.nbytes for state in self._state.values() if self._cast_on_device(state)]
        staging = max(casting, default=0)
        free = free_device_bytes(self.device)
        if free is not None and capacity + staging > free:
            raise torch.OutOfMemoryError(
                f"the device ring needs {capacity + staging} bytes and {self.device} has {free} free: allocated "
                "anyway it would fail, or spill into shared host memory (the driver's system-memory fallback)"
            )
        with self.persistent_allocations():
            self._buffer = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            # One staging buffer serves every copy: each copy and its cast run in turn on the one copy stream.
            self._staging = torch.empty(staging, dtype=torch.uint8, device=self.device) if staging else None
        self._ring = ByteRing(capacity, ring_granule(self._largest, self.ring_bytes or 0))
        self._holds_all = self._ring_holds_all()
        if is_accelerator(self.device):
            for state in self._state.values():
                if state.ready is None:
                    state.ready = torch.Event(device=self.device)
                    state.released = torch.Event(device=self.device)
        if self.copy_stream is not None:
            # The allocator hands out memory on the compute stream: its last reader there may still be
            # queued. The first copy into fresh memory has no released event to wait on, so order the
            # copy stream after everything the compute stream has issued so far.
            self.copy_stream.wait_stream(current_stream(self.device))

    def _views(self, state: _StreamedBlock, start: int) -> tuple[torch.Tensor, ...]:
        return _cached_views(state.device_views, start, lambda: state.layout.views(self._buffer[start:]))

    def _load(self, index: int, held: Container[int]) -> bool:
        """Issues the copy of block ``index`` into the ring; False if it has no room that is not ``held``."""
        if self._ring is None:
            self._allocate_ring()
        state = self._state[index]
        placed = self._ring.place(index, state.region_bytes, held)
        if placed is None:
            return False
        start, overwritten = placed
        stream = self.copy_stream
        with stream if stream is not None else nullcontext():
            if stream is not None:
                for other in overwritten:
                    if self._state[other].released_once:
                        stream.wait_event(self._state[other].released)
            record = self.recorder.copy_started(stream, state.storage.nbytes) if self.recorder else None
            self._copy_in(index, state, start)
            state.fresh = True
            if self.recorder:
                self.recorder.copy_finished(record, stream)
            if state.ready is not None:
                state.ready.record(stream)
        state.copy = record
        return True

    def _copy_in(self, index: int, state: _StreamedBlock, start: int) -> None:
        host = state.host if state.read is None else self._reader.take(index, state.read)
        non_blocking = host.is_pinned()
        size = state.storage.nbytes
        if not self._cast_on_device(state):
            self._buffer[start : start + size].copy_(host[:size], non_blocking=non_blocking)
        else:
            self._staging[:size].copy_(host[:size], non_blocking=non_blocking)
            targets = state.layout.part_views(self._buffer[start:])
            for target, source in zip(targets, state.storage.part_views(self._staging), strict=True):
                target.copy_(source)
        if state.read is not None:
            self._reader.release(index, self.copy_stream)
        companions = state.companion_host
        if companions is not None:
            at = start + aligned(state.layout.nbytes)
            self._buffer[at : at + companions.numel()].copy_(companions, non_blocking=companions.is_pinned())

    @staticmethod
    def _cast_on_device(state: _StreamedBlock) -> bool:
        """Whether the block's host bytes (a storage dtype, a file's stored dtypes) are cast after the copy."""
        return state.storage is not state.layout

    def _prefetch(self, defer_pageable: bool = False) -> None:
        """Issues the copies of the next streamed blocks, as far ahead as the ring has room.

        ``defer_pageable``: skip blocks in pageable memory. A copy from pageable memory holds the host
        thread until it is done (the driver stages it), so issued before a block's kernels are launched
        it would keep the device idle for the whole copy; the post-hook issues it instead, with the block
        just launched computing meanwhile."""
        if not self._state:
            return
        if self._ring is None:
            self._allocate_ring()
        upcoming = look_ahead(self._expected, len(self._order), self._state, self.prefetch)
        held = {call.block for call in self._active}

        def skip(index: int) -> bool:
            # A file-tier block whose read is not done is copied later: waiting here would hold up the
            # launch of the block about to run.
            if self._state[index].read is not None and not self._reader.is_read(index):
                return True
            return defer_pageable and self._deferred(self._state[index])

        copy_ahead(upcoming, held, self._ring.regions, self._load, skip)
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Starts reading the next file-tier blocks that will need a copy, while the reader has free slots.

        A block in the ring needs none if it will still be there at its call: copied for it (within the
        copy window), the ring holding every streamed block, or its region lying beyond what the copies of
        the blocks before it will write from the ring's head (the ring overwrites its oldest regions
        first). The estimate may miss where placement wraps; a miss costs a wasted read or a wait for one,
        never a wrong weight."""
        if self._reader is None:
            return
        ring = self._ring
        advance = 0  # the ring bytes the copies before the block in hand will write, from the head
        upcoming = look_ahead(self._expected, len(self._order), self._state, len(self._state))
        for position, index in enumerate(upcoming):
            state = self._state[index]
            region = ring.regions.get(index)
            stays = region is not None and (
                position < self.prefetch or self._holds_all or (region[0] - ring.head) % ring.capacity >= advance
            )
            if stays:
                if position < self.prefetch and self._reader.holds(index):
                    self._reader.release(index, None)  # read for nothing: it stayed in the ring
                continue
            advance += aligned(state.region_bytes, ring.granule)
            needs_read = state.read is not None and not self._reader.holds(index)
            if needs_read and not self._reader.schedule(index, state.read):
                return

    def _ring_holds_all(self) -> bool:
        """Whether the ring holds every streamed block at once (then a block copied once stays)."""
        return sum(aligned(state.region_bytes) for state in self._state.values()) <= self.capacity

    def _deferred(self, state: _StreamedBlock) -> bool:
        if self.copy_stream is None:
            return False
        return not (self._reader.pinned if state.read is not None else state.pinned)

    # -- hooks -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Marks the start of one pass through the blocks (the root module's forward)."""
        self._finish_active()
        for stamp in self._stamps:
            stamp.check()
        self._order = []
        if self.recorder:
            self.recorder.begin_step(current_stream(self.device))
        self._prefetch()

    def close_open_step(self) -> None:
        """Ends a step an exception left open; nothing when none is.

        The hooks that close a step run with ``always_call``, which PyTorch honours for ``Exception``
        only: an exception outside that hierarchy (ComfyUI 0.33's interrupt is a ``BaseException``)
        leaves the block's region held and its weights pointing at the device until this is called."""
        if self._active or self._order:
            self.end_step()

    def end_step(self) -> None:
        self._finish_active()
        if self._order:
            self._expected = self._order
        self._order = []
        if self.recorder:
            self.recorder.end_step(current_stream(self.device))

    def _pre_hook(self, indices: tuple[int, ...]):
        def hook(module: nn.Module, args: tuple) -> None:
            for index in indices:
                self._call_begins(index)

        return hook

    def _post_hook(self, indices: tuple[int, ...]):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            for index in indices:
                self._call_ends(index)
            if self._pageable_deferred or self._reader is not None:
                self._prefetch()

        return hook

    def _call_begins(self, index: int) -> None:
        compute = current_stream(self.device)
        record = self.recorder.call_arrived(index, compute) if self.recorder else None
        self._order.append(index)
        copy = None
        state = self._state.get(index)
        if state is not None:
            region = self.region_of(index)
            if region is None:
                if not self._load(index, {call.block for call in self._active}):
                    raise RuntimeError(
                        f"no room for {self.unit} {index} in the device ring of {self.capacity} bytes: "
                        f"{len(self._active)} streamed {self.unit}s are running nested inside each other"
                    )
                region = self.region_of(index)
            if compute is not None:
                compute.wait_event(state.ready)
            copy, state.copy = state.copy, None
            state.layout.point_at(self._views(state, region[0]))
        self._active.append(_ActiveCall(index, state is not None, record))
        if self.recorder:
            self.recorder.call_started(record, copy, compute)
        if state is not None and index in self.transforms:  # part of the call's compute, as timed
            self._transform(index, state)
        self._prefetch(defer_pageable=True)

    def _transform(self, index: int, state: _StreamedBlock) -> None:
        try:
            self.transforms[index](state.fresh)
        except BaseException:
            self._ring.drop(index)  # half transformed: the next call copies it afresh
            raise
        state.fresh = False

    def _call_ends(self, index: int) -> None:
        while self._active:
            call = self._active.pop()
            self._release(call)
            if call.block == index:
                return

    def _release(self, call: _ActiveCall) -> None:
        compute = current_stream(self.device)
        if self.recorder:
            self.recorder.call_finished(call.record, compute)
        if not call.streamed:
            return
        state = self._state[call.block]
        if state.released is not None:
            state.released.record(compute)
            state.released_once = True
        state.layout.point_at(state.host_views)

    def _finish_active(self) -> None:
        """Releases calls an exception left open, so the next step starts clean."""
        while self._active:
            self._release(self._active.pop())
