"""Tiny Flux-like and other text-to-image diffusion models of ComfyUI: ``TinyDiT`` specs (``dit_spec.py``), which
``tiny_dit.py`` builds.

Flux, Flux 2, Chroma, Chroma Radiance, LongCat-Image, HunyuanImage 2.1, SD3 (MMDiT), Qwen-Image, HiDream,
Lumina 2, Z-Image (latent and pixel space), and the two UNets SD 1.5 and SDXL.

Some configs name keys that only newer ComfyUIs take (their detection adds them, their params dataclass may
require them) while older ones reject them; ``_Newer`` drops those where the installed class lacks them.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .dit_spec import TinyDiT
from .dits_video import HUNYUAN_VIDEO


class _Newer(Mapping[str, Any]):
    """A config whose keys in ``_NEWER`` are kept only where this ComfyUI's ``target`` (``module:Name``, the
    model's params dataclass or its class) takes them: read when the model is built, so ComfyUI is imported
    then. A class whose ``__init__`` takes ``**kwargs`` takes every key."""

    def __init__(self, target: str, config: Mapping[str, Any]) -> None:
        self._target = target
        self._config = dict(config)

    def _taken(self) -> set[str] | None:
        module, name = self._target.split(":")
        target = getattr(importlib.import_module(module), name)
        if dataclasses.is_dataclass(target):
            return {field.name for field in dataclasses.fields(target)}
        parameters = inspect.signature(target.__init__).parameters.values()
        if any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
            return None
        return {parameter.name for parameter in parameters}

    def _keys(self) -> list[str]:
        taken = self._taken()
        return [key for key in self._config if key not in _NEWER or taken is None or key in taken]

    def __getitem__(self, key: str) -> Any:
        if key not in self._keys():
            raise KeyError(key)
        return self._config[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys())

    def __len__(self) -> int:
        return len(self._keys())


_FLUX = "comfy.ldm.flux.model:FluxParams"
_CHROMA = "comfy.ldm.chroma.model:ChromaParams"
_RADIANCE = "comfy.ldm.chroma_radiance.model:ChromaRadianceParams"
_HUNYUAN = "comfy.ldm.hunyuan_video.model:HunyuanVideoParams"
_NEXTDIT = "comfy.ldm.lumina.model:NextDiT"
#: Config keys that ComfyUI 0.3.75's model classes (Flux, Chroma, HunyuanVideo params; NextDiT) do not take yet.
_NEWER = (
    "txt_ids_dims",
    "yak_mlp",
    "txt_norm",
    "vec_in_dim",
    "use_x0",
    "use_sequential_txt_ids",
    "meanflow_sum",
    "allow_fp16",
)


def _randn(generator: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(*shape, generator=generator)


def _flux_extra(generator: torch.Generator) -> dict[str, Any]:
    return {"pooled_output": _randn(generator, 1, 32), "guidance": 3.5}


def _pooled(width: int) -> Callable[[torch.Generator], dict[str, Any]]:
    def extra(generator: torch.Generator) -> dict[str, Any]:
        return {"pooled_output": _randn(generator, 1, width)}

    return extra


def _hidream_extra(generator: torch.Generator) -> dict[str, Any]:
    """Pooled CLIP-L + CLIP-G, and Llama 3.1's hidden states (batch, layers, tokens, width)."""
    return {"pooled_output": _randn(generator, 1, 32), "conditioning_llama3": _randn(generator, 1, 3, 5, 32)}


def _sdxl_extra(generator: torch.Generator) -> dict[str, Any]:
    """CLIPTextEncodeSDXL's conditioning: the pooled output and the sizes SDXL embeds into its ``y``."""
    size = {"width": 64, "height": 64, "crop_w": 0, "crop_h": 0, "target_width": 64, "target_height": 64}
    return {"pooled_output": _randn(generator, 1, 32), **size}


def _guidance(generator: torch.Generator) -> dict[str, Any]:
    return {"pooled_output": None, "guidance": 3.5}


def _no_pooled(generator: torch.Generator) -> dict[str, Any]:
    """What a text encoder without a pooled output (T5, an LLM) gives: ``pooled_output`` None."""
    return {"pooled_output": None}


def _llm_mask(generator: torch.Generator) -> dict[str, Any]:
    """An LLM text encoder's conditioning that keeps its attention mask: all of the prompt's 7 tokens."""
    return {"pooled_output": None, "attention_mask": torch.ones(1, 7, dtype=torch.long)}


def _hunyuan_image_extra(generator: torch.Generator) -> dict[str, Any]:
    return {**_llm_mask(generator), "guidance": 3.5}


#: Flux's transformer, tiny: width 64 in two heads of 32 (the rope axes must sum to the head width), two blocks of
#: each kind; Chroma's is the same.
_FLUX_BLOCKS = {
    "context_in_dim": 32,
    "hidden_size": 64,
    "num_heads": 2,
    "depth": 2,
    "depth_single_blocks": 2,
    "mlp_ratio": 4.0,
    "axes_dim": [8, 12, 12],
    "theta": 10000,
    "patch_size": 2,
    "qkv_bias": True,
    "txt_ids_dims": [],
}

#: Flux's config; Flux 2 and LongCat-Image (``FluxParams`` too) start from it.
_FLUX_CONFIG = {
    "image_model": "flux",
    "in_channels": 16,
    "out_channels": 16,
    "vec_in_dim": 32,
    **_FLUX_BLOCKS,
    "guidance_embed": True,
    "yak_mlp": False,
    "txt_norm": False,
}

_CHROMA_CONFIG = {
    "image_model": "chroma",
    "in_channels": 64,
    "out_channels": 64,
    "vec_in_dim": None,
    **_FLUX_BLOCKS,
    "in_dim": 64,
    "out_dim": 64,
    "hidden_dim": 64,
    "n_layers": 2,
}

_LUMINA2_CONFIG = {
    "image_model": "lumina2",
    "patch_size": 2,
    "in_channels": 16,
    # Width 32: its SwiGLU widths round up to multiples of 256.
    "dim": 32,
    "cap_feat_dim": 32,
    "n_layers": 2,
    "qk_norm": True,
    # Grouped-query attention, as the real 24 heads over 8.
    "n_heads": 2,
    "n_kv_heads": 1,
    "axes_dims": [4, 6, 6],
    "axes_lens": [300, 512, 512],
    "rope_theta": 10000.0,
    "ffn_dim_multiplier": 4.0,
}

#: Z-Image is a Lumina 2 model (NextDiT) with Z-Image's modulation.
_ZIMAGE_CONFIG = {
    **_LUMINA2_CONFIG,
    # Z-Image's modulation takes a 256-wide time embedding as min(dim, 256) wide: dim cannot be below 256.
    # So: the real head layout (heads of 128, rope axes 32/48/48), two of them, and a small feed-forward.
    "dim": 256,
    "n_kv_heads": 2,
    "axes_dims": [32, 48, 48],
    "axes_lens": [1536, 512, 512],
    "rope_theta": 256.0,
    "ffn_dim_multiplier": 1.0,
    "z_image_modulation": True,
    "time_scale": 1000.0,
    # Detection's test (std of a late ffn_norm1 weight below 0.42) holds for weights near 1.
    "allow_fp16": True,
    "pad_tokens_multiple": 32,
}

#: What detection gives for an SD-style UNet (``detect_unet_config``), two levels of 32 and 64 channels, one
#: res block and one transformer layer each. The head counts come from the model config's ``unet_extra_config``
#: (SD 1.5: 8 heads; SDXL: heads of 64 channels, so one at 64 channels).
_UNET_CONFIG = {
    "use_checkpoint": False,
    "image_size": 32,
    "use_spatial_transformer": True,
    "legacy": False,
    "in_channels": 4,
    "out_channels": 4,
    "model_channels": 32,
    "num_res_blocks": [1, 1],
    "channel_mult": [1, 2],
    "transformer_depth_middle": 1,
    "context_dim": 32,
    "use_temporal_resblock": False,
    "use_temporal_attention": False,
}

SPECS: list[TinyDiT] = [
    TinyDiT("Flux", "Flux", _Newer(_FLUX, _FLUX_CONFIG), (1, 16, 8, 8), (7, 32), _flux_extra),
    TinyDiT(
        "Flux 2",
        "Flux2",
        _Newer(
            _FLUX,
            {
                **_FLUX_CONFIG,
                "image_model": "flux2",
                "in_channels": 128,
                "out_channels": 128,
                "vec_in_dim": None,
                "mlp_ratio": 3.0,
                "axes_dim": [8, 8, 8, 8],
                "theta": 2000,
                "patch_size": 1,
                "qkv_bias": False,
                "global_modulation": True,
                "mlp_silu_act": True,
                "ops_bias": False,
                "default_ref_method": "index",
                "ref_index_scale": 10.0,
                "txt_ids_dims": [3],
            },
        ),
        (1, 128, 4, 4),
        (7, 32),
        _guidance,
    ),
    TinyDiT("Chroma", "Chroma", _Newer(_CHROMA, _CHROMA_CONFIG), (1, 16, 8, 8), (7, 32), _no_pooled),
    TinyDiT(
        "Chroma Radiance",
        "ChromaRadiance",
        _Newer(
            _RADIANCE,
            {
                **_CHROMA_CONFIG,
                "image_model": "chroma_radiance",
                "in_channels": 3,
                "out_channels": 3,
                "patch_size": 16,
                "nerf_hidden_size": 16,
                "nerf_mlp_ratio": 2,
                "nerf_depth": 2,
                "nerf_max_freqs": 4,
                "nerf_tile_size": 512,
                "nerf_final_head_type": "conv",
                "nerf_embedder_dtype": torch.float32,
                "use_x0": False,
                "use_sequential_txt_ids": False,
            },
        ),
        (1, 3, 32, 32),
        (7, 32),
        _no_pooled,
    ),
    TinyDiT(
        "LongCat-Image",
        "LongCatImage",
        _Newer(
            _FLUX,
            {
                **_FLUX_CONFIG,
                "vec_in_dim": None,
                # 3584 (Qwen2.5-VL 7B) is what tells LongCat-Image from Flux in detection: kept.
                "context_in_dim": 3584,
                "guidance_embed": False,
                "txt_ids_dims": [1, 2],
            },
        ),
        (1, 16, 8, 8),
        (7, 3584),
        _no_pooled,
    ),
    TinyDiT(
        "HunyuanImage 2.1",
        "HunyuanImage21",
        _Newer(
            _HUNYUAN,
            {
                **HUNYUAN_VIDEO,
                "in_channels": 64,
                "out_channels": 64,
                "patch_size": [1, 1],
                "vec_in_dim": None,
                "axes_dim": [16, 16],
                "context_in_dim": 32,
                "mlp_ratio": 4.0,
            },
        ),
        (1, 64, 4, 4),
        (7, 32),
        _hunyuan_image_extra,
    ),
    TinyDiT(
        "Stable Diffusion 3.5 Medium",
        "SD3",
        {
            "in_channels": 16,
            "patch_size": 2,
            "out_channels": 16,
            # MMDiT's width is 64 * depth with depth heads of 64.
            "depth": 3,
            "input_size": None,
            "adm_in_channels": 32,
            "context_embedder_config": {
                "target": "torch.nn.Linear",
                "params": {"in_features": 32, "out_features": 192},
            },
            # Detection sets num_patches and pos_embed_max_size (a learned pos_embed buffer), but
            # ``tiny_dit.randomize`` fills parameters only and that buffer is torch.empty: without them
            # MMDiT computes its sin-cos position embedding instead.
            "num_patches": None,
            "pos_embed_max_size": None,
            "qk_norm": "rms",
            "pos_embed_scaling_factor": None,
            "x_block_self_attn_layers": [0],
        },
        (1, 16, 8, 8),
        (7, 32),
        _pooled(32),
    ),
    TinyDiT(
        "Qwen-Image",
        "QwenImage",
        {
            "image_model": "qwen_image",
            "in_channels": 64,
            "out_channels": 16,
            "num_layers": 3,
            "attention_head_dim": 32,
            "num_attention_heads": 2,
            "joint_attention_dim": 32,
            "pooled_projection_dim": 32,
            "axes_dims_rope": (8, 12, 12),
        },
        (1, 16, 1, 8, 8),
        (7, 32),
        _no_pooled,
    ),
    TinyDiT(
        "HiDream-I1",
        "HiDream",
        {
            "image_model": "hidream",
            "patch_size": 2,
            "in_channels": 16,
            "out_channels": 16,
            "num_layers": 2,
            "num_single_layers": 2,
            # Width 32: its SwiGLU widths round up to multiples of 256, which the experts repeat.
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "axes_dims_rope": [8, 4, 4],
            "caption_channels": [32, 32],
            "text_emb_dim": 32,
            "num_routed_experts": 4,
            "num_activated_experts": 2,
            "max_resolution": [128, 128],
            # Which Llama hidden state each block reads (the real 48 repeat its last layer too).
            "llama_layers": [0, 1, 2, 2],
        },
        (1, 16, 8, 8),
        (7, 32),
        _hidream_extra,
    ),
    TinyDiT("Lumina Image 2.0", "Lumina2", _LUMINA2_CONFIG, (1, 16, 8, 8), (7, 32), _llm_mask),
    TinyDiT("Z-Image", "ZImage", _Newer(_NEXTDIT, _ZIMAGE_CONFIG), (1, 16, 8, 8), (7, 32), _llm_mask),
    TinyDiT(
        "Z-Image (pixel space)",
        "ZImagePixelSpace",
        {
            **_ZIMAGE_CONFIG,
            "image_model": "zimage_pixel",
            "patch_size": 16,
            "in_channels": 3,
            "decoder_in_channels": 16 * 16 * 3,
            "decoder_hidden_size": 32,
            "decoder_num_res_blocks": 2,
            "decoder_max_freqs": 4,
        },
        (1, 3, 32, 32),
        (7, 32),
        _llm_mask,
    ),
    TinyDiT(
        "Stable Diffusion 1.5",
        "SD15",
        {
            **_UNET_CONFIG,
            "adm_in_channels": None,
            "transformer_depth": [1, 1],
            "transformer_depth_output": [1, 1, 1, 1],
            "use_linear_in_transformer": False,
        },
        (1, 4, 8, 8),
        (7, 32),
        _pooled(32),
    ),
    TinyDiT(
        "Stable Diffusion XL",
        "SDXL",
        {
            **_UNET_CONFIG,
            # The pooled CLIP-G output (32 wide here) and six 256-wide size embeddings.
            "num_classes": "sequential",
            "adm_in_channels": 32 + 6 * 256,
            # As SDXL: no attention at the first level.
            "transformer_depth": [0, 1],
            "transformer_depth_output": [0, 0, 1, 1],
            "use_linear_in_transformer": True,
        },
        (1, 4, 8, 8),
        (7, 32),
        _sdxl_extra,
    ),
]
