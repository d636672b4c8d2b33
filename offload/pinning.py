"""Page-locked (pinned) host memory: registering host buffers with the driver, and the cap on what the streamers pin.

Buffers are registered in place, as ComfyUI pins its weights, and unregistered just before they are freed. Pinned pages
cannot be swapped, so streamers reserve bytes in a ``PinnedMemoryBudget`` and fall back to pageable memory at the cap; a
second model gets the first to unpin down to an even split."""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from typing import Any, Protocol

import torch

from .device import PROCESS_STATE, accelerator_available, synchronize


class HostRegistrar(Protocol):
    def register(self, pointer: int, nbytes: int) -> bool: ...

    def unregister(self, pointer: int) -> bool: ...


# cudaHostRegisterPortable: pinned for every CUDA context, as ComfyUI registers its own (0.33 clones a model
# per GPU; flag 0 pins for the registering context only).
_REGISTER_PORTABLE = 1


def discard_async_error() -> None:
    """Clears the sticky error a failed registration leaves: CUDA would report it at the next kernel launch as a
    misleading out-of-memory. ComfyUI does the same (``discard_cuda_async_error``)."""
    try:
        torch.ones(1, dtype=torch.uint8, device="cuda").add_(1)
        torch.cuda.synchronize()
    except RuntimeError:
        pass  # the failed call already reported it


def _cudart() -> Any:
    # Looked up at each call: tests replace it.
    cudart: Callable[[], Any] = torch.cuda.cudart
    return cudart()


class CudaHostRegistrar:
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
    """Host memory the engine page-locked. Process-wide, like the driver's registrations: a buffer registered by one
    engine may be freed under another, or on the packing thread."""

    def __init__(self) -> None:
        self.registrar: HostRegistrar | None = None
        self.registered_bytes = 0
        # By address: each buffer's unregistration, run when its storage is freed or by unpin.
        self.registrations: dict[int, weakref.finalize[..., Any]] = {}
        # A buffer's last reference may go on the packing thread or the streamer's.
        self.lock = threading.RLock()


def _page_locks() -> PageLocks:
    return PROCESS_STATE.entry(
        "page locks", PageLocks, "the driver's registrations of host memory belong to the process, not an engine"
    )


def use_host_registrar(registrar: HostRegistrar | None) -> None:
    _page_locks().registrar = registrar


def host_registrar() -> HostRegistrar | None:
    """None where torch's pinned allocator is used (other accelerators)."""
    locks = _page_locks()
    if locks.registrar is None and torch.cuda.is_available():
        locks.registrar = CudaHostRegistrar()
    return locks.registrar


def can_pin_memory() -> bool:
    """Pinning needs a driver; without an accelerator there is nothing to pin for."""
    return host_registrar() is not None or accelerator_available()


def pinned_allocation_bytes(nbytes: int) -> int:
    """The page-locked bytes a buffer of ``nbytes`` takes: exact when registered in place, rounded up to a power of
    two by torch's caching host allocator."""
    if host_registrar() is not None or nbytes <= 1:
        return nbytes
    return 1 << (nbytes - 1).bit_length()


def pinned_bytes() -> int:
    """Bytes page-locked by ``filled_host_buffer`` and still alive."""
    return _page_locks().registered_bytes


def pinned_host_buffer(nbytes: int) -> torch.Tensor | None:
    host, pinned = filled_host_buffer(nbytes, None, pin=True)
    return host if pinned else None


def filled_host_buffer(
    nbytes: int, fill: Callable[[torch.Tensor], None] | None, *, pin: bool
) -> tuple[torch.Tensor, bool]:
    """A host buffer of exactly ``nbytes`` filled by ``fill``, page-locked where ``pin`` asks and the driver allows,
    and whether it is; a refused one stays pageable, filled.

    On CUDA, ordinary memory is registered instead of using torch's pinned allocator, which rounds to powers of two and
    keeps freed blocks pinned. It is filled first, so the fill's copies fault pages in on torch's threads rather than
    ``cudaHostRegister`` on one."""
    registrar = host_registrar()
    if pin and registrar is None:  # other accelerators
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
        host.zero_()  # fault the pages in on torch's threads too
    return host, _register(registrar, host)


def byte_view(storage: torch.UntypedStorage, nbytes: int | None = None) -> torch.Tensor:
    size = storage.nbytes() if nbytes is None else nbytes
    # torch's stubs leave out set_'s (storage, offset, size) overload for an untyped storage.
    return torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))  # type: ignore[call-overload,no-any-return]


def whole_storages(tensors: Iterable[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    storages: dict[int, torch.Tensor] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in storages and storage.nbytes():
            storages[storage.data_ptr()] = byte_view(storage)
    return tuple(storages.values())


def pin_in_place(
    storages: Sequence[torch.Tensor], copies: AbstractContextManager[object], device: torch.device
) -> bool:
    """Page-locks ``storages`` where they lie, as ComfyUI's classic loader does; all or none. False if any is pinned
    already: the driver would refuse and leave a sticky error. After a refusal the others are unregistered under
    ``copies`` once ``device`` is idle, so no asynchronous copy still reads them."""
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
    """Unlocks a buffer ``filled_host_buffer`` registered; its memory stays valid. False if there is nothing to
    unregister (torch's allocator cannot give back part of a buffer)."""
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
    """How many bytes all holders together may pin. ``limit``: bytes, None, or a callable asked at each reservation;
    ``admit`` may refuse too; ``on_change`` hears each change, for a host that books our pins."""

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
        """A holder's share; ``give_back(nbytes)`` unpins up to that much on request and returns what it released."""
        share = PinnedShare(self, give_back)
        self._shares.add(share)
        return share

    def reclaim(self, nbytes: int, asking: PinnedShare) -> None:
        """Has holders above an even split give back, so ``asking`` can take ``nbytes`` within its split."""
        limit = self._limit()
        if limit is None:
            return
        holders = [share for share in self._shares if share is not asking and share.nbytes > 0]
        even = limit // (len(holders) + 1)
        short = self.used + nbytes - limit
        if asking.nbytes + nbytes > even:
            return  # it has its split already
        for holder in sorted(holders, key=lambda share: -share.nbytes):
            if short <= 0:
                return
            over = holder.nbytes - even
            if over > 0:
                short -= holder.give_back(min(over, short))


class PinnedShare:
    """One holder's reservations, released when it is collected, so a streamer dropped without ``disable()`` leaves
    the budget whole."""

    def __init__(self, budget: PinnedMemoryBudget, give_back: Callable[[int], int] | None = None) -> None:
        self.budget = budget
        self.nbytes = 0
        # Weakly: a bound method would keep the holder alive.
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
        give_back = self._give_back() if self._give_back is not None else None
        return give_back(nbytes) if give_back is not None else 0

    def park(self, nbytes: int, memory: object) -> weakref.finalize[..., Any]:
        """Hands ``nbytes`` to ``memory``, a storage outliving its streamer, until collected or adopted."""
        self.nbytes -= nbytes
        return weakref.finalize(memory, self.budget.release, nbytes)

    def adopt(self, parked: weakref.finalize[..., Any]) -> bool:
        """Takes back bytes ``park`` handed out; False when the memory is gone or belongs to another budget."""
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
    """Host buffers for one streamer: pinned where asked and allowed by its ``share`` and the driver."""

    def __init__(self, pin_memory: bool, share: PinnedShare | None) -> None:
        self.pin_memory = pin_memory
        self.share = share

    def buffer(
        self, nbytes: int, fill: Callable[[torch.Tensor], None] | None = None
    ) -> tuple[torch.Tensor, int, str | None]:
        """The buffer filled by ``fill``, the bytes reserved, and why it is pageable despite asking ("cap" or
        "driver"); filled once either way."""
        reserved = pinned_allocation_bytes(nbytes) if self.pin_memory else 0
        pin = self.pin_memory and (self.share is None or self.share.reserve(reserved))
        try:
            host, pinned = filled_host_buffer(nbytes, fill, pin=pin)
        except BaseException:
            self.release(reserved if pin else 0)
            raise
        if pinned:
            return host, reserved, None
        self.release(reserved if pin else 0)  # the driver refused
        why = ("driver" if pin else "cap") if self.pin_memory else None
        return host, 0, why

    def release(self, reserved: int) -> None:
        if reserved and self.share is not None:
            self.share.release(reserved)

    def park(self, reserved: int, storage: object) -> weakref.finalize[..., Any] | None:
        """Hands a pinned buffer's bytes to its ``storage``; None without a budget."""
        return self.share.park(reserved, storage) if self.share is not None else None

    def adopt(self, reservation: weakref.finalize[..., Any] | None, pinned: bool) -> bool:
        """Whether a parked buffer can be taken over without leaving the budget short; its bytes move into this
        share."""
        if reservation is not None:
            return self.share is not None and self.share.adopt(reservation)
        return not (pinned and self.share is not None)  # pinned outside this budget
