"""Which blocks stay on the device: by count, by byte budget, and by position policy."""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum


class ResidencyPolicy(str, Enum):
    """Where the resident blocks sit in the stack.

    ``strided`` spreads them evenly, so each streamed block's copy can hide behind
    the compute of resident neighbours instead of all copies queueing at one end.
    """

    LEADING = "leading"
    TRAILING = "trailing"
    STRIDED = "strided"


def resident_indices(num_blocks: int, count: int, policy: ResidencyPolicy) -> frozenset[int]:
    """The ``count`` block indices that stay resident under ``policy``."""
    if not 0 <= count <= num_blocks:
        raise ValueError(f"resident block count must be between 0 and {num_blocks}, got {count}")
    if policy is ResidencyPolicy.LEADING:
        return frozenset(range(count))
    if policy is ResidencyPolicy.TRAILING:
        return frozenset(range(num_blocks - count, num_blocks))
    # Evenly spaced, centred in each of ``count`` equal spans: 10 blocks, 3 resident -> 1, 5, 8.
    return frozenset(int((i + 0.5) * num_blocks / count) for i in range(count))


def resident_for_budget(block_bytes: Sequence[int], budget_bytes: int, policy: ResidencyPolicy) -> frozenset[int]:
    """The largest resident set under ``policy`` whose blocks fit in ``budget_bytes``."""
    for count in range(len(block_bytes), -1, -1):
        chosen = resident_indices(len(block_bytes), count, policy)
        if sum(block_bytes[i] for i in chosen) <= budget_bytes:
            return chosen
    return frozenset()
