"""The key layouts of the tiny stand-ins for the official templates' models (``harness/template_models.py`` writes
them): each architecture's tensor names and shapes exactly as in the real checkpoints, only narrower and shallower
where ComfyUI's detection (``comfy/model_detection.py``, ``comfy/sd.py``) infers the size from the weights, and at
full size where it fixes it. Built with ``tiny_specs.SpecBuilder``, like the layouts of ``harness/tiny_specs.py``.

What each detection fixes, hence the sizes below (ComfyUI 0.33.0 and 0.3.75 alike unless said):

* Z-Image (Lumina 2 ``NextDiT``): detected as Z-Image only at width 3840 (30 heads of 128, FFN 10240); the caption
  width (``cap_feat_dim``) and the number of layers are inferred. Two noise- and two context-refiner layers are
  fixed (``n_refiner_layers``), so even one layer makes a 0.9 B-parameter model (1.8 GB in bf16): the costliest
  tiny model, seconds a step on a CPU core, so it has just one.
* Flux 2: the width is inferred (``img_in``), 128 per head; the text width (``txt_in``) and the depths are inferred.
* Krea 2: width, heads, key/value heads, depth and the text fusion's layers and width are inferred; the text fusion
  has 20 heads, fixed, so its width must be a multiple of 20.
* Wan 2.1 VAE (also Qwen-Image's and Krea 2's VAE): its base width is inferred (``decoder.head.0.gamma``).
* The Flux VAE (``ae.safetensors``) and Flux 2's: the encoder is 128 channels wide, fixed; 0.33 infers the decoder's
  width, 0.3.75 fixes it at 128 too. So the Flux VAE (Z-Image's, run on both hosts) is full size (84 M parameters),
  and Flux 2's (0.33 only, see ``templates.TEMPLATES``) has a small decoder, as its file name says.
* CLIP-G: ComfyUI's config is fixed (32 layers of 1280), so it is full size like the tiny CLIP-L.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from .tiny_specs import ALPHA, BIAS, LORA, LORA_RANK, NORM, SpecBuilder, TensorSpec, clip_specs

# --- Z-Image (Lumina 2 NextDiT, Z-Image variant) --------------------------------------------------------------------

ZIMAGE_DIM = 3840  # the width ComfyUI detects as Z-Image
ZIMAGE_HEAD_DIM = 128
ZIMAGE_FFN = 10240  # what NextDiT builds at width 3840 with Z-Image's ffn_dim_multiplier (8/3)
ZIMAGE_LAYERS = 1
ZIMAGE_REFINERS = 2  # n_refiner_layers: fixed by ComfyUI
ZIMAGE_CAPTION_DIM = 768  # the tiny CLIP-L's hidden states
ZIMAGE_ADALN_DIM = 256
ZIMAGE_LATENT_CHANNELS = 16
ZIMAGE_PATCH = 2

# --- Flux 2 (dev layout: guidance_in, global modulations, no biases) ----------------------------------------------

FLUX2_HIDDEN = 256  # two heads of 128 (ComfyUI: heads = hidden // sum(axes_dim) = hidden // 128)
FLUX2_DOUBLE_BLOCKS = 2
FLUX2_SINGLE_BLOCKS = 2
FLUX2_MLP_RATIO = 3
FLUX2_CONTEXT_DIM = 768  # the tiny CLIP-L's hidden states
FLUX2_LATENT_CHANNELS = 128  # 32 VAE channels patchified 2x2; patch size 1 in the model
FLUX2_HEAD_DIM = 128

# --- Krea 2 (single-stream MMDiT with a text fusion adapter) -------------------------------------------------------

KREA2_FEATURES = 256  # two heads of 128
KREA2_HEADS = 2
KREA2_KV_HEADS = 1
KREA2_LAYERS = 2
KREA2_MLP = 768  # SwiGLU: int(2 * 256 / 3) * 4 rounded up to 128
KREA2_TIME_DIM = 256
#: The text fusion takes ``TXT_LAYERS`` slices of ``TXT_DIM`` from each token's 1280 features (the tiny CLIP-G's
#: hidden states stand in for 12 stacked Qwen3-VL layers); 320 is a multiple of its 20 fixed heads (16 wide).
KREA2_TXT_LAYERS = 4
KREA2_TXT_DIM = 320
KREA2_TXT_HEADS = 20
KREA2_TXT_MLP = 896  # SwiGLU of 320: int(2 * 320 / 3) * 4 rounded up to 128
KREA2_LATENT_CHANNELS = 16
KREA2_PATCH = 2

# --- VAEs -----------------------------------------------------------------------------------------------------------

WAN_VAE_DIM = 16  # base width, inferred by ComfyUI (the real one is 96)
WAN_VAE_Z = 16
WAN_VAE_MULT = (1, 2, 4, 4)
WAN_VAE_RES_BLOCKS = 2
KL_VAE_CH = 128  # fixed by ComfyUI for the encoder (and, in 0.3.75, the decoder)
KL_VAE_MULT = (1, 2, 4, 4)
KL_VAE_RES_BLOCKS = 2
KL_VAE_SMALL_DECODER_CH = 32  # the decoder's GroupNorms (32 groups) take multiples of 32
FLUX_VAE_Z = 16
FLUX2_VAE_Z = 32

# --- CLIP-G ---------------------------------------------------------------------------------------------------------

CLIP_G_WIDTH = 1280
CLIP_G_LAYERS = 32
CLIP_G_MLP = 5120


def zimage_specs() -> list[TensorSpec]:
    """Z-Image Turbo (comfy/ldm/lumina/model.py ``NextDiT`` with ``z_image_modulation`` and pad tokens)."""
    s, d = SpecBuilder(), ZIMAGE_DIM
    s.tensor("x_pad_token", (1, d))
    s.tensor("cap_pad_token", (1, d))
    s.linear("x_embedder", d, ZIMAGE_LATENT_CHANNELS * ZIMAGE_PATCH * ZIMAGE_PATCH)
    s.linear("t_embedder.mlp.0", 1024, 256)
    s.linear("t_embedder.mlp.2", ZIMAGE_ADALN_DIM, 1024)
    s.norm("cap_embedder.0", ZIMAGE_CAPTION_DIM)
    s.linear("cap_embedder.1", d, ZIMAGE_CAPTION_DIM)
    blocks = [(f"noise_refiner.{i}", True) for i in range(ZIMAGE_REFINERS)]
    blocks += [(f"context_refiner.{i}", False) for i in range(ZIMAGE_REFINERS)]
    blocks += [(f"layers.{i}", True) for i in range(ZIMAGE_LAYERS)]
    for p, modulated in blocks:
        s.linear(f"{p}.attention.qkv", 3 * d, d, bias=False)
        s.linear(f"{p}.attention.out", d, d, bias=False)
        s.norm(f"{p}.attention.q_norm", ZIMAGE_HEAD_DIM)
        s.norm(f"{p}.attention.k_norm", ZIMAGE_HEAD_DIM)
        s.linear(f"{p}.feed_forward.w1", ZIMAGE_FFN, d, bias=False)
        s.linear(f"{p}.feed_forward.w2", d, ZIMAGE_FFN, bias=False)
        s.linear(f"{p}.feed_forward.w3", ZIMAGE_FFN, d, bias=False)
        for norm in ("attention_norm1", "ffn_norm1", "attention_norm2", "ffn_norm2"):
            s.norm(f"{p}.{norm}", d)
        if modulated:
            # scale_msa, gate_msa, scale_mlp, gate_mlp; the gates go through tanh: centred on 1 (tanh 0.76), as in
            # harness/tiny_models.py, so that every layer moves the output.
            s.tensor(f"{p}.adaLN_modulation.0.weight", (4 * d, ZIMAGE_ADALN_DIM))
            s.tensor(f"{p}.adaLN_modulation.0.bias", (4 * d,), BIAS, chunks=4, gates=(1, 3))
    s.linear("final_layer.linear", ZIMAGE_PATCH * ZIMAGE_PATCH * ZIMAGE_LATENT_CHANNELS, d)
    s.linear("final_layer.adaLN_modulation.1", d, ZIMAGE_ADALN_DIM)
    return s.specs


def flux2_specs() -> list[TensorSpec]:
    """Flux 2 dev in BFL's layout (comfy/ldm/flux/model.py with ``global_modulation``, no biases; the QK norms
    stored as ``scale``, which 0.33 renames and 0.3.75's detection requires)."""
    s, h = SpecBuilder(), FLUX2_HIDDEN
    mlp = FLUX2_MLP_RATIO * h
    s.linear("img_in", h, FLUX2_LATENT_CHANNELS, bias=False)
    for emb in ("time_in", "guidance_in"):
        s.linear(f"{emb}.in_layer", h, 256, bias=False)
        s.linear(f"{emb}.out_layer", h, h, bias=False)
    s.linear("txt_in", h, FLUX2_CONTEXT_DIM, bias=False)
    s.linear("double_stream_modulation_img.lin", 6 * h, h, bias=False)
    s.linear("double_stream_modulation_txt.lin", 6 * h, h, bias=False)
    s.linear("single_stream_modulation.lin", 3 * h, h, bias=False)
    for i in range(FLUX2_DOUBLE_BLOCKS):
        for stream in ("img", "txt"):
            p = f"double_blocks.{i}.{stream}"
            s.linear(f"{p}_attn.qkv", 3 * h, h, bias=False)
            s.norm(f"{p}_attn.norm.query_norm", FLUX2_HEAD_DIM, weight_key="scale")
            s.norm(f"{p}_attn.norm.key_norm", FLUX2_HEAD_DIM, weight_key="scale")
            s.linear(f"{p}_attn.proj", h, h, bias=False)
            s.linear(f"{p}_mlp.0", 2 * mlp, h, bias=False)  # SiLU-gated: gate and value in one
            s.linear(f"{p}_mlp.2", h, mlp, bias=False)
    for i in range(FLUX2_SINGLE_BLOCKS):
        p = f"single_blocks.{i}"
        s.linear(f"{p}.linear1", 3 * h + 2 * mlp, h, bias=False)
        s.linear(f"{p}.linear2", h, h + mlp, bias=False)
        s.norm(f"{p}.norm.query_norm", FLUX2_HEAD_DIM, weight_key="scale")
        s.norm(f"{p}.norm.key_norm", FLUX2_HEAD_DIM, weight_key="scale")
    s.linear("final_layer.linear", FLUX2_LATENT_CHANNELS, h, bias=False)
    s.linear("final_layer.adaLN_modulation.1", 2 * h, h, bias=False)
    return s.specs


def _krea2_block(s: SpecBuilder, p: str, features: int, heads: int, kv_heads: int, mlp: int) -> None:
    head_dim = features // heads
    s.norm(f"{p}.prenorm", features, weight_key="scale")
    s.norm(f"{p}.postnorm", features, weight_key="scale")
    s.linear(f"{p}.attn.wq", head_dim * heads, features, bias=False)
    s.linear(f"{p}.attn.wk", head_dim * kv_heads, features, bias=False)
    s.linear(f"{p}.attn.wv", head_dim * kv_heads, features, bias=False)
    s.linear(f"{p}.attn.gate", features, features, bias=False)
    s.norm(f"{p}.attn.qknorm.qnorm", head_dim, weight_key="scale")
    s.norm(f"{p}.attn.qknorm.knorm", head_dim, weight_key="scale")
    s.linear(f"{p}.attn.wo", features, features, bias=False)
    s.linear(f"{p}.mlp.gate", mlp, features, bias=False)
    s.linear(f"{p}.mlp.up", mlp, features, bias=False)
    s.linear(f"{p}.mlp.down", features, mlp, bias=False)


def krea2_specs() -> list[TensorSpec]:
    """Krea 2 (comfy/ldm/krea2/model.py ``SingleStreamDiT``). Its RMS norms scale by ``1 + scale`` (stored around
    0): the builder's norm init (around 1) only doubles them."""
    s, f = SpecBuilder(), KREA2_FEATURES
    s.linear("first", f, KREA2_LATENT_CHANNELS * KREA2_PATCH * KREA2_PATCH)
    for i in range(KREA2_LAYERS):
        p = f"blocks.{i}"
        s.tensor(f"{p}.mod.lin", (6 * f,), BIAS)
        _krea2_block(s, p, f, KREA2_HEADS, KREA2_KV_HEADS, KREA2_MLP)
    s.linear("tmlp.0", f, KREA2_TIME_DIM)
    s.linear("tmlp.2", f, f)
    for group in ("layerwise_blocks", "refiner_blocks"):
        for i in range(2):  # two of each, fixed by the model
            p = f"txtfusion.{group}.{i}"
            _krea2_block(s, p, KREA2_TXT_DIM, KREA2_TXT_HEADS, KREA2_TXT_HEADS, KREA2_TXT_MLP)
    s.linear("txtfusion.projector", 1, KREA2_TXT_LAYERS, bias=False)
    s.norm("txtmlp.0", KREA2_TXT_DIM, weight_key="scale")
    s.linear("txtmlp.1", f, KREA2_TXT_DIM)
    s.linear("txtmlp.3", f, f)
    s.norm("last.norm", f, weight_key="scale")
    s.linear("last.linear", KREA2_PATCH * KREA2_PATCH * KREA2_LATENT_CHANNELS, f)
    s.tensor("last.modulation.lin", (2, f), BIAS)
    s.linear("tproj.1", 6 * f, f)
    return s.specs


def block_lora_specs(model: Iterable[TensorSpec], block_prefixes: Sequence[str]) -> list[TensorSpec]:
    """A LoRA in the ``diffusion_model.<module>.lora_A/lora_B`` layout (what ComfyUI maps for any model) with factors
    for every 2-D weight of the blocks under ``block_prefixes``, so it moves every block the model streams."""
    s = SpecBuilder()
    for spec in model:
        if spec.key.startswith(tuple(block_prefixes)) and spec.key.endswith(".weight") and len(spec.shape) == 2:
            name = f"diffusion_model.{spec.key.removesuffix('.weight')}"
            s.tensor(f"{name}.lora_A.weight", (LORA_RANK, spec.shape[1]), LORA)
            s.tensor(f"{name}.lora_B.weight", (spec.shape[0], LORA_RANK), LORA)
            s.tensor(f"{name}.alpha", (), ALPHA)
    return s.specs


# --- VAEs -----------------------------------------------------------------------------------------------------------


def _wan_residual(s: SpecBuilder, p: str, in_dim: int, out_dim: int) -> None:
    s.tensor(f"{p}.residual.0.gamma", (in_dim, 1, 1, 1), NORM)
    s.tensor(f"{p}.residual.2.weight", (out_dim, in_dim, 3, 3, 3))
    s.tensor(f"{p}.residual.2.bias", (out_dim,), BIAS)
    s.tensor(f"{p}.residual.3.gamma", (out_dim, 1, 1, 1), NORM)
    s.tensor(f"{p}.residual.6.weight", (out_dim, out_dim, 3, 3, 3))
    s.tensor(f"{p}.residual.6.bias", (out_dim,), BIAS)
    if in_dim != out_dim:
        s.tensor(f"{p}.shortcut.weight", (out_dim, in_dim, 1, 1, 1))
        s.tensor(f"{p}.shortcut.bias", (out_dim,), BIAS)


def _wan_middle(s: SpecBuilder, p: str, dim: int) -> None:
    _wan_residual(s, f"{p}.0", dim, dim)
    s.tensor(f"{p}.1.norm.gamma", (dim, 1, 1), NORM)
    s.tensor(f"{p}.1.to_qkv.weight", (3 * dim, dim, 1, 1))
    s.tensor(f"{p}.1.to_qkv.bias", (3 * dim,), BIAS)
    s.tensor(f"{p}.1.proj.weight", (dim, dim, 1, 1))
    s.tensor(f"{p}.1.proj.bias", (dim,), BIAS)
    _wan_residual(s, f"{p}.2", dim, dim)


def _conv(s: SpecBuilder, name: str, out_c: int, in_c: int, kernel: Sequence[int]) -> None:
    s.tensor(f"{name}.weight", (out_c, in_c, *kernel))
    s.tensor(f"{name}.bias", (out_c,), BIAS)


def wan_vae_specs() -> list[TensorSpec]:
    """The Wan 2.1 VAE (comfy/ldm/wan/vae.py ``WanVAE``: causal 3-D convolutions, temporal down/upsampling in the
    last two levels), at base width ``WAN_VAE_DIM``. Qwen-Image's and Krea 2's VAE is the same network."""
    s, dim, z = SpecBuilder(), WAN_VAE_DIM, WAN_VAE_Z
    levels = len(WAN_VAE_MULT)
    temporal_down = (False, True, True)
    dims = [dim * m for m in (1, *WAN_VAE_MULT)]
    _conv(s, "encoder.conv1", dims[0], 3, (3, 3, 3))
    index = 0
    for level, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        for _ in range(WAN_VAE_RES_BLOCKS):
            _wan_residual(s, f"encoder.downsamples.{index}", in_dim, out_dim)
            in_dim, index = out_dim, index + 1
        if level != levels - 1:
            _conv(s, f"encoder.downsamples.{index}.resample.1", out_dim, out_dim, (3, 3))
            if temporal_down[level]:
                _conv(s, f"encoder.downsamples.{index}.time_conv", out_dim, out_dim, (3, 1, 1))
            index += 1
    _wan_middle(s, "encoder.middle", dims[-1])
    s.tensor("encoder.head.0.gamma", (dims[-1], 1, 1, 1), NORM)
    _conv(s, "encoder.head.2", 2 * z, dims[-1], (3, 3, 3))
    _conv(s, "conv1", 2 * z, 2 * z, (1, 1, 1))
    _conv(s, "conv2", z, z, (1, 1, 1))
    up_dims = [dim * m for m in (WAN_VAE_MULT[-1], *WAN_VAE_MULT[::-1])]
    temporal_up = temporal_down[::-1]
    _conv(s, "decoder.conv1", up_dims[0], z, (3, 3, 3))
    _wan_middle(s, "decoder.middle", up_dims[0])
    index = 0
    for level, (in_dim, out_dim) in enumerate(zip(up_dims[:-1], up_dims[1:], strict=True)):
        if level in (1, 2, 3):
            in_dim //= 2  # the previous level's upsampling halved the channels
        for _ in range(WAN_VAE_RES_BLOCKS + 1):
            _wan_residual(s, f"decoder.upsamples.{index}", in_dim, out_dim)
            in_dim, index = out_dim, index + 1
        if level != levels - 1:
            _conv(s, f"decoder.upsamples.{index}.resample.1", out_dim // 2, out_dim, (3, 3))
            if temporal_up[level]:
                _conv(s, f"decoder.upsamples.{index}.time_conv", 2 * out_dim, out_dim, (3, 1, 1))
            index += 1
    s.tensor("decoder.head.0.gamma", (up_dims[-1], 1, 1, 1), NORM)
    _conv(s, "decoder.head.2", 3, up_dims[-1], (3, 3, 3))
    return s.specs


def _kl_resnet(s: SpecBuilder, p: str, in_c: int, out_c: int) -> None:
    s.norm(f"{p}.norm1", in_c, bias=True)
    _conv(s, f"{p}.conv1", out_c, in_c, (3, 3))
    s.norm(f"{p}.norm2", out_c, bias=True)
    _conv(s, f"{p}.conv2", out_c, out_c, (3, 3))
    if in_c != out_c:
        _conv(s, f"{p}.nin_shortcut", out_c, in_c, (1, 1))


def _kl_mid(s: SpecBuilder, p: str, c: int) -> None:
    _kl_resnet(s, f"{p}.block_1", c, c)
    s.norm(f"{p}.attn_1.norm", c, bias=True)
    for proj in ("q", "k", "v", "proj_out"):
        _conv(s, f"{p}.attn_1.{proj}", c, c, (1, 1))
    _kl_resnet(s, f"{p}.block_2", c, c)


def kl_vae_specs(
    z: int, quant_convs: bool = False, batch_norm: bool = False, decoder_ch: int = KL_VAE_CH
) -> list[TensorSpec]:
    """The KL autoencoder of the Flux family (comfy/ldm/modules/diffusionmodules/model.py ``Encoder``/``Decoder``),
    its encoder at ComfyUI's fixed width, its decoder ``decoder_ch`` wide: the Flux VAE (``z`` 16), or Flux 2's
    (``z`` 32, with ``quant_convs`` and the ``batch_norm`` of its 2x2-patchified latent)."""
    s, ch, mult = SpecBuilder(), KL_VAE_CH, KL_VAE_MULT
    _conv(s, "encoder.conv_in", ch, 3, (3, 3))
    in_c = ch
    for level, m in enumerate(mult):
        out_c = ch * m
        for j in range(KL_VAE_RES_BLOCKS):
            _kl_resnet(s, f"encoder.down.{level}.block.{j}", in_c, out_c)
            in_c = out_c
        if level != len(mult) - 1:
            _conv(s, f"encoder.down.{level}.downsample.conv", out_c, out_c, (3, 3))
    _kl_mid(s, "encoder.mid", in_c)
    s.norm("encoder.norm_out", in_c, bias=True)
    _conv(s, "encoder.conv_out", 2 * z, in_c, (3, 3))
    in_c = decoder_ch * mult[-1]
    _conv(s, "decoder.conv_in", in_c, z, (3, 3))
    _kl_mid(s, "decoder.mid", in_c)
    for level in reversed(range(len(mult))):
        out_c = decoder_ch * mult[level]
        for j in range(KL_VAE_RES_BLOCKS + 1):
            _kl_resnet(s, f"decoder.up.{level}.block.{j}", in_c, out_c)
            in_c = out_c
        if level != 0:
            _conv(s, f"decoder.up.{level}.upsample.conv", out_c, out_c, (3, 3))
    s.norm("decoder.norm_out", in_c, bias=True)
    _conv(s, "decoder.conv_out", 3, in_c, (3, 3))
    if quant_convs:
        _conv(s, "quant_conv", 2 * z, 2 * z, (1, 1))
        _conv(s, "post_quant_conv", z, z, (1, 1))
    if batch_norm:
        # The running statistics of the patchified latent (4 z channels); the variance must be positive: norm init.
        s.tensor("bn.running_mean", (4 * z,), BIAS)
        s.tensor("bn.running_var", (4 * z,), NORM)
    return s.specs


def clip_g_specs() -> list[TensorSpec]:
    """CLIP-G (SDXL's bigG text model), full size."""
    return clip_specs(CLIP_G_WIDTH, CLIP_G_LAYERS, CLIP_G_MLP)
