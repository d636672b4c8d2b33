"""A plain LoRA patched into a streamed weight where it arrives, in scratch memory allocated with the ring: a
streamed step then allocates what the resident one does, nothing more (ComfyUI's compiler, 0.35+, records and
replays each block call's allocations).

``comfy.lora.calculate_weight`` allocates at each weight: the cast of the weight to the dtype the patch is
computed in, the product of up and down, its scaling (and a cast of it, where that dtype differs from the
weight's). Here the same operations, in the same order and dtypes, write into views of one scratch buffer the
engine keeps (``BlockStreamer``'s ``scratch_bytes``): ``mm(out=)``, in-place scaling, ``copy_`` for each cast,
then the add into the weight's copy, bit for bit what ComfyUI computes (a fused ``addmm_`` would round
differently). Anything else (a LoHa, DoRA, a LoRA with a mid weight or an offset, a layer's own ``convert_``
or ``set_`` function) is patched by ComfyUI's own code, as before.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import comfy.weight_adapter
import torch

_ALIGN = 256  # each view's offset in the scratch: what the caching allocator gives a tensor, at the least

# The stored dtypes ComfyUI's rounding (``comfy.float.stochastic_rounding``) rounds to nearest, as ``copy_``
# does; it rounds the others (fp8) stochastically, by its own code.
_ROUNDED_TO_NEAREST = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class PlainLora:
    """One patch of a weight that is a plain LoRA: ``strength * alpha / rank * up @ down``, after the weight is
    scaled by ``strength_model``."""

    strength: float
    strength_model: float
    up: torch.Tensor
    down: torch.Tensor
    alpha: float | None

    @property
    def scale(self) -> float:
        """``strength * alpha``, computed as ``LoRAAdapter.calculate_weight`` computes it."""
        alpha = self.alpha / self.down.shape[0] if self.alpha is not None else 1.0
        return self.strength * alpha


def plain_loras(patches: Sequence, weight_shape: torch.Size) -> list[PlainLora] | None:
    """The weight's patches as plain LoRAs, or None if any is something else, or a LoRA that
    ``calculate_weight`` would not add as it is (a mid weight, DoRA, a reshape, an offset, a function, a shape
    that does not match the weight's)."""
    loras = []
    for patch in patches:
        strength, adapter, strength_model, offset, function = patch[:5]
        if offset is not None or function is not None or type(adapter) is not comfy.weight_adapter.LoRAAdapter:
            return None
        up, down, alpha, mid, dora_scale, reshape = adapter.weights[:6]
        if mid is not None or dora_scale is not None or reshape is not None:
            return None
        rows, rank = up.shape[0], up[0].numel()
        if down.shape[0] != rank or rows * down[0].numel() != weight_shape.numel():
            return None
        loras.append(PlainLora(strength, strength_model, up, down, alpha))
    return loras


@dataclass(frozen=True)
class ScratchLayout:
    """Where each intermediate of one weight's patch lies in the scratch, by (offset, dtype, shape); the dtype the
    weight is patched in and the one the products are computed in."""

    parts: dict[str, tuple[int, torch.dtype, tuple[int, ...]]]
    nbytes: int
    work_dtype: torch.dtype
    intermediate: torch.dtype

    @classmethod
    def of(
        cls,
        weight: torch.Tensor,
        loras: Sequence[PlainLora],
        work_dtype: torch.dtype,
        intermediate: torch.dtype,
        in_place: bool,
    ) -> ScratchLayout:
        """The layout for ``weight`` patched in ``work_dtype`` (``in_place``: in the weight itself), the
        products computed in ``intermediate``."""
        sizes: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
        if not in_place:
            sizes.append(("work", work_dtype, tuple(weight.shape)))
        up_rows = max(lora.up.shape[0] for lora in loras)
        sizes.append(("product", intermediate, (up_rows, weight.numel() // up_rows)))
        if intermediate != work_dtype:
            sizes.append(("cast", work_dtype, tuple(weight.shape)))
        for name, tensors in (("up", [lora.up for lora in loras]), ("down", [lora.down for lora in loras])):
            cast = [tensor.flatten(1) for tensor in tensors if tensor.dtype != intermediate]
            if cast:
                sizes.append((name, intermediate, (max(t.shape[0] for t in cast), max(t.shape[1] for t in cast))))
        parts, offset = {}, 0
        for name, dtype, shape in sizes:
            parts[name] = (offset, dtype, shape)
            nbytes = torch.Size(shape).numel() * dtype.itemsize
            offset += -(-nbytes // _ALIGN) * _ALIGN
        return cls(parts, offset, work_dtype, intermediate)

    def view(self, scratch: torch.Tensor, name: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        """Part ``name`` of ``scratch``, at ``shape`` (its full shape if None)."""
        offset, dtype, full = self.parts[name]
        shape = tuple(full if shape is None else shape)
        nbytes = torch.Size(shape).numel() * dtype.itemsize
        return scratch[offset : offset + nbytes].view(dtype).view(shape)


def layout_in(
    scratch: torch.Tensor,
    weight: torch.Tensor,
    loras: Sequence[PlainLora],
    work_dtype: torch.dtype,
    intermediate: torch.dtype,
) -> ScratchLayout | None:
    """The layout ``patch_plain_loras`` patches ``weight`` by (in place where it is in ``work_dtype``), or None
    where ``scratch`` cannot take it: too small, or the adapters not where it is (staged with their block; a
    host copy is ComfyUI's code's to cast)."""
    layout = ScratchLayout.of(weight, loras, work_dtype, intermediate, weight.dtype == work_dtype)
    on_device = all(t.device == scratch.device for lora in loras for t in (lora.up, lora.down))
    return layout if on_device and layout.nbytes <= scratch.numel() else None


def _as(
    tensor: torch.Tensor, dtype: torch.dtype, layout: ScratchLayout, scratch: torch.Tensor, name: str
) -> torch.Tensor:
    """``tensor`` flattened to two dimensions in ``dtype``: itself, or its cast into the scratch (as
    ``cast_to_device`` casts the adapters)."""
    flat = tensor.flatten(1)
    if flat.dtype == dtype:
        return flat
    return layout.view(scratch, name, flat.shape).copy_(flat)


def patch_plain_loras(
    current: torch.Tensor, loras: Sequence[PlainLora], layout: ScratchLayout, scratch: torch.Tensor
) -> torch.Tensor:
    """``current`` (a weight's copy where it arrived) patched by ``loras`` as ``calculate_weight`` patches it,
    all in ``scratch`` as ``layout`` (``layout_in``) lays it out. Returns the patched weight in the layout's work
    dtype: ``current`` itself, or a view of the scratch for the caller to round into it."""
    work_dtype, intermediate = layout.work_dtype, layout.intermediate
    work = layout.view(scratch, "work").copy_(current) if "work" in layout.parts else current
    for lora in loras:
        if lora.strength_model != 1.0:
            work.mul_(lora.strength_model)
        up, down = (
            _as(lora.up, intermediate, layout, scratch, "up"),
            _as(lora.down, intermediate, layout, scratch, "down"),
        )
        product = layout.view(scratch, "product", (up.shape[0], down.shape[1]))
        torch.mm(up, down, out=product)
        product.mul_(lora.scale)
        change = product.view(work.shape)
        if intermediate != work_dtype:
            change = layout.view(scratch, "cast").copy_(change)
        work.add_(change)
    return work


def round_into(current: torch.Tensor, patched: torch.Tensor) -> bool:
    """Writes ``patched`` into ``current`` as ComfyUI's rounding to the stored dtype would (to nearest), where it
    is one of those dtypes; False for a dtype ComfyUI rounds stochastically (the caller rounds it as ComfyUI
    does)."""
    if current.dtype not in _ROUNDED_TO_NEAREST:
        return False
    if patched is not current:
        current.copy_(patched)
    return True
