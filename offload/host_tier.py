"""Which streamed blocks whose weights are in a file keep a host buffer, and which are read from the file at
every step: the host tier and the file tier, below the device.

A host buffer costs host memory, a file read costs read bandwidth at each step. Within a cap on host
memory, as many blocks as fit keep one; they are spread evenly over the call order, so the reads of the
file tier come between copies from host buffers, and the reader, a few slots ahead, is never asked for a
long run of reads at once.
"""

from __future__ import annotations

from collections.abc import Sequence


def host_tier(blocks: Sequence[tuple[int, int]], cap: int) -> frozenset[int]:
    """The blocks (``(index, host bytes)`` in call order) that keep a host buffer within ``cap`` bytes: the
    most that fit, evenly spaced; the others form the file tier."""
    count = len(blocks)
    for kept in range(count, 0, -1):
        chosen = [blocks[i * count // kept] for i in range(kept)]
        if sum(nbytes for _, nbytes in chosen) <= cap:
            return frozenset(index for index, _ in chosen)
    return frozenset()
