"""Streams blocks that do not live on the device through one reusable device buffer, the ring, each copy issued
ahead of use on a dedicated copy stream.

How one step runs:

* Each streamed block's tensors live once, in one flat (pinned) host buffer; the module's parameters point at
  views of it while the block is offloaded.
* The ring is allocated once, sized in bytes: by default as ``prefetch + 1`` blocks as large as the largest
  streamed one; a planner may give it whatever its budget leaves. Before block ``i`` runs, the next streamed
  blocks of the expected call order are copied into it, each into a region of its own size, as far ahead as
  the ring has room and at most ``prefetch`` blocks.
* The compute stream waits on the block's *ready* event, not on the host, and the block's parameters are
  pointed at its region for the duration of its call.
* After the call the block records a *released* event on the compute stream; a copy that overwrites any of its
  bytes waits on it first on the copy stream. That ordering prevents overwriting memory the compute stream has
  not finished reading. Weights are only read, so nothing is copied back.

``stream_blocks`` checks a ``StreamSpec`` against the blocks and builds a ``BlockStreamer``, which owns the
parts, each reading its part of the spec, and changes what is streamed (enable, disable, make resident, unpin):
``HostBlocks`` (``host_blocks.py``: host buffers, pinning, parking), ``DeviceRing`` (``ring.py``),
``FileTier`` (``file_tier.py``), and ``StepCalls`` with ``BlockCalls`` (``calls.py``: the hooks and what each
call does).

Stopping can *park* instead of restoring: blocks that came from the CPU keep their host buffers, which then are
their only storage, in the spec's ``ParkingLot``. The next streamer enabled on the same modules with the same
lot adopts a parked buffer while the modules still use exactly its views, so a host that hands a model from one
streamer to the next (ComfyUI loads a new clone for every prompt) neither copies nor pins its weights again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn

from .calls import BlockCalls, Removable, StepCalls
from .device import synchronize
from .file_source import FileSlice
from .file_tier import FileTier
from .host_blocks import HostBlocks
from .pinning import HostMemory, can_pin_memory
from .ring import DeviceRing
from .spec import StreamSpec


def check_spec(count: int, streamed: frozenset[int], spec: StreamSpec) -> None:
    """Raises, before anything is touched, for streamed indices outside ``count`` blocks, blocks to read from their
    file each step that are not streamed or have no file to read or no slot, a negative prefetch."""
    prefetch, files = spec.ring.prefetch, spec.files
    if prefetch < 0:
        raise ValueError(f"prefetch must be 0 (synchronous) or more, got {prefetch}")
    bad = sorted(i for i in streamed if not 0 <= i < count)
    if bad:
        raise ValueError(f"streamed block indices {bad} are outside 0..{count - 1}")
    extra = sorted(files.read_each_step - streamed)
    if extra:
        raise ValueError(f"blocks {extra} are to be read from their file each step but are not streamed")
    if files.read_each_step and (files.file_slice is None or files.staging_slots < 1):
        raise ValueError("blocks read from their file each step need a file_slice and at least one staging slot")


def stream_blocks(
    blocks: Sequence[nn.Module], device: torch.device | str, streamed: Iterable[int], spec: StreamSpec
) -> BlockStreamer:
    """The engine that streams ``blocks[i]`` for every ``i`` in ``streamed`` as ``spec`` asks; other blocks are
    left alone. Raises for a spec that does not fit the blocks, before anything is touched; ``enable`` starts it."""
    blocks, streamed = list(blocks), frozenset(streamed)
    check_spec(len(blocks), streamed, spec)
    return BlockStreamer(blocks, torch.device(device), streamed, spec)


class BlockStreamer:
    """Streams ``blocks[i]`` for every ``i`` in ``streamed``, as ``spec`` asks (``offload/spec.py``); built by
    ``stream_blocks``, which checks the spec first.

    Prefetch 0 is the synchronous mode kept for comparison: each copy is issued when its block is called and the
    compute waits for it at once."""

    def __init__(
        self, blocks: list[nn.Module], device: torch.device, streamed: frozenset[int], spec: StreamSpec
    ) -> None:
        self.blocks = blocks
        self.device = device
        self.streamed = streamed
        self.spec = spec
        budget = spec.host.pin_budget
        pinned = budget.share(self.give_back_pinned) if budget is not None else None
        memory = HostMemory(spec.host.pin_memory and can_pin_memory(), pinned)
        self.host = HostBlocks(device, memory, spec.host, spec.files, recurse=spec.calls.recurse)
        self.ring = DeviceRing(device, self.host, spec.ring, spec.recorder)
        self.files = FileTier(self.host, self.ring, spec.recorder)
        # The call order the first step expects: a host's earlier engine's ``last_order``, else list order.
        self.calls = StepCalls(len(blocks), spec.calls.call_order)
        self.steps = BlockCalls(self.ring, self.files, self.calls, spec.transforms)
        self._handles: list[Removable] = []
        self.enabled = False

    # -- lifecycle

    def enable(self, progress: Callable[[int, int], None] | None = None) -> None:
        """Moves the streamed blocks into host buffers and installs the hooks; ``progress(done, total)`` hears
        each block packed (a first load packs gigabytes). With ``pack_in_background`` the blocks that can wait are
        only recorded here, and a thread packs them from now on, in the order the steps call them."""
        if self.enabled:
            return
        blocks = {index: self.blocks[index] for index in self.streamed}
        self.host.pack_all(blocks, progress, later=self.spec.host.pack_in_background)
        self.files.start()
        self._handles = self.steps.hook(self.blocks, self.spec.calls)
        self.steps.sources_changed()
        self.enabled = True
        self._pack_in_call_order()

    def _pack_in_call_order(self) -> None:
        """(Re)starts packing the waiting blocks in the background, in the order the steps call them."""
        upcoming = list(self.calls.upcoming(self.host.blocks, len(self.host.blocks)))
        self.host.background.start(upcoming, self.spec.files.file_slice)

    def finish_packing(self) -> None:
        """Waits until every block waiting to be packed is (see ``HostOptions.pack_in_background``)."""
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
        """Stops streaming these blocks: their tensors move to the device for good. Not for a block with a
        transform: resident, its weights would be the module's only copy, and a transform in place would
        change them for good."""
        indices = list(indices)
        transformed = sorted(set(indices) & self.spec.transforms.keys())
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
                with self.spec.ring.persistent_allocations():
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

    # -- what a host reads (``Runner`` documents each)

    @property
    def unit(self) -> str:
        return self.host.unit

    @property
    def units(self) -> int:
        return len(self.blocks)

    @property
    def last_order(self) -> tuple[int, ...]:
        return tuple(self.calls.expected)

    @property
    def read_each_step(self) -> frozenset[int]:
        return self.host.read_each_step

    @property
    def needs_content(self) -> frozenset[int]:
        return self.host.needs_content

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        return self.ring.companions(index)

    @property
    def scratch(self) -> torch.Tensor | None:
        return self.ring.scratch

    @property
    def host_bytes(self) -> int:
        """Host memory the streamer holds: its blocks' host buffers, their companions, the staging slots."""
        return self.host.buffer_bytes + self.companion_bytes + self.staging_bytes

    @property
    def companion_bytes(self) -> int:
        return self.host.companion_bytes

    @property
    def device_buffer_bytes(self) -> int:
        return self.ring.device_buffer_bytes

    @property
    def staging_bytes(self) -> int:
        return self.files.staging_bytes

    @property
    def packed_bytes(self) -> int:
        return self.host.packed_bytes

    @property
    def waiting_bytes(self) -> int:
        return self.host.background.waiting_bytes

    @property
    def background_packing(self) -> tuple[int, int]:
        return self.host.background.progress

    @property
    def pinning_progress(self) -> tuple[int, int]:
        return self.host.background.pinning_progress

    @property
    def refused_pinning(self) -> dict[int, int]:
        return self.host.pageable_because("cap")

    @property
    def failed_pinning(self) -> dict[int, int]:
        return self.host.pageable_because("driver")

    @property
    def file_tier_bytes(self) -> int:
        return self.files.file_bytes

    @property
    def bytes_read(self) -> int:
        return self.files.bytes_read

    def file_slices(self) -> tuple[FileSlice, ...]:
        return self.files.file_slices()
