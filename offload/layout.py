"""Byte layout of one module's tensors inside a single flat buffer.

A block is moved with one copy of one contiguous buffer instead of one copy per
tensor. Each tensor gets an aligned byte range; a typed view of that range is what
the module's parameter points at while it lives in that buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

# Keeps every view aligned for vectorised kernels and for dtype reinterpretation.
ALIGNMENT = 256


def _align(offset: int) -> int:
    return (offset + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class TensorSlot:
    """Where one tensor of a module lives inside the module's flat buffer."""

    owner: nn.Module
    name: str
    is_parameter: bool
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def tensor(self) -> torch.Tensor:
        table = self.owner._parameters if self.is_parameter else self.owner._buffers
        return table[self.name]

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


def _module_tensors(module: nn.Module, recurse: bool) -> Iterator[tuple[nn.Module, str, bool, torch.Tensor]]:
    for owner in module.modules() if recurse else (module,):
        for name, param in owner._parameters.items():
            if param is not None:
                yield owner, name, True, param
        for name, buf in owner._buffers.items():
            if buf is not None:
                yield owner, name, False, buf


def _is_plain(tensor: torch.Tensor) -> bool:
    return type(tensor) in (torch.Tensor, nn.Parameter)


@dataclass(frozen=True)
class BlockLayout:
    """All tensors of a module, packed back to back; ``nbytes`` is the buffer size."""

    slots: tuple[TensorSlot, ...]
    nbytes: int

    @classmethod
    def of(cls, module: nn.Module, storage_dtype: torch.dtype | None = None, recurse: bool = True) -> BlockLayout:
        """Lays out ``module``'s tensors (its own only, unless ``recurse``).

        ``storage_dtype`` applies to floating-point parameters only: buffers such as
        rotary tables lose precision badly and are small.
        """
        slots = []
        offset = 0
        seen: set[int] = set()
        for owner, name, is_parameter, tensor in _module_tensors(module, recurse):
            if id(tensor) in seen:
                raise ValueError(
                    f"{type(module).__name__} shares the tensor {name!r} between two places; "
                    "a shared tensor cannot be streamed as part of one block."
                )
            seen.add(id(tensor))
            if not _is_plain(tensor):
                raise TypeError(
                    f"{type(module).__name__}.{name} is a {type(tensor).__name__}; block streaming "
                    "handles plain tensors of any dtype (fp8 weights with a separate scale included)."
                )
            dtype = tensor.dtype
            if storage_dtype is not None and is_parameter and dtype.is_floating_point:
                dtype = storage_dtype
            offset = _align(offset)
            slots.append(TensorSlot(owner, name, is_parameter, offset, tensor.shape, dtype))
            offset += tensor.numel() * dtype.itemsize
        return cls(tuple(slots), _align(offset))

    def views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(slot.view(flat) for slot in self.slots)

    def pack_into(self, flat: torch.Tensor) -> None:
        """Copies the module's current tensors into ``flat`` (casting to the layout's dtypes)."""
        for slot, view in zip(self.slots, self.views(flat), strict=True):
            view.copy_(slot.tensor())

    def point_at(self, views: tuple[torch.Tensor, ...]) -> None:
        """Makes every tensor of the module use the given views as its storage.

        Swapping ``.data`` keeps the Parameter objects themselves, so code that
        holds a reference to a weight (optimisers, ComfyUI's patcher) still sees it.
        """
        for slot, view in zip(self.slots, views, strict=True):
            slot.tensor().data = view

    def current(self) -> tuple[torch.Tensor, ...]:
        return tuple(slot.tensor().data for slot in self.slots)
