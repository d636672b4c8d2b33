"""What a patch may not change about a streamed weight: the engine packs and streams each weight at the shape
it is stored in, in the form it is stored in. A patch that changes a weight's shape is refused before anything
is loaded (``refuse_reshaping_patches``), as is one a weight stored as packed integers would get through a weight
function (``refuse_patches_on_packed_weights``); a patched weight stored otherwise than the streamed copy it is
written over, as it is written (``overwrite_in_place``).
"""

from __future__ import annotations

import comfy.lora
import comfy.utils
import torch
from comfy.model_patcher import ModelPatcher

from ..offload.layout import TensorForm
from .blocks import inside
from .patch_routes import patched_by_comfyui, patched_parameters


def patched_shape(patches: list, weight: torch.Tensor, key: str) -> torch.Size:
    """The shape ``patches`` give ``weight``: ComfyUI's own ``calculate_shape`` (0.33 and later), else the one
    patch that changed a shape before it, a "diff" that pads the weight (``pad_weight``)."""
    calculate_shape = getattr(comfy.lora, "calculate_shape", None)
    if calculate_shape is not None:
        return calculate_shape(patches, weight, key)
    shape = weight.shape
    for patch in patches:
        value = patch[1]
        if isinstance(value, tuple) and len(value) == 2 and value[0] == "diff":
            data = value[1]
            if len(data) > 1 and data[1].get("pad_weight"):
                shape = data[0].shape
    return shape


def refuse_reshaping_patches(model: ModelPatcher, streamed: frozenset[str], node: str) -> None:
    """Raises, before anything is loaded, where a patch changes the shape of a weight in a ``streamed`` module:
    the engine packs and streams each weight at the shape it is stored in, so it would compute with the wrong
    one. A weight ComfyUI's load never patches (one of a module whose submodules hold weights too) is left out."""
    for key, patches in model.patches.items():
        if not inside(key, streamed):
            continue
        if not patched_by_comfyui(comfy.utils.get_attr(model.model, key.rpartition(".")[0])):
            continue  # a patch ComfyUI ignores, as the engine does
        weight = comfy.utils.get_attr(model.model, key)
        shape = patched_shape(patches, weight, key)
        if tuple(shape) != tuple(weight.shape):
            raise ValueError(
                f"{node}: a patch on this MODEL changes the shape of {key} from {tuple(weight.shape)} to "
                f"{tuple(shape)}, a weight of a block the node streams, and the node streams weights at the shape "
                "they are stored in. Apply that patch (a LoRA or merge that resizes layers) without the node, or "
                "save the patched model and load that instead."
            )


def refuse_patches_on_packed_weights(model: ModelPatcher, streamed: frozenset[str], node: str) -> None:
    """Raises, before anything is loaded, where a patch would reach a ``streamed`` weight stored as packed integers
    (not a float, not a quantized tensor ComfyUI's ops cast) through a weight function: ComfyUI's
    ``calculate_weight`` would read the packed bytes as the weight (ComfyUI-GGUF's Q4_CR_W4A4 layers, whose
    patches only the layer itself applies, from its patcher's ``patch_weight_to_device``)."""
    for name, module, routes in patched_parameters(model, streamed):
        for param, tensor, route in routes:
            key = f"{name}.{param}"
            if route == "device" and key in model.patches and not tensor.is_floating_point():
                raise ValueError(
                    f"{node}: a patch (a LoRA or merge) on this MODEL reaches {key}, a weight of a block the node "
                    f"streams that {type(module).__name__} stores packed as {tensor.dtype} {tuple(tensor.shape)} "
                    "and patches itself, which the node cannot do where it streams it. Apply the LoRA without the "
                    "node, or merge it into the checkpoint (ComfyUI-GGUF: Fuse LoRAs), or use a format the node "
                    "patches (bf16, fp8, int8, GGUF Q8_0/Q4_K)."
                )


def overwrite_in_place(current: torch.Tensor, patched: torch.Tensor, key: str) -> TensorForm | None:
    """Copies ``patched`` into ``current``'s memory, part by part (a quantized tensor's data and scales).
    Returns ``patched``'s form where its description (class, context) differs from ``current``'s."""
    into, source = TensorForm.of(current, key), TensorForm.of(patched, key)
    targets, sources = list(into.parts_of(current)), list(source.parts_of(patched))
    same = len(targets) == len(sources) and all(
        t.shape == s.shape and t.dtype == s.dtype for t, s in zip(targets, sources, strict=False)
    )
    if not same or (into.kind is not source.kind and not (into.is_plain and source.is_plain)):
        raise RuntimeError(
            f"Block Offload: patching {key} changed how its weight is stored ({type(current).__name__}, "
            f"{[(tuple(t.shape), t.dtype) for t in targets]} -> {[(tuple(s.shape), s.dtype) for s in sources]}), "
            "so it cannot be patched where it streams to. Put this patch on a model without a streaming node, "
            "or load the checkpoint unquantized."
        )
    with torch.no_grad():
        for target, part in zip(targets, sources, strict=True):
            if (target.data_ptr(), target.stride()) != (part.data_ptr(), part.stride()):  # else patched where it lies
                target.copy_(part)
    return source if source.is_wrapper and source.context != into.context else None
