"""Packs a streamer's blocks into their host buffers on a thread of its own while the model already streams, so a
first prompt does not wait for packing.

Blocks are packed in call order; until then they are copied from wherever their bytes are. Each packed block replaces
its sources between two of its calls, so bytes are never held twice (but the block being packed) and every step sees the
same weights. The thread only copies and page-locks, both releasing the GIL; the books are kept by the streamer's thread
in ``settle``."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Sequence

import torch

from .file_source import FileSlice, FileStamp, stamps
from .pinning import HostMemory, filled_host_buffer, pin_in_place, whole_storages
from .streamed_block import StreamedBlock
from .system_memory import release_freed_host_memory

#: Freed sources go back to the system every this many bytes, not per block: each trim walks the heap under
#: its lock, and the sequential wrapper packs thousands of modules.
TRIM_BYTES = 32 * 2**20


class PackingStopped(Exception):
    """Raised inside a block's packing when the streamer stops it; the half-filled buffer is dropped."""


class PackingThread:
    """Runs ``pack(index, stopping)`` for each of ``indices`` on a daemon thread, until done, stopped, or one raises;
    the error is kept in ``error`` for the streamer's thread to raise."""

    def __init__(
        self,
        pack: Callable[[int, threading.Event], None],
        indices: Sequence[int],
        at_end: Callable[[], None] | None = None,
    ) -> None:
        self._pack = pack
        self.indices = tuple(indices)
        self._at_end = at_end  # run on the thread however it ends
        # Inference mode is per thread: buffers must be made as the starting thread made them, since ComfyUI
        # re-wraps a quantized weight with inference inner tensors only in that mode.
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
        """Stops after the copy under way (a half-packed block is dropped) and waits for the thread."""
        self.stopping.set()
        self.join()

    def join(self, timeout: float | None = None) -> None:
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
    if stopping.is_set():
        raise PackingStopped


class BackgroundPacking:
    """The background packing of one ``HostBlocks``' waiting blocks (the same ``blocks`` dict). ``lock`` is the host
    side's, held around each hand-over."""

    def __init__(
        self, blocks: dict[int, StreamedBlock], memory: HostMemory, lock: threading.Lock, device: torch.device
    ) -> None:
        self.blocks = blocks
        self.memory = memory
        self.lock = lock
        self.device = device
        self.packed_bytes = 0
        self.total_bytes = 0
        self._thread: PackingThread | None = None
        self._unsettled: list[StreamedBlock] = []  # handed over, books not yet kept
        self._driver_refused = False  # once refused, the driver is not asked again
        self._stamps: tuple[FileStamp, ...] = ()
        self._untrimmed = 0

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.running

    @property
    def progress(self) -> tuple[int, int]:
        """Bytes packed by the thread, and bytes it had to pack, since the streamer started."""
        return self.packed_bytes, self.total_bytes

    @property
    def waiting_bytes(self) -> int:
        return sum(state.storage.nbytes for state in self.blocks.values() if state.waiting)

    @property
    def pinning_progress(self) -> tuple[int, int]:
        """Bytes pinned now, and pinned once waiting blocks with a reservation are packed (the driver may still
        refuse some)."""
        pinned = sum(state.pinned_bytes for state in self.blocks.values() if state.pinned)
        waiting = sum(state.pinned_bytes for state in self.blocks.values() if state.waiting)
        return pinned, pinned + waiting

    def start(self, order: Sequence[int], file_slice: Callable[[torch.Tensor], FileSlice | None] | None) -> None:
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
        """Stops the thread (its block is dropped, the rest keep waiting) and keeps the books."""
        if self._thread is not None:
            self._thread.stop()
            self._thread = None
        self._keep_books()

    def finish(self) -> None:
        if self._thread is not None:
            self._thread.join()
        self.settle()

    def settle(self) -> None:
        """On the streamer's thread: keeps the books of handed-over blocks and raises what packing raised, once.
        Raises ``FileChangedError`` if a file under waiting blocks changed."""
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
        """Pin-budget books for handed-over blocks: a refused registration returns its reservation; a block pinned in
        place returns what its reservation held beyond its tensors (alignment)."""
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
        """Pins a waiting block where its sources lie, when they are process memory holding exactly what it streams:
        faster than copying, and nothing held twice. False, doing nothing, otherwise or when the driver refuses."""
        assert state.sources is not None
        if state.file_backed:
            return False
        if any(source.dtype != part.dtype for source, part in zip(state.sources, state.storage.parts, strict=True)):
            return False  # each copy would cast; packing casts once
        storages = whole_storages(state.sources)
        if sum(storage.numel() for storage in storages) > state.storage.nbytes:
            return False  # memory shared beyond the block
        if pin and not pin_in_place(storages, self.lock, self.device):
            return False
        with self.lock:
            state.in_place, state.pinned = True, pin
            if pin:
                state.pinned_in_place = storages
            elif state.pinned_bytes:
                state.pageable_because = "driver"
            self._unsettled.append(state)
            self.packed_bytes += state.storage.nbytes
        return True

    def pack_waiting(self, index: int, stopping: threading.Event) -> None:
        """On the thread: block ``index`` pinned in place, or copied into a host buffer, then handed over under
        ``lock``; its tensors point at the buffer from its next call."""
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
            # Kept alive until copies issued from them are done: a copy from page-locked memory reads them after
            # it returns.
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
            ready.synchronize()
        del replaced
        # Return freed sources to the system as packing goes, not only at its end.
        self._untrimmed += state.storage.nbytes
        if self._untrimmed >= TRIM_BYTES:
            release_freed_host_memory()
            self._untrimmed = 0
