"""Tiny stand-ins for the files ComfyUI's official templates load, under the templates' own file names, so that a
template's graph runs unchanged (``harness/templates.py``) on a CPU in seconds.

Each diffusion model is its real architecture at tiny width (``harness/template_specs.py``), detected by ComfyUI's own
loader, stored in the template's format as far as ``harness/tiny_quantized.py`` writes it; each LoRA matches its tiny
model's keys (every block's linear layers) with factors as large as the weights, so it changes the output; each VAE is
its real network, tiny where ComfyUI infers its size. A text encoder cannot be tiny (ComfyUI fixes every text
encoder's config), so each template's text-encoder name is a link to a full-size CLIP (the tiny CLIP-L of
``harness/tiny_models.py``, or a CLIP-G where the model needs a width CLIP-L cannot give);
``templates.for_tiny_models`` says how the graph copes.

Files are byte-stable: every tensor is drawn from its own seed (``tiny_models.make_tensor``, the seed from the file's
name and the key) and written by ``safetensors_writer.save_safetensors``; a file whose metadata already names it and
:data:`VERSION` is left alone, so a second run costs a header read per file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from safetensors import safe_open

from . import template_specs as ts
from . import tiny_models as tm
from .tiny_quantized import SAFETENSORS_QUANT, quantized
from .tiny_specs import TensorSpec, wan21_lora_specs, wan21_specs

#: Bump whenever the way tensors are drawn changes, so stale files are rewritten (a change of a file's layout, dtype
#: or format rewrites it anyway: its metadata holds a digest of them, :attr:`TinyFile.digest`).
VERSION = "1"
META_DIGEST = "block_offload_tiny_layout"
#: Name prefix of every file's seed and metadata name, so no file shares a seed with a ``tiny_models`` file.
SEED_PREFIX = "template/"
#: The row length ConvRot rotates by: only layers whose rows are whole groups are quantized with it.
CONVROT_GROUP = 256


def _block_linears(*prefixes: str, row_multiple: int = 1) -> Callable[[str, torch.Tensor], bool]:
    """Only the blocks' 2-D weights (whose rows are ``row_multiple`` long): what "mixed" checkpoints quantize,
    leaving embeddings, modulations and the final layer in bf16."""

    def rule(key: str, tensor: torch.Tensor) -> bool:
        return (
            key.startswith(prefixes)
            and key.endswith(".weight")
            and tensor.dim() == 2
            and tensor.shape[1] % row_multiple == 0
        )

    return rule


@dataclass(frozen=True)
class TinyFile:
    """A file written under ``folder/name``: the tensors of ``specs`` in ``dtype``, the weights that ``quantize``
    picks quantized as ``quant`` (a key of ``tiny_quantized.SAFETENSORS_QUANT``) when given: by default every large
    enough 2-D weight, the rule of the tiny Wan's quantized files (``tiny_quantized.quantized``)."""

    folder: str
    name: str
    specs: Callable[[], list[TensorSpec]]
    dtype: torch.dtype
    quant: str | None = None
    quantize: Callable[[str, torch.Tensor], bool] = quantized

    @property
    def relpath(self) -> Path:
        return Path(self.folder) / self.name

    @property
    def artifact(self) -> tm.Artifact:
        """The float file it is made from, seeded by its own name (``tiny_models.Artifact.seed``)."""
        return tm.Artifact(SEED_PREFIX + self.name, self.specs, self.dtype)

    @property
    def needs(self) -> str | None:
        """The package its writer needs (comfy_kitchen for ConvRot), or None."""
        return SAFETENSORS_QUANT[self.quant].needs if self.quant is not None else None

    @property
    def digest(self) -> str:
        """A digest of what the file holds: every tensor's key, shape and init, the dtype and the format."""
        layout = [(spec.key, spec.shape, spec.init, spec.chunks, spec.gates) for spec in self.specs()]
        text = json.dumps([layout, str(self.dtype), self.quant])
        return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()

    def metadata(self) -> dict[str, str]:
        meta = {tm.META_VERSION: VERSION, tm.META_NAME: SEED_PREFIX + self.name, META_DIGEST: self.digest}
        if self.quant is not None:
            meta["quantization"] = self.quant
        return meta

    def is_current(self, path: Path) -> bool:
        try:
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata() or {}
        except Exception:  # missing, truncated or not safetensors: (re)write it
            return False
        wanted = self.metadata()
        return all(meta.get(key) == wanted[key] for key in (tm.META_VERSION, tm.META_NAME, META_DIGEST))

    def write(self, path: Path) -> None:
        tm.write_whole(path, self._write)

    def _write(self, path: Path) -> None:
        if self.quant is None:
            tm.save_specs(path, self.artifact, self.specs(), self.dtype, self.metadata())  # the Z-Image is 2.2 GB
        else:
            tensors, metadata = self._quantized()
            tm.save_tensors(path, tensors, metadata)

    def _quantized(self) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
        """As ``tiny_models.QuantizedArtifact.contents``: the chosen layers quantized, the layers' configs in the
        file's metadata where the format keeps them there."""
        assert self.quant is not None
        return tm.quantized_contents(tm.build_state_dict(self.artifact), self.quant, self.quantize, self.metadata())


@dataclass(frozen=True)
class LinkedFile:
    """A name that is a symbolic link to another file of the same folder (a text encoder: one full-size CLIP
    serves every template)."""

    folder: str
    name: str
    target: str

    @property
    def relpath(self) -> Path:
        return Path(self.folder) / self.name

    def is_current(self, path: Path) -> bool:
        return path.is_symlink() and os.readlink(path) == self.target

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(self.target)  # relative: the models folder may be reached through another link
        os.replace(tmp, path)


TemplateFile = TinyFile | LinkedFile

CLIP_L_FILE = tm.CLIP_L_FILE
CLIP_G = TinyFile("text_encoders", "block_offload_tiny_clip_g.safetensors", ts.clip_g_specs, torch.float16)


def _te(name: str, target: str = CLIP_L_FILE) -> LinkedFile:
    return LinkedFile("text_encoders", name, target)


def _wan_vae(name: str) -> TinyFile:
    return TinyFile("vae", name, ts.wan_vae_specs, torch.float32)


def _lora_of(specs: Callable[[], list[TensorSpec]], *blocks: str) -> Callable[[], list[TensorSpec]]:
    def lora() -> list[TensorSpec]:
        return ts.block_lora_specs(specs(), blocks)

    lora.__name__ = f"{specs.__name__}_lora"
    return lora


def _flux_vae() -> list[TensorSpec]:
    return ts.kl_vae_specs(ts.FLUX_VAE_Z)


def _flux2_vae() -> list[TensorSpec]:
    return ts.kl_vae_specs(ts.FLUX2_VAE_Z, quant_convs=True, batch_norm=True, decoder_ch=ts.KL_VAE_SMALL_DECODER_CH)


# The file names are the templates' own (``comfyui_workflow_templates_json``). Formats: "fp8_scaled" Wan files are the
# older ``scaled_fp8`` marker format (what Comfy-Org published them in); "fp8mixed" keeps the layer configs in the
# file's metadata, as files of 0.3.7x's time did (0.33 reads them too); "int8_convrot" is ComfyUI 0.33's ConvRot int8.
TEMPLATE_FILES: MappingProxyType[str, tuple[TemplateFile, ...]] = MappingProxyType(
    {
        "video_wan2_2_14B_t2v": (
            # Wan 2.2 14B T2V is Wan 2.1's architecture (two experts): the tiny Wan 2.1 layout, each its own weights.
            TinyFile(
                "diffusion_models",
                "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors",
                wan21_specs,
                torch.float32,
                "scaled_fp8",
            ),
            TinyFile(
                "diffusion_models",
                "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors",
                wan21_specs,
                torch.float32,
                "scaled_fp8",
            ),
            TinyFile(
                "loras", "wan2.2_t2v_lightx2v_4steps_lora_v1.1_high_noise.safetensors", wan21_lora_specs, torch.float32
            ),
            TinyFile(
                "loras", "wan2.2_t2v_lightx2v_4steps_lora_v1.1_low_noise.safetensors", wan21_lora_specs, torch.float32
            ),
            _te("umt5_xxl_fp8_e4m3fn_scaled.safetensors"),
            _wan_vae("wan_2.1_vae.safetensors"),
        ),
        "image_z_image_turbo": (
            TinyFile("diffusion_models", "z_image_turbo_bf16.safetensors", ts.zimage_specs, torch.bfloat16),
            _te("qwen_3_4b.safetensors"),
            TinyFile("vae", "ae.safetensors", _flux_vae, torch.bfloat16),
        ),
        "image_flux2_text_to_image": (
            TinyFile(
                "diffusion_models",
                "flux2_dev_fp8mixed.safetensors",
                ts.flux2_specs,
                torch.bfloat16,
                "float8_e4m3fn in metadata",
                _block_linears("double_blocks.", "single_blocks."),
            ),
            TinyFile(
                "loras",
                "Flux_2-Turbo-LoRA_comfyui.safetensors",
                _lora_of(ts.flux2_specs, "double_blocks.", "single_blocks."),
                torch.float32,
            ),
            _te("mistral_3_small_flux2_bf16.safetensors"),
            TinyFile("vae", "full_encoder_small_decoder.safetensors", _flux2_vae, torch.bfloat16),
        ),
        "image_krea2_turbo_t2i_int8": (
            TinyFile(
                "diffusion_models",
                "krea2_turbo_int8_convrot.safetensors",
                ts.krea2_specs,
                torch.bfloat16,
                "int8_tensorwise convrot",
                _block_linears("blocks.", row_multiple=CONVROT_GROUP),
            ),
            TinyFile("loras", "krea2_darkbrush.safetensors", _lora_of(ts.krea2_specs, "blocks."), torch.float32),
            _te("qwen3vl_4b_fp8_scaled.safetensors", CLIP_G.name),
            _wan_vae("qwen_image_vae.safetensors"),
        ),
    }
)


def template_files(template: str) -> tuple[TemplateFile, ...]:
    """The files ``template`` loads, as written here (KeyError for a template without tiny stand-ins)."""
    return TEMPLATE_FILES[template]


def _linked_targets(files: Iterable[TemplateFile]) -> set[str]:
    return {file.target for file in files if isinstance(file, LinkedFile)}


def write_template_models(template: str, models_dir: Path, log: Callable[[str], None] | None = None) -> dict[str, Path]:
    """Writes the files ``template`` loads into ``models_dir`` (ComfyUI's ``models`` folder) and returns
    ``{file name: path}``; up-to-date files are left alone. The CLIPs the text-encoder names link to are written
    first: the tiny CLIP-L by ``tiny_models``, the CLIP-G here."""
    models_dir = Path(models_dir)
    files = template_files(template)
    targets = _linked_targets(files)
    if CLIP_L_FILE in targets:
        tm.generate(models_dir, only=[tm.CLIP_L])
    prerequisites = (CLIP_G,) if CLIP_G.name in targets else ()
    paths: dict[str, Path] = {}
    for file in (*prerequisites, *files):
        path = models_dir / file.relpath
        if isinstance(file, TinyFile) and file.needs is not None and not _importable(file.needs):
            raise ModuleNotFoundError(f"{file.name}: writing {file.quant} needs the {file.needs} package")
        status = tm.refresh(file, path)
        if log is not None:
            log(f"{file.relpath} ({status})")
        paths[file.name] = path
    return paths


def _importable(package: str) -> bool:
    return importlib.util.find_spec(package) is not None
