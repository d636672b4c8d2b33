"""Tiny random-weight checkpoints of real diffusion architectures, for tests and the demo.

Nothing may be downloaded, yet the pack has to be exercised against the model classes
ComfyUI really builds (``WanModel``, ``Flux``, ``MMDiT``), loaded through ComfyUI's own
loaders (``UNETLoader``, ``CLIPLoader``, ``LoraLoaderModelOnly``). So this module writes
safetensors files whose key names and shapes are exactly those of the real checkpoints,
only narrower and shallower where ComfyUI's detection (``comfy/model_detection.py``)
allows it, filled with seeded random numbers.

Usage::

    python -m harness.tiny_models --models-dir .host/models

or, from Python, :func:`generate`. Files land in ComfyUI's usual sub-folders
(``diffusion_models/``, ``text_encoders/``, ``loras/``). A file that already exists with
the same :data:`GENERATOR_VERSION` is left alone, so a second run costs only a header read.
The output is deterministic: every tensor has its own fixed seed (from the file and its
key), so the bytes depend neither on the run nor on which other files were (re)generated.
Tensors are generated and written one at a time, so even the 2 GB Flux needs little memory.

What ComfyUI 0.3.75 fixes and what it infers from the weights (hence the shapes below):

* Wan 2.1: ``num_heads = dim // 128`` and ``text_dim`` is NOT inferred: the model is built
  with ``text_dim=4096`` whatever the file says. The tiny Wan therefore takes 4096-wide
  context; CLIPLoader type ``sd3`` turns the tiny CLIP-L into exactly that (its 768-wide
  hidden states zero-padded to 4096).
* Flux: ``num_heads=24``, ``axes_dim=[16, 56, 56]`` (head dim 128) and ``mlp_ratio=4`` are
  fixed, so the hidden size must be 3072: a Flux cannot be narrow, only shallow. It is
  stored in bfloat16 (as real Flux checkpoints are) to halve the file; ``context_in_dim``
  and ``vec_in_dim`` are inferred, so both are 768 (CLIP-L hidden states and pooled output,
  CLIPLoader type ``stable_diffusion``).
* SD3 (MMDiT): ``hidden = 64 * depth`` and ``heads = depth``; context and pooled widths are
  inferred. They are 4096 and 2048, as in real SD3, so CLIPLoader type ``sd3`` works.
* CLIP-L: ComfyUI's config (``comfy/sd1_clip_config.json``) is fixed at 12 layers of width
  768, and CLIPLoader cannot override it; missing layers would stay uninitialised memory.
  So it is full size, stored in float16 (ComfyUI runs text encoders in fp16 anyway).

Weights are N(0, 0.02), biases N(0, 0.02), norm scales 1 + N(0, 0.02), except that the
adaLN "gate" slices of every modulation are centred on 1 (see
:meth:`SpecBuilder.modulation`), so removing any one block moves the denoised output by
roughly 10 % (Wan, SD3) to 40-75 % (Flux): a block that is streamed wrongly cannot hide.
Files are written by :func:`save_safetensors`, whose header is byte-stable (safetensors'
own writer orders the metadata differently in every process).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import importlib.util
import json
import math
import os
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

#: Bump whenever any generated tensor changes, so stale files are rewritten.
GENERATOR_VERSION = "2"
#: Base seed; each file adds a stable offset derived from its name.
SEED = 20250601
#: safetensors metadata keys that identify our files.
META_VERSION = "block_offload_tiny_version"
META_NAME = "block_offload_tiny_name"

# Init scales. Linear/conv weights ~ N(0, 0.02) as in most DiT inits; biases and norm
# weights get a little noise too (1 + N(0, 0.02) for scales) so that a bug that drops or
# mixes up a bias or a norm weight while streaming blocks changes the output.
WEIGHT_STD = 0.02
BIAS_STD = 0.02
NORM_STD = 0.02
# LoRA factors: delta = up @ down * alpha / rank has std sqrt(rank) * 0.1 * 0.1 = 0.02 for
# rank 4, alpha 4: as large as the weights themselves, so strength 1.0 moves the output.
LORA_RANK = 4
LORA_ALPHA = 4.0
LORA_STD = 0.1

# --- Architecture sizes ----------------------------------------------------------------

#: Wan 2.1 T2V. dim 256 -> 2 heads of 128 (ComfyUI derives heads = dim // 128).
WAN21_DIM = 256
WAN21_FFN_DIM = 512
WAN21_LAYERS = 5
WAN21_TEXT_DIM = 4096  # fixed by ComfyUI (WanModel default), not inferred from weights
WAN21_FREQ_DIM = 256  # fixed by ComfyUI
WAN21_LATENT_CHANNELS = 16
WAN21_PATCH = (1, 2, 2)

#: Flux (dev-style: with guidance_in). Width fixed by ComfyUI, depth is ours.
FLUX_HIDDEN = 3072  # = 24 heads * 128, both fixed by ComfyUI's Flux detection
FLUX_DOUBLE_BLOCKS = 2
FLUX_SINGLE_BLOCKS = 2
FLUX_CONTEXT_DIM = 768
FLUX_VEC_DIM = 768
FLUX_LATENT_CHANNELS = 16
FLUX_PATCH = 2

#: SD3 / SD3.5 MMDiT (RMS qk-norm like SD3.5). depth 4 -> hidden 256, 4 heads, 4 joint blocks.
SD3_DEPTH = 4
SD3_HIDDEN = 64 * SD3_DEPTH
SD3_CONTEXT_DIM = 4096
SD3_ADM_DIM = 2048
SD3_POS_EMBED_MAX = 32  # latents up to 64x64 (512x512 px)
SD3_LATENT_CHANNELS = 16
SD3_PATCH = 2

#: CLIP-L text encoder, ComfyUI's fixed config.
CLIP_L_WIDTH = 768
CLIP_L_LAYERS = 12
CLIP_L_MLP = 3072
CLIP_L_VOCAB = 49408
CLIP_L_POSITIONS = 77

# --- File names ------------------------------------------------------------------------

WAN21 = "wan21"
FLUX = "flux"
SD3 = "sd3"
CLIP_L = "clip_l"
WAN21_LORA = "wan21_lora"
FLUX_LORA = "flux_lora"
SD3_LORA = "sd3_lora"

WAN21_FILE = "block_offload_tiny_wan21.safetensors"
FLUX_FILE = "block_offload_tiny_flux.safetensors"
SD3_FILE = "block_offload_tiny_sd3.safetensors"
CLIP_L_FILE = "block_offload_tiny_clip_l.safetensors"
WAN21_LORA_FILE = "block_offload_tiny_wan21_lora.safetensors"
FLUX_LORA_FILE = "block_offload_tiny_flux_lora.safetensors"
SD3_LORA_FILE = "block_offload_tiny_sd3_lora.safetensors"

#: The tiny Wan 2.1 quantized as users' small-GPU checkpoints are (see "Quantized checkpoints" below).
WAN21_FP8 = "wan21_fp8"  # ComfyUI's per-layer ``comfy_quant``, float8_e4m3fn: QuantizedTensor on 0.33
WAN21_FP8_METADATA = "wan21_fp8_metadata"  # the same, configs in the file's metadata: also 0.3.75's QuantizedTensor
WAN21_INT8 = "wan21_int8"  # ComfyUI's per-layer ``comfy_quant``, int8_tensorwise: QuantizedTensor on 0.33
WAN21_SCALED_FP8 = "wan21_scaled_fp8"  # the older ``scaled_fp8`` marker: plain fp8 on 0.3.75, converted on 0.33
WAN21_Q8_0 = "wan21_q8_0"  # GGUF Q8_0, for ComfyUI-GGUF
WAN21_Q4_K = "wan21_q4_k"  # GGUF Q4_K, for ComfyUI-GGUF
# The other per-layer ``comfy_quant`` formats of ComfyUI 0.33 (``comfy/quant_ops.py`` QUANT_ALGOS), each a
# QuantizedTensor there and unreadable by 0.3.75. All but fp8 e5m2 are quantized by comfy_kitchen, the
# package 0.33's quant_ops runs, so they are written only where it is installed (ComfyUI 0.33's venv).
WAN21_FP8_E5M2 = "wan21_fp8_e5m2"  # float8_e5m2, per-tensor scale
WAN21_INT8_CONVROT = "wan21_int8_convrot"  # int8_tensorwise with ConvRot: Hadamard-rotated rows, a scale per row
WAN21_W4A4 = "wan21_w4a4"  # convrot_w4a4: rotated, packed signed int4, a scale per row
WAN21_W4A8 = "wan21_w4a8"  # asym_w4a8_int8: rotated, packed 4-bit codes, fp8 group and fp32 row scales, codebook
WAN21_NVFP4 = "wan21_nvfp4"  # nvfp4: packed fp4 e2m1, fp8 scales per 16 values (swizzled), fp32 tensor scale
WAN21_MXFP8 = "wan21_mxfp8"  # mxfp8: fp8 e4m3, e8m0 scales per 32 values (swizzled)

#: ComfyUI model folder of each file; node widgets take the bare file name.
FOLDERS: dict[str, str] = {
    WAN21: "diffusion_models",
    FLUX: "diffusion_models",
    SD3: "diffusion_models",
    CLIP_L: "text_encoders",
    WAN21_LORA: "loras",
    FLUX_LORA: "loras",
    SD3_LORA: "loras",
    WAN21_FP8: "diffusion_models",
    WAN21_FP8_METADATA: "diffusion_models",
    WAN21_INT8: "diffusion_models",
    WAN21_SCALED_FP8: "diffusion_models",
    WAN21_Q8_0: "diffusion_models",
    WAN21_Q4_K: "diffusion_models",
    WAN21_FP8_E5M2: "diffusion_models",
    WAN21_INT8_CONVROT: "diffusion_models",
    WAN21_W4A4: "diffusion_models",
    WAN21_W4A8: "diffusion_models",
    WAN21_NVFP4: "diffusion_models",
    WAN21_MXFP8: "diffusion_models",
}
FILES: dict[str, str] = {
    WAN21: WAN21_FILE,
    FLUX: FLUX_FILE,
    SD3: SD3_FILE,
    CLIP_L: CLIP_L_FILE,
    WAN21_LORA: WAN21_LORA_FILE,
    FLUX_LORA: FLUX_LORA_FILE,
    SD3_LORA: SD3_LORA_FILE,
    WAN21_FP8: "block_offload_tiny_wan21_fp8.safetensors",
    WAN21_FP8_METADATA: "block_offload_tiny_wan21_fp8_metadata.safetensors",
    WAN21_INT8: "block_offload_tiny_wan21_int8.safetensors",
    WAN21_SCALED_FP8: "block_offload_tiny_wan21_scaled_fp8.safetensors",
    WAN21_Q8_0: "block_offload_tiny_wan21_q8_0.gguf",
    WAN21_Q4_K: "block_offload_tiny_wan21_q4_k.gguf",
    WAN21_FP8_E5M2: "block_offload_tiny_wan21_fp8_e5m2.safetensors",
    WAN21_INT8_CONVROT: "block_offload_tiny_wan21_int8_convrot.safetensors",
    WAN21_W4A4: "block_offload_tiny_wan21_w4a4.safetensors",
    WAN21_W4A8: "block_offload_tiny_wan21_w4a8.safetensors",
    WAN21_NVFP4: "block_offload_tiny_wan21_nvfp4.safetensors",
    WAN21_MXFP8: "block_offload_tiny_wan21_mxfp8.safetensors",
}

#: CLIPLoader ``type`` to use with the tiny CLIP-L for each diffusion model, and the
#: conditioning it yields: (context width, pooled width). Type "sd3" with a lone CLIP-L pads
#: its hidden states to 4096 and its pooled output to 2048; "stable_diffusion" gives plain
#: CLIP-L output (CLIPLoader offers no "flux"; DualCLIPLoader's "flux" wants CLIP-L + T5).
CLIP_TYPE: dict[str, str] = {WAN21: "sd3", FLUX: "stable_diffusion", SD3: "sd3"}
CONDITIONING_DIMS: dict[str, tuple[int, int]] = {
    WAN21: (WAN21_TEXT_DIM, 2048),  # Wan T2V ignores the pooled output
    FLUX: (FLUX_CONTEXT_DIM, FLUX_VEC_DIM),
    SD3: (SD3_CONTEXT_DIM, SD3_ADM_DIM),
}
#: The LoRA made for each diffusion model.
LORA_FOR: dict[str, str] = {WAN21: WAN21_LORA, FLUX: FLUX_LORA, SD3: SD3_LORA}
#: The ComfyUI node that makes an empty latent of the right shape for each model:
#: Wan [B, 16, (length - 1) // 4 + 1, H/8, W/8]; Flux and SD3 [B, 16, H/8, W/8].
EMPTY_LATENT_NODE: dict[str, str] = {
    WAN21: "EmptyHunyuanLatentVideo",
    FLUX: "EmptySD3LatentImage",
    SD3: "EmptySD3LatentImage",
}

# --- Tensor specs ----------------------------------------------------------------------

WEIGHT, BIAS, NORM, LORA, ALPHA = "weight", "bias", "norm", "lora", "alpha"


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to generate: its key, shape and how to initialise it."""

    key: str
    shape: tuple[int, ...]
    init: str  # WEIGHT, BIAS, NORM, LORA or ALPHA
    #: For modulation biases: the tensor is ``chunks`` equal slices along its first
    #: non-unit axis (shift, scale, gate, ...) and the ``gates`` slices are centred on 1.
    chunks: int = 1
    gates: tuple[int, ...] = ()


class SpecBuilder:
    """Collects TensorSpecs with the helpers the architectures need (linear, norm, ...)."""

    def __init__(self) -> None:
        self.specs: list[TensorSpec] = []

    def tensor(
        self, key: str, shape: Sequence[int], init: str = WEIGHT, chunks: int = 1, gates: tuple[int, ...] = ()
    ) -> None:
        self.specs.append(TensorSpec(key, tuple(shape), init, chunks, gates))

    def linear(self, name: str, out_f: int, in_f: int, bias: bool = True) -> None:
        self.tensor(f"{name}.weight", (out_f, in_f))
        if bias:
            self.tensor(f"{name}.bias", (out_f,), BIAS)

    def modulation(self, name: str, chunks: int, gates: tuple[int, ...], dim: int) -> None:
        """An adaLN linear producing ``chunks`` vectors (shift, scale, gate, ...) from ``dim``.

        With every bias near 0 the gates would be ~0.05 and each block would add almost nothing
        to the residual stream: a block streamed wrongly (stale, zeroed, another block's
        weights) would barely move the output. Gate biases near 1, as in trained models, make
        every block count.
        """
        self.tensor(f"{name}.weight", (chunks * dim, dim))
        self.tensor(f"{name}.bias", (chunks * dim,), BIAS, chunks, gates)

    def norm(self, name: str, dim: int, bias: bool = False, weight_key: str = "weight") -> None:
        self.tensor(f"{name}.{weight_key}", (dim,), NORM)
        if bias:
            self.tensor(f"{name}.bias", (dim,), BIAS)


def wan21_specs() -> list[TensorSpec]:
    """Wan 2.1 T2V (comfy/ldm/wan/model.py WanModel, model_type 't2v', qk_norm, cross_attn_norm)."""
    s, d = SpecBuilder(), WAN21_DIM
    s.tensor("patch_embedding.weight", (d, WAN21_LATENT_CHANNELS, *WAN21_PATCH))
    s.tensor("patch_embedding.bias", (d,), BIAS)
    s.linear("text_embedding.0", d, WAN21_TEXT_DIM)
    s.linear("text_embedding.2", d, d)
    s.linear("time_embedding.0", d, WAN21_FREQ_DIM)
    s.linear("time_embedding.2", d, d)
    s.linear("time_projection.1", 6 * d, d)  # block modulations get their gate offset themselves
    for i in range(WAN21_LAYERS):
        p = f"blocks.{i}"
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                s.linear(f"{p}.{attn}.{proj}", d, d)
            s.norm(f"{p}.{attn}.norm_q", d)
            s.norm(f"{p}.{attn}.norm_k", d)
        s.norm(f"{p}.norm3", d, bias=True)
        s.linear(f"{p}.ffn.0", WAN21_FFN_DIM, d)
        s.linear(f"{p}.ffn.2", d, WAN21_FFN_DIM)
        # added to time_projection's output: shift, scale, gate (attention), then (FFN)
        s.tensor(f"{p}.modulation", (1, 6, d), BIAS, chunks=6, gates=(2, 5))
    s.linear("head.head", WAN21_LATENT_CHANNELS * 4, d)
    s.tensor("head.modulation", (1, 2, d), BIAS)
    return s.specs


def flux_specs() -> list[TensorSpec]:
    """Flux dev (comfy/ldm/flux/model.py Flux with guidance_in, qkv_bias, vector_in)."""
    s, h = SpecBuilder(), FLUX_HIDDEN
    mlp = 4 * h
    head_dim = 128
    s.linear("img_in", h, FLUX_LATENT_CHANNELS * FLUX_PATCH * FLUX_PATCH)
    for emb, in_dim in (("time_in", 256), ("vector_in", FLUX_VEC_DIM), ("guidance_in", 256)):
        s.linear(f"{emb}.in_layer", h, in_dim)
        s.linear(f"{emb}.out_layer", h, h)
    s.linear("txt_in", h, FLUX_CONTEXT_DIM)
    for i in range(FLUX_DOUBLE_BLOCKS):
        p = f"double_blocks.{i}"
        for stream in ("img", "txt"):
            s.modulation(f"{p}.{stream}_mod.lin", 6, (2, 5), h)
            s.linear(f"{p}.{stream}_attn.qkv", 3 * h, h)
            s.norm(f"{p}.{stream}_attn.norm.query_norm", head_dim, weight_key="scale")
            s.norm(f"{p}.{stream}_attn.norm.key_norm", head_dim, weight_key="scale")
            s.linear(f"{p}.{stream}_attn.proj", h, h)
            s.linear(f"{p}.{stream}_mlp.0", mlp, h)
            s.linear(f"{p}.{stream}_mlp.2", h, mlp)
    for i in range(FLUX_SINGLE_BLOCKS):
        p = f"single_blocks.{i}"
        s.linear(f"{p}.linear1", 3 * h + mlp, h)
        s.linear(f"{p}.linear2", h, h + mlp)
        s.norm(f"{p}.norm.query_norm", head_dim, weight_key="scale")
        s.norm(f"{p}.norm.key_norm", head_dim, weight_key="scale")
        s.modulation(f"{p}.modulation.lin", 3, (2,), h)
    s.linear("final_layer.linear", FLUX_PATCH * FLUX_PATCH * FLUX_LATENT_CHANNELS, h)
    s.linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return s.specs


def sd3_specs() -> list[TensorSpec]:
    """SD3.5-style MMDiT (comfy/ldm/modules/diffusionmodules/mmdit.py, qk_norm 'rms')."""
    s, h = SpecBuilder(), SD3_HIDDEN
    head_dim = 64
    s.tensor("x_embedder.proj.weight", (h, SD3_LATENT_CHANNELS, SD3_PATCH, SD3_PATCH))
    s.tensor("x_embedder.proj.bias", (h,), BIAS)
    s.tensor("pos_embed", (1, SD3_POS_EMBED_MAX * SD3_POS_EMBED_MAX, h))
    s.linear("t_embedder.mlp.0", h, 256)
    s.linear("t_embedder.mlp.2", h, h)
    s.linear("y_embedder.mlp.0", h, SD3_ADM_DIM)
    s.linear("y_embedder.mlp.2", h, h)
    s.linear("context_embedder", h, SD3_CONTEXT_DIM)
    for i in range(SD3_DEPTH):
        for part in ("context_block", "x_block"):
            p = f"joint_blocks.{i}.{part}"
            # The last context block only feeds the x stream: no proj, no MLP, 2 modulations.
            pre_only = part == "context_block" and i == SD3_DEPTH - 1
            s.linear(f"{p}.attn.qkv", 3 * h, h)
            s.norm(f"{p}.attn.ln_q", head_dim)
            s.norm(f"{p}.attn.ln_k", head_dim)
            if not pre_only:
                s.linear(f"{p}.attn.proj", h, h)
                s.linear(f"{p}.mlp.fc1", 4 * h, h)
                s.linear(f"{p}.mlp.fc2", h, 4 * h)
            if pre_only:
                s.modulation(f"{p}.adaLN_modulation.1", 2, (), h)
            else:
                s.modulation(f"{p}.adaLN_modulation.1", 6, (2, 5), h)
    s.linear("final_layer.linear", SD3_PATCH * SD3_PATCH * SD3_LATENT_CHANNELS, h)
    s.linear("final_layer.adaLN_modulation.1", 2 * h, h)
    return s.specs


def clip_l_specs() -> list[TensorSpec]:
    """CLIP-L text model in the transformers key layout ComfyUI's CLIPLoader expects."""
    s, w = SpecBuilder(), CLIP_L_WIDTH
    s.tensor("text_model.embeddings.token_embedding.weight", (CLIP_L_VOCAB, w))
    s.tensor("text_model.embeddings.position_embedding.weight", (CLIP_L_POSITIONS, w))
    for i in range(CLIP_L_LAYERS):
        p = f"text_model.encoder.layers.{i}"
        s.norm(f"{p}.layer_norm1", w, bias=True)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s.linear(f"{p}.self_attn.{proj}", w, w)
        s.norm(f"{p}.layer_norm2", w, bias=True)
        s.linear(f"{p}.mlp.fc1", CLIP_L_MLP, w)
        s.linear(f"{p}.mlp.fc2", w, CLIP_L_MLP)
    s.norm("text_model.final_layer_norm", w, bias=True)
    s.linear("text_projection", w, w, bias=False)
    return s.specs


def _lora(targets: Iterable[tuple[str, int, int]], up: str, down: str, alpha: bool) -> list[TensorSpec]:
    """LoRA factors for (lora key, out, in) targets, named ``{key}{down}`` / ``{key}{up}``."""
    s = SpecBuilder()
    for key, out_f, in_f in targets:
        s.tensor(f"{key}{down}", (LORA_RANK, in_f), LORA)
        s.tensor(f"{key}{up}", (out_f, LORA_RANK), LORA)
        if alpha:
            s.tensor(f"{key}.alpha", (), ALPHA)
    return s.specs


def wan21_lora_specs() -> list[TensorSpec]:
    """Wan LoRA in the ``diffusion_model.<module>.lora_A/lora_B`` layout (musubi/diffusion-pipe)."""
    d, targets = WAN21_DIM, []
    for i in range(WAN21_LAYERS):
        for attn in ("self_attn", "cross_attn"):
            for proj in ("q", "k", "v", "o"):
                targets.append((f"diffusion_model.blocks.{i}.{attn}.{proj}", d, d))
        targets.append((f"diffusion_model.blocks.{i}.ffn.0", WAN21_FFN_DIM, d))
        targets.append((f"diffusion_model.blocks.{i}.ffn.2", d, WAN21_FFN_DIM))
    return _lora(targets, ".lora_B.weight", ".lora_A.weight", alpha=True)


def flux_lora_specs() -> list[TensorSpec]:
    """Flux LoRA in kohya's ``lora_unet_*`` layout (lora_down/lora_up/alpha), both block kinds.

    Only attention projections and the single blocks' output linear: at width 3072 every
    patched weight costs ComfyUI a backup copy and a full-size delta, so the MLPs and
    modulations (three quarters of the parameters) are left out to keep patching quick.
    """
    h, mlp, targets = FLUX_HIDDEN, 4 * FLUX_HIDDEN, []
    for i in range(FLUX_DOUBLE_BLOCKS):
        for stream in ("img", "txt"):
            p = f"lora_unet_double_blocks_{i}_{stream}"
            targets += [(f"{p}_attn_qkv", 3 * h, h), (f"{p}_attn_proj", h, h)]
    for i in range(FLUX_SINGLE_BLOCKS):
        targets.append((f"lora_unet_single_blocks_{i}_linear2", h, h + mlp))
    return _lora(targets, ".lora_up.weight", ".lora_down.weight", alpha=True)


def sd3_lora_specs() -> list[TensorSpec]:
    """SD3 LoRA in the diffusers/PEFT layout (``transformer.transformer_blocks.N.attn.to_q``...).

    to_q/to_k/to_v (and add_*_proj) each patch a third of ComfyUI's fused qkv weight, so this
    also exercises offset (sliced) LoRA patches. No alpha: ComfyUI then scales by 1.
    """
    h, targets = SD3_HIDDEN, []
    for i in range(SD3_DEPTH):
        p = f"transformer.transformer_blocks.{i}"
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            targets.append((f"{p}.attn.{proj}", h, h))
        targets += [(f"{p}.attn.to_out.0", h, h), (f"{p}.ff.net.0.proj", 4 * h, h), (f"{p}.ff.net.2", h, 4 * h)]
    return _lora(targets, ".lora_B.weight", ".lora_A.weight", alpha=False)


@dataclass(frozen=True)
class Artifact:
    """One file to generate: its spec builder and storage dtype."""

    name: str
    specs: Callable[[], list[TensorSpec]]
    dtype: torch.dtype

    @property
    def relpath(self) -> Path:
        return Path(FOLDERS[self.name]) / FILES[self.name]

    @property
    def seed(self) -> int:
        return SEED + zlib.crc32(self.name.encode())

    def is_current(self, path: Path) -> bool:
        return _up_to_date(path, self.name)

    def write(self, path: Path) -> None:
        write_artifact(self, path)


FLOAT_ARTIFACTS: tuple[Artifact, ...] = (
    Artifact(WAN21, wan21_specs, torch.float32),
    Artifact(FLUX, flux_specs, torch.bfloat16),
    Artifact(SD3, sd3_specs, torch.float32),
    Artifact(CLIP_L, clip_l_specs, torch.float16),
    Artifact(WAN21_LORA, wan21_lora_specs, torch.float32),
    Artifact(FLUX_LORA, flux_lora_specs, torch.float32),
    Artifact(SD3_LORA, sd3_lora_specs, torch.float32),
)


def tensor_seed(artifact_seed: int, key: str) -> int:
    """A seed per tensor, so a tensor's values depend only on the file and its key: adding a
    block or a layer to one architecture leaves every other tensor bit-identical."""
    digest = hashlib.blake2b(f"{artifact_seed}:{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def make_tensor(artifact: Artifact, spec: TensorSpec) -> torch.Tensor:
    """One tensor of an artifact, drawn in fp32 from its own seeded generator, then cast."""
    gen = torch.Generator().manual_seed(tensor_seed(artifact.seed, spec.key))
    t = torch.empty(spec.shape, dtype=torch.float32)
    if spec.init == WEIGHT:
        t.normal_(0.0, WEIGHT_STD, generator=gen)
    elif spec.init == BIAS:
        t.normal_(0.0, BIAS_STD, generator=gen)
    elif spec.init == NORM:
        t.normal_(1.0, NORM_STD, generator=gen)
    elif spec.init == LORA:
        t.normal_(0.0, LORA_STD, generator=gen)
    elif spec.init == ALPHA:
        t.fill_(LORA_ALPHA)
    else:
        raise ValueError(f"unknown init {spec.init!r} for {spec.key}")
    for gate in spec.gates:
        t.view(spec.chunks, -1)[gate] += 1.0
    return t.to(artifact.dtype)


def build_state_dict(artifact: Artifact) -> dict[str, torch.Tensor]:
    """All of an artifact's tensors in memory (what its file holds; handy for tests)."""
    return {spec.key: make_tensor(artifact, spec) for spec in artifact.specs()}


_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
}


def save_safetensors(
    path: Path,
    layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    tensor_for: Callable[[str], torch.Tensor],
    metadata: dict[str, str],
) -> None:
    """Write a safetensors file with a byte-stable header, one tensor in memory at a time.

    safetensors' own writer keeps ``__metadata__`` in a Rust HashMap, whose order changes from
    one process to the next, so its files are not bitwise reproducible; it also wants every
    tensor in memory at once. The format is simple (little-endian u64 header size, JSON
    header padded to 8 bytes, raw data), so we write it ourselves: the header from ``layout``
    (key, dtype, shape), keys sorted, then ``tensor_for(key)`` for each key in that order.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this writer copies raw memory")
    entries = sorted(layout)
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for key, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dtype, shape in entries:
            t = tensor_for(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: got {t.dtype} {tuple(t.shape)}, header says {dtype} {tuple(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        # Flush to disk before the rename: a crash then leaves the old file or the complete new
        # one, never an empty one under the final name. It also keeps gigabytes of dirty pages
        # from being written back while the caller goes on to load and run the models.
        f.flush()
        os.fsync(f.fileno())


def _up_to_date(path: Path, name: str) -> bool:
    """Whether ``path`` is a readable safetensors file we wrote with this generator version."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # missing, truncated or not safetensors: regenerate
        return False
    return meta.get(META_VERSION) == GENERATOR_VERSION and meta.get(META_NAME) == name


def write_artifact(artifact: Artifact, path: Path) -> None:
    """Generate and save one artifact atomically (temp file + rename), so an interrupted or
    concurrent run never leaves a half-written file that looks finished."""
    path.parent.mkdir(parents=True, exist_ok=True)
    specs = {spec.key: spec for spec in artifact.specs()}
    layout = [(key, artifact.dtype, spec.shape) for key, spec in specs.items()]
    meta = {META_VERSION: GENERATOR_VERSION, META_NAME: artifact.name, "seed": str(artifact.seed)}
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_safetensors(tmp, layout, lambda key: make_tensor(artifact, specs[key]), meta)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


# --- Quantized checkpoints ----------------------------------------------------------------
# What people run on small GPUs: the tiny Wan 2.1's own weights, quantized the way each format's tools do
# it. Every Linear weight is quantized (2-D, more than QUANTIZE_MIN elements: the rule of ComfyUI-GGUF's
# convert.py); everything else (norms, biases, modulations, the patch embedding) is kept in fp32.

QUANTIZE_MIN = 1024
_QK_K = 256  # values per GGML k-quant super-block


def _quantized(key: str, tensor: torch.Tensor) -> bool:
    return key.endswith(".weight") and tensor.dim() == 2 and tensor.numel() > QUANTIZE_MIN


def _per_tensor(weight: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` / scale in ``dtype``, and the fp32 scale that maps its largest magnitude onto the dtype's."""
    limit = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    scale = weight.abs().amax().float() / limit
    scaled = weight.float() / scale
    if not dtype.is_floating_point:
        scaled = scaled.round()
    return scaled.clamp(-limit, limit).to(dtype), scale


def _comfy_quant_layer(layer: str, weight: torch.Tensor, quant_format: str, dtype: torch.dtype) -> dict:
    """One layer in ComfyUI's per-layer format: quantized weight, ``weight_scale``, and its ``comfy_quant``
    entry (the layer's JSON config as bytes), which 0.33 loads as a QuantizedTensor."""
    data, scale = _per_tensor(weight, dtype)
    return {
        f"{layer}.weight": data,
        f"{layer}.weight_scale": scale,
        f"{layer}.comfy_quant": _config({"format": quant_format}),
    }


def _config(config: dict) -> torch.Tensor:
    """A layer's ``comfy_quant`` entry: its JSON config as bytes, as ComfyUI's own state_dict writes it."""
    return torch.tensor(list(json.dumps(config).encode()), dtype=torch.uint8)


def _kitchen_layer(
    layer: str, weight: torch.Tensor, quant_format: str, layout: str, config: tuple[str, ...] = (), **options: object
) -> dict[str, torch.Tensor]:
    """One layer quantized by comfy_kitchen's ``layout`` class with ``options``, stored as ComfyUI 0.33 stores a
    QuantizedTensor layer (``comfy/ops.py`` ``_quantized_weight_state_dict``): the layout's own state_dict
    tensors (``weight``, ``weight_scale``, ...) and a ``comfy_quant`` entry with the format and the Params
    fields named in ``config``, which its loader (``_load_quantized_module``) reads back into the Params.

    comfy_kitchen is the code 0.33's ``quant_ops`` runs for these formats (it registers these very classes,
    or for NVFP4 and MXFP8 subclasses whose round-to-nearest quantize makes the same calls), so the file holds
    what ComfyUI's own quantizer makes. It is imported here, not ``comfy``: that needs ComfyUI's folder on
    ``sys.path`` and, imported before a test sets ``args.cpu``, would change how the test's ComfyUI starts."""
    from comfy_kitchen import tensor as kitchen

    layout_cls = getattr(kitchen, layout)
    qdata, params = layout_cls.quantize(weight, **options)
    tensors = {}
    for suffix, tensor in layout_cls.state_dict_tensors(qdata, params).items():
        # safetensors' torch reader (0.8) has no F8_E8M0: MXFP8's block scales are stored as their bytes,
        # which ComfyUI's loader views as e8m0 again (``pop_scale(..., torch.float8_e8m0fnu)``).
        if tensor.dtype == torch.float8_e8m0fnu:
            tensor = tensor.view(torch.uint8)
        tensors[f"{layer}.weight{suffix}"] = tensor
    tensors[f"{layer}.comfy_quant"] = _config(
        {"format": quant_format} | {name: getattr(params, name) for name in config}
    )
    return tensors


def _scaled_fp8_layer(layer: str, weight: torch.Tensor) -> dict:
    """One layer in the older ``scaled_fp8`` format: an fp8 weight and its ``scale_weight``."""
    data, scale = _per_tensor(weight, torch.float8_e4m3fn)
    return {f"{layer}.weight": data, f"{layer}.scale_weight": scale}


@dataclass(frozen=True)
class SafetensorsQuant:
    """A quantized safetensors format: how a Linear layer is written, the file-wide marker tensors, and
    where the layers' configs go: ComfyUI 0.3.7x read them from the file's ``_quantization_metadata`` (0.33
    still does), 0.33's own files carry a ``comfy_quant`` entry per layer."""

    layer: Callable[[str, torch.Tensor], dict[str, torch.Tensor]]
    markers: dict[str, torch.Tensor] = field(default_factory=dict)
    config_in_metadata: bool = False
    #: The package ``layer`` imports, if any: where it is missing the file is not written.
    needs: str | None = None


_FP8_LAYER = functools.partial(_comfy_quant_layer, quant_format="float8_e4m3fn", dtype=torch.float8_e4m3fn)
SAFETENSORS_QUANT: dict[str, SafetensorsQuant] = {
    "float8_e4m3fn": SafetensorsQuant(_FP8_LAYER),
    "float8_e4m3fn in metadata": SafetensorsQuant(_FP8_LAYER, config_in_metadata=True),
    "int8_tensorwise": SafetensorsQuant(
        functools.partial(_comfy_quant_layer, quant_format="int8_tensorwise", dtype=torch.int8)
    ),
    # An empty marker: ComfyUI reads its dtype (and a 2-element one as "no fp8 matrix multiply").
    "scaled_fp8": SafetensorsQuant(_scaled_fp8_layer, {"scaled_fp8": torch.empty(0, dtype=torch.float8_e4m3fn)}),
    "float8_e5m2": SafetensorsQuant(
        functools.partial(_comfy_quant_layer, quant_format="float8_e5m2", dtype=torch.float8_e5m2)
    ),
    # ConvRot rotates each row's groups of 256 by a Hadamard matrix before quantizing, so a row's scale must
    # be its own (ComfyUI's quantize refuses convrot without per_channel); the tiny Wan's rows (256, 512 and
    # 4096 long) are whole groups. ComfyUI marks it with "convrot"/"convrot_groupsize" in the layer's config.
    "int8_tensorwise convrot": SafetensorsQuant(
        functools.partial(
            _kitchen_layer,
            quant_format="int8_tensorwise",
            layout="TensorWiseINT8Layout",
            config=("convrot", "convrot_groupsize"),
            convrot=True,
            per_channel=True,
        ),
        needs="comfy_kitchen",
    ),
    # ComfyUI's loader fixes quant_group_size at 64 and reads linear_dtype only where it is not int4, as its
    # state_dict writes it: the defaults are what it loads.
    "convrot_w4a4": SafetensorsQuant(
        functools.partial(
            _kitchen_layer,
            quant_format="convrot_w4a4",
            layout="TensorCoreConvRotW4A4Layout",
            config=("convrot_groupsize",),
        ),
        needs="comfy_kitchen",
    ),
    # The layout's default: symmetric 4-bit codes with a 16-level codebook (the fixed Lloyd-Max table for these
    # Gaussian weights), fp8 scales per 16 values. The asymmetric variant's ``correction`` tensor is one
    # ComfyUI's loader does not read, so a checkpoint cannot carry it.
    "asym_w4a8_int8": SafetensorsQuant(
        functools.partial(
            _kitchen_layer,
            quant_format="asym_w4a8_int8",
            layout="AsymW4A8Int8Layout",
            config=("group_size", "convrot_groupsize"),
        ),
        needs="comfy_kitchen",
    ),
    # Block scales in cuBLAS's swizzled tiles of 128 rows: the 64-row head's are padded to 128, as ComfyUI's.
    "nvfp4": SafetensorsQuant(
        functools.partial(_kitchen_layer, quant_format="nvfp4", layout="TensorCoreNVFP4Layout"), needs="comfy_kitchen"
    ),
    "mxfp8": SafetensorsQuant(
        functools.partial(_kitchen_layer, quant_format="mxfp8", layout="TensorCoreMXFP8Layout"), needs="comfy_kitchen"
    ),
}


def q4_k(weight: torch.Tensor) -> torch.Tensor:
    """GGML Q4_K blocks of ``weight`` (rows a multiple of 256 long), as the bytes GGUF stores.

    The ``gguf`` package reads Q4_K but cannot write it. Each super-block of 256 values holds fp16 ``d`` and
    ``dmin``, six-bit scales and mins for its eight sub-blocks of 32 (packed into 12 bytes), and a 4-bit
    quant per value: a value is ``d * scale * q - dmin * min``. Each sub-block maps [min(its values, 0),
    its max] onto 0..15, its scale and min rounded to multiples of the super-block's ``d`` and ``dmin``."""
    values = weight.float().reshape(-1, 8, 32)
    low = values.amin(-1).clamp(max=0)
    step, offset = (values.amax(-1) - low) / 15, -low
    d = (step.amax(-1) / 63).half()
    dmin = (offset.amax(-1) / 63).half()

    def sixths(wanted: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        unit = unit.float().unsqueeze(-1)
        return torch.where(unit > 0, (wanted / unit).round(), 0).clamp(0, 63).to(torch.uint8)

    scales, mins = sixths(step, d), sixths(offset, dmin)
    real_step = (d.float().unsqueeze(-1) * scales).unsqueeze(-1)
    real_offset = (dmin.float().unsqueeze(-1) * mins).unsqueeze(-1)
    quants = torch.where(real_step > 0, ((values + real_offset) / real_step).round(), 0).clamp(0, 15).to(torch.uint8)
    # Scales and mins 0-3 in the low six bits of bytes 0-3 and 4-7; those of 4-7 split: their low nibbles in
    # bytes 8-11 (scale low, min high), their top two bits in the top bits of bytes 0-3 and 4-7.
    packed_scales = torch.cat(
        [
            scales[:, :4] | (scales[:, 4:] >> 4) << 6,
            mins[:, :4] | (mins[:, 4:] >> 4) << 6,
            (scales[:, 4:] & 0x0F) | (mins[:, 4:] & 0x0F) << 4,
        ],
        dim=1,
    )
    # Sub-blocks 2g and 2g+1 share 32 bytes: low nibbles the first, high nibbles the second.
    pairs = quants.reshape(-1, 4, 2, 32)
    packed_quants = (pairs[:, :, 0] | pairs[:, :, 1] << 4).reshape(-1, 128)
    header = torch.stack([d, dmin], dim=1).view(torch.uint8)
    blocks = torch.cat([header, packed_scales, packed_quants], dim=1)
    return blocks.reshape(weight.shape[0], weight.shape[1] // _QK_K * blocks.shape[1])


@dataclass(frozen=True)
class QuantizedArtifact:
    """A quantized copy of a float artifact: ``quant`` is a key of :data:`SAFETENSORS_QUANT` or a GGML
    quantization type name (``Q8_0``, ``Q4_K``), written as GGUF for ComfyUI-GGUF."""

    name: str
    source: str
    quant: str

    @property
    def relpath(self) -> Path:
        return Path(FOLDERS[self.name]) / FILES[self.name]

    @property
    def is_gguf(self) -> bool:
        return self.quant not in SAFETENSORS_QUANT

    @property
    def needs(self) -> str | None:
        """The package writing the file takes (``gguf``, ``comfy_kitchen``), or None: torch alone."""
        return "gguf" if self.is_gguf else SAFETENSORS_QUANT[self.quant].needs

    def metadata(self) -> dict[str, str]:
        """What identifies the file as ours (and up to date)."""
        return {META_VERSION: GENERATOR_VERSION, META_NAME: self.name, "quantization": self.quant}

    def is_current(self, path: Path) -> bool:
        if not self.is_gguf:
            return _up_to_date(path, self.name)
        try:
            fields = _gguf_strings(path)
        except Exception:  # missing, truncated, not GGUF, or no gguf package: (re)write or refuse there
            return False
        return all(fields.get(key) == value for key, value in self.metadata().items())

    def contents(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A safetensors format's tensors (the source's, each Linear layer quantized) and metadata."""
        quant = SAFETENSORS_QUANT[self.quant]
        tensors = dict(quant.markers)
        for key, tensor in build_state_dict(ARTIFACTS[self.source]).items():
            if _quantized(key, tensor):
                tensors.update(quant.layer(key.removesuffix(".weight"), tensor))
            else:
                tensors[key] = tensor
        metadata = self.metadata()
        if quant.config_in_metadata:
            configs = {key.removesuffix(".comfy_quant"): key for key in tensors if key.endswith(".comfy_quant")}
            layers = {layer: json.loads(tensors.pop(key).numpy().tobytes()) for layer, key in configs.items()}
            metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
        return tensors, metadata

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            if self.is_gguf:
                self._write_gguf(tmp)
            else:
                tensors, metadata = self.contents()
                layout = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
                save_safetensors(tmp, layout, tensors.__getitem__, metadata)
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)

    def _write_gguf(self, path: Path) -> None:
        """As ComfyUI-GGUF's convert.py writes one: architecture ``wan``, the Linear weights in the
        quantization type, the rest in F32, a tensor of more than 4 dimensions stored flat with its
        ``comfy.gguf.orig_shape``."""
        import gguf  # requirements-dev.txt; only the GGUF files need it

        qtype = gguf.GGMLQuantizationType[self.quant]
        writer = gguf.GGUFWriter(path=None, arch="wan")
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        for key, value in self.metadata().items():
            writer.add_string(key, value)
        for key, tensor in sorted(build_state_dict(ARTIFACTS[self.source]).items()):
            if _quantized(key, tensor):
                data = (
                    q4_k(tensor)
                    if self.quant == "Q4_K"
                    else torch.from_numpy(gguf.quants.quantize(tensor.numpy(), qtype))
                )
                writer.add_tensor(key, data.numpy(), raw_dtype=qtype)
                continue
            if tensor.dim() > 4:
                writer.add_array(f"comfy.gguf.orig_shape.{key}", list(tensor.shape))
                tensor = tensor.reshape(tensor.shape[0], -1)
            writer.add_tensor(key, tensor.float().numpy())
        writer.write_header_to_file(path=path)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        with open(path, "rb+") as f:  # on disk before the rename, as save_safetensors does
            os.fsync(f.fileno())


def _gguf_strings(path: Path) -> dict[str, str]:
    """The string fields of a GGUF file's header."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {
        name: str(bytes(field.parts[field.data[-1]]), encoding="utf-8")
        for name, field in reader.fields.items()
        if field.types == [gguf.GGUFValueType.STRING]
    }


QUANTIZED_ARTIFACTS: tuple[QuantizedArtifact, ...] = (
    QuantizedArtifact(WAN21_FP8, WAN21, "float8_e4m3fn"),
    QuantizedArtifact(WAN21_FP8_METADATA, WAN21, "float8_e4m3fn in metadata"),
    QuantizedArtifact(WAN21_INT8, WAN21, "int8_tensorwise"),
    QuantizedArtifact(WAN21_SCALED_FP8, WAN21, "scaled_fp8"),
    QuantizedArtifact(WAN21_Q8_0, WAN21, "Q8_0"),
    QuantizedArtifact(WAN21_Q4_K, WAN21, "Q4_K"),
    QuantizedArtifact(WAN21_FP8_E5M2, WAN21, "float8_e5m2"),
    QuantizedArtifact(WAN21_INT8_CONVROT, WAN21, "int8_tensorwise convrot"),
    QuantizedArtifact(WAN21_W4A4, WAN21, "convrot_w4a4"),
    QuantizedArtifact(WAN21_W4A8, WAN21, "asym_w4a8_int8"),
    QuantizedArtifact(WAN21_NVFP4, WAN21, "nvfp4"),
    QuantizedArtifact(WAN21_MXFP8, WAN21, "mxfp8"),
)

ARTIFACTS: dict[str, Artifact | QuantizedArtifact] = {a.name: a for a in (*FLOAT_ARTIFACTS, *QUANTIZED_ARTIFACTS)}


#: Where the package a writer needs comes from.
_INSTALL_HINT = {
    "gguf": "pip install -r requirements-dev.txt",
    "comfy_kitchen": "ComfyUI 0.33's requirements.txt installs it",
}


def gguf_writable() -> bool:
    """Whether the ``gguf`` package (requirements-dev.txt) is there to write the GGUF checkpoints."""
    return importlib.util.find_spec("gguf") is not None


def _needs(name: str) -> str | None:
    """The package writing artifact ``name`` takes, or None."""
    artifact = ARTIFACTS[name]
    return artifact.needs if isinstance(artifact, QuantizedArtifact) else None


def writable(name: str) -> bool:
    """Whether this process can write artifact ``name``: the package its writer needs, if any, is installed
    (looked up, not imported, so asking costs nothing)."""
    needs = _needs(name)
    return needs is None or importlib.util.find_spec(needs) is not None


def generate(
    models_dir: Path,
    only: Iterable[str] | None = None,
    force: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Path]:
    """Write the tiny checkpoints under ``models_dir`` and return ``{name: path}``.

    ``only`` restricts to some of :data:`ARTIFACTS` (default: all); ``force`` rewrites files
    that are already up to date; ``log`` receives one line per file. A file whose writer needs a package that
    is missing (the GGUF files ``gguf``, most ComfyUI 0.33 quantized ones ``comfy_kitchen``) is left out, with a
    line saying so.
    """
    models_dir = Path(models_dir)
    names = list(ARTIFACTS) if only is None else list(only)
    unknown = sorted(set(names) - set(ARTIFACTS))
    if unknown:
        raise ValueError(f"unknown tiny model(s) {unknown}; known: {sorted(ARTIFACTS)}")
    paths: dict[str, Path] = {}
    for name in names:
        artifact = ARTIFACTS[name]
        path = models_dir / artifact.relpath
        if not writable(name):
            if log is not None:
                needs = _needs(name)
                log(f"{name:<11} skipped: the {needs} package is not installed ({_INSTALL_HINT[needs]})")
            continue
        if not force and artifact.is_current(path):
            status = "up to date"
        else:
            t0 = time.monotonic()
            artifact.write(path)
            status = f"written in {time.monotonic() - t0:.1f} s"
        if log is not None:
            log(f"{name:<11} {path} ({path.stat().st_size / 2**20:.1f} MiB, {status})")
        paths[name] = path
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models-dir", type=Path, required=True, help="ComfyUI models folder to write into")
    parser.add_argument("--only", nargs="+", choices=sorted(ARTIFACTS), help="generate only these files")
    parser.add_argument("--force", action="store_true", help="rewrite files even when they are up to date")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    generate(args.models_dir, only=args.only, force=args.force, log=print)
    print(f"done in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
