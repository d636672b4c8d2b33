"""Packs a streamer's blocks into their host buffers on a thread of its own, while the model already streams.

Packing a block (a fresh host buffer, the copy of its weights into it, the driver's page-locking) costs about
as much as copying it, into pages the kernel must first fault in: seconds for a large model, which a first
prompt would wait for before its first step. Instead the streamer starts at once, copying each block from
wherever its bytes are (the loader's tensors, its checkpoint file's mapping), and this thread packs the blocks
one by one, in the order the steps call them (``HostBlocks.pack_later`` records a block as waiting). Each
packed block replaces its sources between two of its calls (``BackgroundPacking.pack_waiting``), so the
streamed bytes are never held twice but for the one block being packed, and every step sees exactly the same
weights, whatever mix of packed and waiting blocks it copies.

The thread only copies and page-locks; the books (the pin budget, ComfyUI's counts) are kept by the thread
that runs the model, when it next looks (``BackgroundPacking.settle``). Copies and page-locking release the
GIL, so the sampling thread runs on.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch

from .file_source import FileSlice, FileStamp, stamps
from .pinning import HostMemory, filled_host_buffer, pin_in_place, whole_storages
from .streamed_block import StreamedBlock
from .system_memory import release_freed_host_memory

#: Freed sources returned to the system at least this often (bytes), and once more when the thread ends.
TRIM_BYTES = 32 * 2**20


class PackingStopped(Exception):
    """Raised inside a block's packing when the streamer stops it: the half-filled buffer is dropped."""


class PackingThread:
    """Runs ``pack(index, stopping)`` for each of ``indices`` in turn, on a daemon thread, until done, stopped,
    or one raises (kept in ``error`` for the streamer's thread to raise; the rest are not packed).
    ``pack`` checks ``stopping`` between its copies and raises ``PackingStopped`` when it is set."""

    def __init__(
        self,
        pack: Callable[[int, threading.Event], None],
        indices: Sequence[int],
        at_end: Callable[[], None] | None = None,
    ) -> None:
        self._pack = pack
        self.indices = tuple(indices)
        self._at_end = at_end  # run on the thread once it ends, whatever the reason
        # The starting thread's inference mode, which is per thread: buffers and the tensors rebuilt around them
        # are made as packing before the first step made them (a host samples under ``torch.inference_mode``,
        # and ComfyUI re-wraps a quantized weight whose inner tensors are inference tensors only in that mode).
        self._inference_mode = torch.is_inference_mode_enabled()
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="block-offload-pack", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def stop(self) -> None:
        """Stops after the copy under way (a block half packed is dropped), and waits for the thread."""
        self.stopping.set()
        self.join()

    def join(self, timeout: float | None = None) -> None:
        """Waits until every block is packed (or the thread stopped or failed)."""
        if self._thread.ident is not None:
            self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with torch.inference_mode(self._inference_mode):
                self._pack_all()
        finally:
            if self._at_end is not None:
                self._at_end()

    def _pack_all(self) -> None:
        for index in self.indices:
            if self.stopping.is_set():
                return
            try:
                self._pack(index, self.stopping)
            except PackingStopped:
                return
            except BaseException as error:  # noqa: BLE001 - handed to the streamer's thread, which raises it
                self.error = error
                return


def _go_on(stopping: threading.Event) -> None:
    """Between two copies of a block's packing: raises ``PackingStopped`` once its streamer stops it."""
    if stopping.is_set():
        raise PackingStopped


class BackgroundPacking:
    """The packing in the background of one ``HostBlocks``' waiting blocks (``blocks``, the same dict): the
    thread, what it handed over whose books are not kept yet, and the files the waiting blocks are copied from.
    ``lock`` is the host side's: held around each hand-over. ``memory`` keeps the pin budget's books. ``device``:
    where the blocks are copied to."""

    def __init__(
        self, blocks: dict[int, StreamedBlock], memory: HostMemory, lock: threading.Lock, device: torch.device
    ) -> None:
        self.blocks = blocks
        self.memory = memory
        self.lock = lock
        self.device = device
        self.packed_bytes = 0  # copied into host buffers by the thread since the streamer started
        self.total_bytes = 0  # what it has packed and what was left to it when it last started
        self._thread: PackingThread | None = None
        self._unsettled: list[StreamedBlock] = []  # handed over, their books not yet kept (``settle``)
        self._driver_refused = False  # a registration failed: the driver is not asked again by this streamer
        self._stamps: tuple[FileStamp, ...] = ()  # the files waiting blocks are copied from, as they were
        self._untrimmed = 0  # bytes of sources freed since the heap was last trimmed

    @property
    def running(self) -> bool:
        """Whether blocks are still being packed by a running thread."""
        return self._thread is not None and self._thread.running

    @property
    def progress(self) -> tuple[int, int]:
        """Bytes the thread has packed, and those it had to pack, since the streamer started."""
        return self.packed_bytes, self.total_bytes

    @property
    def waiting_bytes(self) -> int:
        """The bytes of the blocks still waiting to be packed."""
        return sum(state.storage.nbytes for state in self.blocks.values() if state.waiting)

    @property
    def pinning_progress(self) -> tuple[int, int]:
        """Bytes of blocks pinned now, and of those that will be once the waiting ones holding a reservation are
        packed (the driver may still refuse some)."""
        pinned = sum(state.pinned_bytes for state in self.blocks.values() if state.pinned)
        waiting = sum(state.pinned_bytes for state in self.blocks.values() if state.waiting)
        return pinned, pinned + waiting

    def start(self, order: Sequence[int], file_slice: Callable[[torch.Tensor], FileSlice | None] | None) -> None:
        """Packs the waiting blocks on a thread, in ``order`` (the order the steps call them) then the others'."""
        self.stop()
        waiting = [index for index, state in self.blocks.items() if state.waiting]
        self.total_bytes = self.packed_bytes + sum(self.blocks[index].storage.nbytes for index in waiting)
        if not waiting:
            return
        if file_slice is not None:
            slices = [file_slice(part) for index in waiting for part in self.blocks[index].sources or ()]
            self._stamps = stamps(source for source in slices if source is not None)
        ranked = [index for index in order if index in waiting]
        ranked += sorted(set(waiting) - set(ranked))
        self._thread = PackingThread(self.pack_waiting, ranked, release_freed_host_memory)
        self._thread.start()

    def stop(self) -> None:
        """Stops the thread (the block it is packing is dropped, the rest keep waiting); books kept."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        self._keep_books()

    def finish(self) -> None:
        """Waits until every waiting block is packed, then ``settle``."""
        if self._thread is not None:
            self._thread.join()
        self.settle()

    def settle(self) -> None:
        """On the streamer's thread: the books of the blocks the thread handed over (``_keep_books``), and what
        packing raised, raised here once. A file that changed under waiting blocks, which the copies read from,
        raises ``FileChangedError`` naming it."""
        self._keep_books()
        thread = self._thread
        if thread is not None and thread.error is not None:
            self._thread, error = None, thread.error
            raise error
        if thread is not None and not thread.running:
            self._thread = None
        if self._stamps and any(state.waiting and state.file_backed for state in self.blocks.values()):
            for stamp in self._stamps:
                stamp.check()

    def _keep_books(self) -> None:
        """The pin budget's books for the blocks the thread handed over: a registration the driver refused gives
        its reservation back, a block pinned in place what its reservation held beyond its tensors' bytes (the
        alignment between them in a host buffer)."""
        while self._unsettled:
            state = self._unsettled.pop()
            if not state.pinned and state.pinned_bytes:
                self.memory.release(state.pinned_bytes)
                state.pinned_bytes = 0
            elif state.pinned_in_place:
                registered = sum(storage.numel() for storage in state.pinned_in_place)
                self.memory.release(state.pinned_bytes - registered)
                state.pinned_bytes = registered

    def _kept_in_place(self, state: StreamedBlock, pin: bool) -> bool:
        """Keeps a waiting block where its sources lie, when they are memory of the process (the classic loader's
        tensors, not views of a file) holding exactly what it streams, page-locked there with ``pin``: twice as
        fast as copying them into a fresh buffer and locking that (``bench/pinning.py``), and nothing copied or
        held twice; without, a copy into a pageable buffer would gain nothing. The block streams from its sources
        from now on. False (nothing done) where they are not, or the driver refuses them: it is packed."""
        assert state.sources is not None
        if state.file_backed:
            return False
        if any(source.dtype != part.dtype for source, part in zip(state.sources, state.storage.parts, strict=True)):
            return False  # stored in other dtypes than it streams in: each copy would cast (packing casts once)
        storages = whole_storages(state.sources)
        if sum(storage.numel() for storage in storages) > state.storage.nbytes:
            return False  # memory shared beyond the block
        if pin and not pin_in_place(storages, self.lock, self.device):
            return False
        with self.lock:
            state.in_place, state.pinned = True, pin
            if pin:
                state.pinned_in_place = storages
            elif state.pinned_bytes:  # reserved, but the driver refused an earlier block
                state.pageable_because = "driver"
            self._unsettled.append(state)
            self.packed_bytes += state.storage.nbytes
        return True

    def pack_waiting(self, index: int, stopping: threading.Event) -> None:
        """On the thread: block ``index`` kept where its sources lie (``_kept_in_place``), or copied from them into a
        host buffer (page-locked where it holds a reservation and the driver has not refused), then handed over
        under ``lock``: its tensors point at the buffer from its next call on (now, between two calls)."""
        state = self.blocks.get(index)
        if state is None or not state.waiting:
            return
        if state.file_backed:
            for stamp in self._stamps:
                stamp.check()
        wants_pin = bool(state.pinned_bytes) and not self._driver_refused
        if self._kept_in_place(state, wants_pin):
            return
        fill = functools.partial(
            state.storage.pack_into, parts=state.sources, between=functools.partial(_go_on, stopping)
        )
        host, pinned = filled_host_buffer(state.storage.nbytes, fill, pin=wants_pin)
        del fill
        if wants_pin and not pinned:
            self._driver_refused = True
        views = state.storage.views(host)
        with self.lock:
            # Kept until the copies issued from them before the hand-over are done (one from page-locked sources
            # still reads them after it returns): until then nothing may free them.
            replaced = state.sources, state.host_views
            state.host, state.host_views, state.sources = host, views, None
            state.pinned = pinned
            if state.pinned_bytes and not pinned:
                state.pageable_because = "driver"
            if not state.in_call:
                state.layout.point_at(views)
            self._unsettled.append(state)
            self.packed_bytes += state.storage.nbytes
            ready = state.ready
        if ready is not None:
            ready.synchronize()  # a copy issued from the sources before the hand-over has read them
        del replaced
        # The sources are freed now (nothing else held them): their heap memory goes back to the system as packing
        # goes, so the streamed weights are never held twice, not only once packing ends (every TRIM_BYTES: the
        # sequential wrapper packs modules by the thousand, and each trim walks the heap under its lock).
        self._untrimmed += state.storage.nbytes
        if self._untrimmed >= TRIM_BYTES:
            release_freed_host_memory()
            self._untrimmed = 0
