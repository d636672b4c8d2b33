"""ComfyUI's Dynamic VRAM (comfy-aimdo, 0.33 and later): the nodes stream a classic twin whose weights stay in their
checkpoint file.

The twin is built by the Dynamic VRAM loader (``cached_patcher_init``), so its weights are views of the file's mapping,
not copies. They are as stored: ComfyUI's part is cast to the recorded dtypes as it loads, and the engine casts the
streamed blocks."""

from __future__ import annotations

import ast
import inspect
import itertools
import logging
import weakref
from collections.abc import Iterator
from typing import NamedTuple

import comfy.model_management
import comfy.utils
import torch
from comfy.model_patcher import ModelPatcher, get_key_weight

from ..offload import PROCESS_STATE, FileSlice
from ..offload.discovery import class_code
from .blocks import inside
from .loaded_patch import as_loaded, compute_dtype, string_to_seed
from .patches import is_plain
from .request import OffloadRequest


class DynamicVramError(ValueError):
    """A Dynamic VRAM model with no reload recipe, so no classic twin."""


def uses_dynamic_vram(model: ModelPatcher) -> bool:
    is_dynamic = getattr(model, "is_dynamic", None)  # absent on 0.3.75
    return bool(is_dynamic is not None and is_dynamic())


#: ComfyUI's diffusion models whose own code prefetches their blocks under Dynamic VRAM (``comfy.model_prefetch``):
#: LTX-2, MiniMax H3, and Qwen-Image 2.1 in later versions. Their twin runs without it, its patcher being classic.
CORE_PREFETCHING = frozenset({"LTXAVModel", "MiniMaxH3Model", "QwenImageTransformer2DModel"})


def core_prefetching(model: ModelPatcher) -> str:
    """The class of a Dynamic VRAM model's diffusion model where ComfyUI prefetches its blocks itself: one of
    ``CORE_PREFETCHING`` whose code makes a prefetch queue in this ComfyUI. "" for any other, a class of code the
    pack does not know included: it streams as every model does."""
    cls = type(model.model.diffusion_model)
    if not uses_dynamic_vram(model) or cls.__name__ not in CORE_PREFETCHING:
        return ""
    calls = (node.attr for tree in class_code(cls) for node in ast.walk(tree) if isinstance(node, ast.Attribute))
    return cls.__name__ if "make_prefetch_queue" in calls else ""


def on_fast_disk(model: ModelPatcher) -> bool:
    """Whether ComfyUI reads this model's offloaded weights from its file at each step instead of pinning them
    (``ModelPatcher.fast_disk``, 0.36 and later)."""
    return bool(getattr(model, "fast_disk", False))


def keep_fast_disk(source: ModelPatcher, cloned: ModelPatcher) -> None:
    """Passes the fast-disk choice on where a clone is made without ComfyUI's ``clone()``, or by a version whose
    ``clone()`` predates it."""
    if hasattr(source, "fast_disk"):
        cloned.fast_disk = source.fast_disk


class _Twins:
    """The classic twins of Dynamic VRAM models, kept across prompts: ComfyUI hands a node a new dynamic clone at
    each upstream change, over the same nn.Module."""

    def __init__(self) -> None:
        # Per dynamic model: its twin as ``clone(model_override=...)`` takes it, built once.
        self.of_model: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
        # Per twin: its plain weights as file views, for ``back_to_file``.
        self.file_views: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )


def _twins() -> _Twins:
    return PROCESS_STATE.entry(
        "dynamic vram twins", _Twins, "a twin outlives the prompt and the clone it was built for, as its model does"
    )


def own_classic_path(model: ModelPatcher) -> str:
    """The name of ``model``'s patcher class where it makes its classic clone itself, else "".

    ComfyUI-GGUF's ``GGUFModelPatcherDynamic`` does, and only that clone applies LoRAs to its quantized blocks. A
    ``clone`` without ``disable_dynamic`` merely forwards, and keeps the file-backed twin."""
    clone = type(model).clone
    if not uses_dynamic_vram(model) or clone is ModelPatcher.clone:
        return ""
    return type(model).__name__ if "disable_dynamic" in inspect.signature(clone).parameters else ""


def classic_clone(model: ModelPatcher, node: str) -> ModelPatcher:
    """A clone of ``model`` that ComfyUI loads the classic way (partial load, ``_load_list``)."""
    if not uses_dynamic_vram(model):
        return model.clone()
    twins = _twins()
    twin = twins.of_model.get(model.model)
    own = own_classic_path(model)
    if twin is None and own:
        logging.info(
            f"Block Offload ({node}): this MODEL uses Dynamic VRAM through {own}, which makes "
            "its classic clone itself; streaming that clone (the MODEL you connected is unchanged)"
        )
        twin = twins.of_model[model.model] = model.clone(disable_dynamic=True).get_clone_model_override()
    if twin is None:
        twin = twins.of_model[model.model] = _file_backed_twin(model, node)
        # Own tensors over the file's bytes: ComfyUI's load replaces a Parameter's data.
        twins.file_views[twin[0]] = {
            name: tensor.detach() for name, tensor in _plain_tensors(twin[0]) if file_slice(tensor) is not None
        }
    classic = model.clone(disable_dynamic=True, model_override=twin)
    keep_fast_disk(model, classic)
    # clone() copies the parent's size, which counts the stored dtypes.
    classic.size = weight_bytes(classic)
    return classic


def _file_backed_twin(model: ModelPatcher, node: str) -> tuple:
    """The model rebuilt by its loader with file-view weights, as a classic clone's model override."""
    if model.cached_patcher_init is None:
        raise DynamicVramError(
            f"{node}: this MODEL uses ComfyUI's Dynamic VRAM and came from a loader that cannot load it again, "
            "which block streaming needs. Load the model with a core loader (Load Diffusion Model, Load "
            "Checkpoint), or start ComfyUI with --disable-dynamic-vram."
        )
    logging.info(
        f"Block Offload ({node}): this MODEL uses Dynamic VRAM; streaming a twin of it whose weights stay in "
        "the checkpoint file (the MODEL you connected is unchanged)"
    )
    loader, arguments, *which = model.cached_patcher_init
    built = loader(*arguments, disable_dynamic=False)
    if which:
        built = built[which[0]]
    # The builder's ModelPatcherDynamic.__del__ must not unpin or detach the twin's weights.
    getattr(built.model, "dynamic_patchers", set()).discard(id(built))
    return built.get_clone_model_override()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _recorded_dtypes(
    model: torch.nn.Module, streamed: frozenset[str] = frozenset(), recurse: bool = True
) -> Iterator[tuple[dict, str, torch.Tensor, torch.dtype | None]]:
    """Parameters and buffers outside ``streamed`` with their table, name and recorded dtype (None: none recorded, or
    quantized)."""
    for module_name, module in model.named_modules() if recurse else (("", model),):
        if streamed and inside(module_name, streamed):
            continue
        for table in (module._parameters, module._buffers):
            for name, tensor in table.items():
                if tensor is not None:
                    dtype = getattr(module, f"{name}_comfy_model_dtype", None)
                    yield table, name, tensor, dtype if type(tensor) in _PLAIN else None


def weight_bytes(model: ModelPatcher) -> int:
    """The weights in their compute dtypes; ``model_size()`` counts them as stored, so an fp32 file run in fp16
    counts twice over."""
    return sum(
        tensor.numel() * dtype.itemsize if dtype is not None else tensor.nbytes
        for _, _, tensor, dtype in _recorded_dtypes(model.model)
    )


def room_for_weights(model: ModelPatcher, request: OffloadRequest) -> int:
    """Device bytes ComfyUI can give this model's weights, within the node's budget if it has one."""
    room = int(comfy.model_management.maximum_vram_for_weights(model.load_device))
    return min(room, request.budget_bytes) if request.budget_bytes else room


def cast_unloaded_to_recorded_dtypes(model: torch.nn.Module, streamed: frozenset[str] = frozenset()) -> None:
    """Casts to the recorded dtypes, outside ``streamed``, what ComfyUI's load does not pass through
    ``patch_weight_to_device``: buffers, and the own parameters of modules with parameters below them (Wan's
    ``modulation``), which the classic load leaves out of its list."""
    for module_name, module in model.named_modules():
        if streamed and inside(module_name, streamed):
            continue
        own = set(module._parameters)
        below = any(True for name, _ in module.named_parameters() if name not in own)
        for table, name, tensor, dtype in _recorded_dtypes(module, recurse=False):
            cast = table is module._buffers or below
            if cast and dtype is not None and tensor.dtype != dtype:
                if isinstance(tensor, torch.nn.Parameter):
                    tensor.data = tensor.data.to(dtype)  # the same Parameter: ComfyUI's patches refer to it
                else:
                    table[name] = tensor.to(dtype)


class _Backup(NamedTuple):
    """The entry ComfyUI's unpatch reads from ``ModelPatcher.backup``, by these fields."""

    weight: torch.Tensor
    inplace_update: bool


def load_in_recorded_dtype(patcher: ModelPatcher, key: str, device: torch.device) -> None:
    """Moves one weight ComfyUI loads to ``device`` and casts it there, as ModelPatcherDynamic does, so no host copy
    is made; a patched weight's backup is its file view."""
    module_name, _, name = key.rpartition(".")
    module = comfy.utils.get_attr(patcher.model, module_name) if module_name else patcher.model
    weight = getattr(module, name)
    dtype = recorded_dtype(module, name) or weight.dtype
    if type(weight) not in _PLAIN or (weight.device == device and weight.dtype == dtype):
        return
    if key in patcher.patches and key not in patcher.backup:
        patcher.backup[key] = _Backup(weight.data, False)
    weight.data = weight.data.to(device=device, dtype=dtype)


#: ModelPatcherDynamic's threshold: layers up to this size (as stored) load the classic way, larger ones are
#: patched as cast.
_LOADED_WHOLE_BYTES = 16 * 1024


def patched_as_cast(model: torch.nn.Module, module_name: str, module: torch.nn.Module) -> bool:
    """Whether Dynamic VRAM patches this module's weights as it casts them: layers of ComfyUI's ops over
    ``_LOADED_WHOLE_BYTES`` as stored. Others it loads as a classic load does."""
    weight = getattr(module, "weight", None)
    if not hasattr(module, "comfy_cast_weights") or not isinstance(weight, torch.Tensor) or not is_plain(weight):
        return False  # quantized layers keep their format's re-quantization
    views = file_views(model)
    prefix = f"{module_name}." if module_name else ""
    stored = sum(views.get(prefix + name, tensor).nbytes for name, tensor in module.state_dict().items())
    return stored > _LOADED_WHOLE_BYTES


def patch_loaded_as_dynamic_vram(patcher: ModelPatcher, key: str, inplace_update: bool = False) -> bool:
    """Patches one plain weight the twin loads as the Dynamic VRAM model would; False, patching nothing, for weights
    left to ComfyUI."""
    weight, set_func, _ = get_key_weight(patcher.model, key)
    if key not in patcher.patches or set_func is not None or not is_plain(weight):
        return False
    module_name, _, param = key.rpartition(".")
    module = comfy.utils.get_attr(patcher.model, module_name) if module_name else patcher.model
    if not patched_as_cast(patcher.model, module_name, module):
        return False
    inplace_update = patcher.weight_inplace_update or inplace_update
    if key not in patcher.backup:
        backup = weight.to(device=patcher.offload_device, copy=inplace_update)
        patcher.backup[key] = _Backup(backup, inplace_update)
    dtype = compute_dtype(patcher)
    patched = as_loaded(module, param, weight, key, patcher.patches[key], string_to_seed(module_name), None, dtype)
    if inplace_update:
        comfy.utils.copy_to_param(patcher.model, key, patched)
    else:
        comfy.utils.set_attr_param(patcher.model, key, patched)
    return True


def stored_as_computed(module: torch.nn.Module, recurse: bool = True) -> bool:
    return all(dtype in (None, tensor.dtype) for _, _, tensor, dtype in _recorded_dtypes(module, recurse=recurse))


def _plain_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if type(tensor) in _PLAIN:
            yield name, tensor


def file_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return _twins().file_views.get(model, {})


def back_to_file(model: torch.nn.Module) -> None:
    """Points twin weights that ComfyUI's unload copied back to the host at their file views again, so the copies are
    freed. Weights elsewhere stay."""
    views = file_views(model)
    for name, tensor in _plain_tensors(model):
        view = views.get(name)
        if view is not None and tensor.device.type == "cpu" and tensor.data_ptr() != view.data_ptr():
            tensor.data = view


def recorded_dtype(module: torch.nn.Module, name: str) -> torch.dtype | None:
    return getattr(module, f"{name}_comfy_model_dtype", None)


def file_slice(part: torch.Tensor) -> FileSlice | None:
    """Where a tensor's bytes lie in its file, if it is one whole tensor of a file Dynamic VRAM mapped. ``file_ref``
    is a descriptor (a handle on Windows, where the engine copies from the mapping)."""
    info = getattr(part.untyped_storage(), "_comfy_tensor_file_slice", None)
    if info is None or info.file_ref is None:
        return None
    if part.storage_offset() != 0 or not part.is_contiguous() or part.numel() * part.element_size() != info.size:
        return None
    return FileSlice(int(info.file_ref), info.offset, info.size, part)
