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

``BlockStreamer`` owns the parts, each with its own state, and changes what is streamed (enable, disable,
make resident, unpin):

* ``HostBlocks`` (``host_blocks.py``): the host buffers, pinning, parking and adoption;
* ``DeviceRing`` (``device_ring.py``): the ring's memory, copies and events, the regions'
  books (``ring.py``, whose schedule the planner replays), companions;
* ``FileTier`` (``file_tier.py``): blocks read from their checkpoint file at each copy;
* ``StepCalls`` (``calls.py``): the calls open now and the learned call order;
* ``BlockCalls`` (``block_calls.py``): what runs at each step and block call, through the hooks (``hooks.py``)
  by which it sees the model run.

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

from .block_calls import BlockCalls
from .calls import StepCalls
from .device import synchronize
from .device_ring import DeviceRing
from .file_source import FileSlice
from .file_tier import FileTier
from .hooks import Removable
from .host_blocks import HostBlocks
from .layout import DtypeOf
from .page_lock import can_pin_memory
from .parking import ParkingLot
from .pinning import PinnedMemoryBudget
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
        self.files = FileTier(self.host, self.ring, staging_slots, recorder)
        # The call order the first step expects: a host's earlier engine's ``last_order``, else list order.
        self.calls = StepCalls(len(self.blocks), call_order)
        self.steps = BlockCalls(self.ring, self.files, self.calls, transforms=self.transforms, unit=self.unit)
        self._handles: list[Removable] = []
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
        self._handles = self.steps.hook(self.blocks, self.holders, self.entry_methods, self.root)
        self.steps.sources_changed()
        self.enabled = True
        self._pack_in_call_order()

    def _pack_in_call_order(self) -> None:
        """(Re)starts packing the waiting blocks in the background, in the order the steps call them."""
        upcoming = list(self.calls.upcoming(self.host.blocks, len(self.host.blocks)))
        self.host.background.start(upcoming, self.host.file_slice)

    def finish_packing(self) -> None:
        """Waits until every block waiting to be packed is (see ``pack_in_background``)."""
        self.host.background.finish()
        self.steps.sources_changed()

    def disable(self, park: bool = False) -> None:
        """Puts every streamed tensor back on its original device, bit for bit, and frees all buffers.

        ``park``: blocks that came from the CPU keep their host buffer as their storage instead (with a
        storage dtype they point back at their originals), and a later ``enable`` on the same modules
        adopts it; a pinned buffer stays counted by the pin budget until it is adopted or freed.
        """
        if not self.enabled:
            return
        self.host.check_can_park(park)
        self.steps.finish_active()
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
        self.steps.finish_active()
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
        self.steps.finish_active()
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
        self.steps.sources_changed()
        return freed

    def wrote_content(self, indices: Iterable[int]) -> None:
        """The host has written their ``contents`` into these blocks' host buffers (their tensors, on the host)."""
        self.host.wrote_content(indices)

    def allocate_device_buffers(self) -> None:
        """Allocates the ring now rather than at the first block call, so running out of device
        memory shows while the model is being placed, where the caller can still fall back."""
        if self.host.blocks and self.ring.books is None:
            self.ring.allocate()

    def close_open_step(self) -> None:
        """See ``BlockCalls.close_open_step``."""
        self.steps.close_open_step()
