"""Per-module offloading for any module tree, block list or not: every module that owns tensors streams on its own
through the block machinery. After the first pass the most-called modules stay on the device while they fit
``vram_limit_bytes``."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace
from enum import Enum

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .calls import eager
from .layout import BlockLayout, module_stored_bytes
from .plan import stream_buffer_bytes
from .runner import PackProgress
from .spec import SequentialOptions, StreamSpec
from .streamer import BlockStreamer


class ModuleState(str, Enum):
    OFFLOADED = "offloaded"  # only on the host
    ONLOADED = "onloaded"  # copied to a device slot for a call, released after
    KEPT = "kept"  # promoted: lives on the device


def _own_tensors(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in (*module._parameters.values(), *module._buffers.values()) if t is not None]


def _own_bytes(module: nn.Module) -> int:
    return module_stored_bytes(module, recurse=False)


def streamed_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """The modules a ``SequentialOffloader`` of ``root`` streams: those that own tensors. Whoever hides them from
    another loader must ask here, so both mean the same set."""
    return [(name, module) for name, module in root.named_modules() if _own_tensors(module)]


def buffer_bytes(
    root: nn.Module,
    prefetch: int,
    storage_dtype: torch.dtype | None = None,
    holders: Mapping[int, nn.Module] | None = None,
) -> int:
    """Device bytes a ``SequentialOffloader`` of ``root`` allocates before keeping any module: its ring, sized for
    prefetch and every level of nesting, plus a staging buffer for a storage dtype."""
    modules = [module for _, module in streamed_modules(root)]
    if not modules:
        return 0
    largest = max(_own_bytes(module) for module in modules)
    staging = 0
    if storage_dtype is not None:
        staging = max(BlockLayout.of(module, storage_dtype, recurse=False).nbytes for module in modules)
    return stream_buffer_bytes(largest, prefetch, _nesting(root, modules, holders or {}), staging)


def _nesting(root: nn.Module, modules: list[nn.Module], holders: Mapping[int, nn.Module]) -> int:
    """The most ring regions held at once by calls running inside one another: each call holds one per module it
    brings in."""
    held = Counter(id(module) for index, module in enumerate(modules) if index not in holders)
    held.update(id(holder) for holder in holders.values())

    def depth(module: nn.Module) -> int:
        below = max((depth(child) for child in module.children()), default=0)
        return below + held[id(module)]

    return max(1, depth(root))


def stream_modules(
    root: nn.Module,
    device: torch.device | str,
    spec: StreamSpec,
    options: SequentialOptions,
) -> SequentialOffloader:
    """The engine that streams every tensor-owning module of ``root`` as ``spec`` asks, indices as in
    ``streamed_modules``. It sets the spec's root, recurse and nesting itself. Raises for a spec that does not
    fit, before anything is touched."""
    if spec.calls.root is not None or not spec.calls.recurse or spec.ring.nesting != 1:
        raise ValueError("the sequential wrapper sets the spec's root, recurse and nesting itself: leave them unset")
    modules = [module for _, module in streamed_modules(root)]
    nesting = _nesting(root, modules, spec.calls.holders)
    spec = replace(spec, calls=replace(spec.calls, root=root, recurse=False), ring=replace(spec.ring, nesting=nesting))
    return SequentialOffloader(modules, device, frozenset(range(len(modules))), spec, options)


class SequentialOffloader(BlockStreamer):
    """A ``BlockStreamer`` over every tensor-owning module that keeps the most-called ones on the device after the
    first pass. A module with a transform is never kept (see ``make_resident``)."""

    def __init__(
        self,
        modules: list[nn.Module],
        device: torch.device | str,
        streamed: frozenset[int],
        spec: StreamSpec,
        options: SequentialOptions,
    ) -> None:
        super().__init__(modules, device, streamed, spec)
        self.options = options
        self._promotion_hook: RemovableHandle | None = None

    def enable(self, progress: PackProgress | None = None) -> None:
        super().enable(progress)
        root = self.spec.calls.root
        if self.options.vram_limit_bytes > 0 and root is not None:
            self._promotion_hook = root.register_forward_hook(eager(self._promote_after_first_pass))

    def disable(self, park: bool = False) -> None:
        if self._promotion_hook is not None:
            self._promotion_hook.remove()
            self._promotion_hook = None
        super().disable(park)

    def state(self, module: nn.Module) -> ModuleState:
        index = next(i for i, m in enumerate(self.blocks) if m is module)
        if index not in self.streamed:
            return ModuleState.KEPT
        if self.ring.region_of(index) is not None:
            return ModuleState.ONLOADED
        return ModuleState.OFFLOADED

    def _promote_after_first_pass(self, *_: object) -> None:
        if self._promotion_hook is not None:
            self._promotion_hook.remove()
            self._promotion_hook = None
        calls = Counter(index for index in self.calls.expected if index not in self.spec.transforms)
        # Among equals the smaller module first, so more fit.
        ranked = sorted(calls, key=lambda i: (-calls[i], _own_bytes(self.blocks[i])))
        limit = self.options.vram_limit_bytes - self.ring.device_buffer_bytes  # the limit counts the ring too
        kept, used = [], 0
        for index in ranked:
            size = _own_bytes(self.blocks[index])
            if used + size <= limit:
                kept.append(index)
                used += size
        self.make_resident(kept)
        if self.options.on_promote is not None and kept:
            self.options.on_promote(used)
