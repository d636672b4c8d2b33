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
from collections.abc import Callable, Container, Hashable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import TypeVar, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .device import (
    can_pin_memory,
    current_stream,
    synchronize,
)
from .device_ring import DeviceRing
from .file_source import FileSlice, FileStamp, stamps
from .host_blocks import HostBlocks, StreamedBlock
from .layout import DtypeOf, aligned
from .parking import ParkingLot
from .pinning import PinnedMemoryBudget
from .reader import FileReader
from .timeline import CallRecord, TimelineRecorder

Hook = TypeVar("Hook", bound=Callable[..., object])


def eager(hook: Hook) -> Hook:
    """``hook``, run as plain Python under ``torch.compile``: the engine's hooks issue copies, record events
    and repoint parameters, which a traced graph would bake in once; the compiler breaks the graph around
    them instead, and compiles the blocks' own code between them."""
    disable: Callable[..., object] = torch.compiler.disable
    return cast(Hook, disable(hook, recursive=True))


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
        persistent_allocations: Callable[[], AbstractContextManager[object]] = nullcontext,
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
        extra = sorted(frozenset(read_each_step) - self.streamed)
        if extra:
            raise ValueError(f"blocks {extra} are to be read from their file each step but are not streamed")
        if frozenset(read_each_step) and (file_slice is None or staging_slots < 1):
            raise ValueError("blocks read from their file each step need a file_slice and at least one staging slot")
        self.transforms = dict(transforms or {})
        self.holders = dict(holders or {})
        self.persistent_allocations = persistent_allocations
        self.staging_slots = staging_slots
        self.prefetch = prefetch
        self._pinned = pin_budget.share(self.give_back_pinned) if pin_budget is not None else None
        self.recorder = recorder
        self.root = root
        self.recurse = recurse
        self.host = HostBlocks(
            self.device,
            unit=self.unit,
            recurse=recurse,
            pin_memory=pin_memory and can_pin_memory(),
            pinned=self._pinned,
            storage_dtype=storage_dtype,
            dtype_of=dtype_of,
            file_slice=file_slice,
            read_each_step=frozenset(read_each_step),
            contents={index: content for index, content in (contents or {}).items() if content is not None},
            companions=companions or {},
            parking=parking,
        )
        self.ring = DeviceRing(
            self.device,
            self.host,
            prefetch=prefetch,
            nesting=nesting,
            ring_bytes=ring_bytes,
            recorder=recorder,
            persistent_allocations=persistent_allocations,
        )
        self.copy_stream = self.ring.copy_stream
        self._reader: FileReader | None = None
        self._slot_reservation = 0  # the staging slots' pinned bytes
        self._stamps: tuple[FileStamp, ...] = ()  # the files read from, as they were when streaming began
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
            self.host.pack(index, self.blocks[index])
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
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())
        self.enabled = True

    def disable(self, park: bool = False) -> None:
        """Puts every streamed tensor back on its original device, bit for bit, and frees all buffers.

        ``park``: blocks that came from the CPU keep their host buffer as their storage instead (with a
        storage dtype they point back at their originals), and a later ``enable`` on the same modules
        adopts it; a pinned buffer stays counted by the pin budget until it is adopted or freed.
        """
        if not self.enabled:
            return
        if park and self.host.parking is None:
            raise ValueError("parking needs a ParkingLot: give the streamer one (parking=...) to park into")
        self._finish_active()
        synchronize(self.device)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.ring.free()
        self._stop_reader()
        self.host.let_go(park)
        self.enabled = False

    def release_device_buffers(self) -> None:
        """Frees the ring; it is allocated again by the next call that needs it."""
        self._finish_active()
        synchronize(self.device)
        self.ring.free()

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
            state = self.host.take(index)
            if state is not None:
                self.ring.drop(index)
                if self._reader is not None:
                    self._reader.release(index, None)  # a read made ahead for it goes unused
                with self.persistent_allocations():
                    self.host.restore(state, self.device)
                self.host.unpin(state)
        self.streamed = frozenset(self.host.blocks)
        self.ring.recount()
        self.host.read_each_step &= self.streamed

    @property
    def last_order(self) -> tuple[int, ...]:
        """The block calls of the last finished step, in order (list order before the first step)."""
        return tuple(self._expected)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether every part of ``tensor`` (a quantized one's data and scales) lies in the engine's device
        buffers: a streamed unit's weights while it runs, copied there for the call."""
        return self.ring.holds(tensor)

    @property
    def ring_memory(self) -> torch.Tensor | None:
        """The ring's device memory (None before the first call and after a release): what the streamed
        blocks' weights are views of while they run."""
        return self.ring.memory

    @property
    def running(self) -> tuple[int, ...]:
        """The blocks whose calls are open, outermost first (empty between calls)."""
        return tuple(call.block for call in self._active)

    @property
    def staging_pinned(self) -> bool:
        """Whether the staging slots the file tier is read into are all pinned (False without a file tier)."""
        return self._reader is not None and self._reader.pinned

    def region_of(self, index: int) -> tuple[int, int] | None:
        """The bytes of the ring (start, end) holding streamed block ``index``, or None while it is only on
        the host."""
        return self.ring.region_of(index)

    @property
    def capacity(self) -> int:
        """The ring's bytes: as asked, and never less than the blocks running inside each other need."""
        return self.ring.capacity

    @property
    def unit(self) -> str:
        return "block" if self.recurse else "module"

    @property
    def units(self) -> int:
        return len(self.blocks)

    @property
    def host_bytes(self) -> int:
        """Host memory the streamer holds: its blocks' host buffers, their companions, the staging slots."""
        return self.host.buffer_bytes + self.companion_bytes + self.staging_bytes

    @property
    def companion_bytes(self) -> int:
        """Of ``host_bytes``, the blocks' companions (packed once, copied with their blocks)."""
        return self.host.companion_bytes

    @property
    def staging_bytes(self) -> int:
        """The reader's staging slots, the host memory file-tier blocks are read into."""
        return self._reader.slot_bytes if self._reader is not None else 0

    @property
    def device_buffer_bytes(self) -> int:
        """Device bytes the ring (and its staging buffer) hold now (0 before the first call and after a release)."""
        return self.ring.device_buffer_bytes

    @property
    def refused_pinning(self) -> dict[int, int]:
        """Streamed blocks (index: host bytes) that wanted pinned memory but got pageable memory,
        because the pin budget was spent."""
        return self.host.pageable_because("cap")

    @property
    def failed_pinning(self) -> dict[int, int]:
        """Streamed blocks (index: host bytes) whose memory the driver refused to pin (they stream from
        pageable memory)."""
        return self.host.pageable_because("driver")

    def give_back_pinned(self, nbytes: int) -> int:
        """Unpins streamed blocks, last first, until ``nbytes`` of the pin budget are free again (for another
        model that gets none); returns how many. Nothing while a step runs: its copies read these buffers.
        The blocks go on streaming from the same memory, pageable."""
        if self._active or self._order or self._pinned is None:
            return 0
        synchronize(self.device)  # copies issued ahead (across the step boundary) read these buffers
        freed = self.host.unpin_some(nbytes)
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())
        return freed

    def _start_reader(self) -> None:
        reads = [state.read for state in self.host.blocks.values() if state.read is not None]
        if not reads:
            return
        slot_bytes = max(read.nbytes for read in reads)
        slots = [self._staging_slot(slot_bytes) for _ in range(self.staging_slots)]
        self._reader = self.ring.reader = FileReader(slots, self.recorder.read_done if self.recorder else None)
        self._stamps = stamps(source for read in reads for source in read.slices())

    def _staging_slot(self, nbytes: int) -> torch.Tensor:
        """A host staging slot, pinned where the budget and the driver allow (counted like a host buffer)."""
        slot, reserved, _ = self.host.buffer(nbytes)
        self._slot_reservation += reserved
        return slot

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        """Block ``index``'s companions as device views, while it is in the ring (from its copy to its region
        being overwritten: a host reads them during the block's call); None when it has none or is elsewhere."""
        return self.ring.companions(index)

    def _stop_reader(self) -> None:
        if self._reader is None:
            return
        self._reader.close()
        self._reader = self.ring.reader = None
        self._stamps = ()
        self.host.release(self._slot_reservation)
        self._slot_reservation = 0

    @property
    def file_tier_bytes(self) -> int:
        """The bytes read from files for one pass through every file-tier block."""
        return sum(state.read.file_bytes for state in self.host.blocks.values() if state.read is not None)

    def file_slices(self) -> tuple[FileSlice, ...]:
        """The file slices of the file-tier blocks, in block order."""
        blocks = sorted(self.host.blocks.items())
        return tuple(source for _, state in blocks if state.read for source in state.read.slices())

    @property
    def bytes_read(self) -> int:
        """The bytes read from files since the streamer was enabled."""
        return self._reader.file_bytes if self._reader is not None else 0

    @property
    def read_each_step(self) -> frozenset[int]:
        """The streamed blocks read from their file at each copy (the file tier)."""
        return self.host.read_each_step

    @property
    def needs_content(self) -> frozenset[int]:
        """The streamed blocks whose host buffers do not hold the content ``contents`` names for them yet."""
        return self.host.needs_content

    def wrote_content(self, indices: Iterable[int]) -> None:
        """The host has written their ``contents`` into these blocks' host buffers (their tensors, on the host)."""
        self.host.wrote_content(indices)

    # -- device side -------------------------------------------------------------------------

    def allocate_device_buffers(self) -> None:
        """Allocates the ring now rather than at the first block call, so running out of device
        memory shows while the model is being placed, where the caller can still fall back."""
        if self.host.blocks and self.ring.books is None:
            self.ring.allocate()

    def _prefetch(self, defer_pageable: bool = False) -> None:
        """Issues the copies of the next streamed blocks, as far ahead as the ring has room.

        ``defer_pageable``: skip blocks in pageable memory. A copy from pageable memory holds the host
        thread until it is done (the driver stages it), so issued before a block's kernels are launched
        it would keep the device idle for the whole copy; the post-hook issues it instead, with the block
        just launched computing meanwhile."""
        if not self.host.blocks:
            return
        books, _ = self.ring.allocated()
        upcoming = look_ahead(self._expected, len(self._order), self.host.blocks, self.prefetch)
        held = {call.block for call in self._active}
        reader = self._reader

        def skip(index: int) -> bool:
            # A file-tier block whose read is not done is copied later: waiting here would hold up the
            # launch of the block about to run.
            if self.host.blocks[index].read is not None and reader is not None and not reader.is_read(index):
                return True
            return defer_pageable and self._deferred(self.host.blocks[index])

        copy_ahead(upcoming, held, books.regions, self.ring.load, skip)
        self._read_ahead()

    def _read_ahead(self) -> None:
        """Starts reading the next file-tier blocks that will need a copy, while the reader has free slots.

        A block in the ring needs none if it will still be there at its call: copied for it (within the
        copy window), the ring holding every streamed block, or its region lying beyond what the copies of
        the blocks before it will write from the ring's head (the ring overwrites its oldest regions
        first). The estimate may miss where placement wraps; a miss costs a wasted read or a wait for one,
        never a wrong weight."""
        reader, ring = self._reader, self.ring.books
        if reader is None or ring is None:
            return
        advance = 0  # the ring bytes the copies before the block in hand will write, from the head
        upcoming = look_ahead(self._expected, len(self._order), self.host.blocks, len(self.host.blocks))
        for position, index in enumerate(upcoming):
            state = self.host.blocks[index]
            region = ring.regions.get(index)
            stays = region is not None and (
                position < self.prefetch or self.ring.holds_all or (region[0] - ring.head) % ring.capacity >= advance
            )
            if stays:
                if position < self.prefetch and reader.holds(index):
                    reader.release(index, None)  # read for nothing: it stayed in the ring
                continue
            advance += aligned(state.region_bytes, ring.granule)
            if state.read is not None and not reader.holds(index) and not reader.schedule(index, state.read):
                return

    def _deferred(self, state: StreamedBlock) -> bool:
        if self.copy_stream is None:
            return False
        return not (self.staging_pinned if state.read is not None else state.pinned)

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

    def _pre_hook(self, indices: tuple[int, ...]) -> Callable[[nn.Module, tuple[object, ...]], None]:
        def hook(module: nn.Module, args: tuple[object, ...]) -> None:
            for index in indices:
                self._call_begins(index)

        return hook

    def _post_hook(self, indices: tuple[int, ...]) -> Callable[[nn.Module, tuple[object, ...], object], None]:
        def hook(module: nn.Module, args: tuple[object, ...], output: object) -> None:
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
        state = self.host.blocks.get(index)
        if state is not None:
            region = self.region_of(index)
            if region is None:
                if not self.ring.load(index, {call.block for call in self._active}):
                    raise RuntimeError(
                        f"no room for {self.unit} {index} in the device ring of {self.capacity} bytes: "
                        f"{len(self._active)} streamed {self.unit}s are running nested inside each other"
                    )
                region = self.region_of(index)
                assert region is not None  # just placed
            if compute is not None and state.ready is not None:
                compute.wait_event(state.ready)
            copy, state.copy = state.copy, None
            state.layout.point_at(self.ring.views(state, region[0]))
        self._active.append(_ActiveCall(index, state is not None, record))
        if self.recorder:
            self.recorder.call_started(record, copy, compute)
        if state is not None and index in self.transforms:  # part of the call's compute, as timed
            self._transform(index, state)
        self._prefetch(defer_pageable=True)

    def _transform(self, index: int, state: StreamedBlock) -> None:
        try:
            self.transforms[index](state.fresh)
        except BaseException:
            self.ring.drop(index)  # half transformed: the next call copies it afresh
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
        state = self.host.blocks[call.block]
        if state.released is not None:
            state.released.record(compute)
            state.released_once = True
        state.layout.point_at(state.host_views)

    def _finish_active(self) -> None:
        """Releases calls an exception left open, so the next step starts clean."""
        while self._active:
            self._release(self._active.pop())
