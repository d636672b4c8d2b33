"""ComfyUI's Dynamic VRAM (0.33 and later, comfy-aimdo; the default on NVIDIA): the nodes stream a classic twin
whose weights stay in their checkpoint file.

Dynamic VRAM places weights itself (aimdo's virtual address space, faulted in per module by its own
priorities), so the pack streams a twin of the model under ComfyUI's classic ModelPatcher, as
``clone(disable_dynamic=True)`` (ComfyUI's TorchCompileModel's call) makes one, carrying every patch,
option and attachment over; the input MODEL keeps its dynamic weights. ComfyUI's own twin reloads the
checkpoint classically, copying every weight into memory of the process; this one is built by ComfyUI's
Dynamic VRAM loader instead (the same reload recipe, ``cached_patcher_init``), whose weights are views of
the file's mapping (``comfy.utils.load_safetensors``: each storage carries its ``_comfy_tensor_file_slice``).
Building it reads no weight: the pages are read when a weight is used.

Those weights are as stored: only ``ModelPatcherDynamic`` casts them, to the dtype ComfyUI recorded
(``<name>_comfy_model_dtype``), as it pages them in. So does the pack: what ComfyUI loads is cast as it
loads it, weight by weight, on the device (``load_in_recorded_dtype``), and the engine casts the streamed
blocks (host buffers packed in the recorded dtypes, file-tier blocks read as stored and cast on the device:
``file_slice`` and ``recorded_dtype`` are what it is given).
"""

from __future__ import annotations

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
from .blocks import inside
from .loaded_patch import as_loaded, compute_dtype, string_to_seed
from .patches import is_plain
from .request import OffloadRequest


class DynamicVramError(ValueError):
    """A Dynamic VRAM model that ComfyUI cannot give a classic twin of (no reload recipe)."""


def uses_dynamic_vram(model: ModelPatcher) -> bool:
    """Whether ComfyUI (0.33 and later) manages this model with Dynamic VRAM (comfy-aimdo)."""
    is_dynamic = getattr(model, "is_dynamic", None)  # absent before Dynamic VRAM (0.3.75)
    return bool(is_dynamic is not None and is_dynamic())


def on_fast_disk(model: ModelPatcher) -> bool:
    """Whether ComfyUI reads this model's offloaded weights from its checkpoint file at each step instead of
    pinning them in RAM: ``ModelPatcher.fast_disk`` (0.36 and later), chosen per checkpoint from its disk's link
    (``comfy.storage``) or forced by ``--fast-disk``. Older versions have no such choice."""
    return bool(getattr(model, "fast_disk", False))


def keep_fast_disk(source: ModelPatcher, cloned: ModelPatcher) -> None:
    """``cloned`` keeps ``source``'s fast-disk choice: ComfyUI's own ``clone()`` passes it on where it has one,
    this also where a clone is made another way (a version whose ``clone()`` predates it)."""
    if hasattr(source, "fast_disk"):
        cloned.fast_disk = source.fast_disk


class _Twins:
    """The classic twins of Dynamic VRAM models, kept across prompts: ComfyUI hands a node a new dynamic clone
    at each change before it (a LoRA, another patch node), the same nn.Module under each."""

    def __init__(self) -> None:
        # Per Dynamic VRAM model (its nn.Module, shared by all its clones): its twin, as
        # ``clone(model_override=...)`` takes it, built once, not once per change. The entry goes when the
        # dynamic model does (the loader's output is replaced or freed).
        self.of_model: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()
        # Per twin (its nn.Module): its plain weights as views of their checkpoint file, by name. A real unload
        # points what ComfyUI moved back to the host at them again, so the twin holds no copy of them in RAM.
        self.file_views: weakref.WeakKeyDictionary[torch.nn.Module, dict[str, torch.Tensor]] = (
            weakref.WeakKeyDictionary()
        )


def _twins() -> _Twins:
    return PROCESS_STATE.entry(
        "dynamic vram twins", _Twins, "a twin outlives the prompt and the clone it was built for, as its model does"
    )


def own_classic_path(model: ModelPatcher) -> str:
    """The name of the Dynamic VRAM ``model``'s patcher class where that class makes its classic clone itself
    (overrides ``clone``), else "". ComfyUI-GGUF's ``GGUFModelPatcherDynamic`` (2026) does: its Dynamic VRAM
    weights are GGUF blocks as ``QuantizedTensor``s that only its Dynamic VRAM patcher patches (its classic
    ``GGUFModelPatcher`` leaves a LoRA out of them), and ``clone(disable_dynamic=True)`` reloads the file its
    classic way, the model ComfyUI's hooks and TorchCompileModel run. The pack streams that one. A ``clone`` that
    names no ``disable_dynamic`` only passes its arguments on (to copy attributes of its own): ComfyUI's classic
    reload would copy every weight into memory, so such a class keeps the file-backed twin."""
    clone = type(model).clone
    if not uses_dynamic_vram(model) or clone is ModelPatcher.clone:
        return ""
    return type(model).__name__ if "disable_dynamic" in inspect.signature(clone).parameters else ""


def classic_clone(model: ModelPatcher, node: str) -> ModelPatcher:
    """A clone of ``model`` whose weights ComfyUI loads the classic way (partial load, ``_load_list``)."""
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
        # Tensors of their own over the file's bytes: a Parameter's data is replaced as ComfyUI loads it.
        twins.file_views[twin[0]] = {
            name: tensor.detach() for name, tensor in _plain_tensors(twin[0]) if file_slice(tensor) is not None
        }
    classic = model.clone(disable_dynamic=True, model_override=twin)
    keep_fast_disk(model, classic)
    # clone() hands over the dynamic parent's size, which counts the checkpoint's stored dtypes.
    classic.size = weight_bytes(classic)
    return classic


def _file_backed_twin(model: ModelPatcher, node: str) -> tuple:
    """The model built again by the loader that built it, with Dynamic VRAM's weights (views of the file),
    as the model override of a classic clone."""
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
    built = loader(*arguments, disable_dynamic=False)  # as ComfyUI calls a recipe, with Dynamic VRAM kept
    if which:
        built = built[which[0]]
    # The builder is only a way to the model: it never loads it, and must not unpin or detach anything
    # of the twin as it is deleted (ModelPatcherDynamic.__del__ acts only for patchers in this set).
    getattr(built.model, "dynamic_patchers", set()).discard(id(built))
    return built.get_clone_model_override()


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _recorded_dtypes(
    model: torch.nn.Module, streamed: frozenset[str] = frozenset(), recurse: bool = True
) -> Iterator[tuple[dict, str, torch.Tensor, torch.dtype | None]]:
    """Every parameter and buffer (outside the ``streamed`` modules; the model's own only, unless ``recurse``)
    with its table, name and the dtype ComfyUI recorded for it (``<name>_comfy_model_dtype``); None where it
    recorded none or the tensor is quantized."""
    for module_name, module in model.named_modules() if recurse else (("", model),):
        if streamed and inside(module_name, streamed):
            continue
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


def cast_unloaded_to_recorded_dtypes(model: torch.nn.Module, streamed: frozenset[str] = frozenset()) -> None:
    """Casts, outside the ``streamed`` modules, what ComfyUI's load does not pass through
    ``patch_weight_to_device`` to the dtypes ComfyUI recorded for it: buffers (moved as they are by
    ``module.to``) and the own parameters of a module with parameters below it too (Wan's ``modulation``:
    ComfyUI's classic load leaves them out of its load list, and the model casts them at each use). All
    small; the weights ComfyUI loads go through ``load_in_recorded_dtype``, one at a time."""
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
    """The entry ComfyUI keeps in ``ModelPatcher.backup`` for a patched weight (``patch_weight_to_device``'s
    namedtuple, which its unpatch reads by these fields)."""

    weight: torch.Tensor
    inplace_update: bool


def load_in_recorded_dtype(patcher: ModelPatcher, key: str, device: torch.device) -> None:
    """Moves one weight ComfyUI is loading to ``device`` in the dtype ComfyUI recorded for it, cast there, as
    ModelPatcherDynamic pages a weight in: the cast never makes a copy of the weight in host memory, however
    much of the model ComfyUI loads. A patched weight's backup (what ComfyUI's unpatch puts back) is its view
    of the file, not a copy of it. Quantized tensors (a tensor subclass) are ComfyUI's ops' to handle."""
    module_name, _, name = key.rpartition(".")
    module = comfy.utils.get_attr(patcher.model, module_name) if module_name else patcher.model
    weight = getattr(module, name)
    dtype = recorded_dtype(module, name) or weight.dtype
    if type(weight) not in _PLAIN or (weight.device == device and weight.dtype == dtype):
        return
    if key in patcher.patches and key not in patcher.backup:
        patcher.backup[key] = _Backup(weight.data, False)
    weight.data = weight.data.to(device=device, dtype=dtype)


#: ModelPatcherDynamic loads a layer of ComfyUI's ops of at most this many bytes (as stored) the classic way,
#: patches included; a larger one it patches as it casts it, in the compute dtype.
_LOADED_WHOLE_BYTES = 16 * 1024


def patched_as_cast(model: torch.nn.Module, module_name: str, module: torch.nn.Module) -> bool:
    """Whether a Dynamic VRAM model patches this module's weights as it casts them (``as_loaded``'s
    ``dynamic_vram``): a layer of ComfyUI's ops over 16 KiB as its file stores it (``module_size``, on the
    twin's views of the file where it has them). Others it loads as a classic load does."""
    weight = getattr(module, "weight", None)
    if not hasattr(module, "comfy_cast_weights") or not isinstance(weight, torch.Tensor) or not is_plain(weight):
        return False  # a quantized layer keeps its format's own re-quantization (not compared on a GPU yet)
    views = file_views(model)
    prefix = f"{module_name}." if module_name else ""
    stored = sum(views.get(prefix + name, tensor).nbytes for name, tensor in module.state_dict().items())
    return stored > _LOADED_WHOLE_BYTES


def patch_loaded_as_dynamic_vram(patcher: ModelPatcher, key: str, inplace_update: bool = False) -> bool:
    """Patches one plain weight a Dynamic VRAM model's twin loads (already on the device, in the dtype ComfyUI
    recorded) as that model patches it (``as_loaded``), where ComfyUI's ``patch_weight_to_device`` would
    compute the patch as a classic load does. Returns False, patching nothing, for a weight it leaves to
    ComfyUI: unpatched, quantized, patched through the layer's ``set_`` function, or one the Dynamic VRAM
    model also patches the classic way (``patched_as_cast``)."""
    weight, set_func, _ = get_key_weight(patcher.model, key)
    if key not in patcher.patches or set_func is not None or not is_plain(weight):
        return False
    module_name, _, param = key.rpartition(".")
    module = comfy.utils.get_attr(patcher.model, module_name) if module_name else patcher.model
    if not patched_as_cast(patcher.model, module_name, module):
        return False
    inplace_update = patcher.weight_inplace_update or inplace_update
    if key not in patcher.backup:  # as ComfyUI keeps it, for its unpatch
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
    """Whether every plain tensor of ``module`` is held in the dtype ComfyUI computes it in (none to cast)."""
    return all(dtype in (None, tensor.dtype) for _, _, tensor, dtype in _recorded_dtypes(module, recurse=recurse))


def _plain_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        if type(tensor) in _PLAIN:
            yield name, tensor


def file_views(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """A twin's weights as views of its checkpoint file, by name (empty for any other model)."""
    return _twins().file_views.get(model, {})


def back_to_file(model: torch.nn.Module) -> None:
    """Points a twin's plain weights that ComfyUI moved back to the host (its unload copies what it loaded to
    the offload device) at their views of the file again, as they were before any load: the copies go, and
    the next load casts them again. Weights elsewhere (on the device, a streamed block's host buffer) stay."""
    views = file_views(model)
    for name, tensor in _plain_tensors(model):
        view = views.get(name)
        if view is not None and tensor.device.type == "cpu" and tensor.data_ptr() != view.data_ptr():
            tensor.data = view


def recorded_dtype(module: torch.nn.Module, name: str) -> torch.dtype | None:
    """The dtype ComfyUI computes a module's plain tensor in (the engine's ``dtype_of``)."""
    return getattr(module, f"{name}_comfy_model_dtype", None)


def file_slice(part: torch.Tensor) -> FileSlice | None:
    """Where a tensor's bytes are in its checkpoint file, if it is one whole tensor of a file ComfyUI's Dynamic
    VRAM reader mapped (the engine's ``file_slice``). ``file_ref`` is the file's descriptor (a handle on
    Windows, where the engine copies from the mapping instead)."""
    info = getattr(part.untyped_storage(), "_comfy_tensor_file_slice", None)
    if info is None or info.file_ref is None:
        return None
    if part.storage_offset() != 0 or not part.is_contiguous() or part.numel() * part.element_size() != info.size:
        return None
    return FileSlice(int(info.file_ref), info.offset, info.size, part)
