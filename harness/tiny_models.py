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
Tensors are generated and written one at a time, so even the 1 GB Flux needs little memory.

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
import fcntl
import hashlib
import importlib.util
import json
import os
import sys
import time
import zlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from safetensors import safe_open

from .safetensors_writer import save_safetensors
from .tiny_quantized import SAFETENSORS_QUANT, gguf_strings, q4_k, quantized
from .tiny_specs import (
    ALPHA,
    BIAS,
    FLUX_CONTEXT_DIM,
    FLUX_VEC_DIM,
    LORA,
    NORM,
    SD3_ADM_DIM,
    SD3_CONTEXT_DIM,
    WAN21_TEXT_DIM,
    WEIGHT,
    TensorSpec,
    clip_l_specs,
    flux_lora_specs,
    flux_specs,
    sd3_lora_specs,
    sd3_specs,
    wan21_lora_specs,
    wan21_specs,
)

#: Bump whenever any generated tensor changes, so stale files are rewritten.
GENERATOR_VERSION = "3"
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
# LoRA factors (``tiny_specs.LORA_RANK``): alpha / rank scales them to the weights' size.
LORA_ALPHA = 4.0
LORA_STD = 0.1

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


def _up_to_date(path: Path, name: str) -> bool:
    """Whether ``path`` is a readable safetensors file we wrote with this generator version."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
    except Exception:  # missing, truncated or not safetensors: regenerate
        return False
    return meta.get(META_VERSION) == GENERATOR_VERSION and meta.get(META_NAME) == name


def write_artifact(artifact: Artifact, path: Path) -> None:
    """Generate and save one artifact atomically (``write_whole``), so an interrupted or concurrent run never
    leaves a half-written file that looks finished."""
    meta = {META_VERSION: GENERATOR_VERSION, META_NAME: artifact.name, "seed": str(artifact.seed)}
    write_whole(path, lambda tmp: save_specs(tmp, artifact, artifact.specs(), artifact.dtype, meta))


def save_specs(
    path: Path, artifact: Artifact, specs: Iterable[TensorSpec], dtype: torch.dtype, meta: dict[str, str]
) -> None:
    """Generates ``artifact``'s tensors one at a time as they are written (a 1 GB file needs little memory)."""
    by_key = {spec.key: spec for spec in specs}
    layout = [(key, dtype, spec.shape) for key, spec in by_key.items()]
    save_safetensors(path, layout, lambda key: make_tensor(artifact, by_key[key]), meta)


class Writable(Protocol):
    def is_current(self, path: Path) -> bool: ...
    def write(self, path: Path) -> None: ...


def refresh(file: Writable, path: Path, force: bool = False, wait: bool = True) -> str | None:
    """Writes ``file`` at ``path`` unless it is there and up to date (or ``force``); says which, and how long.

    Under a lock beside the file: the suites and workers that start together each need every tiny file, and one
    writes it while the others wait for it, instead of each writing its own copy on the same cores. ``wait=False``
    returns None at once while another process holds the lock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.with_name(f".{path.name}.lock").open("a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return None
        if not force and file.is_current(path):
            return "up to date"
        start = time.monotonic()
        file.write(path)
        return f"written in {time.monotonic() - start:.1f} s"


def write_whole(path: Path, fill: Callable[[Path], None]) -> None:
    """``fill`` writes a temporary file beside ``path`` that is then renamed into place: a reader (another suite's
    server, another worker) never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        fill(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def save_tensors(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    layout = [(key, t.dtype, tuple(t.shape)) for key, t in tensors.items()]
    save_safetensors(path, layout, tensors.__getitem__, metadata)


def quantized_contents(
    state: dict[str, torch.Tensor],
    quant_name: str,
    quantize: Callable[[str, torch.Tensor], bool],
    metadata: dict[str, str],
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``state`` in the safetensors format ``quant_name``: each layer ``quantize`` picks quantized, the others as
    they are, and the layers' configs moved into ``metadata`` where the format keeps them there."""
    quant = SAFETENSORS_QUANT[quant_name]
    tensors = dict(quant.markers)
    for key, tensor in state.items():
        if quantize(key, tensor):
            tensors.update(quant.layer(key.removesuffix(".weight"), tensor))
        else:
            tensors[key] = tensor
    if quant.config_in_metadata:
        configs = {key.removesuffix(".comfy_quant"): key for key in tensors if key.endswith(".comfy_quant")}
        layers = {layer: json.loads(tensors.pop(key).numpy().tobytes()) for layer, key in configs.items()}
        metadata["_quantization_metadata"] = json.dumps({"format_version": "1.0", "layers": layers})
    return tensors, metadata


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
            fields = gguf_strings(path)
        except Exception:  # missing, truncated, not GGUF, or no gguf package: (re)write or refuse there
            return False
        return all(fields.get(key) == value for key, value in self.metadata().items())

    def contents(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """A safetensors format's tensors (the source's, each Linear layer quantized) and metadata."""
        return quantized_contents(build_state_dict(ARTIFACTS[self.source]), self.quant, quantized, self.metadata())

    def write(self, path: Path) -> None:
        write_whole(path, self._write_gguf if self.is_gguf else self._write_safetensors)

    def _write_safetensors(self, path: Path) -> None:
        tensors, metadata = self.contents()
        save_tensors(path, tensors, metadata)

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
            if quantized(key, tensor):
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
    pending = []
    for name in names:
        if writable(name):
            pending.append(name)
        elif log is not None:
            needs = _needs(name)
            log(f"{name:<11} skipped: the {needs} package is not installed ({_INSTALL_HINT[needs]})")
    # The files another process is writing are waited for last: this one writes the others meanwhile.
    for wait in (False, True):
        busy = []
        for name in pending:
            path = models_dir / ARTIFACTS[name].relpath
            status = refresh(ARTIFACTS[name], path, force, wait)
            if status is None:
                busy.append(name)
                continue
            if log is not None:
                log(f"{name:<11} {path} ({path.stat().st_size / 2**20:.1f} MiB, {status})")
            paths[name] = path
        pending = busy
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
