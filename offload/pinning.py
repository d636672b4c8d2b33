"""A cap on page-locked (pinned) host memory, shared by every streamer that asks it.

Pinned pages cannot be swapped out, so a process that pins too much starves the
rest of the system. Streamers reserve each host buffer's bytes before pinning it;
once the cap is reached they keep streaming from ordinary pageable memory, which
copies more slowly and cannot overlap compute as well, but never fails.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable


class PinnedMemoryBudget:
    """How many bytes all holders together may pin.

    ``limit`` is a number of bytes, ``None`` for no cap, or a callable asked at each
    reservation, so a host that pins memory of its own can leave less for us.
    """

    def __init__(self, limit: int | None | Callable[[], int | None] = None) -> None:
        self._limit = limit if callable(limit) else (lambda: limit)
        self.used = 0

    @property
    def limit(self) -> int | None:
        return self._limit()

    def reserve(self, nbytes: int) -> bool:
        """Takes ``nbytes`` if they fit under the cap; False (and nothing taken) if they do not."""
        limit = self._limit()
        if limit is not None and self.used + nbytes > limit:
            return False
        self.used += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.used -= nbytes

    def share(self) -> PinnedShare:
        return PinnedShare(self)


class PinnedShare:
    """One holder's reservations. Whatever it still holds goes back when it is collected, so a
    streamer dropped without ``disable()`` (its model deleted mid-use) leaves the budget whole."""

    def __init__(self, budget: PinnedMemoryBudget) -> None:
        self.budget = budget
        self.nbytes = 0

    def reserve(self, nbytes: int) -> bool:
        if not self.budget.reserve(nbytes):
            return False
        self.nbytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)
        self.nbytes -= nbytes

    def park(self, nbytes: int, memory: object) -> weakref.finalize:
        """Hands ``nbytes`` of this share to ``memory`` (a host buffer's storage that outlives its streamer):
        they stay counted until ``memory`` is collected, unless a share of the same budget adopts them first."""
        self.nbytes -= nbytes
        return weakref.finalize(memory, self.budget.release, nbytes)

    def adopt(self, parked: weakref.finalize) -> bool:
        """Takes back bytes ``park`` handed out, without counting them twice; False when the memory is gone
        or was counted by another budget (then nothing changes)."""
        held = parked.peek()
        if held is None or held[1] != self.budget.release:
            return False
        parked.detach()
        self.nbytes += held[2][0]
        return True

    def __del__(self) -> None:
        if self.nbytes:
            self.budget.release(self.nbytes)
            self.nbytes = 0
