"""Byte layout of one module's tensors in a single flat buffer, so a block moves with one copy.

Every tensor keeps its stored bytes (a quantized weight's data and scales, never a dequantized copy) and is rebuilt
around typed views wherever the buffer is, so ComfyUI's quantized ops and ComfyUI-GGUF compute as with a resident
tensor. Kinds are told apart by structure, not class, so the engine imports none of those libraries: plain tensors;
wrappers implementing ``__tensor_flatten__`` (ComfyUI's ``QuantizedTensor``); storage subclasses with no
``__torch_dispatch__`` of their own (ComfyUI-GGUF's ``GGMLTensor``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import nn

#: The compute dtype of a module's plain tensor where it differs from the stored one; None: as stored.
DtypeOf = Callable[[nn.Module, str], "torch.dtype | None"]

# For vectorised kernels and dtype reinterpretation.
ALIGNMENT = 256

KINDS = (
    "plain tensors of any dtype (fp8 weights with a separate scale included)",
    "wrapper subclasses implementing __tensor_flatten__/__tensor_unflatten__ (ComfyUI's QuantizedTensor)",
    "subclasses with memory of their own and no __torch_dispatch__ (ComfyUI-GGUF's GGMLTensor)",
)


def aligned(nbytes: int, granule: int = ALIGNMENT) -> int:
    return (nbytes + granule - 1) // granule * granule


def _own_memory(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor over ``tensor``'s memory; a subclass's own ``detach`` (GGMLTensor's returns itself) would give
    back the subclass."""
    with torch._C.DisableTorchFunctionSubclass():
        return torch.Tensor.detach(tensor)


@dataclass(frozen=True)
class TensorForm:
    """How one tensor is made of plain tensors, in ``parts_of`` order.

    Plain tensors and storage subclasses are one part, put in place by swapping ``.data``, so the Python object, its
    attributes and whoever holds it stay. A wrapper has a form per inner tensor and is rebuilt."""

    kind: type[torch.Tensor]
    context: object = None
    inner: tuple[tuple[str, TensorForm], ...] = ()
    size: torch.Size | None = None
    stride: tuple[int, ...] | None = None

    @property
    def is_wrapper(self) -> bool:
        return self.size is not None

    @property
    def is_plain(self) -> bool:
        return self.kind in (torch.Tensor, nn.Parameter)

    @classmethod
    def of(cls, tensor: torch.Tensor, where: str) -> TensorForm:
        kind = type(tensor)
        if kind in (torch.Tensor, nn.Parameter):
            return cls(kind)
        if hasattr(kind, "__tensor_flatten__") and hasattr(kind, "__tensor_unflatten__"):
            names, context = cast(Any, tensor).__tensor_flatten__()  # torch does not type this protocol
            inner = tuple((name, cls.of(getattr(tensor, name), f"{where}.{name}")) for name in names)
            return cls(kind, context, inner, tensor.size(), tensor.stride())
        if kind.__torch_dispatch__ is torch.Tensor.__torch_dispatch__:
            return cls(kind)
        raise TypeError(
            f"{where} is a {kind.__name__}, a tensor subclass that block streaming cannot store as its bytes: "
            f"it has a __torch_dispatch__ of its own but no __tensor_flatten__. Streaming handles "
            + "; ".join(KINDS)
            + "."
        )

    def parts_of(self, tensor: torch.Tensor) -> Iterator[torch.Tensor]:
        """The plain tensors ``tensor`` is stored as (aliases of its memory), in layout order."""
        if not self.is_wrapper:
            yield _own_memory(tensor)
            return
        # Asked of the tensor itself: a wrapper may expose its inner tensors only once flattened.
        names, _ = cast(Any, tensor).__tensor_flatten__()
        for name, (_, form) in zip(names, self.inner, strict=True):
            yield from form.parts_of(getattr(tensor, name))

    def assemble(self, parts: Iterator[torch.Tensor]) -> torch.Tensor:
        if not self.is_wrapper:
            return next(parts)
        inner = {name: form.assemble(parts) for name, form in self.inner}
        rebuilt: torch.Tensor = cast(Any, self.kind).__tensor_unflatten__(inner, self.context, self.size, self.stride)
        return rebuilt


@dataclass(frozen=True)
class Part:
    offset: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        return flat[self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)


@dataclass(frozen=True)
class TensorSlot:
    owner: nn.Module
    name: str
    is_parameter: bool
    form: TensorForm
    parts: tuple[Part, ...]

    def tensor(self) -> torch.Tensor:
        table = self.owner._parameters if self.is_parameter else self.owner._buffers
        tensor = table[self.name]
        assert tensor is not None, f"{self.name} was None when the layout was taken"
        return tensor

    def place(self, tensors: Views, index: int) -> None:
        """Makes the module hold ``tensors[index]``.

        Swapping ``.data`` keeps the object, so holders (ComfyUI's patcher, ComfyUI-GGUF's attributes) still see it.
        Where the module holds an inference tensor, a normal one goes in as its inference alias. A wrapper's device is
        fixed at construction, so the rebuilt one replaces it, as ComfyUI itself does with quantized Parameters."""
        tensor = tensors[index]
        if not self.form.is_wrapper:
            held = self.tensor()
            if held.is_inference() and not tensor.is_inference():
                tensor = tensors.inference_alias(index)
            held.data = tensor
        elif self.is_parameter:
            self.owner._parameters[self.name] = cast(nn.Parameter, tensor)
        else:
            self.owner._buffers[self.name] = tensor


class Views(tuple[torch.Tensor, ...]):
    """A module's tensors as ``point_at`` places them, kept by whoever places them repeatedly, so each tensor's
    inference alias is made once: every streamed call places two sets, and making the aliases each time would
    dominate its host work."""

    def inference_alias(self, index: int) -> torch.Tensor:
        aliases: dict[int, torch.Tensor] = self.__dict__.setdefault("aliases", {})
        alias = aliases.get(index)
        if alias is None:
            alias = aliases[index] = _inference_alias(self[index])
        return alias


def _inference_alias(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``'s memory as an inference tensor. An inference-mode tensor (ComfyUI builds its Parameters in
    ``torch.inference_mode``) that takes a normal tensor's memory through ``.data`` loses its version counter, and
    every view of it then fails."""
    with torch.inference_mode():
        alias = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
        return alias.set_(tensor.untyped_storage(), tensor.storage_offset(), tensor.shape, tensor.stride())


def _module_tensors(module: nn.Module, recurse: bool) -> Iterator[tuple[nn.Module, str, bool, torch.Tensor]]:
    for owner in module.modules() if recurse else (module,):
        for name, param in owner._parameters.items():
            if param is not None:
                yield owner, name, True, param
        for name, buf in owner._buffers.items():
            if buf is not None:
                yield owner, name, False, buf


def stored_bytes(tensor: torch.Tensor) -> int:
    if type(tensor) in (torch.Tensor, nn.Parameter):  # the common case, without making an alias
        return tensor.numel() * tensor.element_size()
    return sum(part.nbytes for part in TensorForm.of(tensor, type(tensor).__name__).parts_of(tensor))


def module_stored_bytes(module: nn.Module, recurse: bool = True, dtype_of: DtypeOf | None = None) -> int:
    """Stored bytes of ``module``'s parameters and buffers, each counted once; with ``dtype_of``, plain tensors
    counted in their compute dtype."""
    unique = {id(tensor): (owner, name, tensor) for owner, name, _, tensor in _module_tensors(module, recurse)}
    total = 0
    for owner, name, tensor in unique.values():
        computed = (
            dtype_of(owner, name) if dtype_of is not None and type(tensor) in (torch.Tensor, nn.Parameter) else None
        )
        total += tensor.numel() * computed.itemsize if computed is not None else stored_bytes(tensor)
    return total


@dataclass(frozen=True)
class BlockLayout:
    """All tensors of a module, parts packed back to back in ``nbytes``."""

    slots: tuple[TensorSlot, ...]
    nbytes: int

    @classmethod
    def of(
        cls,
        module: nn.Module,
        storage_dtype: torch.dtype | None = None,
        recurse: bool = True,
        dtype_of: DtypeOf | None = None,
    ) -> BlockLayout:
        """Lays out ``module``'s tensors (its own only, unless ``recurse``).

        ``dtype_of`` gives plain tensors their compute dtype. ``storage_dtype`` then applies to plain float parameters
        only: buffers such as rotary tables are small and lose precision badly, and subclass parts only mean something
        in their own dtypes."""
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
            form = TensorForm.of(tensor, f"{type(owner).__name__}.{name}")
            parts = []
            computed = dtype_of(owner, name) if dtype_of is not None and form.is_plain else None
            for part in form.parts_of(tensor):
                dtype = computed or part.dtype
                if storage_dtype is not None and is_parameter and form.is_plain and dtype.is_floating_point:
                    dtype = storage_dtype
                offset = aligned(offset)
                parts.append(Part(offset, part.shape, dtype))
                offset += part.numel() * dtype.itemsize
            slots.append(TensorSlot(owner, name, is_parameter, form, tuple(parts)))
        return cls(tuple(slots), aligned(offset))

    @property
    def parts(self) -> tuple[Part, ...]:
        return tuple(part for slot in self.slots for part in slot.parts)

    @property
    def device(self) -> torch.device | None:
        first = next(self._current_parts(), None)
        return None if first is None else first.device

    def part_views(self, flat: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(part.view(flat) for part in self.parts)

    def assemble(self, parts: Iterable[torch.Tensor]) -> Views:
        remaining = iter(parts)
        tensors = []
        for slot in self.slots:
            tensor = slot.form.assemble(remaining)
            if slot.is_parameter and slot.form.is_wrapper:
                tensor._is_param = True  # as nn.Parameter marks a subclass, without its copy
            tensors.append(tensor)
        return Views(tensors)

    def views(self, flat: torch.Tensor) -> Views:
        return self.assemble(self.part_views(flat))

    def pack_into(
        self,
        flat: torch.Tensor,
        parts: tuple[torch.Tensor, ...] | None = None,
        between: Callable[[], None] | None = None,
    ) -> None:
        """Copies the current parts (or ``parts``) into ``flat``, casting to the layout's dtypes; ``between`` runs
        before each copy (the packing thread's check that it may go on)."""
        for view, part in zip(self.part_views(flat), self.current() if parts is None else parts, strict=True):
            if between is not None:
                between()
            view.copy_(part)

    def point_at(self, tensors: Views) -> None:
        if len(tensors) != len(self.slots):
            raise ValueError(f"{len(tensors)} tensors for a layout of {len(self.slots)}")
        for index, slot in enumerate(self.slots):
            slot.place(tensors, index)

    def held(self) -> Views:
        """The module's tensors as held now, for ``point_at`` to put back: a wrapper as its own object, since a
        rebuilt one would lose attributes and an inference-mode one could not be detached again by ComfyUI."""
        return Views(
            slot.tensor() if slot.form.is_wrapper else next(slot.form.parts_of(slot.tensor())) for slot in self.slots
        )

    def current(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._current_parts())

    def _current_parts(self) -> Iterator[torch.Tensor]:
        for slot in self.slots:
            yield from slot.form.parts_of(slot.tensor())
