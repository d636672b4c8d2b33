"""The device ring: one device buffer where streamed blocks live while they run, each copied into a region of its own
size, placed one after the other in copy order.

Sizing it in bytes rather than in blocks lets copies run as far ahead as memory allows, and small blocks take less of
it. ``ByteRing`` keeps the books, shared with the planner's replay (``costs.simulate``) along with ``look_ahead`` and
``copy_ahead``; ``DeviceRing`` owns the memory, events and views, and issues the copies on the copy stream."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from .device import copy_stream, current_stream, free_device_bytes, is_accelerator
from .file_source import FileReader
from .host_blocks import HostBlocks
from .layout import ALIGNMENT, TensorForm, Views, aligned
from .spec import RingOptions
from .streamed_block import StreamedBlock
from .timeline import TimelineRecorder


def ring_capacity(largest: int, prefetch: int, nesting: int = 1, ring_bytes: int = 0) -> int:
    """The ring's bytes: one slot of the ``largest`` block per block copied ahead and per block running, or
    ``ring_bytes`` but no less than the least that always works.

    With ``nesting`` blocks running inside each other, ``2 * nesting - 1`` of the largest always suffice: the ``nesting
    - 1`` held regions split the rest into at most ``nesting`` stretches, one of which fits the largest."""
    if not ring_bytes:
        return (prefetch + nesting) * aligned(largest)
    return max(aligned(ring_bytes), (2 * nesting - 1) * aligned(largest))


def ring_granule(largest: int, ring_bytes: int = 0) -> int:
    """Where regions may start. A default ring uses slots of the largest block, so small blocks never straddle two
    slots and make a large one wait; a ring sized in bytes starts anywhere aligned."""
    return ALIGNMENT if ring_bytes else aligned(largest)


@dataclass
class ByteRing:
    """The regions of a ring of ``capacity`` bytes: ``regions[block] = (start, end)``.

    A region goes where the last one ended, wrapping at the end, so the oldest copies are overwritten first. Regions of
    ``held`` blocks (running or about to) are never overwritten: the region then goes to the free stretch nearest after
    the head. That search is complete, since a region that fits anywhere can slide down to 0 or to a held region's end.
    """

    capacity: int
    granule: int = ALIGNMENT  # regions start at its multiples (``ring_granule``)
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)
    head: int = 0  # where the next region goes when it fits there

    def place(self, block: int, nbytes: int, held: Container[int]) -> tuple[int, list[int]] | None:
        """A region of ``nbytes`` for ``block``: its start and the blocks it overwrites (dropped), or None when every
        stretch that fits would overwrite a ``held`` block."""
        size = aligned(nbytes)
        start = self.head
        overwritten = self._overlapping(start, start + size) if start + size <= self.capacity else None
        if overwritten is None or any(other in held for other in overwritten):
            free = self._free_start(size, held)
            if free is None:
                return None
            start = free
            overwritten = self._overlapping(start, start + size)
        for other in overwritten:
            del self.regions[other]
        self.regions[block] = (start, start + size)
        after = aligned(start + size, self.granule)
        self.head = after if after < self.capacity else 0
        return start, overwritten

    def _overlapping(self, start: int, end: int) -> list[int]:
        return [other for other, (a, b) in self.regions.items() if a < end and start < b]

    def _free_start(self, size: int, held: Container[int]) -> int | None:
        head, capacity, granule = self.head, self.capacity, self.granule
        bounds = sorted(region for other, region in self.regions.items() if other in held)
        best, best_after = None, capacity  # the start found nearest after the head, and how far after it
        low = 0
        for high, next_low in [*bounds, (capacity, capacity)]:
            # The stretch [low, high) holds nothing held; a region fits at its start, or at the head inside it.
            for start in (head, low) if low <= head < high else (low,):
                if start + size <= high and (start - head) % capacity < best_after:
                    best, best_after = start, (start - head) % capacity
            low = aligned(max(low, next_low), granule)
        return best

    def drop(self, block: int) -> None:
        self.regions.pop(block, None)


def look_ahead(order: Sequence[int], position: int, streamed: Container[int], count: int) -> Iterator[int]:
    """The next ``count`` streamed blocks of ``order`` from ``position``, wrapping into the next step."""
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
    """Copies the ``upcoming`` blocks not ``loaded`` yet, in order, until one does not fit. Each is ``held`` from its
    turn on, so a nearer block is never overwritten for a further one; ``skip`` defers a block without stopping."""
    for index in upcoming:
        held.add(index)
        if index in loaded or skip(index):
            continue
        if not load(index, held):
            return


#: Device views kept per block, one per ring position; positions repeat once the ring's cycle and the step's
#: line up.
_VIEWS_KEPT = 16

CachedViews = TypeVar("CachedViews", bound=tuple[torch.Tensor, ...])


def _cached_views(cache: dict[int, CachedViews], start: int, make: Callable[[], CachedViews]) -> CachedViews:
    views = cache.get(start)
    if views is None:
        if len(cache) == _VIEWS_KEPT:
            cache.clear()
        views = cache[start] = make()
    return views


class DeviceRing:
    """The ring the ``host``'s blocks are copied into, allocated at the first copy. File-tier blocks are copied from
    ``reader``'s staging slots."""

    def __init__(
        self, device: torch.device, host: HostBlocks, options: RingOptions, recorder: TimelineRecorder | None
    ) -> None:
        self.device = device
        self.host = host
        self.options = options
        self.recorder = recorder
        self.copy_stream = copy_stream(device)
        self.reader: FileReader | None = None
        self.books: ByteRing | None = None
        self.memory: torch.Tensor | None = None
        self._staging: torch.Tensor | None = None  # a copy to cast lands here first
        self.scratch: torch.Tensor | None = None  # for a host's transforms
        self.holds_all = False  # every streamed block fits at once, so a block copied once stays

    @property
    def capacity(self) -> int:
        options = self.options
        return ring_capacity(self._largest, options.prefetch, options.nesting, options.ring_bytes or 0)

    @property
    def _largest(self) -> int:
        return max((state.region_bytes for state in self.host.blocks.values()), default=0)

    @property
    def device_buffer_bytes(self) -> int:
        return sum(buffer.numel() for buffer in (self.memory, self._staging, self.scratch) if buffer is not None)

    def recount(self) -> None:
        self.holds_all = sum(aligned(state.region_bytes) for state in self.host.blocks.values()) <= self.capacity

    def allocate(self) -> None:
        capacity = self.capacity
        casting = [state.storage.nbytes for state in self.host.blocks.values() if cast_on_device(state)]
        staging = max(casting, default=0)
        free = free_device_bytes(self.device)
        scratch = self.options.scratch_bytes
        needed = capacity + staging + scratch
        if free is not None and needed > free:
            raise torch.OutOfMemoryError(
                f"the device ring needs {needed} bytes and {self.device} has {free} free: allocated "
                "anyway it would fail, or spill into shared host memory (the driver's system-memory fallback)"
            )
        with self.options.persistent_allocations():
            self.memory = torch.empty(capacity, dtype=torch.uint8, device=self.device)
            # One staging buffer suffices: copies and casts run in turn on the one copy stream.
            self._staging = torch.empty(staging, dtype=torch.uint8, device=self.device) if staging else None
            # One scratch suffices: transforms run in turn on the compute stream.
            self.scratch = torch.empty(scratch, dtype=torch.uint8, device=self.device) if scratch else None
        self.books = ByteRing(capacity, ring_granule(self._largest, self.options.ring_bytes or 0))
        self.recount()
        if is_accelerator(self.device):
            for state in self.host.blocks.values():
                if state.ready is None:
                    state.ready = torch.Event(device=self.device)
                    state.released = torch.Event(device=self.device)
        # The allocator hands out memory on the compute stream: its last reader there may still be queued. The
        # first copy into fresh memory has no released event to wait on.
        self._copies_after_compute()

    def _copies_after_compute(self) -> None:
        """Orders the copy stream after all compute issued so far, for ring bytes that no region's released event
        covers."""
        compute = current_stream(self.device)
        if self.copy_stream is not None and compute is not None:
            self.copy_stream.wait_stream(compute)

    def free(self) -> None:
        for state in self.host.blocks.values():
            state.device_views.clear()  # views keep their memory alive
            if state.companions is not None:
                state.companions.views.clear()
        with self.options.persistent_allocations():
            self.books = self.memory = self._staging = self.scratch = None

    def region_of(self, index: int) -> tuple[int, int] | None:
        return None if self.books is None else self.books.regions.get(index)

    def drop(self, index: int) -> None:
        if self.books is not None:
            self.books.drop(index)

    def holds(self, tensor: torch.Tensor) -> bool:
        """Whether every part of ``tensor`` (a quantized one's data and scales) lies in the ring."""
        if self.memory is None:
            return False
        start, end = self.memory.data_ptr(), self.memory.data_ptr() + self.memory.numel()
        parts = list(TensorForm.of(tensor, "tensor").parts_of(tensor))
        return all(start <= part.data_ptr() < end for part in parts)

    def allocated(self) -> tuple[ByteRing, torch.Tensor]:
        if self.books is None or self.memory is None:
            self.allocate()
        assert self.books is not None and self.memory is not None
        return self.books, self.memory

    def views(self, state: StreamedBlock, start: int) -> Views:
        _, memory = self.allocated()
        return _cached_views(state.device_views, start, lambda: state.layout.views(memory[start:]))

    def transform(self, index: int, transform: Callable[[bool], None]) -> None:
        """Runs a host's ``transform`` of block ``index`` in the ring, telling it whether this is the first call
        since the copy. One that raises leaves the region to be copied afresh: half transformed, it must not run
        again."""
        state = self.host.blocks[index]
        try:
            transform(state.fresh)
        except BaseException:
            # Its queued kernels may still write the region, and a later copy there would not wait for them.
            self._copies_after_compute()
            self.drop(index)
            raise
        state.fresh = False

    def companions(self, index: int) -> tuple[torch.Tensor, ...] | None:
        state = self.host.blocks.get(index)
        region = self.region_of(index)
        if state is None or state.companions is None or region is None or self.memory is None:
            return None
        layout, memory = state.companions.layout, self.memory
        start = region[0] + aligned(state.layout.nbytes)
        return _cached_views(state.companions.views, start, lambda: layout.views(memory[start:]))

    def load(self, index: int, held: Container[int]) -> bool:
        """Issues the copy of block ``index`` into the ring; False if no room is free of ``held`` blocks. The copy
        stream first waits for the released event of every block it overwrites."""
        books, memory = self.allocated()
        state = self.host.blocks[index]
        placed = books.place(index, state.region_bytes, held)
        if placed is None:
            return False
        start, overwritten = placed
        stream = self.copy_stream
        with stream if stream is not None else nullcontext():
            if stream is not None:
                for other in overwritten:
                    released = self.host.blocks[other].released
                    if released is not None and self.host.blocks[other].released_once:
                        stream.wait_event(released)
            record = self.recorder.copy_started(stream, state.storage.nbytes) if self.recorder else None
            try:
                unpacked = self._copy_in(index, state, memory, start)
            except BaseException:
                self._copy_failed(index, state)
                raise
            if record is not None:
                record.unpacked = unpacked
            state.fresh = True
            if self.recorder:
                self.recorder.copy_finished(record, stream)
            if state.ready is not None:
                state.ready.record(stream)
        state.copy = record
        return True

    def _copy_failed(self, index: int, state: StreamedBlock) -> None:
        """After a copy raised: the region holds other bytes, so it is forgotten, and the staging slot is freed once
        its issued work is done, to be read again."""
        self.drop(index)
        if self.reader is not None and state.read is not None:
            self.reader.release(index, self.copy_stream)

    def _copy_in(self, index: int, state: StreamedBlock, memory: torch.Tensor, start: int) -> bool:
        """Issues the block's copy into the ring at ``start``; whether it came from a block still waiting to be
        packed."""
        reader = self.reader
        unpacked = False
        size = state.storage.nbytes
        cast = cast_on_device(state)
        if cast:
            assert self._staging is not None
            target = self._staging[:size]
        else:
            target = memory[start : start + size]
        if state.read is not None:
            assert reader is not None
            host = reader.take(index, state.read)
            target.copy_(host[:size], non_blocking=host.is_pinned())
        else:
            with self.host.lock:  # the packing thread hands a block over between copies, never during one
                unpacked = state.waiting
                if state.sources is not None:  # waiting, or pinned in place: part by part
                    for view, source in zip(state.storage.part_views(target), state.sources, strict=True):
                        view.copy_(source, non_blocking=True)
                    if state.ready is not None:
                        # Under the lock: the packing thread waits for this event before freeing the sources,
                        # which an asynchronous copy may still be reading.
                        state.ready.record(self.copy_stream)
                else:
                    target.copy_(state.host[:size], non_blocking=state.host.is_pinned())
        if cast:
            targets = state.layout.part_views(memory[start:])
            for target_part, source in zip(targets, state.storage.part_views(target), strict=True):
                target_part.copy_(source)
        if reader is not None and state.read is not None:
            reader.release(index, self.copy_stream)
        if state.companions is not None:
            state.companions.copy_into(memory[start + aligned(state.layout.nbytes) :])
        return unpacked


def cast_on_device(state: StreamedBlock) -> bool:
    return state.storage is not state.layout
