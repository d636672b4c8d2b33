"""What a host asks of the engine, as one frozen value: ``StreamSpec``, in parts by concern, handed once to
``stream_blocks`` or ``stream_modules``. Frozen all the way down, so a spec cannot change under a running engine."""

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
    """How streamed blocks are kept on the host.

    ``pin_budget``: blocks it refuses stream from pageable memory. ``storage_dtype``: float parameters kept in another
    dtype on the host, cast back on the device. ``pack_in_background``: ``enable`` leaves blocks that can wait to a
    thread. ``parking``: where a parking stop leaves host buffers and a start takes them from. ``contents``: per block,
    a name for what the host writes over its packed weights. ``companions``: per block, tensors copied with it."""

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
    """The device ring.

    ``prefetch``: most blocks copied ahead (0: synchronous). ``ring_bytes``: its size (None: ``prefetch + 1`` of the
    largest block). ``nesting``: most streamed units running inside one another. ``scratch_bytes``: for the transforms.
    ``persistent_allocations``: a context around each lasting allocation and its free, for a host that replays each
    call's allocations (ComfyUI's compiler)."""

    prefetch: int = 1
    ring_bytes: int | None = None
    nesting: int = 1
    scratch_bytes: int = 0
    persistent_allocations: Callable[[], AbstractContextManager[object]] = nullcontext


@dataclass(frozen=True)
class FileOptions:
    """Weights that are views of their checkpoint file.

    ``file_slice``: where a tensor's bytes are in its file (None: in none). ``dtype_of``: each plain tensor's compute
    dtype. ``read_each_step``: blocks with no host buffer, read at each copy through ``staging_slots`` slots."""

    file_slice: Callable[[torch.Tensor], FileSlice | None] | None = None
    dtype_of: DtypeOf | None = None
    read_each_step: frozenset[int] = frozenset()
    staging_slots: int = 2

    def __post_init__(self) -> None:
        _frozen(self, "read_each_step", frozenset(self.read_each_step))


@dataclass(frozen=True)
class CallOptions:
    """How the engine sees the blocks run.

    ``root``: its call brackets a step. ``recurse``: a unit is a block with submodules (False: one module's own
    tensors). ``call_order``: an earlier engine's ``last_order``, for the first step. ``holders``: per block, the module
    whose call brings it in. ``entry_methods``: per block, its methods the model runs instead of calling it."""

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
    """Everything an engine is asked to do.

    ``transforms``: per block, a transform of its weights in the ring, called on the compute stream at each call and
    told whether it is the first since the copy. ``recorder`` times copies and calls on the device."""

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
    """After the first pass, the most-called modules stay on the device within ``vram_limit_bytes`` (0: none);
    ``on_promote`` hears the bytes moved."""

    vram_limit_bytes: int = 0
    on_promote: Callable[[int], None] | None = None
