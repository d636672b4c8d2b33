"""Tiny video diffusion transformers of ComfyUI, as ``TinyDiT`` specs (``dit_spec.py``) that ``tiny_dit.py``
builds: Wan, HunyuanVideo, LTX, Mochi, CogVideoX."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from .dit_spec import TinyDiT


class _HunyuanConfig(Mapping[str, Any]):
    """A HunyuanVideo config less the keys this ComfyUI's ``HunyuanVideoParams`` lacks: 0.33 requires
    ``meanflow_sum``, which 0.3.75 rejects (its detection does not set it either). Resolved on first use, so
    that importing this file needs no ComfyUI."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = dict(config)
        self._resolved: dict[str, Any] | None = None

    def _get(self) -> dict[str, Any]:
        if self._resolved is None:
            from comfy.ldm.hunyuan_video.model import HunyuanVideoParams

            known = {f.name for f in dataclasses.fields(HunyuanVideoParams)} | {"image_model"}
            self._resolved = {key: value for key, value in self._config.items() if key in known}
        return self._resolved

    def __getitem__(self, key: str) -> Any:
        return self._get()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._get())


def _mask(tokens: int) -> torch.Tensor:
    """A T5 tokenizer's attention mask for ``tokens`` real tokens (what its text encoders put in a conditioning)."""
    return torch.ones(1, tokens, dtype=torch.long)


def _hunyuan_video_extra(generator: torch.Generator) -> dict[str, Any]:
    # CLIP-L pooled output (encode_adm reads it, vector_in takes 768); guidance for the distilled guidance_in.
    return {"pooled_output": torch.randn(1, 768, generator=generator), "guidance": 6.0}


def _hunyuan_video_15_extra(generator: torch.Generator) -> dict[str, Any]:
    # The Qwen 2.5 VL encoder has no pooled output: None (encode_adm reads the key; no vector_in).
    return {"pooled_output": None}


def _ltxv_extra(generator: torch.Generator) -> dict[str, Any]:
    # LTXVModel.forward takes attention_mask positionally: the T5 encoder always gives one.
    return {"attention_mask": _mask(7)}


#: LTX-2's packed audio+video latent: the sampler sees both flattened into one (1, 1, N) tensor (as
#: ``comfy.utils.pack_latents`` makes of a NestedTensor latent) and the model unpacks it by ``latent_shapes``.
_LTXAV_VIDEO = (1, 128, 2, 4, 4)
_LTXAV_AUDIO = (1, 8, 5, 16)  # 8 audio channels x 16 mel bins, fixed by LTXAVModel: audio_in_channels 128
_LTXAV_PACKED = (1, 1, math.prod(_LTXAV_VIDEO[1:]) + math.prod(_LTXAV_AUDIO[1:]))


def _ltxav_extra(generator: torch.Generator) -> dict[str, Any]:
    # The Gemma encoder gives unprocessed features of width caption_channels (and no attention mask), which LTXAV's
    # extra_conds runs through the model's text connectors; latent_shapes in the conditioning overrides the
    # sampler's (a single packed tensor).
    return {
        "unprocessed_ltxav_embeds": True,
        "latent_shapes": [torch.Size(_LTXAV_VIDEO), torch.Size(_LTXAV_AUDIO)],
    }


def _mochi_extra(generator: torch.Generator) -> dict[str, Any]:
    # AsymmDiTJoint.forward takes attention_mask positionally; extra_conds turns it into num_tokens too.
    return {"attention_mask": _mask(7)}


#: HunyuanVideo's config, tiny; HunyuanVideo 1.5 and HunyuanImage 2.1 (``dits_flux_like.py``, same params class)
#: start from it.
HUNYUAN_VIDEO = {
    "image_model": "hunyuan_video",
    "in_channels": 16,
    "out_channels": 16,
    "patch_size": [1, 2, 2],
    "vec_in_dim": 768,
    "axes_dim": [8, 12, 12],  # sums to the head dim, 64 / 2 heads
    "meanflow": False,
    "context_in_dim": 24,
    "hidden_size": 64,
    "mlp_ratio": 2.0,
    "num_heads": 2,
    "depth": 2,
    "depth_single_blocks": 2,
    "theta": 256,
    "qkv_bias": True,
    # The glyph (ByT5) mapper is 1472 -> 2048 -> 2048 wide whatever the model's width: left out.
    "byt5": False,
    "guidance_embed": True,
    "use_cond_type_embedding": False,
    "vision_in_dim": None,
    "meanflow_sum": False,
}

#: Tiny Wan 2.1 widths: head dim 16, whose rope axes are 8 + 4 + 4.
_WAN_WIDTHS = {
    "image_model": "wan2.1",
    "dim": 32,
    "ffn_dim": 64,
    "freq_dim": 32,
    "text_dim": 24,
    "num_heads": 2,
    "num_layers": 3,
    "in_dim": 16,
    "out_dim": 16,
}
#: The Wan 2.1 config detection gives (``model_detection`` adds patch size, window, qk and cross-attention norms) at
#: ``_WAN_WIDTHS``; the Wan variants of ``dits_wan_variants.py`` start from it too.
WAN_21 = {
    **_WAN_WIDTHS,
    "patch_size": (1, 2, 2),
    "window_size": (-1, -1),
    "qk_norm": True,
    "cross_attn_norm": True,
    "eps": 1e-6,
}

SPECS: list[TinyDiT] = [
    # Only the widths: the keys detection adds are WanModel's defaults.
    TinyDiT("Wan 2.1 T2V", "WAN21_T2V", {**_WAN_WIDTHS, "model_type": "t2v"}, (1, 16, 1, 8, 8), (7, 24)),
    # VACE: vace_blocks run beside blocks 0 and 2 (vace_layers_mapping); with no vace_frames in the conditioning
    # WAN21_Vace's extra_conds gives zero frames (32 channels) and a ones mask (64), hence vace_in_dim 96.
    TinyDiT(
        "Wan 2.1 VACE",
        "WAN21_Vace",
        {**WAN_21, "model_type": "vace", "num_layers": 4, "vace_in_dim": 96, "vace_layers": 2},
        (1, 16, 1, 8, 8),
        (7, 24),
    ),
    # Wan 2.2 TI2V 5B: 48-channel latent (Wan 2.2 VAE), WAN22 model_base (per-frame timesteps when a denoise mask
    # is given); text-to-video: no concat channels.
    TinyDiT(
        "Wan 2.2 TI2V 5B",
        "WAN22_T2V",
        {**WAN_21, "model_type": "t2v", "in_dim": 48, "out_dim": 48},
        (1, 48, 1, 8, 8),
        (7, 24),
    ),
    TinyDiT(
        "HunyuanVideo",
        "HunyuanVideo",
        _HunyuanConfig(HUNYUAN_VIDEO),
        (1, 16, 1, 8, 8),
        (7, 24),
        _hunyuan_video_extra,
    ),
    # HunyuanVideo 1.5: 32-channel latent; in_channels 65 = noise + image latent + mask (zeros for text-to-video,
    # from concat_cond), 54 double blocks and no single blocks in the real model; byt5_in (fixed 1472 -> 2048
    # widths, 7 M parameters) is left out; vision_in is shrunk (1152 in the real model).
    TinyDiT(
        "HunyuanVideo 1.5",
        "HunyuanVideo15",
        _HunyuanConfig(
            {
                **HUNYUAN_VIDEO,
                "in_channels": 65,
                "out_channels": 32,
                "vec_in_dim": None,
                "guidance_embed": False,
                "depth": 3,
                "depth_single_blocks": 0,
                "use_cond_type_embedding": True,
                "vision_in_dim": 16,
                "meanflow_sum": True,
            }
        ),
        (1, 32, 1, 8, 8),
        (7, 24),
        _hunyuan_video_15_extra,
    ),
    TinyDiT(
        "LTX-Video",
        "LTXV",
        {
            "image_model": "ltxv",
            "num_layers": 3,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "cross_attention_dim": 32,
            "caption_channels": 24,
            "in_channels": 128,
            "use_keyframes_abs_pos_embedding": False,
        },
        (1, 128, 2, 4, 4),
        (7, 24),
        _ltxv_extra,
    ),
    # LTX-2 (audio+video), LTX-2.0 layout (text connectors inside the model, run by extra_conds). The latent is the
    # packed (1, 1, N) form of a video (1, 128, 2, 4, 4) and an audio (1, 8, 5, 16) latent.
    TinyDiT(
        "LTX-2",
        "LTXAV",
        {
            "image_model": "ltxav",
            "num_layers": 3,
            "attention_head_dim": 16,
            "num_attention_heads": 2,
            "cross_attention_dim": 32,
            "audio_attention_head_dim": 8,
            "audio_num_attention_heads": 2,
            "audio_cross_attention_dim": 16,
            "caption_channels": 32,
            "in_channels": 128,
            "audio_in_channels": 128,
            "connector_attention_head_dim": 16,
            "connector_num_attention_heads": 2,
            "connector_num_layers": 2,
            "rope_type": "split",
            "frequencies_precision": "float64",
            "use_keyframes_abs_pos_embedding": False,
        },
        _LTXAV_PACKED,
        (7, 32),
        _ltxav_extra,
    ),
    # Mochi: AsymmetricJointBlock asserts hidden_size_x * mlp_ratio_x == 1536 * 8, so the visual MLP stays 8192
    # wide (SwiGLU 2/3 of 12288): hidden_size_x is kept at 16 for size. The last block has update_y False.
    TinyDiT(
        "Mochi",
        "GenmoMochi",
        {
            "image_model": "mochi_preview",
            "depth": 3,
            "patch_size": 2,
            "num_heads": 2,
            "hidden_size_x": 16,
            "hidden_size_y": 16,
            "mlp_ratio_x": 768.0,
            "mlp_ratio_y": 4.0,
            "learn_sigma": False,
            "in_channels": 12,
            "qk_norm": True,
            "qkv_bias": False,
            "out_bias": True,
            "attn_drop": 0.0,
            "patch_embed_bias": True,
            "posenc_preserve_area": True,
            "timestep_mlp_bias": True,
            "attend_to_padding": False,
            "timestep_scale": 1000.0,
            "use_t5": True,
            "t5_feat_dim": 24,
            "t5_token_length": 256,
            "rope_theta": 10000.0,
        },
        (1, 12, 1, 8, 8),
        (7, 24),
        _mochi_extra,
    ),
    # CogVideoX 5B layout (3-D rotary embeddings, no positional embedding table); rope axes: head_dim / 4 + 2 x 3/8.
    TinyDiT(
        "CogVideoX",
        "CogVideoX_T2V",
        {
            "image_model": "cogvideox",
            "num_attention_heads": 2,
            "attention_head_dim": 16,
            "time_embed_dim": 32,
            "num_layers": 3,
            "in_channels": 16,
            "patch_size": 2,
            "text_embed_dim": 24,
            "use_learned_positional_embeddings": False,
            "use_rotary_positional_embeddings": True,
        },
        (1, 16, 2, 8, 8),
        (7, 24),
    ),
]
