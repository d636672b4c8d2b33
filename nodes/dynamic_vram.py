"""ComfyUI's Dynamic VRAM (0.33 and later, comfy-aimdo; the default on NVIDIA): the nodes stream a classic twin.

Dynamic VRAM places weights itself (aimdo's virtual address space, faulted in per module by its own
priorities), so the pack streams a classic copy of the model: ``clone(disable_dynamic=True)``, the call
ComfyUI's own TorchCompileModel makes, reloads the checkpoint with ComfyUI's classic ModelPatcher and
carries every patch, option and attachment over. The input MODEL keeps its dynamic weights.

That reload runs under Dynamic VRAM's process-wide flag (``comfy.memory_management.aimdo_enabled``),
with which ``comfy.ops`` Linear and Embedding take the checkpoint's tensors as stored, uncast: only
``ModelPatcherDynamic`` casts them, to the dtype ComfyUI recorded (``<name>_comfy_model_dtype``), as it
pages them in. The twin gets that cast once here, so it computes in one dtype as a classic load does.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterator

import comfy.model_management
import torch
from comfy.model_patcher import ModelPatcher

from ..offload import release_freed_host_memory
from .request import OffloadRequest


class DynamicVramError(ValueError):
    """A Dynamic VRAM model that ComfyUI cannot give a classic twin of (no reload recipe)."""


def uses_dynamic_vram(model: ModelPatcher) -> bool:
    """Whether ComfyUI (0.33 and later) manages this model with Dynamic VRAM (comfy-aimdo)."""
    is_dynamic = getattr(model, "is_dynamic", None)  # absent before Dynamic VRAM (0.3.75)
    return bool(is_dynamic is not None and is_dynamic())


# Per Dynamic VRAM model (its nn.Module, shared by all its clones): the classic twin ComfyUI loaded for
# the pack, as ``clone(model_override=...)`` takes it. A LoRA or another patch node before ours makes a
# new dynamic clone at each change; the twin is loaded from disk once, not once per change. The entry
# goes when the dynamic model does (the loader's output is replaced or freed).
_CLASSIC_TWINS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def classic_clone(model: ModelPatcher, node: str) -> ModelPatcher:
    """A clone of ``model`` whose weights ComfyUI loads the classic way (partial load, ``_load_list``)."""
    if not uses_dynamic_vram(model):
        return model.clone()
    twin = _CLASSIC_TWINS.get(model.model)
    if twin is not None:
        classic = model.clone(disable_dynamic=True, model_override=twin)
    else:
        if model.cached_patcher_init is None:
            raise DynamicVramError(
                f"{node}: this MODEL uses ComfyUI's Dynamic VRAM and came from a loader that cannot load it again "
                "without it, which block streaming needs. Load the model with a core loader (Load Diffusion "
                "Model, Load Checkpoint), or start ComfyUI with --disable-dynamic-vram."
            )
        logging.info(
            f"Block Offload ({node}): this MODEL uses Dynamic VRAM; loading a classic copy of it to stream "
            "(the MODEL you connected is unchanged)"
        )
        classic = model.clone(disable_dynamic=True)
        cast_to_recorded_dtypes(classic.model)
        release_freed_host_memory()  # the stored-dtype copy just freed
        _CLASSIC_TWINS[model.model] = classic.get_clone_model_override()
    # clone() hands over the dynamic parent's size, which counts the checkpoint's stored dtypes.
    classic.size = comfy.model_management.module_size(classic.model)
    return classic


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _recorded_dtypes(model: torch.nn.Module) -> Iterator[tuple[dict, str, torch.Tensor, torch.dtype | None]]:
    """Every parameter and buffer with its table, name and the dtype ComfyUI recorded for it
    (``<name>_comfy_model_dtype``); None where it recorded none or the tensor is quantized (a subclass)."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    dtype = getattr(module, f"{name}_comfy_model_dtype", None)
                    yield table, name, tensor, dtype if type(tensor) in _PLAIN else None


def weight_bytes(model: ModelPatcher) -> int:
    """The model's weights in the dtypes ComfyUI computes them in: a Dynamic VRAM model holds them as
    stored until it pages them in (so ``model_size()`` counts an fp32 file run in fp16 twice over)."""
    return sum(
        tensor.numel() * dtype.itemsize if dtype is not None else tensor.nbytes
        for _, _, tensor, dtype in _recorded_dtypes(model.model)
    )


def room_for_weights(model: ModelPatcher, request: OffloadRequest) -> int:
    """The device bytes ComfyUI can give this model's weights (its memory less ComfyUI's inference reserve),
    within the node's own budget when it has one."""
    room = int(comfy.model_management.maximum_vram_for_weights(model.load_device))
    return min(room, request.budget_bytes) if request.budget_bytes else room


def cast_to_recorded_dtypes(model: torch.nn.Module) -> None:
    """Casts every plain parameter and buffer to the dtype ComfyUI recorded for it, as ModelPatcherDynamic
    does when it pages a weight in. Quantized tensors (a tensor subclass) are ComfyUI's ops' to handle."""
    for table, name, tensor, dtype in _recorded_dtypes(model):
        if dtype is None or tensor.dtype == dtype:
            continue
        if isinstance(tensor, torch.nn.Parameter):
            tensor.data = tensor.data.to(dtype)  # the same Parameter: ComfyUI's patches refer to it
        else:
            table[name] = tensor.to(dtype)
