"""Page-locked (pinned) host memory: registering host buffers with the driver, and the cap on how much of it the
streamers take.

* Host buffers are registered with the driver in place, exactly their bytes, as ComfyUI pins its weights, and
  unregistered just before their memory is freed. A host (or a test recreating the driver) may put its own
  registrar in place of CUDA's (``use_host_registrar``).
* ``PinnedMemoryBudget``: pinned pages cannot be swapped out, so a process that pins too much starves the rest
  of the system. Streamers reserve each host buffer's bytes before pinning it; once the cap is reached they
  stream from pageable memory, which copies more slowly and overlaps compute less, but never fails. Each
  streamer holds a share, and no share keeps more than an even split of the cap from another that asks: a
  model streaming after a first one that pinned it all gets the first to unpin down to its half.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .device import PROCESS_STATE, accelerator_available, synchronize


class HostRegistrar(Protocol):
    """Page-locks ordinary host memory in place, and unlocks it (``CudaHostRegistrar``; a test may inject another)."""

    def register(self, pointer: int, nbytes: int) -> bool: ...

    def unregister(self, pointer: int) -> bool: ...


# cudaHostRegisterPortable: the pages are pinned for every CUDA context, as ComfyUI registers its own (0.33
# deep-clones a model for each GPU; pages registered with flag 0 are pinned for the registering context only).
_REGISTER_PORTABLE = 1


def discard_async_error() -> None:
    """Clears the error a failed registration leaves behind: CUDA reports it at the next kernel launch (as a
    misleading out-of-memory) unless a launch and a synchronize consume it first. ComfyUI does the same
    after each failed pin (``discard_cuda_async_error``)."""
    try:
        torch.ones(1, dtype=torch.uint8, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass  # the error being dropped: the failed call already said so


def _cudart() -> Any:
    """CUDA's runtime API as torch binds it (looked up at each call: tests put a recreated one in its place)."""
    cudart: Callable[[], Any] = torch.cuda.cudart
    return cudart()


class CudaHostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister``, each failure's sticky error cleared by ``discard_error``."""

    def __init__(self, discard_error: Callable[[], None] | None = None) -> None:
        self.discard_error = discard_error  # None: ``discard_async_error``

    def register(self, pointer: int, nbytes: int) -> bool:
        return self._succeeded(_cudart().cudaHostRegister(pointer, nbytes, _REGISTER_PORTABLE))

    def unregister(self, pointer: int) -> bool:
        return self._succeeded(_cudart().cudaHostUnregister(pointer))

    def _succeeded(self, status: int) -> bool:
        if status == 0:
            return True
        (self.discard_error or discard_async_error)()
        return False


class PageLocks:
    """The host memory the engine has page-locked in place, and what locks it. Process-wide as the driver's
    registrations are: a buffer registered by one engine may be freed under another's, or on the packing
    thread (``offload/background_packing.py``)."""

    def __init__(self) -> None:
        self.registrar: HostRegistrar | None = None
        # Bytes registered and not yet given back (see filled_host_buffer).
        self.registered_bytes = 0
        # Each registered buffer's unregistration, by address: run when its storage is freed, or by unpin.
        self.registrations: dict[int, weakref.finalize[..., Any]] = {}
        # Both change on the packing thread as on the streamer's; a buffer's last reference may go on either.
        self.lock = threading.RLock()


def _page_locks() -> PageLocks:
    return PROCESS_STATE.entry(
        "page locks", PageLocks, "the driver's registrations of host memory belong to the process, not an engine"
    )


def use_host_registrar(registrar: HostRegistrar | None) -> None:
    """Pins through ``registrar`` from now on (a host's own error handling; None: back to the default)."""
    _page_locks().registrar = registrar


def host_registrar() -> HostRegistrar | None:
    """What pins host buffers in place: CUDA's registration; None where torch's pinned allocator is used."""
    locks = _page_locks()
    if locks.registrar is None and torch.cuda.is_available():
        locks.registrar = CudaHostRegistrar()
    return locks.registrar


def can_pin_memory() -> bool:
    """Page-locked host memory needs a driver; without an accelerator there is nothing to pin for."""
    return host_registrar() is not None or accelerator_available()


def pinned_allocation_bytes(nbytes: int) -> int:
    """The page-locked bytes a buffer of ``nbytes`` takes: exactly ``nbytes`` when registered in place;
    torch's caching host allocator (other accelerators) rounds every request up to a power of two."""
    if host_registrar() is not None or nbytes <= 1:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def pinned_bytes() -> int:
    """Host bytes page-locked by ``filled_host_buffer`` and still alive: what this process really pins for
    the engine (torch's caching host allocator, used by others, is not in it)."""
    return _page_locks().registered_bytes


def pinned_host_buffer(nbytes: int) -> torch.Tensor | None:
    """Exactly ``nbytes`` of page-locked host memory, or None when the driver refuses it
    (``filled_host_buffer`` with nothing to write)."""
    host, pinned = filled_host_buffer(nbytes, None, pin=True)
    return host if pinned else None


def filled_host_buffer(
    nbytes: int, fill: Callable[[torch.Tensor], None] | None, *, pin: bool
) -> tuple[torch.Tensor, bool]:
    """A host buffer of exactly ``nbytes`` holding what ``fill`` writes into it, page-locked where ``pin`` asks
    and the driver allows; and whether it is. A refused registration leaves it pageable, already filled.

    ``torch.empty(..., pin_memory=True)`` goes through torch's caching host allocator, which rounds
    every request up to a power of two (a 702 MB block pins 1 GiB) and keeps freed blocks pinned until
    its cache is emptied. On CUDA the buffer is ordinary memory registered with the driver instead, as
    ComfyUI pins its weights, and unregistered just before it is freed: when the last tensor viewing it
    goes, torch finalizes the storage's weak references before it releases the memory.
    It is filled first and registered after: fresh pages are first touched (faulted in and zeroed by the
    kernel) by whoever touches them first, and ``cudaHostRegister`` touches them on one thread, where the
    fill's copies spread them over torch's threads (``bench/pinning.py`` times both orders). A buffer to
    register with nothing to fill is zeroed first, for the same reason.
    """
    registrar = host_registrar()
    if pin and registrar is None:  # other accelerators: torch's way, filled once pinned
        try:
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        except RuntimeError:
            host, pin = torch.empty(nbytes, dtype=torch.uint8), False
    else:
        host = torch.empty(nbytes, dtype=torch.uint8)
    if fill is not None:
        fill(host)
    if not pin or registrar is None:
        return host, pin
    if fill is None:
        host.zero_()  # nothing to write yet (a staging slot): touched all the same, on torch's threads
    return host, _register(registrar, host)


def byte_view(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    """The first ``nbytes`` of ``storage`` (all of it by default) as a byte tensor."""
    size = storage.nbytes() if nbytes is None else nbytes
    # torch's stubs leave out set_'s (storage, offset, size) overload for an untyped storage.
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))  # type: ignore[call-overload,no-any-return]


def whole_storages(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The storages under ``tensors``, each once, as byte tensors over the whole of it (what registering one in
    place page-locks)."""
    storages: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages and storage.nbytes():
            storages[storage.data_ptr()] = byte_view(storage)
    return tuple(storages.values())


def pin_in_place(
    storages: Sequence[torch.Tensor], copies: AbstractContextManager[object], device: torch.device
) -> bool:
    """Page-locks ``storages`` (``whole_storages``) where they lie, as ComfyUI's classic loader pins its weights:
    nothing copied, no page faulted in, each unregistered when freed or by ``unpin_host_buffer``. All or none, and
    False where any is page-locked already (another holder's registration: the driver would refuse it, and may
    leave an error for a later kernel launch as it does). One the driver refuses unregisters the others, holding
    ``copies`` (the lock under which copies from the storages are issued) once ``device`` (where they are copied
    to) is done: a copy issued from one registered meanwhile runs asynchronously, as from any page-locked memory."""
    registrar = host_registrar()
    if registrar is None or any(storage.is_pinned() for storage in storages):
        return False
    done: list[torch.Tensor] = []
    for storage in storages:
        if not _register(registrar, storage):
            with copies:
                synchronize(device)
                for registered in done:
                    unpin_host_buffer(registered)
            return False
        done.append(storage)
    return True


def _register(registrar: HostRegistrar, host: torch.Tensor) -> bool:
    """Page-locks ``host`` (a whole storage) in place until its storage is freed or ``unpin_host_buffer``."""
    nbytes = host.numel()
    if nbytes == 0:
        return True
    pointer = host.data_ptr()
    if not registrar.register(pointer, nbytes):
        return False
    locks = _page_locks()
    with locks.lock:
        locks.registered_bytes += nbytes
        locks.registrations[pointer] = weakref.finalize(
            host.untyped_storage(), _unregister, locks, registrar, pointer, nbytes
        )
    return True


def unpin_host_buffer(host: torch.Tensor) -> bool:
    """Unlocks a buffer ``filled_host_buffer`` registered, now; its memory stays valid, pageable. False if
    there is nothing to unregister (torch's pinned allocator cannot give back part of a buffer)."""
    registration = _page_locks().registrations.get(host.data_ptr())
    if registration is None or not registration.alive:
        return False
    registration()
    return True


def _unregister(locks: PageLocks, registrar: HostRegistrar, pointer: int, nbytes: int) -> None:
    with locks.lock:
        locks.registrations.pop(pointer, None)
        locks.registered_bytes -= nbytes
    registrar.unregister(pointer)


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
