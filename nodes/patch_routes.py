"""Which parameters of the streamed units carry patches, and how each is patched (``patched_parameters``).

A plain weight or bias of ComfyUI's ops, and one of a layer that stores its weight itself
(``stored_by_layer``), is patched where it arrives; any other weight of ComfyUI's ops, and one with only
wrapper patches, by weight functions at compute time. GGUF weights carry their patches to ComfyUI-GGUF's own
ops (``tensor.patches``), which apply them at compute time. A weight of another leaf module (outside ComfyUI's
ops) is patched once before packing, as before: its block is packed again when its patches change. A weight
of a module whose submodules hold weights too (Wan's blocks' and head's ``modulation``, LTX's
``scale_shift_table``) is never patched: ComfyUI's load leaves such a module out (``ModelPatcher._load_list``),
so a model merge or a LoRA key on it changes nothing in ComfyUI, and must change nothing here.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from comfy.model_patcher import ModelPatcher

from .blocks import inside


def _carries_patches(weight: torch.Tensor) -> bool:
    """A GGUF tensor: quantized bytes whose patches ride on the tensor to ComfyUI-GGUF's ops."""
    return hasattr(weight, "tensor_type") and hasattr(weight, "patches")


def stored_by_layer(module: torch.nn.Module) -> bool:
    """A layer whose weight ComfyUI's load stores through the layer's own ``set_weight`` (a quantized format
    re-quantizes the patched weight): its ops compute from that form, with the format's kernel, only while it
    has no weight or bias function. Its patched weight and bias are written where they arrive instead."""
    return callable(getattr(module, "set_weight", None))


def patched_by_comfyui(module: torch.nn.Module) -> bool:
    """Whether ComfyUI's load patches ``module``'s own weights: not where its submodules hold weights too (its
    ``_load_list`` skips those "random weights in non leaf modules", by name, as here)."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    return all(name in own for name, _ in module.named_parameters())


def patched_parameters(
    model: ModelPatcher, units: frozenset[str], patched_too: bool = False
) -> Iterator[tuple[str, torch.nn.Module, list[tuple[str, torch.Tensor, str]]]]:
    """The named units' modules with patched weights, each with its patched parameters and how each is patched:
    ``carried`` (a GGUF tensor, whose patches ride on it to ComfyUI-GGUF's ops), ``arrival`` (a plain weight or
    bias of ComfyUI's ops, or one of a layer that stores its weight itself: in place, where it arrives),
    ``device`` (any other weight of ComfyUI's ops, and one with only wrapper patches: weight functions at compute
    time), ``bake`` (outside ComfyUI's ops: once before packing).
    Modules ComfyUI has loaded and patched only with ``patched_too``."""
    if not model.patches and not any(model.weight_wrapper_patches.values()):
        return  # nothing to look for: the walk of every module would be most of a load's time with no LoRA
    for name, module in model.model.named_modules():
        # A module ComfyUI loaded and patched (resident in an earlier placement) holds these patches already,
        # as ComfyUI's own load trusts the flag (its unpatch clears it).
        if not inside(name, units) or (getattr(module, "comfy_patched_weights", False) and not patched_too):
            continue
        if not patched_by_comfyui(module):
            continue
        ops_module = hasattr(module, "comfy_cast_weights")
        routes = []
        for param, tensor in module.named_parameters(recurse=False):
            key = f"{name}.{param}"
            if key not in model.patches and not model.weight_wrapper_patches.get(key):
                continue
            if _carries_patches(tensor):  # ComfyUI-GGUF's layers read no weight functions
                routes.append((param, tensor, "carried"))
            elif ops_module and param in ("weight", "bias"):
                on_arrival = key in model.patches and (stored_by_layer(module) or is_plain(tensor))
                routes.append((param, tensor, "arrival" if on_arrival else "device"))
            elif key in model.patches:
                routes.append((param, tensor, "bake"))
        if routes:
            yield name, module, routes


def is_plain(tensor: torch.Tensor) -> bool:
    """A weight whose host buffer view holds it as computed from (no quantized format of its own)."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_floating_point()
