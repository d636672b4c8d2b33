"""Tiny image diffusion transformers of ComfyUI, as ``TinyDiT`` specs (``dit_spec.py``) that ``tiny_dit.py``
builds: AuraFlow, PixArt Sigma, Hunyuan-DiT, Lens, PixelDiT, OmniGen2, Ideogram 4, Krea 2, Mage-Flow, ERNIE-Image,
Boogu, PiD and Stable Cascade (stages C and B).

Each config is the one ComfyUI's detection gives for the model (``comfy/model_detection.py``), the widths shrunk
and the keys detection leaves at the class default (head widths, rope axes, text width) set so that they fit.
"""

from __future__ import annotations

from typing import Any

import torch

from .dit_spec import TinyDiT

TOKENS = 7
#: The latent of Flux 2's VAE (``latent_formats.Flux2``, 128 channels), which Lens, Ideogram 4, Mage-Flow and
#: ERNIE-Image take.
_FLUX2_LATENT = (1, 128, 8, 8)


def _mask(tokens: int = TOKENS) -> torch.Tensor:
    """The text encoder's attention mask for an unpadded prompt, as ``SDClipModel`` returns it."""
    return torch.ones(1, tokens, dtype=torch.long)


def _hunyuan_dit(generator: torch.Generator) -> dict[str, Any]:
    # HyditModel: CLIP tokens (context) plus mT5 tokens, each with its mask.
    return {
        "attention_mask": _mask(8),
        "conditioning_mt5xl": torch.randn(1, 8, 32, generator=generator),
        "attention_mask_mt5xl": _mask(8),
    }


def _attention_mask(generator: torch.Generator) -> dict[str, Any]:
    return {"attention_mask": _mask()}


def _lens(generator: torch.Generator) -> dict[str, Any]:
    return {"attention_mask": _mask(), "num_layers_stacked": 2}


def _pixart_null_caption(diffusion_model: torch.nn.Module) -> None:
    """``y_embedder.y_embedding`` (the null caption, a checkpoint buffer): PixArt's CaptionEmbedder draws it from the
    global RNG, so each build would get another; seeded values instead."""
    buffer = diffusion_model.y_embedder.y_embedding
    with torch.no_grad():
        buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(0)) / buffer.shape[-1] ** 0.5)


def _pid(generator: torch.Generator) -> dict[str, Any]:
    # PiDConditioning: the latent to decode (a Flux/SD3 latent, 16 channels, 1/32 of the image side: 8x VAE times 4x
    # upscale) and the degradation level; PidNet raises without the latent.
    return {
        "attention_mask": _mask(),
        "lq_latent": torch.randn(1, 16, 1, 1, generator=generator),
        "degrade_sigma": torch.tensor([0.1]),
    }


def _cascade_c(generator: torch.Generator) -> dict[str, Any]:
    # CLIP-G's pooled output (extra_conds reads the key); no unCLIP image: the model gets zeros of 768.
    return {"pooled_output": torch.randn(1, 24, generator=generator)}


def _cascade_b(generator: torch.Generator) -> dict[str, Any]:
    # Stage C's output (StableCascade_StageB_Conditioning puts it in the conditioning): 16 channels at 1/42 of the
    # image side; stage B interpolates it to its grid.
    return {
        "pooled_output": torch.randn(1, 24, generator=generator),
        "stable_cascade_prior": torch.randn(1, 16, 2, 2, generator=generator),
    }


#: PixelDiT's config; PiD's body starts from it.
_PIXELDIT_CONFIG = {
    "image_model": "pixeldit_t2i",
    "in_channels": 3,
    "num_groups": 2,
    "hidden_size": 32,
    "pixel_hidden_size": 4,
    "pixel_attn_hidden_size": 32,
    "pixel_num_groups": 2,
    "patch_depth": 2,
    "pixel_depth": 2,
    "patch_size": 16,
    "txt_embed_dim": 24,
    "txt_max_length": 16,
}

SPECS: list[TinyDiT] = [
    TinyDiT(
        "AuraFlow",
        "AuraFlow",
        {
            "max_seq": 16,
            "cond_seq_dim": 24,
            "n_double_layers": 2,
            "n_layers": 4,
            "dim": 32,
            "n_heads": 2,
            "global_conddim": 32,
            "patch_size": 2,
            "in_channels": 4,
            "out_channels": 4,
        },
        (1, 4, 8, 8),
        (TOKENS, 24),
    ),
    TinyDiT(
        "PixArt Sigma",
        "PixArtSigma",
        {
            "image_model": "pixart_sigma",
            "num_heads": 2,
            "patch_size": 2,
            "hidden_size": 32,
            "in_channels": 4,
            "depth": 3,
            "model_max_length": 8,
            "input_size": 64,
            "pe_interpolation": 1,
            "micro_condition": False,
            "caption_channels": 24,
        },
        # PixArtMS.forward_orig takes its positional-embedding base size from round((H + W) / 128): under 33 latent
        # pixels a side it is 0 and the embedding divides by it (as in ComfyUI, images under ~264 px fail).
        (1, 4, 36, 36),
        (TOKENS, 24),
        fill=_pixart_null_caption,
    ),
    TinyDiT(
        "Hunyuan-DiT",
        "HunyuanDiT",
        {
            # v1.2 (no size or style condition): the pooler's fixed 1024-wide output feeds a Linear to 4 x hidden,
            # which at a width of 32 held 75 % of the weights; at 128 the blocks hold most, as at full size.
            "image_model": "hydit",
            "depth": 4,  # the least with a long skip: block 3 takes block 0's output
            "hidden_size": 128,
            "num_heads": 2,
            "mlp_ratio": 4.0,
            "patch_size": 2,
            "in_channels": 4,
            "text_states_dim": 24,
            "text_states_dim_t5": 32,
            "text_len": 8,  # the CLIP and mT5 token counts the conditioning must have (at least)
            "text_len_t5": 8,
        },
        (1, 4, 8, 8),
        (8, 24),
        _hunyuan_dit,
    ),
    TinyDiT(
        "Lens",
        "Lens",
        {
            "image_model": "lens",
            "in_channels": 128,
            "out_channels": 32,
            "num_layers": 3,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "axes_dims_rope": (4, 6, 6),
            "enc_hidden_dim": 16,
            "multi_layer_encoder_feature": True,
            "selected_layer_index": (0, 1),
        },
        _FLUX2_LATENT,
        (TOKENS, 32),
        _lens,
    ),
    TinyDiT(
        "PixelDiT",
        "PixelDiTT2I",
        _PIXELDIT_CONFIG,
        (1, 3, 32, 32),
        (TOKENS, 24),
        _attention_mask,
    ),
    TinyDiT(
        "OmniGen2",
        "Omnigen2",
        {
            "image_model": "omnigen2",
            "axes_dim_rope": [4, 6, 6],
            "axes_lens": [1024, 1664, 1664],
            "ffn_dim_multiplier": None,
            "hidden_size": 32,
            "in_channels": 16,
            "multiple_of": 32,
            "norm_eps": 1e-05,
            "num_attention_heads": 2,
            "num_kv_heads": 1,
            "num_layers": 2,
            "num_refiner_layers": 2,
            "out_channels": None,
            "patch_size": 2,
            "text_feat_dim": 24,
            "timestep_scale": 1000.0,
        },
        (1, 16, 8, 8),
        (TOKENS, 24),
        _attention_mask,
    ),
    # Ideogram4.unet_extra_config fixes the full widths (18 heads of 256, ...); tiny_dit.model_config lets these win.
    TinyDiT(
        "Ideogram 4",
        "Ideogram4",
        {
            "image_model": "ideogram4",
            "in_channels": 128,
            "num_layers": 3,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "intermediate_size": 64,
            "adaln_dim": 32,
            "llm_features_dim": 24,
            "rope_theta": 5000000,
            "mrope_section": [4, 2, 2],
            "norm_eps": 1e-5,
        },
        _FLUX2_LATENT,
        (TOKENS, 24),
    ),
    TinyDiT(
        "Krea 2",
        "Krea2",
        {
            "image_model": "krea2",
            "features": 32,
            "channels": 16,
            "patch": 2,
            "layers": 3,
            "heads": 2,
            "kvheads": 1,
            "txtlayers": 3,
            "txtdim": 16,
            "txtheads": 2,
            "txtkvheads": 2,
        },
        (1, 16, 8, 8),
        (TOKENS, 48),
    ),
    TinyDiT(
        "Mage-Flow",
        "MageFlow",
        {
            "image_model": "mage_flow",
            "in_channels": 128,
            "num_layers": 3,
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "joint_attention_dim": 24,
            "axes_dims_rope": (4, 6, 6),
        },
        _FLUX2_LATENT,
        (TOKENS, 24),
    ),
    TinyDiT(
        "ERNIE-Image",
        "ErnieImage",
        {
            "image_model": "ernie",
            "hidden_size": 32,
            "num_attention_heads": 2,
            "num_layers": 3,
            "ffn_hidden_size": 64,
            "in_channels": 128,
            "out_channels": 128,
            "patch_size": 1,
            "text_in_dim": 24,
            "rope_axes_dim": (4, 6, 6),
        },
        _FLUX2_LATENT,
        (TOKENS, 24),
        _attention_mask,
    ),
    TinyDiT(
        "Boogu",
        "Boogu",
        {
            # Detection sets the widths and counts below; the heads, rope axes and MLP rounding are class defaults,
            # set here so that they fit the tiny width (as in OmniGen2, which Boogu extends).
            "image_model": "boogu",
            "hidden_size": 32,
            "num_layers": 3,
            "num_double_stream_layers": 3,
            "num_refiner_layers": 3,
            "instruction_feat_dim": 24,
            "num_attention_heads": 2,
            "num_kv_heads": 1,
            "multiple_of": 32,
            "axes_dim_rope": [4, 6, 6],
            "patch_size": 2,
            "in_channels": 16,
        },
        (1, 16, 8, 8),
        (TOKENS, 24),
        _attention_mask,
    ),
    TinyDiT(
        "PiD",
        "PiD",
        {
            # PixelDiT's body with PiD v1's low-quality latent branch (16 latent channels).
            **_PIXELDIT_CONFIG,
            "image_model": "pid",
            "patch_depth": 4,
            "pixel_depth": 3,
            "lq_hidden_dim": 8,
            "lq_interval": 2,  # a gate before blocks 0 and 2, as the full model's 7 gates for 14 blocks
            "lq_latent_channels": 16,
            "latent_spatial_down_factor": 8,
        },
        (1, 3, 32, 32),
        (TOKENS, 24),
        _pid,
    ),
    TinyDiT(
        "Stable Cascade (stage C)",
        "Stable_Cascade_C",
        {
            # extra_conds gives the model a 768-wide CLIP image embedding (zeros without unCLIP), so clip_img_mapper
            # takes 768 x c_cond * c_clip_seq whatever the config: at c_hidden 32 it held 46 % of the weights, about
            # as much as the blocks; at 64 the blocks hold most, as at full size.
            "stable_cascade_stage": "c",
            "c_in": 16,
            "c_out": 16,
            "c_cond": 32,
            "c_hidden": [64, 64],
            "nhead": [2, 2],
            "blocks": [[1, 2], [2, 1]],
            "block_repeat": [[1, 1], [1, 1]],
            "level_config": ["CTA", "CTA"],
            "c_clip_text": 24,
            "c_clip_text_pooled": 24,
            "c_r": 16,
        },
        (1, 16, 8, 8),
        (TOKENS, 24),
        _cascade_c,
    ),
    TinyDiT(
        "Stable Cascade (stage B)",
        "Stable_Cascade_B",
        {
            "stable_cascade_stage": "b",
            "c_in": 4,
            "c_out": 4,
            "c_cond": 32,
            "c_hidden": [16, 16, 32, 32],
            "nhead": [-1, -1, 2, 2],
            "blocks": [[2, 2, 1, 1], [1, 1, 2, 2]],  # 3 or 4 blocks a level ("CT" levels: 2 each of C and T)
            "block_repeat": [[1, 1, 1, 1], [3, 3, 2, 2]],
            "level_config": ["CT", "CT", "CTA", "CTA"],
            "c_clip": 24,
            "c_r": 16,
        },
        (1, 4, 16, 16),
        (TOKENS, 24),
        _cascade_b,
    ),
]
