"""Where streamed blocks live on the device: one buffer of a byte capacity (the ring), each block copied
into a region of its own size, regions placed one after the other in the order blocks are copied.

Sizing the buffer in bytes rather than in blocks lets the copies run as far ahead as memory allows: while
resident blocks compute, the copy stream fills the whole ring, and small blocks take less of it than the
largest one would. The ring only keeps the books (which block holds which bytes); ``BlockStreamer`` owns
the memory and the events, and the planner's simulator (``offload.simulator``) replays the same books with clocks.

What to copy when is chosen by ``look_ahead`` and ``copy_ahead``, here so that the engine and the
planner's replay of it share them.

A region is placed where the previous one ended (wrapping to the start when the rest is too short), so
the blocks copied longest ago are overwritten first; regions start at multiples of a granule
(``ring_granule``). Blocks the caller *holds* (running, or about to run)
are never overwritten: the region goes to the start of another stretch between held regions, the one
nearest after the head. That is complete: a region that fits anywhere can slide down until it starts at
0 or at a held region's end.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

from .layout import ALIGNMENT, aligned


def ring_capacity(largest: int, prefetch: int, nesting: int = 1, ring_bytes: int = 0) -> int:
    """The bytes of a stream's ring: by default one slot per block copied ahead (``prefetch``) and per
    block running (``nesting``), each as large as the ``largest`` block; else ``ring_bytes``, and no less
    than the least that always works.

    With ``nesting`` blocks running inside each other, ``2 * nesting - 1`` of the largest are that least
    for regions placed anywhere: the ``nesting - 1`` regions held around the innermost one split the rest
    into at most ``nesting`` stretches, one of which is then at least as large as the largest block.
    """
    if not ring_bytes:
        return (prefetch + nesting) * aligned(largest)
    return max(aligned(ring_bytes), (2 * nesting - 1) * aligned(largest))


def ring_granule(largest: int, ring_bytes: int = 0) -> int:
    """Where regions may start (multiples of this). In a default ring, at slots as large as the
    ``largest`` block, so it fragments no more than a pool of equal slots: a large block never waits
    because the small ones before it straddle two slots. In a ring sized in bytes, anywhere aligned."""
    return ALIGNMENT if ring_bytes else aligned(largest)


@dataclass
class ByteRing:
    """The regions of a ring of ``capacity`` bytes: ``regions[block] = (start, end)``."""

    capacity: int
    granule: int = ALIGNMENT  # regions start at its multiples (``ring_granule``)
    regions: dict[int, tuple[int, int]] = field(default_factory=dict)
    head: int = 0  # where the next region goes when it fits there

    def place(self, block: int, nbytes: int, held: Container[int]) -> tuple[int, list[int]] | None:
        """A region of ``nbytes`` for ``block``: its start and the blocks it overwrites (their regions are
        dropped), or None when every stretch that fits would overwrite a ``held`` block."""
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
        """Where a region of ``size`` overwrites nothing held: the head when it can, else the start of the
        free stretch (between held regions) nearest after it."""
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
    """The next ``count`` streamed blocks of the call ``order`` from ``position``, wrapping into the next step."""
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
    """Copies the ``upcoming`` blocks not ``loaded`` yet, in order, until one does not fit. Each is ``held``
    (not to be overwritten) from its turn on, so a nearer block is never overwritten for a further one;
    ``skip`` leaves a block for later without stopping. The engine and the planner's replay both copy so."""
    for index in upcoming:
        held.add(index)
        if index in loaded or skip(index):
            continue
        if not load(index, held):
            return
