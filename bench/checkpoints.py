"""The checkpoints the ComfyUI benchmark builds its models from: every key and shape of the real files
(Wan 2.1 T2V 14B, Flux.1-dev, Qwen-Image, LTX-2.3 22B, MiniMax H3), or of tiny ones for ``--smoke``, as meta
tensors, no data.

The host's own ``comfy.model_detection`` reads these shapes and picks the model config and classes, as
it does for a file on disk, so whatever parameters a ComfyUI version needs come from that version.

Wan and Flux reuse the key layouts of ``harness/tiny_models.py`` (what the test checkpoints are built
from) at the real sizes: its spec builders read the sizes from module constants when called, so the
sizes are swapped in for the call. Qwen-Image has no tiny checkpoint; its layout is written here.

LTX-2.3 and MiniMax H3, the two models ComfyUI 0.33 streams itself under Dynamic VRAM, take their layout from the
host's own classes built on the meta device at their default sizes (those of the released models), with the
switches a file's ``config`` metadata gives ComfyUI's detection; their smoke versions from the tiny specs of
``harness/dits_*.py``. Their latent is the packed audio and video one the sampler hands the model, with its
``latent_shapes``, and their text context is the one ComfyUI's ``extra_conds`` makes once per prompt.

Flux also comes quantized as users' small-GPU files are: ComfyUI's per-layer ``comfy_quant`` fp8 e4m3 and
GGUF Q8_0, each Linear weight quantized by ``tiny_models``' rule (its ``quant`` names the format as
``tiny_models.QuantizedArtifact`` does).
"""

from __future__ import annotations

import importlib
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Any
from unittest import mock

import torch

from harness import dits_video, dits_video_image, tiny_quantized, tiny_specs
from harness.dit_spec import TinyDiT
from harness.tiny_specs import NORM, WEIGHT, SpecBuilder, TensorSpec

#: The hidden size ComfyUI 0.3.75 fixes for Flux and Qwen-Image (24 heads of 128): their tiny smoke
#: checkpoints are shallow, never narrow.
FIXED_HIDDEN = 3072


def resized(layout: Callable[[], list[TensorSpec]], **sizes: object) -> Callable[[], list[TensorSpec]]:
    """``tiny_specs``' key layout of an architecture with other sizes (its module constants, by name).

    ``mock.patch.multiple`` refuses a name the module lacks, so a renamed constant fails loudly."""

    def specs() -> list[TensorSpec]:
        with mock.patch.multiple(tiny_specs, **sizes):
            return layout()

    return specs


def qwen_image_specs(layers: int, text_dim: int = 3584, latent_channels: int = 16, patch: int = 2) -> list[TensorSpec]:
    """Qwen-Image (``comfy/ldm/qwen_image/model.py``, the diffusers key layout ComfyUI loads as is)."""
    s, h = SpecBuilder(), FIXED_HIDDEN
    head_dim = 128
    s.linear("img_in", h, latent_channels * patch * patch)
    s.norm("txt_norm", text_dim)
    s.linear("txt_in", h, text_dim)
    s.linear("time_text_embed.timestep_embedder.linear_1", h, 256)
    s.linear("time_text_embed.timestep_embedder.linear_2", h, h)
    for i in range(layers):
        p = f"transformer_blocks.{i}"
        for stream in ("img", "txt"):
            s.modulation(f"{p}.{stream}_mod.1", 6, (2, 5), h)
            s.linear(f"{p}.{stream}_mlp.net.0.proj", 4 * h, h)
            s.linear(f"{p}.{stream}_mlp.net.2", h, 4 * h)
        for proj in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_out.0", "to_add_out"):
            s.linear(f"{p}.attn.{proj}", h, h)
        for norm in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            s.norm(f"{p}.attn.{norm}", head_dim)
    s.linear("norm_out.linear", 2 * h, h)
    s.linear("proj_out", patch * patch * latent_channels, h)
    return s.specs


def comfy_layout(module: str, model_class: str, config: Mapping[str, Any]) -> Callable[[], list[TensorSpec]]:
    """Every key and shape of the host's ``module.model_class`` built with ``config`` on the meta device: the file
    it loads as is (no key renamed on the way)."""

    def specs() -> list[TensorSpec]:
        import comfy.ops

        built = getattr(importlib.import_module(module), model_class)
        with torch.device("meta"):
            model = built(**config, dtype=torch.bfloat16, operations=comfy.ops.disable_weight_init)
        return [
            TensorSpec(key, tuple(tensor.shape), WEIGHT if tensor.dim() > 1 else NORM)
            for key, tensor in model.state_dict().items()
        ]

    return specs


def config_metadata(config: Mapping[str, Any]) -> Mapping[str, str]:
    """The safetensors metadata that hands ComfyUI's detection a transformer's config (as LTX files carry it)."""
    return MappingProxyType({"config": json.dumps({"transformer": dict(config)})})


def packed(*latents: tuple[int, ...]) -> tuple[int, ...]:
    """The one (1, 1, N) latent the sampler makes of an audio and a video latent (``comfy.utils.pack_latents``)."""
    return (1, 1, sum(math.prod(shape[1:]) for shape in latents))


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint's layout, and the inputs of one denoising step at the benchmark's resolution."""

    name: str
    title: str
    layout: Callable[[], list[TensorSpec]]
    latent: tuple[int, ...]
    text_tokens: int
    context_key: str  # the checkpoint's text projection: its input width is the text encoder's
    pooled_key: str | None = None  # likewise for a pooled text vector (Flux's ``y``)
    guidance: bool = False  # guidance-distilled (Flux dev): a guidance scale per step
    #: None: the weights in the benchmark's float dtype; else a key of ``tiny_quantized.SAFETENSORS_QUANT`` or a
    #: GGML quantization type name (written as GGUF, loaded by ComfyUI-GGUF).
    quant: str | None = None
    gguf_arch: str = ""  # ``general.architecture`` of the checkpoint written as GGUF (ComfyUI-GGUF checks it)
    metadata: Mapping[str, str] = field(default_factory=dict)  # the file's ``__metadata__``
    quantized_under: tuple[str, ...] = ()  # where ``quant`` applies only to some layers: their prefixes
    #: The streams of a packed latent (``latent`` then is ``packed(*latent_shapes)``), handed to the model.
    latent_shapes: tuple[tuple[int, ...], ...] = ()
    #: The text context's width where ``context_key``'s input width is not it (a context ``extra_conds`` made).
    context_width: int | None = None

    @property
    def is_gguf(self) -> bool:
        return self.quant is not None and self.quant not in tiny_quantized.SAFETENSORS_QUANT

    def quantized(self, name: str, quant: str, label: str, gguf_arch: str) -> Checkpoint:
        """The same checkpoint as ``name``, its Linear weights in ``quant`` (``label`` says how in the title)."""
        return replace(self, name=name, title=f"{self.title}, {label}", quant=quant, gguf_arch=gguf_arch)

    def shapes(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The checkpoint as ComfyUI's detection reads it: every tensor, on the meta device (no memory)."""
        return {spec.key: torch.empty(spec.shape, dtype=dtype, device="meta") for spec in self.layout()}

    def input_shapes(self, shapes: dict[str, torch.Tensor]) -> dict[str, tuple[int, ...]]:
        """``BaseModel.apply_model``'s tensor inputs, their widths read off the checkpoint."""
        width = shapes[self.context_key].shape[1] if self.context_width is None else self.context_width
        found = {"x": self.latent, "c_crossattn": (1, self.text_tokens, width)}
        if self.pooled_key is not None:
            found["y"] = (1, shapes[self.pooled_key].shape[1])
        return found


WAN14B, FLUX12B, QWEN20B = "wan14b", "flux12b", "qwen20b"
LTX23_22B_FP8, MINIMAX_H3_INT8 = "ltx23_22b_fp8", "minimax_h3_int8"
FP8, Q8_0, INT8 = "float8_e4m3fn", "Q8_0", "int8_tensorwise"
FP8_LABEL = "weights fp8 e4m3 (ComfyUI per-layer comfy_quant)"
Q8_0_LABEL = "weights GGUF Q8_0 (ComfyUI-GGUF)"
FLUX12B_FP8, FLUX12B_Q8_0 = "flux12b_fp8", "flux12b_q8_0"

CHECKPOINTS = {
    WAN14B: Checkpoint(
        WAN14B,
        "Wan 2.1 T2V 14B (40 blocks, dim 5120), 480x832 x 33 frames, bf16",
        resized(tiny_specs.wan21_specs, WAN21_DIM=5120, WAN21_FFN_DIM=13824, WAN21_LAYERS=40),
        latent=(1, 16, 9, 60, 104),  # 33 frames -> 9 latent frames, 480x832 / 8
        text_tokens=512,
        context_key="text_embedding.0.weight",
    ),
    FLUX12B: Checkpoint(
        FLUX12B,
        "Flux.1-dev 12B (19 double + 38 single blocks, hidden 3072), 1024x1024, bf16",
        resized(tiny_specs.flux_specs, FLUX_DOUBLE_BLOCKS=19, FLUX_SINGLE_BLOCKS=38, FLUX_CONTEXT_DIM=4096),
        latent=(1, 16, 128, 128),
        text_tokens=512,
        context_key="txt_in.weight",
        pooled_key="vector_in.in_layer.weight",
        guidance=True,
    ),
    QWEN20B: Checkpoint(
        QWEN20B,
        "Qwen-Image 20B (60 blocks, hidden 3072), 1024x1024, 256 text tokens, bf16",
        lambda: qwen_image_specs(layers=60),
        latent=(1, 16, 1, 128, 128),  # Qwen-Image takes video-shaped latents, one frame
        text_tokens=256,
        context_key="txt_in.weight",
    ),
}
CHECKPOINTS[FLUX12B_FP8] = CHECKPOINTS[FLUX12B].quantized(FLUX12B_FP8, FP8, FP8_LABEL, "flux")
CHECKPOINTS[FLUX12B_Q8_0] = CHECKPOINTS[FLUX12B].quantized(FLUX12B_Q8_0, Q8_0, Q8_0_LABEL, "flux")

LTXAV, MINIMAX_H3 = ("comfy.ldm.lightricks.av_model", "LTXAVModel"), ("comfy.ldm.minimax.model", "MiniMaxH3Model")
#: LTX-2.3's switches over LTX-2's layout, which its file's config metadata gives ComfyUI's detection.
LTX23_SWITCHES = MappingProxyType(
    {"apply_gated_attention": True, "cross_attention_adaln": True, "caption_proj_before_connector": True}
)
#: int8 per tensor, ComfyUI's ``int8_tensorwise``: the template's int8_convrot file stores its Linear weights in as
#: many bytes, rotated first; the rotation needs rows of whole 256-wide groups, which the AdaLN layers' 2688 are not.
INT8_LABEL = "Linear weights int8 (ComfyUI per-layer int8_tensorwise)"


#: 768x512, 49 frames at 25 fps: LTX's video latent (128 channels, /8 in time + 1, /32 in space) and its audio one
#: (8 channels x 16 mel bins, 25 latent frames a second).
LTX23_LATENTS = ((1, 128, 7, 16, 24), (1, 8, 50, 16))
#: MiniMax H3's video latent (24 channels) of 3510 tokens in its 1x2x2 patches, and its stereo audio latent.
MINIMAX_H3_LATENTS = ((1, 24, 9, 30, 52), (1, 32, 2, 50))
CHECKPOINTS[LTX23_22B_FP8] = Checkpoint(
    LTX23_22B_FP8,
    "LTX-2.3 22B (48 audio-video blocks, video 4096 / audio 2048 wide), 768x512 x 49 frames, "
    "Linear weights fp8 e4m3 (ComfyUI per-layer comfy_quant)",
    comfy_layout(*LTXAV, LTX23_SWITCHES),
    latent=packed(*LTX23_LATENTS),
    text_tokens=256,
    context_key="transformer_blocks.0.attn2.to_k.weight",
    quant=FP8,
    quantized_under=("transformer_blocks.",),  # the blocks, which stream, fp8; the layers around them bf16
    metadata=config_metadata(LTX23_SWITCHES),
    latent_shapes=LTX23_LATENTS,
    # What extra_conds hands on with the caption projection before the connectors: video and audio width side by
    # side (LTXAVModel's defaults: 32 heads of 128, 32 of 64).
    context_width=32 * 128 + 32 * 64,
)
CHECKPOINTS[MINIMAX_H3_INT8] = Checkpoint(
    MINIMAX_H3_INT8,
    f"MiniMax H3 (50 blocks, hidden 5376), 3510 video tokens, {INT8_LABEL}",
    comfy_layout(*MINIMAX_H3, {}),
    latent=packed(*MINIMAX_H3_LATENTS),
    text_tokens=256,
    context_key="condition_proj.weight",
    quant=INT8,
    quantized_under=("blocks.", "token_refiner.blocks."),  # the blocks int8; the layers around them bf16
    latent_shapes=MINIMAX_H3_LATENTS,
    context_width=5376,  # what extra_conds hands on: projected to the model's width (MiniMaxH3Model's default), refined
)


def _tiny(spec_name: str, checkpoint: Checkpoint, model_class: tuple[str, str], context_width: int) -> Checkpoint:
    """``checkpoint``'s smoke version: the tiny spec's model and latent (``harness/dits_*.py``), its processed text
    context ``context_width`` wide."""
    spec: TinyDiT = next(s for s in (*dits_video.SPECS, *dits_video_image.SPECS) if s.name == spec_name)
    config = {key: value for key, value in spec.unet_config.items() if key != "image_model"}
    latents = tuple(tuple(shape) for shape in spec.extra(torch.Generator())["latent_shapes"])
    return replace(
        checkpoint,
        title=f"{spec_name} architecture, tiny (smoke test: times mean nothing)",
        layout=comfy_layout(*model_class, config),
        latent=packed(*latents),
        text_tokens=spec.context[0],
        metadata=config_metadata(config),
        latent_shapes=latents,
        context_width=context_width,
    )


#: The same architectures as small as ComfyUI's detection allows, for ``--smoke`` on the CPU.
SMOKE_CHECKPOINTS = {
    WAN14B: Checkpoint(
        WAN14B,
        "Wan 2.1 architecture, tiny (smoke test: times mean nothing)",
        resized(tiny_specs.wan21_specs, WAN21_LAYERS=4),
        latent=(1, 16, 2, 8, 8),
        text_tokens=16,
        context_key="text_embedding.0.weight",
    ),
    FLUX12B: Checkpoint(
        FLUX12B,
        "Flux architecture, 1 double + 1 single block (smoke test: times mean nothing)",
        resized(tiny_specs.flux_specs, FLUX_DOUBLE_BLOCKS=1, FLUX_SINGLE_BLOCKS=1),
        latent=(1, 16, 4, 4),
        text_tokens=4,
        context_key="txt_in.weight",
        pooled_key="vector_in.in_layer.weight",
        guidance=True,
    ),
    QWEN20B: Checkpoint(
        QWEN20B,
        "Qwen-Image architecture, 1 block (smoke test: times mean nothing)",
        lambda: qwen_image_specs(layers=1),
        latent=(1, 16, 1, 4, 4),
        text_tokens=4,
        context_key="txt_in.weight",
    ),
}
# Quantized, the smoke runs the tiny Wan: the tiny Flux (width 3072, 0.5 GB quantized) takes about a minute
# a model on the CPU, most of it dequantizing every weight at every step.
SMOKE_CHECKPOINTS[FLUX12B_FP8] = SMOKE_CHECKPOINTS[WAN14B].quantized(FLUX12B_FP8, FP8, FP8_LABEL, "wan")
SMOKE_CHECKPOINTS[FLUX12B_Q8_0] = SMOKE_CHECKPOINTS[WAN14B].quantized(FLUX12B_Q8_0, Q8_0, Q8_0_LABEL, "wan")
# The tiny LTX-2 has LTX-2.0's layout: its processed context is the caption's width twice (32).
SMOKE_CHECKPOINTS[LTX23_22B_FP8] = _tiny("LTX-2", CHECKPOINTS[LTX23_22B_FP8], LTXAV, 2 * 32)
SMOKE_CHECKPOINTS[MINIMAX_H3_INT8] = _tiny("MiniMax H3", CHECKPOINTS[MINIMAX_H3_INT8], MINIMAX_H3, 64)
