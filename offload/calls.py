"""How the engine sees the model run, and what it does at each call (the stream rules are in ``streamer.py``).

* ``StepCalls``: the open calls and the call order. The order is learnt: the first step assumes the given one (an
earlier engine's, else list order), later steps the previous step's, so a block that runs twice, out of order or not at
all costs one unhidden copy at most once. A step that raised teaches nothing. * The hooks: a pair per module called (a
block, or the holder that brings blocks in), a wrapper per block method the model calls instead of the block, and a pair
around the root's forward, which brackets one step. * ``BlockCalls``: what the hooks do: wait for the copy, point the
parameters at the ring, transform, copy ahead, record the release and point the parameters back."""

from __future__ import annotations

import functools
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, cast

import torch
from torch import nn

from .device import current_stream
from .file_tier import FileTier
from .host_blocks import HostBlocks
from .ring import DeviceRing, copy_ahead, look_ahead
from .spec import CallOptions, Transform
from .streamed_block import StreamedBlock
from .timeline import CallRecord, TimelineRecorder


@dataclass
class OpenCall:
    block: int
    streamed: bool
    record: CallRecord | None


class StepCalls:
    def __init__(self, units: int, call_order: Sequence[int] | None = None) -> None:
        known = call_order is not None and all(0 <= index < units for index in call_order)
        self.expected: list[int] = list(call_order) if known and call_order else list(range(units))
        self.order: list[int] = []
        self.open: list[OpenCall] = []

    @property
    def in_step(self) -> bool:
        return bool(self.open or self.order)

    def running(self, block: int) -> bool:
        return any(call.block == block for call in self.open)

    def held(self) -> set[int]:
        """The blocks running now, whose memory must not be overwritten."""
        return {call.block for call in self.open}

    def upcoming(self, streamed: Container[int], count: int) -> Iterator[int]:
        """The next ``count`` ``streamed`` blocks expected, wrapping into the next step."""
        return look_ahead(self.expected, len(self.order), streamed, count)

    def arrived(self, block: int) -> None:
        self.order.append(block)

    def opened(self, call: OpenCall) -> None:
        self.open.append(call)

    def closed(self, block: int) -> Iterator[OpenCall]:
        """The calls that end with ``block``'s: its own and any an exception left open inside it, innermost first."""
        while self.open:
            call = self.open.pop()
            yield call
            if call.block == block:
                return

    def close_all(self) -> Iterator[OpenCall]:
        """Every open call an exception left, innermost first."""
        while self.open:
            yield self.open.pop()

    def step_began(self) -> None:
        self.order = []

    def step_ended(self, learn: bool = True) -> None:
        """The next step is expected in this one's order, if it called any and ``learn``."""
        if self.order and learn:
            self.expected = self.order
        self.order = []


Hook = TypeVar("Hook", bound=Callable[..., object])


class Removable(Protocol):
    def remove(self) -> None: ...


def eager(hook: Hook) -> Hook:
    """``hook`` run as plain Python under ``torch.compile``: its copies, events and repointing would be baked into a
    traced graph once, so the compiler breaks the graph around it."""
    disable: Callable[..., object] = torch.compiler.disable
    return cast(Hook, disable(hook, recursive=True))


def hook_calls(
    blocks: Sequence[nn.Module],
    holders: Mapping[int, nn.Module],
    methods: Mapping[int, Sequence[str]],
    begins: Callable[[int], None],
    ends: Callable[[int], None],
    after: Callable[[], None],
    running: Callable[[int], bool],
) -> list[Removable]:
    """Calls ``begins(i)`` before block ``i`` runs and ``ends(i)`` after, even when it raised, then ``after()``.

    ``holders[i]``: the module whose call brings block ``i`` in. One hook pair per module called; a holder lets its
    blocks go in reverse order, so an ending call never releases one around it. ``methods[i]``: block methods the model
    runs instead of calling it, each a call unless the block is ``running`` already (ending there would release it under
    the outer call)."""
    callers: dict[int, tuple[nn.Module, list[int]]] = {}
    for index, block in enumerate(blocks):
        caller = holders.get(index, block)
        callers.setdefault(id(caller), (caller, []))[1].append(index)
    handles: list[Removable] = []
    for caller, indices in callers.values():
        handles.append(caller.register_forward_pre_hook(eager(_each(begins, tuple(indices)))))
        handles.append(
            caller.register_forward_hook(eager(_each(ends, tuple(reversed(indices)), after)), always_call=True)
        )
    for index, names in methods.items():
        handles += [_MethodCalls(blocks[index], name, index, begins, ends, after, running) for name in names]
    return handles


class _MethodCalls:
    """Block ``index``'s method ``name``, shadowed by an instance attribute that brackets it with ``begins`` and
    ``ends`` unless the block is ``running``. The end runs whatever the method raised, interrupts included."""

    def __init__(
        self,
        block: nn.Module,
        name: str,
        index: int,
        begins: Callable[[int], None],
        ends: Callable[[int], None],
        after: Callable[[], None],
        running: Callable[[int], bool],
    ) -> None:
        method: Callable[..., object] = getattr(block, name)

        @eager
        def begin() -> bool:
            if running(index):
                return False
            try:
                begins(index)
            except BaseException:  # the call may be open already: close it, as a post-hook would
                ends(index)
                raise
            return True

        @eager
        def end() -> None:
            ends(index)
            after()

        @functools.wraps(method)
        def called(*args: object, **kwargs: object) -> object:
            began = begin()
            try:
                return method(*args, **kwargs)
            finally:
                if began:
                    end()

        self.block, self.name, self.called = block, name, called
        block.__dict__[name] = called

    def remove(self) -> None:
        if self.block.__dict__.get(self.name) is self.called:
            del self.block.__dict__[self.name]


def hook_step(root: nn.Module, begin: Callable[[], None], end: Callable[[bool], None]) -> list[Removable]:
    """Calls ``begin()`` before ``root``'s forward, ahead of its other hooks (the root may be a block too), and
    ``end(returned)`` after, even when it raised: PyTorch then hands the hook no output."""
    return [
        root.register_forward_pre_hook(eager(lambda *_: begin()), prepend=True),
        root.register_forward_hook(eager(lambda _root, _args, output: end(output is not None)), always_call=True),
    ]


def _each(
    call: Callable[[int], None], indices: tuple[int, ...], then: Callable[[], None] | None = None
) -> Callable[..., None]:

    def hook(module: nn.Module, *_: object) -> None:
        for index in indices:
            call(index)
        if then is not None:
            then()

    return hook


class BlockCalls:
    """The steps and block calls of one streamer (see the module docstring)."""

    def __init__(
        self, ring: DeviceRing, files: FileTier, calls: StepCalls, transforms: Mapping[int, Transform]
    ) -> None:
        self.ring = ring
        self.files = files
        self.calls = calls
        self.device: torch.device = ring.device
        self.host: HostBlocks = ring.host
        self.recorder: TimelineRecorder | None = ring.recorder
        self.transforms = transforms
        self._pageable_deferred = False  # some block's copies wait for the post-hook

    def hook(self, blocks: Sequence[nn.Module], options: CallOptions) -> list[Removable]:
        handles = hook_calls(
            blocks,
            options.holders,
            options.entry_methods,
            self._call_begins,
            self._call_ends,
            self._after_call,
            self.calls.running,
        )
        if options.root is not None:
            handles += hook_step(options.root, self.begin_step, self.end_step)
        return handles

    def sources_changed(self) -> None:
        """Some blocks' host memory changed kind (packed, pinned, unpinned): decide again which copies wait for a
        post-hook."""
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())

    def _prefetch(self, defer_pageable: bool = False) -> None:
        """Issues the copies of the next streamed blocks as far ahead as the ring has room, and the reads of the
        file-tier blocks after them.

        ``defer_pageable``: skip blocks in pageable memory. Such a copy holds the host thread until done (the driver
        stages it), so issued before the block's kernels it would idle the device; the post-hook issues it with the
        block just launched. A file-tier block whose read is not done is deferred too, so its wait never delays the next
        launch."""
        if not self.host.blocks:
            return
        books, _ = self.ring.allocated()

        def skip(index: int) -> bool:
            return self.files.reading(index) or (defer_pageable and self._deferred(self.host.blocks[index]))

        copy_ahead(
            self.calls.upcoming(self.host.blocks, self.ring.options.prefetch),
            self.calls.held(),
            books.regions,
            self.ring.load,
            skip,
        )
        if self.files.reader is not None:  # spares a look over every block at each call
            self.files.read_ahead(
                self.calls.upcoming(self.host.blocks, len(self.host.blocks)), self.ring.options.prefetch
            )

    def _deferred(self, state: StreamedBlock) -> bool:
        if self.ring.copy_stream is None:
            return False
        if state.companions is not None and not state.companions.pinned:
            return True
        return not (self.files.pinned if state.read is not None else state.pinned)

    def begin_step(self) -> None:
        self.finish_active()
        self.files.check_files()
        packing = self.host.background.running
        self.host.background.settle()
        if packing:  # some blocks may copy from pinned memory now
            self.sources_changed()
        self.calls.step_began()
        if self.recorder:
            self.recorder.begin_step(current_stream(self.device))
        self._prefetch()

    def close_open_step(self) -> None:
        """Ends a step an exception left open; nothing when none is.

        PyTorch honours ``always_call`` for ``Exception`` only, so a ``BaseException`` (ComfyUI 0.33's interrupt) leaves
        the region held and the weights on the device until this is called."""
        if self.calls.in_step:
            self.end_step(returned=False)

    def end_step(self, returned: bool = True) -> None:
        """Ends a step; one that did not return teaches no call order."""
        self.finish_active()
        self.calls.step_ended(learn=returned)
        if self.recorder:
            self.recorder.end_step(current_stream(self.device))

    def _call_begins(self, index: int) -> None:
        compute = current_stream(self.device)
        record = self.recorder.call_arrived(index, compute) if self.recorder else None
        self.calls.arrived(index)
        copy = None
        state = self.host.blocks.get(index)
        if state is not None:
            region = self.ring.region_of(index)
            if region is None:
                if not self.ring.load(index, self.calls.held()):
                    raise RuntimeError(
                        f"no room for {self.host.unit} {index} in the device ring of {self.ring.capacity} bytes: "
                        f"{len(self.calls.open)} streamed {self.host.unit}s are running nested inside each other"
                    )
                region = self.ring.region_of(index)
                assert region is not None
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
        if state is not None and index in self.transforms:  # timed as part of the call's compute
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

    def finish_active(self) -> None:
        """Releases calls an exception left open, so the next step starts clean."""
        for call in self.calls.close_all():
            self._release(call)
