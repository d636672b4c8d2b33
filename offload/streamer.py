"""Streams blocks that do not live on the device through one reusable device
buffer, the ring, each copy issued ahead of use on a dedicated copy stream.

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

``BlockStreamer`` wires the parts at each call; each keeps its own state:

* ``HostBlocks`` (``host_blocks.py``): the host buffers, pinning, parking and adoption;
* ``DeviceRing`` (``device_ring.py``): the ring's memory, copies and events, the regions'
  books (``ring.py``, whose schedule the planner replays), companions;
* ``FileTier`` (``file_tier.py``): blocks read from their checkpoint file at each copy;
* ``StepCalls`` (``calls.py``): the calls open now and the learned call order;
* the hooks (``hooks.py``) through which it sees the model run.

Stopping can *park* instead of restoring: blocks that came from the CPU keep
their host buffers, which then are their only storage (valid CPU tensors holding
exactly the weights), in the streamer's ``ParkingLot`` (``offload/parking.py``).
The next streamer enabled on the same modules with the same lot adopts a parked
buffer while the modules still use exactly its views, so a host that hands a
model from one streamer to the next (ComfyUI loads a new clone for every prompt)
neither copies nor pins the streamed weights again.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from .calls import OpenCall, StepCalls
from .device import current_stream, synchronize
from .device_ring import DeviceRing
from .file_source import FileSlice
from .file_tier import FileTier
from .hooks import Removable, hook_calls, hook_step
from .host_blocks import HostBlocks
from .layout import DtypeOf
from .page_lock import can_pin_memory
from .parking import ParkingLot
from .pinning import PinnedMemoryBudget
from .ring import copy_ahead
from .streamed_block import StreamedBlock
from .timeline import TimelineRecorder
from .views import StreamerViews


def check_arguments(
    count: int, streamed: frozenset[int], read_each_step: frozenset[int], prefetch: int, files: bool, staging_slots: int
) -> None:
    """Raises, before anything is touched, for streamed indices outside ``count`` blocks, blocks to read from their
    file each step that are not streamed or have no file to read (``files``) or no slot, a negative prefetch."""
    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 (synchronous) or more, got {prefetch}")
    bad = sorted(i for i in streamed if not 0 <= i < count)
    if bad:
        raise ValueError(f"streamed block indices {bad} are outside 0..{count - 1}")
    extra = sorted(read_each_step - streamed)
    if extra:
        raise ValueError(f"blocks {extra} are to be read from their file each step but are not streamed")
    if read_each_step and (not files or staging_slots < 1):
        raise ValueError("blocks read from their file each step need a file_slice and at least one staging slot")


class BlockStreamer(StreamerViews):
    """Streams ``blocks[i]`` for every ``i`` in ``streamed``; other blocks are left alone.

    ``prefetch=0`` is the synchronous mode kept for comparison: each copy is issued
    when its block is called and the compute waits for it at once.
    ``ring_bytes`` sizes the device ring (see the module docstring); ``prefetch`` then
    still caps how many blocks are copied ahead.
    ``pin_budget`` caps the pinned host memory: blocks it refuses stream from pageable memory.
    ``call_order``: the order the blocks were called in by an earlier streamer of the same model
    (``last_order``), so the first step copies and reads ahead in that order rather than the list's.
    ``transforms``: per streamed block, a host's transform of its weights where they are in the ring, called
    (``copied``) on the compute stream at each call, once the block's tensors point at the ring, as part of the
    call's compute; ``copied`` at the first call after each copy, when the region holds the bytes as packed
    (ComfyUI's patches of quantized weights are re-quantized in place then, as ComfyUI re-quantizes them at
    load; later calls only put the re-quantized tensors back). A transform that raises leaves the region to be
    copied afresh. ``scratch_bytes``: device memory the transforms work in (``scratch``), allocated with the ring,
    so no call allocates.
    ``holders``: per block, the module whose call brings it in, where that is not the block itself (``hooks.py``).
    ``entry_methods``: per block, the methods of its own the model runs it through instead of calling it
    (``block_methods.py``); each run of one is a call of the block.
    ``persistent_allocations``: a context entered around each device allocation the engine keeps from one call
    to the next (its ring and staging buffer, a block made resident) and around their frees, some of which
    happen inside a block call (a ring released with ``release_device_buffers`` is allocated again by the next
    call): a host that records and replays the allocations of each call (ComfyUI's compiler) keeps them out.
    How blocks are kept on the host (``storage_dtype``, ``dtype_of``, ``file_slice``, ``read_each_step``,
    ``companions``, ``contents``, ``parking``): see ``HostBlocks``; file-tier blocks are read through
    ``staging_slots`` host slots (``FileTier``).
    ``pack_in_background``: ``enable`` returns without packing the blocks that can wait; they stream from where
    their bytes are until a thread of their own has packed them (``offload/packing_thread.py``).
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
        entry_methods: Mapping[int, Sequence[str]] | None = None,
        persistent_allocations: Callable[[], AbstractContextManager[object]] = nullcontext,
        parking: ParkingLot | None = None,
        pack_in_background: bool = False,
        scratch_bytes: int = 0,
    ) -> None:
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.streamed = frozenset(streamed)
        check_arguments(len(self.blocks), self.streamed, frozenset(read_each_step), prefetch,
                        file_slice is not None, staging_slots)  # fmt: skip
        self.transforms = dict(transforms or {})
        self.holders = dict(holders or {})
        self.entry_methods = dict(entry_methods or {})
        self.persistent_allocations = persistent_allocations
        self.prefetch = prefetch
        self.recorder = recorder
        self.root = root
        self.recurse = recurse
        self.host = HostBlocks(
            self.device,
            unit=self.unit,
            recurse=recurse,
            pin_memory=pin_memory and can_pin_memory(),
            pinned=pin_budget.share(self.give_back_pinned) if pin_budget is not None else None,
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
            scratch_bytes=scratch_bytes,
        )
        self.copy_stream = self.ring.copy_stream
        self.files = FileTier(self.host, self.ring, staging_slots, recorder)
        # The call order the first step expects: a host's earlier engine's ``last_order``, else list order.
        self.calls = StepCalls(len(self.blocks), call_order)
        self._handles: list[Removable] = []
        self._pageable_deferred = False  # some streamed block's copies wait for the post-hook
        self.pack_in_background = pack_in_background
        self.enabled = False

    # -- lifecycle ---------------------------------------------------------------------------

    def enable(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Moves the streamed blocks into host buffers and installs the hooks; ``progress(done, total)`` hears
        each block packed (a first load packs gigabytes). With ``pack_in_background`` the blocks that can wait are
        only recorded here, and a thread packs them from now on, in the order the steps call them."""
        if self.enabled:
            return
        blocks = {index: self.blocks[index] for index in self.streamed}
        self.host.pack_all(blocks, progress, later=self.pack_in_background)
        self.files.start()
        self._handles = hook_calls(
            self.blocks,
            self.holders,
            self.entry_methods,
            self._call_begins,
            self._call_ends,
            self._after_call,
            self.calls.running,
        )
        if self.root is not None:
            self._handles += hook_step(self.root, self.begin_step, self.end_step)
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())
        self.enabled = True
        self._pack_in_call_order()

    def _pack_in_call_order(self) -> None:
        """(Re)starts packing the waiting blocks in the background, in the order the steps call them."""
        upcoming = list(self.calls.upcoming(self.host.blocks, len(self.host.blocks)))
        self.host.background.start(upcoming, self.host.file_slice)

    def finish_packing(self) -> None:
        """Waits until every block waiting to be packed is (see ``pack_in_background``)."""
        self.host.background.finish()
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())

    def disable(self, park: bool = False) -> None:
        """Puts every streamed tensor back on its original device, bit for bit, and frees all buffers.

        ``park``: blocks that came from the CPU keep their host buffer as their storage instead (with a
        storage dtype they point back at their originals), and a later ``enable`` on the same modules
        adopts it; a pinned buffer stays counted by the pin budget until it is adopted or freed.
        """
        if not self.enabled:
            return
        self.host.check_can_park(park)
        self._finish_active()
        synchronize(self.device)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.ring.free()
        self.files.stop()
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
        self.host.background.stop()
        for index in indices:
            state = self.host.take(index)
            if state is not None:
                self.ring.drop(index)
                self.files.forget(index)
                with self.persistent_allocations():
                    state.restore(self.device)
                self.host.unpin(state)
        self.streamed = frozenset(self.host.blocks)
        self.ring.recount()
        self.host.read_each_step &= self.streamed
        self._pack_in_call_order()

    def give_back_pinned(self, nbytes: int) -> int:
        """Unpins streamed blocks, last first, until ``nbytes`` of the pin budget are free again (for another
        model that gets none); returns how many. Nothing while a step runs: its copies read these buffers.
        The blocks go on streaming from the same memory, pageable."""
        if self.calls.in_step or self.host.memory.share is None:
            return 0
        synchronize(self.device)  # copies issued ahead (across the step boundary) read these buffers
        packing = self.host.background.running
        self.host.background.stop()
        freed = self.host.unpin_some(nbytes)
        if packing:
            self._pack_in_call_order()
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())
        return freed

    def wrote_content(self, indices: Iterable[int]) -> None:
        """The host has written their ``contents`` into these blocks' host buffers (their tensors, on the host)."""
        self.host.wrote_content(indices)

    def allocate_device_buffers(self) -> None:
        """Allocates the ring now rather than at the first block call, so running out of device
        memory shows while the model is being placed, where the caller can still fall back."""
        if self.host.blocks and self.ring.books is None:
            self.ring.allocate()

    # -- each step and call ----------------------------------------------------------------------

    def _prefetch(self, defer_pageable: bool = False) -> None:
        """Issues the copies of the next streamed blocks, as far ahead as the ring has room, and the reads of
        the file-tier blocks after them.

        ``defer_pageable``: skip blocks in pageable memory. A copy from pageable memory holds the host
        thread until it is done (the driver stages it), so issued before a block's kernels are launched
        it would keep the device idle for the whole copy; the post-hook issues it instead, with the block
        just launched computing meanwhile. A file-tier block whose read is not done is copied later too:
        waiting for it would hold up the launch of the block about to run."""
        if not self.host.blocks:
            return
        books, _ = self.ring.allocated()

        def skip(index: int) -> bool:
            return self.files.reading(index) or (defer_pageable and self._deferred(self.host.blocks[index]))

        copy_ahead(
            self.calls.upcoming(self.host.blocks, self.prefetch), self.calls.held(), books.regions, self.ring.load, skip
        )
        if self.files.reader is not None:  # no look-ahead over every block at each call without a file tier
            self.files.read_ahead(self.calls.upcoming(self.host.blocks, len(self.host.blocks)), self.prefetch)

    def _deferred(self, state: StreamedBlock) -> bool:
        if self.copy_stream is None:
            return False
        if state.companions is not None and not state.companions.pinned:
            return True
        return not (self.files.pinned if state.read is not None else state.pinned)

    def begin_step(self) -> None:
        """Marks the start of one pass through the blocks (the root module's forward)."""
        self._finish_active()
        self.files.check_files()
        packing = self.host.background.running
        self.host.background.settle()
        if packing:  # blocks were packed since the last step: some of them copy from pinned memory now
            self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())
        self.calls.step_began()
        if self.recorder:
            self.recorder.begin_step(current_stream(self.device))
        self._prefetch()

    def close_open_step(self) -> None:
        """Ends a step an exception left open; nothing when none is.

        The hooks that close a step run with ``always_call``, which PyTorch honours for ``Exception``
        only: an exception outside that hierarchy (ComfyUI 0.33's interrupt is a ``BaseException``)
        leaves the block's region held and its weights pointing at the device until this is called."""
        if self.calls.in_step:
            self.end_step()

    def end_step(self) -> None:
        self._finish_active()
        self.calls.step_ended()
        if self.recorder:
            self.recorder.end_step(current_stream(self.device))

    def _call_begins(self, index: int) -> None:
        compute = current_stream(self.device)
        record = self.recorder.call_arrived(index, compute) if self.recorder else None
        self.calls.arrived(index)
        copy = None
        state = self.host.blocks.get(index)
        if state is not None:
            region = self.region_of(index)
            if region is None:
                if not self.ring.load(index, self.calls.held()):
                    raise RuntimeError(
                        f"no room for {self.unit} {index} in the device ring of {self.capacity} bytes: "
                        f"{len(self.calls.open)} streamed {self.unit}s are running nested inside each other"
                    )
                region = self.region_of(index)
                assert region is not None  # just placed
            if compute is not None and state.ready is not None:
                compute.wait_event(state.ready)
            copy, state.copy = state.copy, None
            views = self.ring.views(state, region[0])
            with self.host.lock:
                state.in_call = True
                state.layout.point_at(views)
        self.calls.opened(OpenCall(index, state is not None, record))
        if self.recorder:
            self.recorder.call_started(record, copy, compute)
        if state is not None and index in self.transforms:  # part of the call's compute, as timed
            self.ring.transform(index, self.transforms[index])
        self._prefetch(defer_pageable=True)

    def _call_ends(self, index: int) -> None:
        for call in self.calls.closed(index):
            self._release(call)

    def _after_call(self) -> None:
        if self._pageable_deferred or self.files.reader is not None:
            self._prefetch()

    def _release(self, call: OpenCall) -> None:
        compute = current_stream(self.device)
        if self.recorder:
            self.recorder.call_finished(call.record, compute)
        if not call.streamed:
            return
        state = self.host.blocks[call.block]
        if state.released is not None:
            state.released.record(compute)
            state.released_once = True
        with self.host.lock:
            state.in_call = False
            state.layout.point_at(state.host_views)

    def _finish_active(self) -> None:
        """Releases calls an exception left open, so the next step starts clean."""
        for call in self.calls.close_all():
            self._release(call)
