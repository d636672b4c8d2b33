"""Tiny random-weight instances of ComfyUI's own diffusion models, built from its own classes and configs.

Each ``TinyDiT`` (``dit_spec.py``) names a ``comfy.supported_models`` class (what ComfyUI's loader would detect)
and the config its detection would produce, shrunk to a few channels; ``build`` makes the model as
``comfy.sd.load_diffusion_model_state_dict`` does after detection (the config's ``get_model``, weights
loaded, a ``ModelPatcher``), with seeded random weights; ``sample`` runs ComfyUI's sampler on it with a
latent and a conditioning of the shapes the model takes. The families are listed in ``dits_*.py`` (data: they
import ``dit_spec.py``, not this builder); ``zoo()`` gathers them.

Run ``python -m harness.tiny_dit [NAME ...]`` (ComfyUI on ``sys.path``, see ``inprocess.py``) to build and
sample each once and see its size and time; ``--readme docs/models.md`` writes that page's table of them
(``scripts/supported_models.sh``).
"""

from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from . import dits_flux_like, dits_image, dits_video, dits_video_image, dits_wan_variants
from .dit_spec import TinyDiT

#: Sampler steps: enough for the engine to learn the call order, then stream.
STEPS = 2
SEED = 20251125
WEIGHT_STD = 0.02


def _seed(name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{SEED}:{name}".encode()).digest()[:8], "little")


def randomize(module: torch.nn.Module) -> None:
    """Seeded random parameters, each from its own name: ComfyUI's layers skip initialisation, so they would
    hold whatever memory they got. One-dimensional weights (norms, scales) are near 1, the rest near 0."""
    with torch.no_grad():
        for name, param in module.named_parameters():
            generator = torch.Generator().manual_seed(_seed(name))
            values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * WEIGHT_STD
            if param.dim() == 1 and name.endswith("weight"):
                values += 1.0
            param.copy_(values.to(param.dtype))


def model_config(spec: TinyDiT) -> Any:
    """The config class with the spec's config, its keys over those the class fixes (``unet_extra_config``: the
    widths of a model ComfyUI knows in one size only)."""
    import comfy.supported_models

    config = getattr(comfy.supported_models, spec.config)(dict(spec.unet_config))
    config.unet_config.update(spec.unet_config)
    return config


def _model(spec: TinyDiT, dtype: torch.dtype, weights: dict[str, torch.Tensor] | None) -> Any:
    """The config's model as ``comfy.sd.load_diffusion_model_state_dict`` makes it once detected: stored in
    ``dtype`` (computed through ComfyUI's casts where its device cannot compute that), ``weights`` loaded, or
    seeded random ones."""
    import comfy.model_management as mm

    config = model_config(spec)
    device = mm.get_torch_device()
    manual_cast = mm.unet_manual_cast(dtype, device, config.supported_inference_dtypes)
    try:
        config.set_inference_dtype(dtype, manual_cast, device=device)
    except TypeError:  # 0.3.75 takes no device
        config.set_inference_dtype(dtype, manual_cast)
    with spec.building():
        model = config.get_model(weights or {}, "")
    if weights is None:
        randomize(model.diffusion_model)
    else:
        model.load_model_weights(dict(weights), "")
    spec.fill(model.diffusion_model)  # again after loading: a buffer outside the state dict is made anew
    return model


def build(spec: TinyDiT, weight_dtype: torch.dtype | None = None) -> Any:
    """A ``ModelPatcher`` of the model with its seeded random weights, stored as ``weight_dtype`` when given (as
    UNETLoader's ``weight_dtype`` stores them: the float32 weights cast), else in float32."""
    import comfy.model_management as mm
    import comfy.model_patcher

    model = _model(spec, torch.float32, None)
    if weight_dtype is not None:
        model = _model(spec, weight_dtype, model.diffusion_model.state_dict())
    device = mm.get_torch_device()
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=mm.unet_offload_device())


def conditioning(spec: TinyDiT, generator: torch.Generator) -> list[list[Any]]:
    tokens, width = spec.context
    context = torch.randn(1, tokens, width, generator=generator)
    return [[context, spec.extra(generator)]]


def sample(spec: TinyDiT, model: Any, seed: int = 5) -> torch.Tensor:
    """``STEPS`` euler steps of ComfyUI's sampler from a zero latent and seeded noise, at cfg 1 (the positive
    conditioning only, as ComfyUI skips the negative there)."""
    import comfy.sample

    diffusion_model = model.model.diffusion_model
    if hasattr(diffusion_model, "clear_kv_cache"):
        # HiDream-O1 keeps its text prefix's keys and values across prompts: each sample starts without them, so
        # that two samples of the same model compare (with them, a later one computes fewer tokens).
        diffusion_model.clear_kv_cache()
    cond = conditioning(spec, torch.Generator().manual_seed(1))
    latent = torch.zeros(spec.latent)
    noise = torch.randn(spec.latent, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(
        model, noise, STEPS, 1.0, "euler", "normal", cond, cond, latent, seed=seed, disable_pbar=True
    )


def zoo() -> list[TinyDiT]:
    """Every tiny model, in the order of the ``dits_*`` files."""
    return [
        *dits_video.SPECS,
        *dits_wan_variants.SPECS,
        *dits_video_image.SPECS,
        *dits_flux_like.SPECS,
        *dits_image.SPECS,
    ]


README_BEGIN, README_END = "<!-- supported models: begin -->", "<!-- supported models: end -->"


def models_table() -> str:
    """docs/models.md's table of the tested models: name, ComfyUI classes, and the block lists found in each, with the
    methods the model runs the blocks through where it does not call them (or why the block nodes stream it module
    by module)."""
    from block_offload.nodes.blocks import find_blocks
    from block_offload.offload import NoBlocksError
    from block_offload.offload.discovery import entry_methods

    rows = ["| Model | ComfyUI classes | Block lists found |", "|---|---|---|"]
    for spec in zoo():
        diffusion_model = build(spec).model.diffusion_model
        try:
            found = find_blocks(diffusion_model)
        except NoBlocksError as error:
            lists = f"none, streamed module by module: {error}"
        else:
            lists = ", ".join(f"`{found_list.path}` ({found_list.kind})" for found_list in found.lists)
            methods = dict.fromkeys(name for names in entry_methods(diffusion_model, found).values() for name in names)
            if methods:
                lists += f", run through their methods {', '.join(f'`{name}`' for name in methods)}"
        rows.append(f"| {spec.name} | `{spec.config}`, `{type(diffusion_model).__name__}` | {lists} |")
    return "\n".join(rows)


def with_models_table(readme: str) -> str:
    """``readme`` with ``models_table`` between its markers."""
    begin, end = readme.index(README_BEGIN) + len(README_BEGIN), readme.index(README_END)
    return f"{readme[:begin]}\n{models_table()}\n{readme[end:]}"


def check(specs: Sequence[TinyDiT]) -> int:
    """Builds and samples each model twice: finite, not all zero, deterministic. Prints size and time."""
    failed = 0
    for spec in specs:
        if not spec.available():
            print(f"{spec.name:32s} not in this ComfyUI ({spec.config})")
            continue
        try:
            start = time.perf_counter()
            model = build(spec)
            first, second = sample(spec, model), sample(spec, model)
            seconds = time.perf_counter() - start
            params = sum(p.numel() for p in model.model.diffusion_model.parameters())
            problems = []
            if not torch.isfinite(first).all():
                problems.append("not finite")
            if not first.abs().sum() > 0:
                problems.append("all zero")
            if not torch.equal(first, second):
                problems.append("not deterministic")
            failed += bool(problems)
            print(f"{spec.name:32s} {params / 1e6:7.2f} M params {seconds:6.2f} s {' '.join(problems) or 'ok'}")
        except Exception as error:  # report every model, then fail
            failed += 1
            print(f"{spec.name:32s} FAILED: {type(error).__name__}: {error}")
    return 1 if failed else 0


def main(argv: Sequence[str]) -> int:
    """``[NAME ...]``: checks the models named (all by default); ``--readme PATH``: writes the table into it."""
    from comfy.cli_args import args

    args.cpu = True
    if argv[:1] == ["--readme"]:
        path = Path(argv[1])
        path.write_text(with_models_table(path.read_text()))
        return 0
    specs = [spec for spec in zoo() if not argv or spec.name in argv or spec.config in argv]
    return check(specs)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
