"""The key layouts of the tiny checkpoints (``harness/tiny_models.py``): each architecture's tensor names and
shapes, exactly those of the real checkpoints, only narrower and shallower where ComfyUI's detection
(``comfy/model_detection.py``) allows it. The sizes are module constants, read when a layout is built, so a
benchmark can build the same layout at real sizes (``bench.checkpoints.resized``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# LoRA factors: delta = up @ down * alpha / rank has std sqrt(rank) * 0.1 * 0.1 = 0.02 for
# rank 4, alpha 4: as large as the weights themselves, so strength 1.0 moves the output.
LORA_RANK = 4

# --- Architecture sizes ----------------------------------------------------------------

#: Wan 2.1 T2V. dim 256 -> 2 heads of 128 (ComfyUI derives heads = dim // 128).
WAN21_DIM = 256
WAN21_FFN_DIM = 512
WAN21_LAYERS = 5
WAN21_TEXT_DIM = 4096  # fixed by ComfyUI (WanModel default), not inferred from weights
WAN21_FREQ_DIM = 256  # fixed by ComfyUI
WAN21_LATENT_CHANNELS = 16
WAN21_PATCH = (1, 2, 2)
#: A wider, deeper tiny Wan (``bench.checkpoints.resized``): 24 blocks of 6 MiB in fp16 (dim 512, 4 heads), where the
#: model's Python objects (a module tree, about 3.6 KiB a module) are small beside its weights, as in a real Wan.
WAN21_WIDE_SIZES = {"WAN21_DIM": 512, "WAN21_FFN_DIM": 1024, "WAN21_LAYERS": 24}

#: Flux (dev-style: with guidance_in). Width fixed by ComfyUI, depth is ours.
FLUX_HIDDEN = 3072  # = 24 heads * 128, both fixed by ComfyUI's Flux detection
FLUX_DOUBLE_BLOCKS = 1
FLUX_SINGLE_BLOCKS = 1
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


def clip_specs(width: int, layers: int, mlp: int) -> list[TensorSpec]:
    """A CLIP text model (CLIP-L, CLIP-G) in the transformers key layout ComfyUI's CLIPLoader expects."""
    s, w = SpecBuilder(), width
    s.tensor("text_model.embeddings.token_embedding.weight", (CLIP_L_VOCAB, w))
    s.tensor("text_model.embeddings.position_embedding.weight", (CLIP_L_POSITIONS, w))
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}"
        s.norm(f"{p}.layer_norm1", w, bias=True)
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s.linear(f"{p}.self_attn.{proj}", w, w)
        s.norm(f"{p}.layer_norm2", w, bias=True)
        s.linear(f"{p}.mlp.fc1", mlp, w)
        s.linear(f"{p}.mlp.fc2", w, mlp)
    s.norm("text_model.final_layer_norm", w, bias=True)
    s.linear("text_projection", w, w, bias=False)
    return s.specs


def clip_l_specs() -> list[TensorSpec]:
    """CLIP-L, full size (ComfyUI's config fixes it)."""
    return clip_specs(CLIP_L_WIDTH, CLIP_L_LAYERS, CLIP_L_MLP)


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
