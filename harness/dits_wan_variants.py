"""Tiny variants of Wan whose diffusion model has its own class, as ``TinyDiT`` specs (``dit_spec.py``) that
``tiny_dit.py`` builds: Causal Forcing (Causal-WAN), Fun Camera, HuMo, S2V, Animate, Animate-2, SCAIL, SCAIL-2 and
WanDancer.

Each gets the conditioning its nodes give, so that its extra modules run (audio, pose, face, camera, music); where a
module ComfyUI builds has widths no config key reaches (a CLIP-vision projection 1280 wide, HuMo's whisper
projection, Animate's face motion encoder), the model is built with them narrowed (``building``)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from .dit_spec import TinyDiT, no_extra
from .dits_video import WAN_21

_CONTEXT = (7, 24)
#: The width of the CLIP-vision features the i2v-shaped variants project (``MLPProj``, 1280 in ComfyUI).
_CLIP_WIDTH = 32
_CLIP_TOKENS = 5


def _wan_variant(
    name: str,
    config: str,
    overrides: Mapping[str, Any],
    extra: Callable[[torch.Generator], dict[str, Any]] = no_extra,
    building: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext,
    frames: int = 1,
) -> TinyDiT:
    """A Wan variant: ``WAN_21`` with ``overrides`` (its ``model_type`` and what else it changes), on a Wan 2.1 latent
    of ``frames`` frames and the Wan text context."""
    return TinyDiT(name, config, {**WAN_21, **overrides}, (1, 16, frames, 8, 8), _CONTEXT, extra, building=building)


@contextlib.contextmanager
def _patched_init(cls: type, init: Callable[..., None]) -> Iterator[None]:
    original = cls.__init__
    cls.__init__ = init
    try:
        yield
    finally:
        cls.__init__ = original


def _narrowed(cls: type, **widths: Any) -> contextlib.AbstractContextManager[None]:
    """``cls`` built with ``widths`` over the keyword arguments its callers pass (fixed there, no config key)."""
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **{**kwargs, **widths})

    return _patched_init(cls, init)


@contextlib.contextmanager
def _tiny_clip_projection() -> Iterator[None]:
    """The i2v-shaped variants' CLIP-vision projections (``img_emb``, WanDancer's ``img_emb_refimage``): ``MLPProj``
    takes 1280-wide features from a fixed argument (a 1280 x 1280 layer, far more than the tiny blocks); here
    ``_CLIP_WIDTH``."""
    import comfy.ldm.wan.model

    cls = comfy.ldm.wan.model.MLPProj
    original = cls.__init__

    @functools.wraps(original)
    def init(self: Any, in_dim: int, out_dim: int, *args: Any, **kwargs: Any) -> None:
        original(self, _CLIP_WIDTH, out_dim, *args, **kwargs)

    with _patched_init(cls, init):
        yield


def _clip_vision_output(generator: torch.Generator) -> Any:
    """A CLIP-vision output as ComfyUI's encoder gives it (the model reads its penultimate hidden states)."""
    import comfy.clip_vision

    output = comfy.clip_vision.Output()
    output["penultimate_hidden_states"] = torch.randn(1, _CLIP_TOKENS, _CLIP_WIDTH, generator=generator)
    return output


# Wan 2.2 Fun Camera (t2v-shaped; Wan 2.1's is i2v): the Plücker camera embedding at pixel size (``WanCameraEmbedding``:
# 6 x 4 frames stacked into 24 channels per latent frame; in_dim_control_adapter of them here); ``control_adapter``
# pixel-unshuffles it onto the patches.
_CAMERA_CHANNELS = 2


def _camera_extra(generator: torch.Generator) -> dict[str, Any]:
    return {"camera_conditions": torch.randn(1, _CAMERA_CHANNELS, 1, 64, 64, generator=generator)}


# S2V: audio_embed is wav2vec2's hidden states (25 layers x audio_dim) at 4 audio frames per latent frame;
# reference image, motion frames (FramePackMotioner) and control video as ``WanSoundImageToVideo`` gives them.
_S2V_AUDIO_DIM = 16


def _s2v_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        "audio_embed": torch.randn(1, 25, _S2V_AUDIO_DIM, 4, generator=generator),
        "reference_latents": [torch.randn(1, 16, 1, 8, 8, generator=generator)],
        "reference_motion": torch.randn(1, 16, 2, 8, 8, generator=generator),
        "control_video": torch.randn(1, 16, 1, 8, 8, generator=generator),
    }


# HuMo: whisper features windowed per latent frame (8 audio frames x 5 layer groups x 1280, narrowed here), projected
# to 16 tokens per frame for each block's audio cross-attention; the node always sets a reference latent (zeros
# without a reference image), a frame the audio is padded over.
_HUMO_AUDIO = {"channels": 8, "intermediate_dim": 8}


def _humo_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        "audio_embed": torch.randn(1, 1, 8, 5, _HUMO_AUDIO["channels"], generator=generator),
        "reference_latents": [torch.zeros(1, 16, 1, 8, 8)],
    }


def _humo_building() -> contextlib.AbstractContextManager[None]:
    """HuMo's ``AudioProjModel`` takes whisper's 1280-wide features through a 512-wide MLP (fixed arguments:
    39 M parameters); here 8 and 8. Its output stays 1536 wide, as the blocks' audio cross-attention takes."""
    import comfy.ldm.wan.model

    return _narrowed(comfy.ldm.wan.model.AudioProjModel, **_HUMO_AUDIO)


# Animate: the pose video's latents add onto frames 1.. (frame 0 is the reference), the face video (pixels in
# [-1, 1], 4 x (latent frames - 1) + 1 frames) runs the motion encoder and the face encoder, and
# face_adapter.fuser_blocks[i // 5] runs after every fifth block.
_ANIMATE_FACE_WIDTH = 8
_ANIMATE_STYLE_DIM = 16
#: The motion encoder's channels, from its first convolution on: ComfyUI's are 32, 64, ... 512, with seven
#: halving ResBlocks between them. Three here, so the face video is 32 x 32 (ComfyUI's node makes it 512 x 512),
#: down to the 4 x 4 its last convolution takes.
_ANIMATE_CHANNELS = (4, 8, 8, 8)
_ANIMATE_FACE_SIZE = 4 * 2 ** (len(_ANIMATE_CHANNELS) - 1)


def _animate_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        "pose_video_latent": torch.randn(1, 16, 1, 8, 8, generator=generator),
        "face_video_pixels": torch.rand(1, 3, 5, _ANIMATE_FACE_SIZE, _ANIMATE_FACE_SIZE, generator=generator) * 2 - 1,
        "clip_vision_output": _clip_vision_output(generator),
    }


@contextlib.contextmanager
def _animate_building() -> Iterator[None]:
    """Animate's face path at tiny width: ComfyUI fixes its motion encoder (StyleGAN convolutions 32 to 512 channels,
    512-wide style, seven halvings of a 512 x 512 face) and face encoder (1024-wide causal convolutions) in code,
    36 M parameters and seconds per face frame on a CPU. Here the same layer classes: ``_ANIMATE_CHANNELS`` (three
    halvings), style ``_ANIMATE_STYLE_DIM``, face encoder width ``_ANIMATE_FACE_WIDTH``; the motion directions
    (512 x 20, so motion_encoder_dim 512) are kept."""
    import comfy.ldm.wan.model_animate as animate

    def encoder_app(self: Any, w_dim: int = 512, dtype: Any = None, device: Any = None, operations: Any = None) -> None:
        torch.nn.Module.__init__(self)
        kwargs = {"device": device, "dtype": dtype, "operations": operations}
        channels = _ANIMATE_CHANNELS
        self.convs = torch.nn.ModuleList(
            [
                animate.ConvLayer(3, channels[0], 1, **kwargs),
                *(animate.ResBlock(channels[i], channels[i + 1], **kwargs) for i in range(len(channels) - 1)),
                animate.EqualConv2d(channels[-1], w_dim, 4, padding=0, bias=False, **kwargs),
            ]
        )

    def face_encoder(
        self: Any,
        in_dim: int,
        hidden_dim: int,
        num_heads: int,
        dtype: Any = None,
        device: Any = None,
        operations: Any = None,
    ) -> None:
        torch.nn.Module.__init__(self)
        factory_kwargs = {"dtype": dtype, "device": device}
        width = _ANIMATE_FACE_WIDTH
        self.num_heads = num_heads
        self.conv1_local = animate.CausalConv1d(
            in_dim, width * num_heads, 3, stride=1, operations=operations, **factory_kwargs
        )
        self.act = torch.nn.SiLU()
        self.conv2 = animate.CausalConv1d(width, width, 3, stride=2, operations=operations, **factory_kwargs)
        self.conv3 = animate.CausalConv1d(width, width, 3, stride=2, operations=operations, **factory_kwargs)
        self.out_proj = operations.Linear(width, hidden_dim, **factory_kwargs)
        self.norm1 = operations.LayerNorm(width, elementwise_affine=False, eps=1e-6, **factory_kwargs)
        self.norm2 = operations.LayerNorm(width, elementwise_affine=False, eps=1e-6, **factory_kwargs)
        self.norm3 = operations.LayerNorm(width, elementwise_affine=False, eps=1e-6, **factory_kwargs)
        self.padding_tokens = torch.nn.Parameter(torch.empty(1, 1, 1, hidden_dim, **factory_kwargs))

    with (
        _tiny_clip_projection(),
        _patched_init(animate.EncoderApp, encoder_app),
        _patched_init(animate.FaceEncoder, face_encoder),
        _narrowed(animate.Generator, style_dim=_ANIMATE_STYLE_DIM),
    ):
        yield


# Animate-2: the pose video's latents (one frame fewer than the generation, whose frame 0 is the reference image)
# run each block's pose pass (``forward_pose``) before its generation pass (``forward_gen``) takes their keys and
# values.
def _animate2_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        "pose_video_latent": torch.randn(1, 16, 1, 8, 8, generator=generator),
        "clip_vision_output": _clip_vision_output(generator),
    }


# SCAIL: the pose video's latents at half resolution (their own patch embedding, tokens after the video's) and a
# reference latent before the video's frames; extra_conds adds the 4 mask channels to both (20 = in_dim).
def _scail_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        "pose_video_latent": torch.randn(1, 16, 1, 4, 4, generator=generator),
        "reference_latents": [torch.randn(1, 16, 1, 8, 8, generator=generator)],
        "clip_vision_output": _clip_vision_output(generator),
    }


# SCAIL-2: SCAIL's inputs and the 28-channel identity masks (7 colours x 4 frames): one over the pose video, one over
# the reference frame then the video's frames (zeros there), as ``WanSCAILToVideo`` gives them (frames before channels).
def _scail2_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        **_scail_extra(generator),
        "driving_mask_28ch": (torch.rand(1, 1, 28, 4, 4, generator=generator) > 0.5).float(),
        "ref_mask_28ch": torch.cat(
            [(torch.rand(1, 1, 28, 8, 8, generator=generator) > 0.5).float(), torch.zeros(1, 1, 28, 8, 8)], dim=1
        ),
        "ref_mask_flag": True,
    }


# WanDancer: the music features (35 per audio frame: envelope, MFCC, chroma, peaks, beats) run the music encoder, then
# music_injector after the blocks in audio_inject_layers; fps 30 keeps the main patch embedding and head (another fps
# switches to the ``_global`` ones). CLIP-vision features of the start and the reference image, as its node gives them.
def _wandancer_extra(generator: torch.Generator) -> dict[str, Any]:
    return {
        "audio_embed": torch.rand(1, 8, 35, generator=generator),
        "fps": 30.0,
        "audio_inject_scale": 1.0,
        "clip_vision_output": _clip_vision_output(generator),
        "clip_vision_output_ref": _clip_vision_output(generator),
    }


SPECS: list[TinyDiT] = [
    # Causal Forcing (Causal-WAN): WanModel's weights with KV-cached causal blocks; detected from the checkpoint's
    # metadata (causal_ar, which the config class drops again). ComfyUI's euler samples it as plain Wan; only the
    # ar_video sampler drives its frame-by-frame forward_block.
    _wan_variant("Wan 2.1 Causal Forcing", "WAN21_CausalAR_T2V", {"model_type": "t2v"}),
    # Wan 2.2 Fun Camera: in_dim 36 = noise + 20 zero concat channels (no start image). in_dim_control_adapter is 24
    # in the real model (its default): 2 here and 6 blocks, so that the blocks outweigh the adapter (a convolution of
    # 64 x in_dim_control_adapter x 4 inputs per channel, and a residual block of two 3 x 3 convolutions).
    _wan_variant(
        "Wan 2.2 Fun Camera",
        "WAN22_Camera",
        {"model_type": "camera_2.2", "in_dim": 36, "num_layers": 6, "in_dim_control_adapter": _CAMERA_CHANNELS},
        _camera_extra,
    ),
    # HuMo 17B layout: in_dim 36 (noise + the 20 channels extra_conds fills with the VAE's zero-image values).
    _wan_variant("Wan 2.1 HuMo", "WAN21_HuMo", {"model_type": "humo", "in_dim": 36}, _humo_extra, _humo_building),
    # S2V: audio injected after blocks 0, 3 and 6 (12 of 40 in the real model), through its AdaIN layers; width 64
    # and 8 blocks, so that the block lists outweigh FramePackMotioner's fixed-kernel projections (16 x dim x 292).
    _wan_variant(
        "Wan 2.2 S2V",
        "WAN22_S2V",
        {
            "model_type": "s2v",
            "dim": 64,
            "ffn_dim": 128,
            "num_layers": 8,
            "audio_dim": _S2V_AUDIO_DIM,
            "num_audio_token": 4,
            "enable_adain": True,
            "cond_dim": 16,
            "audio_inject_layers": [0, 3, 6],
            "adain_mode": "attn_norm",
            "framepack_drop_mode": "padd",
        },
        _s2v_extra,
    ),
    # Animate: 15 blocks, so that face_adapter has 3 fuser blocks (num_layers // 5), all called (after blocks 0, 5, 10);
    # two latent frames, so that the pose latents add onto frame 1.
    _wan_variant(
        "Wan 2.2 Animate",
        "WAN22_Animate",
        {"model_type": "animate", "in_dim": 36, "num_layers": 15, "motion_encoder_dim": 512},
        _animate_extra,
        _animate_building,
        frames=2,
    ),
    _wan_variant(
        "Wan Animate 2",
        "WAN_Animate2",
        {"model_type": "animate2", "in_dim": 36},
        _animate2_extra,
        _tiny_clip_projection,
        frames=2,
    ),
    _wan_variant(
        "Wan 2.1 SCAIL", "WAN21_SCAIL", {"model_type": "scail", "in_dim": 20}, _scail_extra, _tiny_clip_projection
    ),
    _wan_variant(
        "Wan 2.1 SCAIL-2",
        "WAN21_SCAIL2",
        {"model_type": "scail2", "in_dim": 20, "mask_in_dim": 28},
        _scail2_extra,
        _tiny_clip_projection,
    ),
    # WanDancer: in_dim 36 (noise + mask + start-image latents, zeros here); the music encoder is 2 layers with a
    # fixed 1024-wide MLP (music_dim narrows the rest).
    _wan_variant(
        "Wan 2.2 WanDancer",
        "WAN22_WanDancer",
        {
            "model_type": "wandancer",
            "in_dim": 36,
            "audio_inject_layers": [0, 1, 2],
            "music_dim": 16,
            "music_heads": 2,
            "music_feature_dim": 35,
            "music_latent_dim": 16,
        },
        _wandancer_extra,
        _tiny_clip_projection,
    ),
]
