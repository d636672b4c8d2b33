"""When a streamer's copies happen: what runs at each step's start and end and around each block call.

``BlockStreamer`` (``streamer.py``) says what is streamed and how it is kept (host buffers, the ring, the
file tier); the hooks (``hooks.py``) call in here as the model runs:

* a step's start settles the background packing and issues the copies of the first blocks it expects;
* a block call waits (on the device) for its block's copy, points the block's parameters at its region of the
  ring, runs the host's transform of it there, and issues the next copies;
* the call's end records when the compute stream is done with the region (a later copy into any of its bytes
  waits on that), and points the parameters back at the host buffers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from .calls import OpenCall, StepCalls
from .device import current_stream
from .device_ring import DeviceRing
from .file_tier import FileTier
from .hooks import Removable, hook_calls, hook_step
from .host_blocks import HostBlocks
from .ring import copy_ahead
from .spec import CallOptions, Transform
from .streamed_block import StreamedBlock
from .timeline import TimelineRecorder


class BlockCalls:
    """The steps and block calls of one streamer (see the module docstring): its ring's device, host blocks,
    prefetch (how many blocks are copied ahead) and recorder; ``transforms``: see ``StreamSpec``."""

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
        self._pageable_deferred = False  # some streamed block's copies wait for the post-hook

    def hook(self, blocks: Sequence[nn.Module], options: CallOptions) -> list[Removable]:
        """Hooks the blocks' calls, and the root's forward as the step, to this; returns the handles."""
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
        """Some blocks' host memory changed kind (packed, pinned or unpinned): which copies wait for a call's
        post-hook is decided again."""
        self._pageable_deferred = any(self._deferred(state) for state in self.host.blocks.values())

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
            self.calls.upcoming(self.host.blocks, self.ring.options.prefetch),
            self.calls.held(),
            books.regions,
            self.ring.load,
            skip,
        )
        if self.files.reader is not None:  # no look-ahead over every block at each call without a file tier
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
        """Marks the start of one pass through the blocks (the root module's forward)."""
        self.finish_active()
        self.files.check_files()
        packing = self.host.background.running
        self.host.background.settle()
        if packing:  # blocks were packed since the last step: some of them copy from pinned memory now
            self.sources_changed()
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
            self.end_step(returned=False)

    def end_step(self, returned: bool = True) -> None:
        """Ends a step; one that did not return (it raised, or was interrupted) teaches no call order: the blocks
        after where it stopped would not be copied ahead in the next."""
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

    def finish_active(self) -> None:
        """Releases calls an exception left open, so the next step starts clean."""
        for call in self.calls.close_all():
            self._release(call)
