"""A cap on page-locked (pinned) host memory, shared by every streamer that asks it.

Pinned pages cannot be swapped out, so a process that pins too much starves the
rest of the system. Streamers reserve each host buffer's bytes before pinning it;
once the cap is reached they keep streaming from ordinary pageable memory, which
copies more slowly and cannot overlap compute as well, but never fails.

Each streamer holds a share. No share keeps more than an even split of the cap
from another that asks: a model streaming after a first one that pinned it all
(Wan 2.2's second expert) gets the first to unpin blocks down to its half.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from .page_lock import filled_host_buffer, pinned_allocation_bytes

#: Answers whether ``nbytes`` more may be pinned now, beyond the cap (a host's check of available RAM).
Admission = Callable[[int], bool]


class PinnedMemoryBudget:
    """How many bytes all holders together may pin.

    ``limit`` is a number of bytes, ``None`` for no cap, or a callable asked at each
    reservation, so a host that pins memory of its own can leave less for us.
    ``admit`` is asked too, when given; ``on_change`` hears every change of ``used``
    (a host keeping its own books of pinned memory counts ours in them).
    """

    def __init__(
        self,
        limit: int | None | Callable[[], int | None] = None,
        *,
        admit: Admission | None = None,
        on_change: Callable[[int], None] | None = None,
    ) -> None:
        self._limit = limit if callable(limit) else (lambda: limit)
        self._admit = admit
        self._on_change = on_change
        self._shares: weakref.WeakSet[PinnedShare] = weakref.WeakSet()
        self.used = 0

    @property
    def limit(self) -> int | None:
        return self._limit()

    def reserve(self, nbytes: int) -> bool:
        """Takes ``nbytes`` if they fit under the cap; False (and nothing taken) if they do not."""
        limit = self._limit()
        if limit is not None and self.used + nbytes > limit:
            return False
        if self._admit is not None and not self._admit(nbytes):
            return False
        self._change(nbytes)
        return True

    def release(self, nbytes: int) -> None:
        self._change(-nbytes)

    def _change(self, nbytes: int) -> None:
        self.used += nbytes
        if self._on_change is not None:
            self._on_change(nbytes)

    def share(self, give_back: Callable[[int], int] | None = None) -> PinnedShare:
        """A holder's share; ``give_back(nbytes)`` unpins up to ``nbytes`` of what it holds when another
        holder needs them (returns how many it released through the share)."""
        share = PinnedShare(self, give_back)
        self._shares.add(share)
        return share

    def reclaim(self, nbytes: int, asking: PinnedShare) -> None:
        """Has holders above an even split of the cap give back, so that ``asking`` (within its split
        after taking ``nbytes``) can take them."""
        limit = self._limit()
        if limit is None:
            return
        holders = [share for share in self._shares if share is not asking and share.nbytes > 0]
        even = limit // (len(holders) + 1)
        short = self.used + nbytes - limit
        if asking.nbytes + nbytes > even:
            return  # it has its split already: what others hold stays theirs
        for holder in sorted(holders, key=lambda share: -share.nbytes):
            if short <= 0:
                return
            over = holder.nbytes - even
            if over > 0:
                short -= holder.give_back(min(over, short))


class PinnedShare:
    """One holder's reservations. Whatever it still holds goes back when it is collected, so a
    streamer dropped without ``disable()`` (its model deleted mid-use) leaves the budget whole."""

    def __init__(self, budget: PinnedMemoryBudget, give_back: Callable[[int], int] | None = None) -> None:
        self.budget = budget
        self.nbytes = 0
        # Weakly: the share belongs to its holder, and a bound method would keep the holder alive.
        self._give_back = weakref.WeakMethod(give_back) if give_back is not None else None

    def reserve(self, nbytes: int) -> bool:
        if not self.budget.reserve(nbytes):
            self.budget.reclaim(nbytes, asking=self)
            if not self.budget.reserve(nbytes):
                return False
        self.nbytes += nbytes
        return True

    def release(self, nbytes: int) -> None:
        self.budget.release(nbytes)
        self.nbytes -= nbytes

    def give_back(self, nbytes: int) -> int:
        """Asks the holder to unpin about ``nbytes``; how many it gave back."""
        give_back = self._give_back() if self._give_back is not None else None
        return give_back(nbytes) if give_back is not None else 0

    def park(self, nbytes: int, memory: object) -> weakref.finalize[..., Any]:
        """Hands ``nbytes`` of this share to ``memory`` (a host buffer's storage that outlives its streamer):
        they stay counted until ``memory`` is collected, unless a share of the same budget adopts them first."""
        self.nbytes -= nbytes
        return weakref.finalize(memory, self.budget.release, nbytes)

    def adopt(self, parked: weakref.finalize[..., Any]) -> bool:
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


class HostMemory:
    """Host buffers for one streamer: pinned where ``pin_memory`` asks and its ``share`` of a pin budget
    (None: unbounded) and the driver allow, pageable otherwise."""

    def __init__(self, pin_memory: bool, share: PinnedShare | None) -> None:
        self.pin_memory = pin_memory
        self.share = share

    def buffer(
        self, nbytes: int, fill: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[torch.Tensor, int, str | None]:
        """The buffer, holding what ``fill`` writes into it; the bytes reserved in the pin budget; and why it is
        pageable although pinning was asked ("cap": the budget refused; "driver": the driver refused to
        register it). It is filled once, whichever it turns out to be."""
        reserved = pinned_allocation_bytes(nbytes) if self.pin_memory else 0
        pin = self.pin_memory and (self.share is None or self.share.reserve(reserved))
        try:
            host, pinned = filled_host_buffer(nbytes, fill, pin=pin)
        except BaseException:
            self.release(reserved if pin else 0)  # a fill that failed (its file changed): nothing was kept
            raise
        if pinned:
            return host, reserved, None
        self.release(reserved if pin else 0)  # the driver refused: pageable memory
        why = ("driver" if pin else "cap") if self.pin_memory else None
        return host, 0, why

    def release(self, reserved: int) -> None:
        """Gives ``reserved`` bytes of the pin budget back (a buffer from ``buffer`` is dropped)."""
        if reserved and self.share is not None:
            self.share.release(reserved)

    def park(self, reserved: int, storage: object) -> weakref.finalize[..., Any] | None:
        """Hands a pinned buffer's ``reserved`` bytes to its ``storage`` as it outlives the streamer
        (``PinnedShare.park``); None without a budget."""
        return self.share.park(reserved, storage) if self.share is not None else None

    def adopt(self, reservation: weakref.finalize[..., Any] | None, pinned: bool) -> bool:
        """Whether a parked buffer (``pinned`` or not, its bytes ``reservation`` from ``park``) can be taken over
        without leaving the budget short: its bytes move into this share."""
        if reservation is not None:
            return self.share is not None and self.share.adopt(reservation)
        return not (pinned and self.share is not None)  # pinned outside this budget
