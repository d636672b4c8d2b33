"""The file tier: streamed blocks with no host buffer, read from their checkpoint file for each copy into a few host
staging slots, in their stored dtypes; and which file-backed blocks keep a host buffer instead (``host_tier``).

Reads run ahead of the copies on the reader's thread, only for blocks that will need a copy. Files are stamped at start
and checked every step, so a checkpoint rewritten under a running model is an error, never a wrong weight. Kept blocks
are spread evenly over the call order so the reader never faces a long run of reads."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .file_source import FileReader, FileSlice, FileStamp, read_threads, stamps
from .host_blocks import HostBlocks
from .layout import aligned
from .ring import DeviceRing
from .timeline import TimelineRecorder


class FileTier:
    """A streamer's file-tier reader, staging slots and file stamps; idle when no block is read from a file."""

    def __init__(self, host: HostBlocks, ring: DeviceRing, recorder: TimelineRecorder | None) -> None:
        self.host = host
        self.ring = ring
        self.recorder = recorder
        self.reader: FileReader | None = None
        self._slot_reservation = 0
        self._stamps: tuple[FileStamp, ...] = ()

    def start(self) -> None:
        """Allocates the staging slots (pinned as a host buffer would be) and starts the reader, if any block is read
        from its file."""
        reads = [state.read for state in self.host.blocks.values() if state.read is not None]
        if not reads:
            return
        slot_bytes = max(read.nbytes for read in reads)
        slots = []
        for _ in range(self.host.files.staging_slots):
            slot, reserved, _ = self.host.memory.buffer(slot_bytes)
            self._slot_reservation += reserved
            slots.append(slot)
        handles = {source.handle for read in reads for source in read.slices()}
        on_read = self.recorder.read_done if self.recorder else None
        self.reader = self.ring.reader = FileReader(slots, on_read, read_threads(handles))
        self._stamps = stamps(source for read in reads for source in read.slices())

    def stop(self) -> None:
        if self.reader is None:
            return
        self.reader.close()
        self.reader = self.ring.reader = None
        self._stamps = ()
        self.host.memory.release(self._slot_reservation)
        self._slot_reservation = 0

    def check_files(self) -> None:
        for stamp in self._stamps:
            stamp.check()

    def reading(self, index: int) -> bool:
        """Whether block ``index``'s read is still under way, so its copy would wait."""
        state = self.host.blocks[index]
        return state.read is not None and self.reader is not None and not self.reader.is_read(index)

    def forget(self, index: int) -> None:
        """Block ``index`` no longer streams; a read made ahead for it goes unused."""
        if self.reader is not None:
            self.reader.release(index, None)

    def read_ahead(self, upcoming: Iterable[int], prefetch: int) -> None:
        """Starts reading the ``upcoming`` file-tier blocks that will need a copy, while slots are free.

        A block in the ring needs none if it will still be there at its call: copied within the ``prefetch`` window, the
        ring holding every block, or its region lying beyond what earlier copies will overwrite from the head. The
        estimate may miss where placement wraps; a miss costs a wasted read or a wait, never a wrong weight."""
        reader, books = self.reader, self.ring.books
        if reader is None or books is None:
            return
        advance = 0  # ring bytes earlier copies will write from the head
        for position, index in enumerate(upcoming):
            state = self.host.blocks[index]
            region = books.regions.get(index)
            stays = region is not None and (
                position < prefetch or self.ring.holds_all or (region[0] - books.head) % books.capacity >= advance
            )
            if stays:
                if position < prefetch and reader.holds(index):
                    reader.release(index, None)  # it stayed in the ring
                continue
            advance += aligned(state.region_bytes, books.granule)
            if state.read is not None and not reader.holds(index) and not reader.schedule(index, state.read):
                return

    @property
    def pinned(self) -> bool:
        """Whether all staging slots are pinned (False without a file tier)."""
        return self.reader is not None and self.reader.pinned

    @property
    def staging_bytes(self) -> int:
        return self.reader.slot_bytes if self.reader is not None else 0

    @property
    def bytes_read(self) -> int:
        return self.reader.file_bytes if self.reader is not None else 0

    @property
    def file_bytes(self) -> int:
        return sum(state.read.file_bytes for state in self.host.blocks.values() if state.read is not None)

    def file_slices(self) -> tuple[FileSlice, ...]:
        blocks = sorted(self.host.blocks.items())
        return tuple(source for _, state in blocks if state.read for source in state.read.slices())


def host_tier(blocks: Sequence[tuple[int, int]], cap: int) -> frozenset[int]:
    """The blocks (``(index, host bytes)`` in call order) that keep a host buffer within ``cap``: the most that fit,
    evenly spaced."""
    count = len(blocks)
    for kept in range(count, 0, -1):
        chosen = [blocks[i * count // kept] for i in range(kept)]
        if sum(nbytes for _, nbytes in chosen) <= cap:
            return frozenset(index for index, _ in chosen)
    return frozenset()
