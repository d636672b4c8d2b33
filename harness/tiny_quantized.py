"""The tiny Wan 2.1's weights quantized as users' small-GPU checkpoints are: ComfyUI's per-layer formats
(``comfy_quant``, the older ``scaled_fp8``), written as safetensors, and GGUF for ComfyUI-GGUF, each the way its
own tools write it (``harness/tiny_models.py`` names the files).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# What people run on small GPUs: the tiny Wan 2.1's own weights, quantized the way each format's tools do
# it. Every Linear weight is quantized (2-D, more than QUANTIZE_MIN elements: the rule of ComfyUI-GGUF's
# convert.py); everything else (norms, biases, modulations, the patch embedding) is kept in fp32.

QUANTIZE_MIN = 1024
_QK_K = 256  # values per GGML k-quant super-block


def quantized(key: str, tensor: torch.Tensor) -> bool:
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


def gguf_strings(path: Path) -> dict[str, str]:
    """The string fields of a GGUF file's header."""
    import gguf

    reader = gguf.GGUFReader(path)
    return {
        name: str(bytes(field.parts[field.data[-1]]), encoding="utf-8")
        for name, field in reader.fields.items()
        if field.types == [gguf.GGUFValueType.STRING]
    }
