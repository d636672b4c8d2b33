"""Tiny newer video and image diffusion transformers of ComfyUI, as ``TinyDiT`` specs (``dit_spec.py``) that
``tiny_dit.py`` builds: Cosmos 1, Cosmos Predict2, Anima (its LLM adapter built tiny inside
``anima_tiny_adapter()``), Kandinsky 5 (video and image), MiniMax H3 (audio-video), SeedVR2, HiDream-O1 and
JoyImage."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .dit_spec import TinyDiT

# Qwen3-VL / HiDream-O1 chat-template token ids (comfy.text_encoders.hidream_o1).
_IM_START, _IM_END, _USER, _ASSISTANT, _NEWLINE = 151644, 151645, 872, 77091, 198
_BOI, _TMS = 151669, 151673
_HIDREAM_O1_PROMPT = 4
_HIDREAM_O1_TOKENS = 3 + _HIDREAM_O1_PROMPT + 7


def _pooled(width: int) -> Callable[[torch.Generator], dict[str, Any]]:
    """A CLIP-L pooled output as the Kandinsky 5 text encoder gives it (``y`` of the model)."""

    def extra(generator: torch.Generator) -> dict[str, Any]:
        return {"pooled_output": torch.randn(1, width, generator=generator)}

    return extra


def _seedvr2_condition(generator: torch.Generator) -> dict[str, Any]:
    """SeedVR2Conditioning: the low-quality video's latent (channels last there, 16) plus a ones mask channel."""
    latent = torch.randn(1, 16, 1, 8, 8, generator=generator)
    return {"condition": torch.cat([latent, torch.ones(1, 1, 1, 8, 8)], dim=1)}


def _hidream_o1_ids(generator: torch.Generator) -> dict[str, Any]:
    """HiDreamO1Tokenizer's chat template around a few prompt ids, as HiDreamO1TE puts them in ``extra``."""
    prompt = torch.randint(0, 1000, (_HIDREAM_O1_PROMPT,), generator=generator).tolist()
    ids = [_IM_START, _USER, _NEWLINE, *prompt, _IM_END, _NEWLINE, _IM_START, _ASSISTANT, _NEWLINE, _BOI, _TMS]
    return {"text_input_ids": torch.tensor([ids], dtype=torch.long)}


def _anima_ids(generator: torch.Generator) -> dict[str, Any]:
    """AnimaTokenizer's T5 ids and weights for the LLM adapter, next to the Qwen3 0.6B hidden states."""
    return {
        "t5xxl_ids": torch.randint(0, 32128, (5,), generator=generator, dtype=torch.int),
        "t5xxl_weights": torch.ones(5),
    }


# MiniMax H3 samples a video latent (24 channels) and a stereo audio latent (32 channels, 2, frames) together:
# MiniMaxH3AV.fix_empty_latent makes the pair (a NestedTensor) and the sampler packs it into one (B, 1, N) latent with
# ``latent_shapes``. ``tiny_dit.sample`` takes one plain tensor, so the entry starts from that packed latent and hands
# ``latent_shapes`` in the conditioning (which extra_conds prefers); the model unpacks it as usual. Unlike a nested
# latent, the sampler then sees one stream, so the audio stream is not carried scaled by shift / audio_shift.
_MINIMAX_H3_VIDEO = (1, 24, 1, 8, 8)
_MINIMAX_H3_AUDIO = (1, 32, 2, 2)
_MINIMAX_H3_PACKED = 24 * 1 * 8 * 8 + 32 * 2 * 2


def _minimax_h3_streams(generator: torch.Generator) -> dict[str, Any]:
    """The shapes of the packed latent's video and audio streams, as the sampler passes them to extra_conds."""
    return {"latent_shapes": [torch.Size(_MINIMAX_H3_VIDEO), torch.Size(_MINIMAX_H3_AUDIO)]}


def _minimax_h3_rope(diffusion_model: torch.nn.Module) -> None:
    """``rope.inv_freq``: MiniMaxH3Model makes it with ``torch.empty`` and the checkpoint holds it. The standard rope
    inverse frequencies, ``theta ** (-2i / d)`` for each of the 3 axes' ``d = 2 * rope_inv_freq_len`` rotary dims
    (``rope_freqs`` multiplies each axis' position by the same ``inv_freq``), theta 10000."""
    inv_freq = diffusion_model.rope.inv_freq
    dim = 2 * inv_freq.numel()
    with torch.no_grad():
        inv_freq.copy_(1.0 / 10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))


def _seedvr2_conditioning(diffusion_model: torch.nn.Module) -> None:
    """The stored text embeddings NaDiT keeps (``positive_conditioning`` / ``negative_conditioning``, made with
    ``torch.empty``, from the checkpoint; used when a conditioning has no text): seeded random values."""
    with torch.no_grad():
        for seed, name in enumerate(("positive_conditioning", "negative_conditioning")):
            buffer = getattr(diffusion_model, name)
            generator = torch.Generator().manual_seed(seed)
            buffer.copy_(torch.randn(buffer.shape, generator=generator, dtype=torch.float32))


@contextlib.contextmanager
def anima_tiny_adapter() -> Iterator[None]:
    """Builds Anima's LLM adapter tiny: ``comfy.ldm.anima.model.LLMAdapter`` takes no config, its defaults make a
    32128 x 1024 embedding and 6 blocks 1024 wide (135 M parameters). Here: width 32, 2 blocks, 2 heads."""
    import comfy.ldm.anima.model

    tiny = {"source_dim": 32, "target_dim": 32, "model_dim": 32, "num_layers": 2, "num_heads": 2}
    init = comfy.ldm.anima.model.LLMAdapter.__init__
    defaults = init.__defaults__
    keywords = [p for p in inspect.signature(init).parameters.values() if p.default is not inspect.Parameter.empty]
    init.__defaults__ = tuple(tiny.get(p.name, p.default) for p in keywords)
    try:
        yield
    finally:
        init.__defaults__ = defaults


#: The tiny widths and layout Cosmos 1 and Cosmos Predict2 share.
_COSMOS = {
    "max_img_h": 240,
    "max_img_w": 240,
    "max_frames": 128,
    "in_channels": 16,
    "out_channels": 16,
    "patch_spatial": 2,
    "patch_temporal": 1,
    "model_channels": 64,
    "concat_padding_mask": True,
    "crossattn_emb_channels": 32,
    "pos_emb_cls": "rope3d",
    "pos_emb_interpolation": "crop",
    "use_adaln_lora": True,
    "adaln_lora_dim": 16,
    "num_blocks": 3,
    "num_heads": 2,
    "mlp_ratio": 2.0,
}

#: Cosmos Predict2's config; Anima's blocks are the same.
_COSMOS_PREDICT2 = {
    **_COSMOS,
    "image_model": "cosmos_predict2",
    "pos_emb_learnable": True,
    "min_fps": 1,
    "max_fps": 30,
    "extra_per_block_abs_pos_emb": False,
    "rope_h_extrapolation_ratio": 4.0,
    "rope_w_extrapolation_ratio": 4.0,
    "rope_t_extrapolation_ratio": 1.0,
    "extra_h_extrapolation_ratio": 1.0,
    "extra_w_extrapolation_ratio": 1.0,
    "extra_t_extrapolation_ratio": 1.0,
    "rope_enable_fps_modulation": False,
}

SPECS: list[TinyDiT] = [
    TinyDiT(
        "Cosmos 1 T2V",
        "CosmosT2V",
        {
            **_COSMOS,
            "image_model": "cosmos",
            "block_config": "FA-CA-MLP",
            "pos_emb_learnable": False,
            "block_x_format": "THWBD",
            "affline_emb_norm": True,
            "extra_per_block_abs_pos_emb": True,
            "rope_h_extrapolation_ratio": 1.0,
            "rope_w_extrapolation_ratio": 1.0,
            "rope_t_extrapolation_ratio": 2.0,
            "extra_per_block_abs_pos_emb_type": "learnable",
        },
        (1, 16, 2, 8, 8),
        (7, 32),
    ),
    TinyDiT("Cosmos Predict2 T2I", "CosmosT2IPredict2", _COSMOS_PREDICT2, (1, 16, 1, 8, 8), (7, 32)),
    # Cosmos Predict2 blocks behind a T5-id LLM adapter; context width 32 = the tiny adapter's output width.
    TinyDiT(
        "Anima",
        "Anima",
        {**_COSMOS_PREDICT2, "image_model": "anima"},
        (1, 16, 1, 8, 8),
        (7, 32),
        _anima_ids,
        building=anima_tiny_adapter,
    ),
    TinyDiT(
        "Kandinsky 5 (video)",
        "Kandinsky5",
        {
            "image_model": "kandinsky5",
            "model_dim": 64,
            "axes_dims": (8, 12, 12),
            "time_dim": 32,
            "ff_dim": 128,
            "visual_embed_dim": 132,
            "num_text_blocks": 2,
            "num_visual_blocks": 3,
            "in_text_dim": 32,
            "in_text_dim2": 24,
        },
        (1, 16, 2, 8, 8),
        (7, 32),
        _pooled(24),
    ),
    TinyDiT(
        "Kandinsky 5 (image)",
        "Kandinsky5Image",
        {
            "image_model": "kandinsky5",
            "model_dim": 64,
            "axes_dims": (8, 12, 12),
            "rope_scale_factor": (1.0, 1.0, 1.0),
            "time_dim": 32,
            "ff_dim": 128,
            "visual_embed_dim": 64,
            "num_text_blocks": 2,
            "num_visual_blocks": 3,
            "in_text_dim": 32,
            "in_text_dim2": 24,
        },
        (1, 16, 8, 8),
        (7, 32),
        _pooled(24),
    ),
    TinyDiT(
        "MiniMax H3",
        "MiniMaxH3",
        {
            "image_model": "minimax_h3",
            "num_layers": 3,
            "token_refiner_num_layers": 2,
            "hidden_size": 64,
            "latents_dim": 24,
            "audio_latents_dim": 32,
            "attention_head_dim": 32,
            "num_attention_heads": 2,
            "ffn_hidden_size": 64,
            "text_dim": 32,
            "timestep_input_dim": 256,
            "time_embed_hidden_size": 64,
            "time_embed_dim": 32,
            "rope_inv_freq_len": 4,
        },
        (1, 1, _MINIMAX_H3_PACKED),
        (7, 32),
        _minimax_h3_streams,
        fill=_minimax_h3_rope,
    ),
    TinyDiT(
        "SeedVR2",
        "SeedVR2",
        {
            "image_model": "seedvr2",
            # Width 128: its two default text conditionings are fixed buffers of 2.5 MB, which narrower blocks
            # would not outweigh (at full size they are under 0.1 % of the weights).
            "vid_dim": 128,
            "heads": 2,
            "head_dim": 64,
            "rope_dim": 32,
            "num_layers": 4,
            "mm_layers": 2,
            "norm_eps": 1.0e-05,
            "mlp_type": "swiglu",
            "vid_out_norm": True,
            "txt_in_dim": 32,
        },
        (1, 16, 1, 8, 8),
        (7, 32),
        _seedvr2_condition,
        fill=_seedvr2_conditioning,
    ),
    TinyDiT(
        "HiDream-O1",
        "HiDreamO1",
        {
            "image_model": "hidream_o1",
            # Width 128: the pixel patch projections (32 x 32 x 3 to the width and back) grow with the width, the
            # layers with its square; narrower, the layers would not hold most of the weights, as at full size.
            "text_config_overrides": {
                "hidden_size": 128,
                "intermediate_size": 512,
                "num_hidden_layers": 3,
                "num_attention_heads": 2,
                "num_key_value_heads": 1,
                "head_dim": 64,
                "rope_dims": [16, 8, 8],
            },
            "vision_config_overrides": {
                "hidden_size": 16,
                "num_heads": 2,
                "intermediate_size": 32,
                "depth": 2,
                "num_position_embeddings": 16,
            },
        },
        (1, 3, 64, 64),
        (_HIDREAM_O1_TOKENS, 1),
        _hidream_o1_ids,
    ),
    TinyDiT(
        "JoyImage",
        "JoyImage",
        {
            "image_model": "joyimage",
            "in_channels": 16,
            "hidden_size": 128,
            "patch_size": [1, 2, 2],
            "num_layers": 3,
            "num_attention_heads": 1,
            "mlp_width_ratio": 2.0,
            "text_dim": 32,
        },
        (1, 16, 1, 8, 8),
        (7, 32),
    ),
]
