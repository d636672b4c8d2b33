"""Streams blocks that do not live on the device into a small pool of reusable
device buffers, each copy issued ahead of use on a dedicated copy stream.

How one step runs, with prefetch ``k``:

* Each streamed block's tensors live once, in one flat (pinned) host buffer; the
  module's parameters point at views of it while the block is offloaded.
* ``k + 1`` device slots, each as large as the largest streamed block, are
  allocated once. Before block ``i`` runs, the next ``k`` streamed blocks of the
  expected call order are already being copied into free slots.
* The compute stream waits on the block's *ready* event, not on the host, and
  the block's parameters are pointed at the slot for the duration of its call.
* After the call the slot records a *released* event on the compute stream; the
  copy stream waits on it before overwriting the slot. That ordering is what
  prevents the use-after-free race of freeing a buffer the compute stream has
  not finished reading. Weights are only read, so nothing is copied back.

The call order is learned: the first step assumes list order, later steps
follow the order the previous step really used, so blocks that run twice, run
out of order or are skipped cost a miss (an unhidden copy) at most once.

Stopping can *park* instead of restoring: blocks that came from the CPU keep
their host buffers, which then are their only storage (valid CPU tensors holding
exactly the weights). The next streamer enabled on the same modules adopts a
parked buffer while the modules still use exactly its views, so a host that
hands a model from one streamer to the next (ComfyUI loads a new clone for
every prompt) neither copies nor pins the streamed weights again.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Container, Iterable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .device import can_pin_memory, copy_stream, current_stream, is_accelerator, pinned_host_buffer, synchronize
from .layout import BlockLayout
from .pinning import PinnedMemoryBudget
from .plan import slot_count
from .timeline import CallRecord, CopyRecord, TimelineRecorder


class SlotState(Protocol):
    """What the slot choice reads of a slot (offload.planner replays it on slots of its own)."""

    block: int | None
    in_use: bool
    last_used: int


def pick_slot(slots: Sequence[SlotState], protected: Container[int]) -> int | None:
    """A free slot, preferring empty ones, then the least recently used block not about to run."""
    best = None
    for number, slot in enumerate(slots):
        if slot.in_use or (slot.block is not None and slot.block in protected):
            continue
        if slot.block is None:
            return number
        if best is None or slot.last_used < slots[best].last_used:
            best = number
    return best


def eager(hook: Callable) -> Callable:
    """``hook``, run as plain Python under ``torch.compile``: the engine's hooks issue copies, record events
    and repoint parameters, which a traced graph would bake in once; the compiler breaks the graph around
    them instead, and compiles the blocks' own code between them."""
    return torch.compiler.disable(hook, recursive=True)


def look_ahead(order: Sequence[int], position: int, streamed: Container[int], count: int) -> list[int]:
    """The next ``count`` streamed blocks of the call ``order`` from ``position``, wrapping into the next step."""
    ahead: list[int] = []
    for offset in range(len(order) if count > 0 else 0):
        index = order[(position + offset) % len(order)]
        if index in streamed and index not in ahead:
            ahead.append(index)
            if len(ahead) == count:
                break
    return ahead


@dataclass
class _Slot:
    """A device buffer that holds one streamed block at a time."""

    flat: torch.Tensor
    staging: torch.Tensor | None
    ready: torch.Event | None
    released: torch.Event | None
    block: int | None = None
    in_use: bool = False
    released_once: bool = False
    last_used: int = -1
    copy: CopyRecord | None = None
    views: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)


@dataclass
class _StreamedBlock:
    """The host side of a streamed block: its packed tensors and where they came from."""

    layout: BlockLayout
    storage: BlockLayout
    host: torch.Tensor
    host_views: tuple[torch.Tensor, ...]
    origin_device: torch.device
    # Kept only with a lossy storage dtype: restoring from the rounded copy would change the model.
    originals: tuple[torch.Tensor, ...] | None = None
    slot: int | None = None
    pinned: bool = False


@dataclass(frozen=True)
class _ParkedBuffer:
    """A parked block's host buffer, known only weakly: the module's tensors are what keep it alive."""

    storage: weakref.ref[torch.UntypedStorage]
    nbytes: int
    signature: tuple[tuple[str, bool, int, torch.Size, torch.dtype], ...]
    pinned: bool
    recurse: bool  # laid out with the block's submodules, or its own tensors only
    # Its pinned bytes' reservation, released when the buffer is freed, or taken back by an adopting share.
    reservation: weakref.finalize | None

    def host(self) -> torch.Tensor | None:
        storage = self.storage()
        if storage is None:
            return None
        return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (self.nbytes,))


# Keyed weakly by the block module: a deleted model takes its parked buffers (and their reservations) with it.
_PARKED: weakref.WeakKeyDictionary[nn.Module, _ParkedBuffer] = weakref.WeakKeyDictionary()


def _signature(layout: BlockLayout) -> tuple[tuple[str, bool, int, torch.Size, torch.dtype], ...]:
    # No owner modules: a value of the weak registry must not keep its key alive.
    return tuple(
        (slot.name, slot.is_parameter, part.offset, part.shape, part.dtype)
        for slot in layout.slots
        for part in slot.parts
    )


def _same_memory(tensor: torch.Tensor, view: torch.Tensor) -> bool:
    return (
        tensor.device == view.device
        and tensor.data_ptr() == view.data_ptr()
        and tensor.dtype == view.dtype
        and tensor.shape == view.shape
        and tensor.stride() == view.stride()
    )


def unpark(modules: Iterable[nn.Module]) -> None:
    """Gives the parked blocks among ``modules`` memory of their own again (a copy of what they hold),
    so that their host buffers, pinned ones included, are freed: what a host's real unload calls."""
    for module in modules:
        parked = _PARKED.pop(module, None)
        host = parked.host() if parked is not None else None
        if host is None:
            continue
        start, end = host.data_ptr(), host.data_ptr() + parked.nbytes
        layout = BlockLayout.of(module, recurse=parked.recurse)
        parts = tuple(
            part.clone() if part.device.type == "cpu" and start <= part.data_ptr() < end else part
            for part in layout.current()
        )
        layout.point_at(layout.assemble(parts))


@dataclass
class _ActiveCall:
    block: int
    slot: int | None
    record: CallRecord | None


class BlockStreamer:
    """Streams ``blocks[i]`` for every ``i`` in ``streamed``; other blocks are left alone.

    ``prefetch=0`` is the synchronous mode kept for comparison: each copy is issued
    when its block is called and the compute waits for it at once.
    ``storage_dtype`` keeps floating-point parameters in another dtype on the host;
    they are cast back on the copy stream, right after the copy, so the cast and
    the copy are ordered on one stream. It shrinks what each step copies; the
    originals are kept too, because a rounded copy must never replace them.
    ``pin_budget`` caps the pinned host memory: blocks it refuses stream from pageable memory.
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
    ) -> None:
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {prefetch}")
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.streamed = frozenset(streamed)
        bad = sorted(i for i in self.streamed if not 0 <= i < len(self.blocks))
        if bad:
            raise ValueError(f"streamed block indices {bad} are outside 0..{len(self.blocks) - 1}")
        self.prefetch = prefetch
        self.pin_memory = pin_memory and can_pin_memory()
        self._pinned = pin_budget.share() if pin_budget is not None else None
        self.storage_dtype = storage_dtype
        self.recorder = recorder
        self.root = root
        self.recurse = recurse
        # Nested streamed modules (a wrapped module inside another) each hold a slot.
        self.num_slots = slot_count(prefetch, nesting)
        self.copy_stream = copy_stream(self.device)
        self._state: dict[int, _StreamedBlock] = {}
        self._slots: list[_Slot] = []
        self._handles: list[RemovableHandle] = []
        self._active: list[_ActiveCall] = []
        self._expected: list[int] = list(range(len(self.blocks)))
        self._order: list[int] = []
        self._tick = 0
        self._pageable_deferred = False  # some streamed block's copies wait for the post-hook
        self.enabled = False

    # -- lifecycle ---------------------------------------------------------------------------

    def enable(self) -> None:
        """Moves the streamed blocks into host buffers and installs the hooks."""
        if self.enabled:
            return
        for index in sorted(self.streamed):
            self._state[index] = self._offload(self.blocks[index])
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(eager(self._pre_hook(index))))
            self._handles.append(block.register_forward_hook(eager(self._post_hook(index)), always_call=True))
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
        self._finish_active()
        synchronize(self.device)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        for index in sorted(self._state):
            if park and self._state[index].origin_device.type == "cpu":
                self._park(index)
            else:
                self._restore(index, self._state[index].origin_device)
                self._unpin(self._state[index])
        self._state.clear()
        self._slots.clear()
        self.enabled = False

    def release_device_buffers(self) -> None:
        """Frees the slot pool; it is allocated again by the next call that needs it."""
        self._finish_active()
        synchronize(self.device)
        for state in self._state.values():
            state.slot = None
        self._slots.clear()

    def make_resident(self, indices: Iterable[int]) -> None:
        """Stops streaming these blocks: their tensors move to the device for good."""
        self._finish_active()
        synchronize(self.device)
        for index in indices:
            if index in self._state:
                slot = self._state[index].slot
                if slot is not None:
                    self._slots[slot].block = None
                self._restore(index, self.device)
                self._unpin(self._state[index])
                del self._state[index]
        self.streamed = frozenset(self._state)

    @property
    def last_order(self) -> tuple[int, ...]:
        """The block calls of the last finished step, in order (list order before the first step)."""
        return tuple(self._expected)

    def slot_of(self, index: int) -> int | None:
        """The slot holding streamed block ``index`` on the device, or None while it is only on the host."""
        state = self._state.get(index)
        return None if state is None else state.slot

    @property
    def unit(self) -> str:
        return "block" if self.recurse else "module"

    @property
    def units(self) -> int:
        return len(self.blocks)

    @property
    def host_bytes(self) -> int:
        return sum(state.host.numel() for state in self._state.values())

    @property
    def device_buffer_bytes(self) -> int:
        """Device bytes the slot pool holds now (0 before the first call and after a release)."""
        return sum(s.flat.numel() + (s.staging.numel() if s.staging is not None else 0) for s in self._slots)

    @property
    def refused_pinning(self) -> dict[int, int]:
        """Streamed blocks (index: host bytes) that wanted pinned memory but got pageable memory,
        because the pin budget was spent."""
        if not self.pin_memory:
            return {}
        return {index: state.host.numel() for index, state in sorted(self._state.items()) if not state.pinned}

    @property
    def _casts(self) -> bool:
        return self.storage_dtype is not None

    # -- host side ---------------------------------------------------------------------------

    def _offload(self, block: nn.Module) -> _StreamedBlock:
        layout = BlockLayout.of(block, recurse=self.recurse)
        adopted = self._adopt(block, layout)
        if adopted is not None:
            return adopted
        storage = layout
        if self._casts:
            storage = BlockLayout.of(block, self.storage_dtype, recurse=self.recurse)
        origin = layout.device or self.device
        pinned = self.pin_memory and (self._pinned is None or self._pinned.reserve(storage.nbytes))
        host = pinned_host_buffer(storage.nbytes) if pinned else None
        if host is None:
            if pinned and self._pinned is not None:
                self._pinned.release(storage.nbytes)  # the driver refused: stream it from pageable memory
            pinned = False
            host = torch.empty(storage.nbytes, dtype=torch.uint8)
        storage.pack_into(host)
        host_views = storage.views(host)
        # Kept on the host: originals left on the device would keep the whole block there.
        originals = tuple(t.to("cpu") for t in layout.current()) if self._casts else None
        # Without a storage dtype, the block's only copy of its weights is now the host buffer.
        layout.point_at(host_views)
        return _StreamedBlock(layout, storage, host, host_views, origin, originals, pinned=pinned)

    def _park(self, index: int) -> None:
        """Leaves block ``index`` on host memory without a copy (its tensors already point at the host views)."""
        state = self._state[index]
        if state.originals is not None:
            state.layout.point_at(state.layout.assemble(state.originals))  # the rounded copy must not replace them
            self._unpin(state)
            return
        storage = state.host.untyped_storage()
        nbytes = state.host.numel()
        reservation = self._pinned.park(nbytes, storage) if state.pinned and self._pinned is not None else None
        _PARKED[self.blocks[index]] = _ParkedBuffer(
            weakref.ref(storage), nbytes, _signature(state.layout), state.pinned, self.recurse, reservation
        )

    def _adopt(self, block: nn.Module, layout: BlockLayout) -> _StreamedBlock | None:
        """The block's parked host buffer, taken over as it is, if the block still uses exactly its views
        (a weight replaced or patched while parked means it is packed again) and it is pinned as asked."""
        parked = _PARKED.pop(block, None)
        if parked is None or self._casts or parked.pinned != self.pin_memory:
            return None
        host = parked.host()
        if host is None or parked.signature != _signature(layout):
            return None
        parts = layout.part_views(host)
        if not all(_same_memory(tensor, view) for tensor, view in zip(layout.current(), parts, strict=True)):
            return None
        if parked.reservation is not None:
            if self._pinned is None or not self._pinned.adopt(parked.reservation):
                return None
        elif parked.pinned and self._pinned is not None:
            return None  # pinned outside this budget: adopting it would leave the budget short
        return _StreamedBlock(layout, layout, host, layout.assemble(parts), host.device, pinned=parked.pinned)

    def _unpin(self, state: _StreamedBlock) -> None:
        """Gives the block's pinned bytes back to the budget (its host buffer is dropped with it)."""
        if state.pinned and self._pinned is not None:
            self._pinned.release(state.host.numel())

    def _restore(self, index: int, device: torch.device) -> None:
        state = self._state[index]
        sources = state.originals if state.originals is not None else state.storage.part_views(state.host)
        restored = tuple(
            source.to(device=device, dtype=part.dtype, copy=True)
            for part, source in zip(state.layout.parts, sources, strict=True)
        )
        state.layout.point_at(state.layout.assemble(restored))

    # -- device side -------------------------------------------------------------------------

    def allocate_device_buffers(self) -> None:
        """Allocates the slot pool now rather than at the first block call, so running out of device
        memory shows while the model is being placed, where the caller can still fall back."""
        if self._state and not self._slots:
            self._allocate_slots()

    def _allocate_slots(self) -> None:
        largest = max(state.layout.nbytes for state in self._state.values())
        staging = max(state.storage.nbytes for state in self._state.values()) if self._casts else 0
        on_device = is_accelerator(self.device)
        for _ in range(self.num_slots):
            self._slots.append(
                _Slot(
                    flat=torch.empty(largest, dtype=torch.uint8, device=self.device),
                    staging=torch.empty(staging, dtype=torch.uint8, device=self.device) if staging else None,
                    ready=torch.Event(device=self.device) if on_device else None,
                    released=torch.Event(device=self.device) if on_device else None,
                )
            )
        if self.copy_stream is not None:
            # The allocator hands out memory on the compute stream: its last reader there may still be
            # queued. The first copy into a fresh slot has no released event to wait on, so order the
            # copy stream after everything the compute stream has issued so far.
            self.copy_stream.wait_stream(current_stream(self.device))

    def _views(self, slot: _Slot, index: int) -> tuple[torch.Tensor, ...]:
        views = slot.views.get(index)
        if views is None:
            views = slot.views[index] = self._state[index].layout.views(slot.flat)
        return views

    def _load(self, index: int, protected: set[int]) -> int | None:
        """Issues the copy of block ``index`` into a slot; returns the slot, or None if none is free."""
        if not self._slots:
            self._allocate_slots()
        number = pick_slot(self._slots, protected)
        if number is None:
            return None
        slot = self._slots[number]
        if slot.block is not None:
            self._state[slot.block].slot = None
        state = self._state[index]
        stream = self.copy_stream
        with stream if stream is not None else nullcontext():
            if stream is not None and slot.released_once:
                stream.wait_event(slot.released)
            record = self.recorder.copy_started(stream, state.storage.nbytes) if self.recorder else None
            self._copy_in(state, slot, index)
            if self.recorder:
                self.recorder.copy_finished(record, stream)
            if slot.ready is not None:
                slot.ready.record(stream)
        slot.block = index
        slot.copy = record
        state.slot = number
        return number

    def _copy_in(self, state: _StreamedBlock, slot: _Slot, index: int) -> None:
        non_blocking = state.host.is_pinned()
        if slot.staging is None:
            slot.flat[: state.host.numel()].copy_(state.host, non_blocking=non_blocking)
            return
        slot.staging[: state.host.numel()].copy_(state.host, non_blocking=non_blocking)
        targets = state.layout.part_views(slot.flat)
        for target, source in zip(targets, state.storage.part_views(slot.staging), strict=True):
            target.copy_(source)

    def _upcoming(self) -> list[int]:
        return look_ahead(self._expected, len(self._order), self._state, self.prefetch)

    def _prefetch(self, defer_pageable: bool = False) -> None:
        """Issues the copies of the next ``prefetch`` streamed blocks into free slots.

        ``defer_pageable``: skip blocks in pageable memory. A copy from pageable memory holds the host
        thread until it is done (the driver stages it), so issued before a block's kernels are launched
        it would keep the device idle for the whole copy; the post-hook issues it instead, with the block
        just launched computing meanwhile."""
        ahead = self._upcoming()
        protected = set(ahead)
        for index in ahead:
            state = self._state[index]
            if state.slot is not None or (defer_pageable and self._deferred(state)):
                continue
            if self._load(index, protected) is None:
                return

    def _deferred(self, state: _StreamedBlock) -> bool:
        return self.copy_stream is not None and not state.pinned

    # -- hooks -------------------------------------------------------------------------------

    def begin_step(self) -> None:
        """Marks the start of one pass through the blocks (the root module's forward)."""
        self._finish_active()
        self._order = []
        if self.recorder:
            self.recorder.begin_step(current_stream(self.device))
        self._prefetch()

    def close_open_step(self) -> None:
        """Ends a step an exception left open; nothing when none is.

        The hooks that close a step run with ``always_call``, which PyTorch honours for ``Exception``
        only: an exception outside that hierarchy (ComfyUI 0.33's interrupt is a ``BaseException``)
        leaves the block's slot in use and its weights pointing at the device until this is called."""
        if self._active or self._order:
            self.end_step()

    def end_step(self) -> None:
        self._finish_active()
        if self._order:
            self._expected = self._order
        self._order = []
        if self.recorder:
            self.recorder.end_step(current_stream(self.device))

    def _pre_hook(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            self._call_begins(index)

        return hook

    def _post_hook(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            self._call_ends(index)
            if self._pageable_deferred:
                self._prefetch()

        return hook

    def _call_begins(self, index: int) -> None:
        compute = current_stream(self.device)
        record = self.recorder.call_arrived(index, compute) if self.recorder else None
        self._order.append(index)
        self._tick += 1
        number = None
        copy = None
        if index in self._state:
            state = self._state[index]
            number = state.slot
            if number is None:
                protected = {call.block for call in self._active}
                number = self._load(index, protected)
                if number is None:
                    raise RuntimeError(
                        f"no free device slot for block {index}: {len(self._active)} streamed blocks are "
                        f"running nested inside each other but the pool has {self.num_slots} slots"
                    )
            slot = self._slots[number]
            if compute is not None:
                compute.wait_event(slot.ready)
            slot.in_use = True
            slot.last_used = self._tick
            copy, slot.copy = slot.copy, None
            state.layout.point_at(self._views(slot, index))
        self._active.append(_ActiveCall(index, number, record))
        if self.recorder:
            self.recorder.call_started(record, copy, compute)
        self._prefetch(defer_pageable=True)

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
        if call.slot is None:
            return
        slot = self._slots[call.slot]
        if slot.released is not None:
            slot.released.record(compute)
            slot.released_once = True
        slot.in_use = False
        state = self._state[call.block]
        state.layout.point_at(state.host_views)

    def _finish_active(self) -> None:
        """Releases calls an exception left open, so the next step starts clean."""
        while self._active:
            self._release(self._active.pop())
