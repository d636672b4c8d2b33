"""ComfyUI 0.33's Dynamic VRAM as it runs on an NVIDIA GPU, reproduced on the CPU for in-process tests
(the fixtures ``dynamic_vram`` and ``stored_wan`` in tests/conftest.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import save_file

from .dit_spec import TinyDiT

#: Checkpoints as users store them, and the dtypes ComfyUI computes in on a GPU (fp16 for Wan on recent
#: NVIDIA cards, bf16 elsewhere).
STORED = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE = {"fp16": torch.float16, "bf16": torch.bfloat16}


class DynamicVram:
    """ComfyUI 0.33 started with Dynamic VRAM, as ``main.py`` sets it up on an NVIDIA GPU, on the CPU.

    * The process-wide ``comfy.memory_management.aimdo_enabled`` is on, so ``comfy.ops`` Linear and
      Embedding take checkpoint tensors as stored (no cast to the model's dtype) for every model loaded
      from then on, the classic twins the nodes make included.
    * The model computes natively in half precision, as on a GPU: no manual cast (on the CPU ComfyUI
      would cast every weight to fp32 per layer, which hides a dtype mix).
    * Files are read by ComfyUI's Dynamic VRAM reader (``comfy.utils.load_safetensors``, on comfy-aimdo's
      mapping, which needs no GPU): every weight a view of the file, its storage carrying the file slice.
    * ComfyUI's loaders build ``CoreModelPatcher``, which ``main.py`` makes ``ModelPatcherDynamic``: the
      weights are assigned as read (``assign=True``), not copied into the model.
    * The device has ``room_for_weights`` bytes for weights (``maximum_vram_for_weights``), 1 MiB unless
      a test says otherwise.
    * The dynamic MODEL is ComfyUI's own load of the file, whose patcher answers ``is_dynamic()``: on a
      CPU load device ComfyUI hands back a plain ModelPatcher (``ModelPatcherDynamic.__new__``).
    """

    def __init__(self, comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
        import comfy_aimdo.control
        from comfy import memory_management, model_patcher
        from comfy.model_patcher import ModelPatcher

        self.comfy = comfy
        self.monkeypatch = monkeypatch
        self.flag = memory_management
        assert comfy_aimdo.control.init("cuda"), "comfy-aimdo's file reader did not load"
        monkeypatch.setattr(comfy.mm, "unet_manual_cast", lambda *args, **kwargs: None)
        monkeypatch.setattr(self.flag, "aimdo_enabled", True)
        # A GPU smaller than the tiny models, so the nodes stream them (a model that fits is left to
        # Dynamic VRAM, see test_a_node_steps_aside_where_dynamic_vram_keeps_the_model_resident).
        self.room_for_weights = 2**20
        monkeypatch.setattr(comfy.mm, "maximum_vram_for_weights", lambda device=None: self.room_for_weights)

        class DynamicOnCPU(ModelPatcher):
            def is_dynamic(self) -> bool:
                return True

        self.patcher_class = DynamicOnCPU
        self.patchers = model_patcher
        monkeypatch.setattr(model_patcher, "CoreModelPatcher", DynamicOnCPU)

    @contextlib.contextmanager
    def aimdo(self, enabled: bool) -> Iterator[None]:
        """Dynamic VRAM on or off (``--disable-dynamic-vram``), the flag and the patcher class together."""
        before = self.flag.aimdo_enabled, self.patchers.CoreModelPatcher
        self.flag.aimdo_enabled = enabled
        self.patchers.CoreModelPatcher = self.patcher_class if enabled else self.patchers.ModelPatcher
        try:
            yield
        finally:
            self.flag.aimdo_enabled, self.patchers.CoreModelPatcher = before

    def load(self, path: Path, dtype: torch.dtype):
        """The dynamic MODEL: ComfyUI's Load Diffusion Model with the flag on."""
        model = self.comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype})
        model.__class__ = self.patcher_class
        return model

    def load_tiny_dit(self, spec: TinyDiT, folder: Path):
        """The dynamic MODEL of ``spec``'s tiny model (``harness.tiny_dit``, float32), written to a file in ``folder``
        and loaded from it. ComfyUI's detection cannot tell a tiny config from its keys where the class fixes some
        widths, so while the test runs it is told the spec's config for that file's keys, the node's reload of the
        file included."""
        from comfy import model_detection

        from . import tiny_dit

        with self.aimdo(False):  # built the classic way: under the flag ComfyUI's layers wait for a state dict
            built = tiny_dit.build(spec).model.diffusion_model
        path = folder / f"{spec.name}.safetensors"
        save_file({key: tensor.contiguous() for key, tensor in built.state_dict().items()}, str(path))
        keys, detect = frozenset(built.state_dict()), model_detection.model_config_from_unet

        def spec_config(state_dict, *args, **kwargs):
            return tiny_dit.model_config(spec) if frozenset(state_dict) == keys else detect(state_dict, *args, **kwargs)

        self.monkeypatch.setattr(model_detection, "model_config_from_unet", spec_config)
        return self.load(path, torch.float32)

    def load_classic(self, path: Path, dtype: torch.dtype):
        """The same file loaded as with --disable-dynamic-vram: the reference."""
        with self.aimdo(False):
            return self.comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype})

    def load_patched_as_cast(
        self, path: Path, dtype: torch.dtype, lora: dict[str, torch.Tensor], strength: float = 1.0
    ):
        """The file with ``lora`` at ``strength`` patched into its weights as ``ModelPatcherDynamic`` patches them
        on a GPU, with ComfyUI's own functions: a layer of ComfyUI's ops over 16 KiB as the file stores it (its
        size on the Dynamic VRAM model, whose weights are the file's views) gets its ``LowVramPatch`` applied to
        the weight cast to the compute dtype (``comfy.ops``' ``post_cast``), then rounded to the dtype its VRAM
        keeps it in (``dtype``); any other weight is patched as a classic load does (``patch_weight_to_device``).
        Stored as computed, no patches left: the reference of a node on the Dynamic VRAM MODEL with that LoRA."""
        import comfy.float
        import comfy.model_patcher
        import comfy.utils

        as_stored = self.load(path, dtype).model
        model = self.comfy.sd.load_lora_for_models(self.load_classic(path, dtype), None, lora, strength, 0)[0]
        patched = {}
        for key in model.patches:
            module_name, _, _ = key.rpartition(".")
            module = comfy.utils.get_attr(model.model, module_name)
            weight = comfy.utils.get_attr(model.model, key)
            stored_size = self.comfy.mm.module_size(comfy.utils.get_attr(as_stored, module_name))
            plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
            if plain and hasattr(module, "comfy_cast_weights") and stored_size > 16 * 1024:
                cast = comfy.model_patcher.LowVramPatch(key, model.patches)(weight.to(dtype, copy=True))
                seed = comfy.utils.string_to_seed(module_name)  # post_cast's seed: the layer's seed_key
                patched[key] = comfy.float.stochastic_rounding(cast, weight.dtype, seed=seed)
            else:
                patched[key] = model.patch_weight_to_device(key, return_weight=True)
        model.patches.clear()
        for key, weight in patched.items():
            comfy.utils.set_attr_param(model.model, key, weight)
        return model
