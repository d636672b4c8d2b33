"""What a host asks of the engine, as one frozen value: ``StreamSpec``, in parts by concern. A host builds it
once and hands it to ``stream_blocks`` or ``stream_modules``; every part the engine builds reads its own part.

Frozen all the way down: mappings are stored read-only and sequences as tuples or frozensets, so a spec
cannot change under an engine that runs from it."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from .file_source import FileSlice
from .layout import DtypeOf
from .parking import ParkingLot
from .pinning import PinnedMemoryBudget
from .timeline import TimelineRecorder

Transform = Callable[[bool], None]


def _frozen(spec: object, name: str, value: Any) -> None:
    object.__setattr__(spec, name, value)


def _empty() -> Mapping[Any, Any]:
    return MappingProxyType({})


@dataclass(frozen=True)
class HostOptions:
    """How streamed blocks are kept on the host (``HostBlocks``).

    ``pin_budget`` caps the pinned host memory: blocks it refuses stream from pageable memory.
    ``storage_dtype`` keeps floating-point parameters in another dtype on the host, cast back on the device.
    ``pack_in_background``: ``enable`` returns without packing the blocks that can wait; a thread packs them.
    ``parking``: where a stop with ``park`` leaves the host buffers, and where a start takes them over from.
    ``contents``: per block, a name for what the host writes over its weights in its host buffer (None: none).
    ``companions``: per block, tensors copied with it into the ring."""

    pin_memory: bool = True
    pin_budget: PinnedMemoryBudget | None = None
    storage_dtype: torch.dtype | None = None
    pack_in_background: bool = False
    parking: ParkingLot | None = None
    contents: Mapping[int, Hashable] = field(default_factory=_empty)
    companions: Mapping[int, Sequence[torch.Tensor]] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        named = {index: content for index, content in self.contents.items() if content is not None}
        _frozen(self, "contents", MappingProxyType(named))
        _frozen(self, "companions", MappingProxyType({i: tuple(ts) for i, ts in self.companions.items()}))


@dataclass(frozen=True)
class RingOptions:
    """The device ring (``DeviceRing``).

    ``prefetch``: how many blocks are copied ahead at most (0: each copy waits, kept for comparison).
    ``ring_bytes`` sizes the ring (None: ``prefetch + 1`` blocks as large as the largest).
    ``nesting``: how many streamed units run inside one another at most (each holds a region).
    ``scratch_bytes``: device memory the transforms work in, allocated with the ring.
    ``persistent_allocations``: a context around each device allocation kept from one call to the next, and
    around its free: a host that records and replays each call's allocations (ComfyUI's compiler) keeps
    them out."""

    prefetch: int = 1
    ring_bytes: int | None = None
    nesting: int = 1
    scratch_bytes: int = 0
    persistent_allocations: Callable[[], AbstractContextManager[object]] = nullcontext


@dataclass(frozen=True)
class FileOptions:
    """Weights that are views of their checkpoint file (``FileTier``).

    ``file_slice`` says where a tensor's bytes are in its file (None: in none). ``dtype_of`` gives the dtype
    each plain tensor is computed in. ``read_each_step``: blocks with no host buffer, read from their file at
    each copy through ``staging_slots`` host slots."""

    file_slice: Callable[[torch.Tensor], FileSlice | None] | None = None
    dtype_of: DtypeOf | None = None
    read_each_step: frozenset[int] = frozenset()
    staging_slots: int = 2

    def __post_init__(self) -> None:
        _frozen(self, "read_each_step", frozenset(self.read_each_step))


@dataclass(frozen=True)
class CallOptions:
    """How the engine sees the blocks run (``BlockCalls``, ``calls.py``).

    ``root``: the model, whose call begins and ends a step. ``recurse``: a unit is a block with its submodules
    (False: one module's own tensors). ``call_order``: the order an earlier engine of the same model saw
    (``last_order``), which the first step copies ahead in. ``holders``: per block, the module whose call brings
    it in, where that is not the block itself. ``entry_methods``: per block, the methods of its own the model
    runs it through instead of calling it."""

    root: nn.Module | None = None
    recurse: bool = True
    call_order: tuple[int, ...] | None = None
    holders: Mapping[int, nn.Module] = field(default_factory=_empty)
    entry_methods: Mapping[int, Sequence[str]] = field(default_factory=_empty)

    def __post_init__(self) -> None:
        if self.call_order is not None:
            _frozen(self, "call_order", tuple(self.call_order))
        _frozen(self, "holders", MappingProxyType(dict(self.holders)))
        _frozen(self, "entry_methods", MappingProxyType({i: tuple(ms) for i, ms in self.entry_methods.items()}))


@dataclass(frozen=True)
class StreamSpec:
    """Everything an engine is asked to do, by concern.

    ``transforms``: per block, a host's transform of its weights where they arrive in the ring, called on the
    compute stream at each call, told whether this is the first call since the copy (``DeviceRing.transform``).
    ``recorder`` times each copy and call on the device."""

    host: HostOptions = HostOptions()
    ring: RingOptions = RingOptions()
    files: FileOptions = FileOptions()
    calls: CallOptions = CallOptions()
    transforms: Mapping[int, Transform] = field(default_factory=_empty)
    recorder: TimelineRecorder | None = None

    def __post_init__(self) -> None:
        _frozen(self, "transforms", MappingProxyType(dict(self.transforms)))


@dataclass(frozen=True)
class SequentialOptions:
    """The sequential wrapper's own options: after the first pass, the most called modules stay on the device
    while they fit ``vram_limit_bytes`` (0: none), and ``on_promote`` hears how many bytes moved there."""

    vram_limit_bytes: int = 0
    on_promote: Callable[[int], None] | None = None
