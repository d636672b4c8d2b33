"""Weight patches on streamed blocks: which weights carry them and how each is patched (``patched_parameters``), the
host tensors they hold, and the patches refused before anything loads.

Adapters travel with their block, copied into the ring right after its weights, where ComfyUI's lowvram path would copy
each from pageable memory at every step. Refused, since the engine streams each weight at its stored shape and form:
reshaping patches, patches that would reach packed-integer weights through a weight function, and hook LoRAs, which
ComfyUI writes into the parameters between calls, where a streamed copy never sees them."""

from __future__ import annotations

import copy
from collections.abc import Callable, Container, Iterator
from typing import Any, Protocol, TypeGuard, overload

import comfy.lora
import comfy.utils
import torch
from comfy.model_patcher import ModelPatcher

from ..offload.layout import TensorForm
from .blocks import inside


def _carries_patches(weight: torch.Tensor) -> bool:
    """A GGUF tensor, whose patches ride on it to ComfyUI-GGUF's ops."""
    return hasattr(weight, "tensor_type") and hasattr(weight, "patches")


def stored_by_layer(module: torch.nn.Module) -> bool:
    """A layer that stores its weight through its own ``set_weight`` (a quantized format). Its ops use the format's
    kernel only while it has no weight function, so its patches are written where they arrive."""
    return callable(getattr(module, "set_weight", None))


def patched_by_comfyui(module: torch.nn.Module) -> bool:
    """Whether ComfyUI's load patches ``module``'s own weights: its ``_load_list`` skips modules whose submodules
    hold weights too (Wan's ``modulation``), so a patch there changes nothing, here as in ComfyUI."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    return all(name in own for name, _ in module.named_parameters())


def patched_parameters(
    model: ModelPatcher, units: frozenset[str], patched_too: bool = False
) -> Iterator[tuple[str, torch.nn.Module, list[tuple[str, torch.Tensor, str]]]]:
    """The named units' modules with patched weights, and each parameter's route: ``carried`` (GGUF), ``arrival``
    (patched in place where it arrives), ``device`` (weight functions at compute time), ``bake`` (outside
    ComfyUI's ops: once before packing). Modules ComfyUI already patched only with ``patched_too``."""
    if not model.patches and not any(model.weight_wrapper_patches.values()):
        return  # skip a walk of every module when there is no patch
    for name, module in model.model.named_modules():
        # ComfyUI already patched it (resident earlier); its own load trusts the flag too.
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
            if _carries_patches(tensor):  # GGUF layers read no weight functions
                routes.append((param, tensor, "carried"))
            elif ops_module and param in ("weight", "bias"):
                on_arrival = key in model.patches and (stored_by_layer(module) or is_plain(tensor))
                routes.append((param, tensor, "arrival" if on_arrival else "device"))
            elif key in model.patches:
                routes.append((param, tensor, "bake"))
        if routes:
            yield name, module, routes


def is_plain(tensor: torch.Tensor) -> bool:
    """A float weight with no quantized format of its own."""
    return type(tensor) in (torch.Tensor, torch.nn.Parameter) and tensor.is_floating_point()


# -- the host tensors a weight's patches hold (its adapters)


class _WeightAdapter(Protocol):
    weights: list[Any] | tuple[Any, ...]


def _is_weight_adapter(value: object) -> TypeGuard[_WeightAdapter]:
    return isinstance(getattr(value, "weights", None), (tuple, list))


def host_tensors(value: object) -> Iterator[torch.Tensor]:
    """The host tensors a patch holds, in a fixed order."""
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu":
            yield value
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from host_tensors(item)
    elif _is_weight_adapter(value):
        yield from host_tensors(value.weights)


@overload
def with_host_tensors(value: list[Any], replacements: Iterator[torch.Tensor]) -> list[Any]: ...
@overload
def with_host_tensors(
    value: list[Any] | tuple[Any, ...], replacements: Iterator[torch.Tensor]
) -> list[Any] | tuple[Any, ...]: ...
@overload
def with_host_tensors(value: object, replacements: Iterator[torch.Tensor]) -> object: ...


def with_host_tensors(value: object, replacements: Iterator[torch.Tensor]) -> object:
    """``value`` with its host tensors, in ``host_tensors``'s order, taken from ``replacements``."""
    if isinstance(value, torch.Tensor):
        return next(replacements) if value.device.type == "cpu" else value
    if isinstance(value, list):
        return [with_host_tensors(item, replacements) for item in value]
    if isinstance(value, tuple):
        items = [with_host_tensors(item, replacements) for item in value]
        if hasattr(value, "_fields"):  # a namedtuple
            namedtuple_class: Callable[..., tuple[Any, ...]] = type(value)
            return namedtuple_class(*items)
        return tuple(items)
    if _is_weight_adapter(value):
        adapter = copy.copy(value)
        adapter.weights = with_host_tensors(value.weights, replacements)
        return adapter
    return value


def unit_named(name: str, units: Container[str]) -> str | None:
    """The one of ``units`` that module ``name`` is or lies in; None if none."""
    parts = name.split(".")
    return next((prefix for end in range(len(parts), 0, -1) if (prefix := ".".join(parts[:end])) in units), None)


def adapter_bytes(model: ModelPatcher, units: frozenset[str], recurse: bool) -> dict[str, int]:
    """Host bytes of each named unit's patch adapters: what staging them adds to the unit."""
    held: dict[str, dict[int, int]] = {}
    for key, patches in model.patches.items():
        owner = key.rpartition(".")[0]
        unit = unit_named(owner, units) if recurse else (owner if owner in units else None)
        if unit is not None and patched_by_comfyui(model.model.get_submodule(owner)):
            tensors = held.setdefault(unit, {})
            for tensor in host_tensors(patches):
                tensors[id(tensor)] = tensor.numel() * tensor.element_size()
    return {unit: sum(tensors.values()) for unit, tensors in held.items()}


# -- what a patch may not change about a streamed weight


def patched_shape(patches: list, weight: torch.Tensor, key: str) -> torch.Size:
    """The shape ``patches`` give ``weight``: ComfyUI's ``calculate_shape`` (0.33), else the one patch that reshaped
    before it, a padding "diff"."""
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
    """Raises, before anything loads, where a patch changes a streamed weight's shape."""
    for key, patches in model.patches.items():
        if not inside(key, streamed):
            continue
        if not patched_by_comfyui(comfy.utils.get_attr(model.model, key.rpartition(".")[0])):
            continue
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
    """Raises, before anything loads, where a weight function would reach a streamed weight stored as packed
    integers: ``calculate_weight`` would read the bytes as the weight (ComfyUI-GGUF's Q4_CR_W4A4 layers patch
    themselves)."""
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
    """Copies ``patched`` into ``current``'s memory part by part. Returns ``patched``'s form where its description
    differs; raises where its storage layout changed."""
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
            if (target.data_ptr(), target.stride()) != (part.data_ptr(), part.stride()):
                target.copy_(part)
    return source if source.is_wrapper and source.context != into.context else None


# -- hook LoRAs: ComfyUI's ``patch_hooks`` writes into the parameter, which a streamed block's copy ignores and a
# Dynamic VRAM twin's read-only file mapping crashes on.


def hook_strengths(model: ModelPatcher, streamed: frozenset[str]) -> dict[str, set[float]]:
    strengths: dict[str, set[float]] = {}
    for patches in model.hook_patches.values():
        for key, entries in patches.items():
            if inside(key, streamed):
                strengths.setdefault(key, set()).update(entry[0] for entry in entries)
    return strengths


def refuse_weight_hooks(model: ModelPatcher, streamed: frozenset[str], node: str) -> None:
    """Raises where this sampling's hooks patch a streamed weight. Strength 0 is refused too: ComfyUI writes the
    weights anyway (fatally, into a Dynamic VRAM twin's file mapping)."""
    strengths = hook_strengths(model, streamed)
    if not strengths:
        return
    text_encoder_only = (
        " Its model strength is 0: to hook the text encoder only, set apply_to_conds to false on Set CLIP Hooks."
        if all(used == {0.0} for used in strengths.values())
        else ""
    )
    raise ValueError(
        f"{node}: a hook LoRA (Create Hook LoRA, or hooks set on a conditioning) patches {len(strengths)} weights "
        f"of blocks this node streams ({min(strengths)}, ...). ComfyUI writes hook patches into the weights between "
        "model calls, which streamed blocks do not follow, so the output would be wrong. Load the LoRA with "
        f"Load LoRA (LoraLoaderModelOnly) instead, or run this workflow without the node.{text_encoder_only}"
    )
