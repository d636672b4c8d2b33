"""Streams blocks that do not live on the device through one reusable device buffer, the ring, each copy issued ahead
of use on a dedicated copy stream.

Stream rules for one step:

* Each streamed block lives once, in a flat (pinned) host buffer; its parameters point at views of it while off the
device. * Before block ``i`` runs, the next blocks in the expected call order are copied into the ring, as far ahead as
it has room and at most ``prefetch`` blocks. * The compute stream waits on the block's *ready* event, never the host,
and the parameters point at the block's region for the duration of its call. * After the call a *released* event is
recorded on the compute stream; a copy that overwrites any of those bytes waits on it first, so nothing is overwritten
before compute has read it. Weights are only read, never copied back.

Stopping can *park* instead of restoring: blocks from the CPU keep their host buffers, in the spec's ``ParkingLot``, and
the next streamer on the same modules adopts them, so a host handing a model to a new clone each prompt neither copies
nor pins its weights again."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import nn

from .calls import BlockCalls, Removable, StepCalls
from .device import synchronize
from .file_tier import FileTier
from .host_blocks import HostBlocks
from .pinning import HostMemory, can_pin_memory
from .ring import DeviceRing
from .runner import PackProgress, StreamReport
from .spec import StreamSpec


def stream_blocks(
    blocks: Sequence[nn.Module], device: torch.device | str, streamed: Iterable[int], spec: StreamSpec
) -> BlockStreamer:
    """The engine that streams ``blocks[i]`` for every ``i`` in ``streamed`` as ``spec`` asks. Raises for a spec that
    does not fit, before anything is touched; ``enable`` starts it."""
    return BlockStreamer(list(blocks), device, frozenset(streamed), spec)


class BlockStreamer:
    """Streams ``blocks[i]`` for every ``i`` in ``streamed``, as ``spec`` asks; built by ``stream_blocks``. Prefetch
    0 is the synchronous mode, kept for comparison."""

    def __init__(
        self, blocks: list[nn.Module], device: torch.device | str, streamed: frozenset[int], spec: StreamSpec
    ) -> None:
        _check(len(blocks), streamed, spec)
        self.blocks = blocks
        self.device = device = torch.device(device)
        self.streamed = streamed
        self.spec = spec
        budget = spec.host.pin_budget
        pinned = budget.share(self.give_back_pinned) if budget is not None else None
        memory = HostMemory(spec.host.pin_memory and can_pin_memory(), pinned)
        self.host = HostBlocks(device, memory, spec.host, spec.files, recurse=spec.calls.recurse)
        self.ring = DeviceRing(device, self.host, spec.ring, spec.recorder)
        self.files = FileTier(self.host, self.ring, spec.recorder)
        self.calls = StepCalls(len(blocks), spec.calls.call_order)
        self.steps = BlockCalls(self.ring, self.files, self.calls, spec.transforms)
        self._handles: list[Removable] = []
        self.enabled = False

    # -- lifecycle

    def enable(self, progress: PackProgress | None = None) -> None:
        """Packs the streamed blocks and installs the hooks; ``progress`` hears each. With
        ``pack_in_background`` a thread packs the blocks that can wait."""
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
        upcoming = list(self.calls.upcoming(self.host.blocks, len(self.host.blocks)))
        self.host.background.start(upcoming, self.spec.files.file_slice)

    def finish_packing(self) -> None:
        self.host.background.finish()
        self.steps.sources_changed()

    def disable(self, park: bool = False) -> None:
        """Puts every streamed tensor back on its original device, bit for bit, and frees all buffers. ``park``:
        blocks from the CPU keep their host buffer for a later ``enable`` to adopt, its pinned bytes still
        counted."""
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
        """Frees the ring; the next call that needs it allocates it again."""
        self.steps.finish_active()
        synchronize(self.device)
        self.ring.free()

    def make_resident(self, indices: Iterable[int]) -> None:
        """Moves these blocks to the device for good. Refused for a block with a transform: resident, its weights
        would be the only copy, and a transform in place would change them for good."""
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
        """Unpins blocks, last first, until ``nbytes`` are free for another model; returns how many. Nothing while a
        step runs, since its copies read these buffers. The blocks stream on, pageable."""
        if self.calls.in_step or self.host.memory.share is None:
            return 0
        synchronize(self.device)  # copies issued ahead across the step boundary read these buffers
        packing = self.host.background.running
        self.host.background.stop()
        freed = self.host.unpin_some(nbytes)
        if packing:
            self._pack_in_call_order()
        self.steps.sources_changed()
        return freed

    def wrote_content(self, indices: Iterable[int]) -> None:
        self.host.wrote_content(indices)

    def allocate_device_buffers(self) -> None:
        """Allocates the ring now, so running out of memory shows while the model is placed and the caller can still
        fall back."""
        if self.host.blocks and self.ring.books is None:
            self.ring.allocate()

    def close_open_step(self) -> None:
        """See ``BlockCalls.close_open_step``."""
        self.steps.close_open_step()

    # -- what a host reads

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        return self.ring.companions(index)

    @property
    def scratch(self) -> torch.Tensor | None:
        return self.ring.scratch

    def report(self) -> StreamReport:
        """The engine's numbers now. It passes over every unit, so a host reads it where it logs or shows them, not
        at each block call."""
        host, files, background = self.host, self.files, self.host.background
        companion_bytes, staging_bytes = host.companion_bytes, files.staging_bytes
        return StreamReport(
            unit=host.unit,
            units=len(self.blocks),
            streamed=self.streamed,
            read_each_step=host.read_each_step,
            needs_content=host.needs_content,
            last_order=tuple(self.calls.expected),
            host_bytes=host.buffer_bytes + companion_bytes + staging_bytes,
            companion_bytes=companion_bytes,
            staging_bytes=staging_bytes,
            device_buffer_bytes=self.ring.device_buffer_bytes,
            packed_bytes=host.packed_bytes,
            background_packing=background.progress,
            waiting_bytes=background.waiting_bytes,
            pinning_progress=background.pinning_progress,
            refused_pinning=host.pageable_because("cap"),
            failed_pinning=host.pageable_because("driver"),
            file_tier_bytes=files.file_bytes,
            bytes_read=files.bytes_read,
            file_slices=files.file_slices(),
        )


def _check(count: int, streamed: frozenset[int], spec: StreamSpec) -> None:
    """Raises, before anything is touched, for a spec that does not fit ``count`` blocks."""
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
