"""This pack against ComfyUI's own offloading, side by side in one process, on real-shaped models.

    .venv/bin/python -m bench.comfy_bench [--models wan14b flux12b] [--budgets 0.25 0.5 0.75]
                                         [--steps 3] [--warmup 1] [--out docs/results]

Each model is built by ComfyUI's own classes (``comfy.supported_models`` config ->
``comfy.model_base`` -> ``WanModel`` / ``Flux``) with random bf16 weights (nothing is
downloaded) and wrapped in ComfyUI's ``ModelPatcher``. Every configuration is loaded the way
ComfyUI's memory manager loads a model, ``partially_load(device, budget)`` with the budget
as ``load_models_gpu`` would compute it, then runs the diffusion model's forward
(``apply_model``) on fixed inputs: ``--warmup`` untimed steps, then ``--steps`` timed ones.

Configurations: fully resident (the reference); per budget (a share of the model's bytes),
ComfyUI's partial loading with its async offload on (2 streams, its NVIDIA default) and off,
this pack's Async Block Offload with as many leading blocks resident as fit (prefetch 1 and 2),
Partial GPU Residency trailing, strided and auto (the planner), and the Sequential Offload
Wrapper; without a budget, Async Block Offload with every block streamed. The lower bound is
max(resident step, bytes that do not fit / pinned host-to-device bandwidth).

Writes ``<model>.json``, ``<model>.md`` (the table and the issue's targets) and ``<model>.png``
(step time against budget, one line per method) to ``--out``.

Needs a CUDA device and exits with status 2 without one. ``--smoke`` runs the same code on the
CPU with tiny shapes (the times mean nothing), so the test suite can check the script itself.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import torch

from harness.comfy_host import REPO, resolve_comfyui_path
from harness.pack import PACK

from bench.plot import line_chart
from bench.results import ALL_STREAMED, AUTO, COMFYUI, GIB, RESIDENT, Measurement, ModelRun, markdown, series, write
from bench.timing import h2d_bandwidth_gbps, ms_per_call

NO_CUDA_EXIT = 2


@dataclass(frozen=True)
class ModelSpec:
    """A model shape: ComfyUI's config for it, and the inputs of one denoising step."""

    name: str
    title: str
    unet_config: dict[str, Any]
    latent: tuple[int, ...]
    context: tuple[int, ...]
    extra: dict[str, tuple[int, ...]] = field(default_factory=dict)  # more conditioning, by keyword
    guidance: bool = False


# Wan 2.1 T2V 14B: what comfy/model_detection.py derives from the real checkpoint.
WAN_CONFIG = {
    "image_model": "wan2.1",
    "model_type": "t2v",
    "patch_size": (1, 2, 2),
    "freq_dim": 256,
    "window_size": (-1, -1),
    "qk_norm": True,
    "cross_attn_norm": True,
    "eps": 1e-6,
    "in_dim": 16,
    "out_dim": 16,
    "text_len": 512,
}
# Flux.1 dev (12B): likewise, with guidance embedding.
FLUX_CONFIG = {
    "image_model": "flux",
    "guidance_embed": True,
    "axes_dim": [16, 56, 56],
    "mlp_ratio": 4.0,
    "theta": 10000,
    "in_channels": 16,
    "out_channels": 16,
    "patch_size": 2,
    "qkv_bias": True,
}

MODELS = {
    "wan14b": ModelSpec(
        "wan14b",
        "Wan 2.1 14B-shaped DiT (40 blocks, dim 5120), 480x832 x 33 frames, bf16",
        {**WAN_CONFIG, "dim": 5120, "ffn_dim": 13824, "num_heads": 40, "num_layers": 40, "text_dim": 4096},
        latent=(1, 16, 9, 60, 104),  # 33 frames -> 9 latent frames, 480x832 / 8
        context=(1, 512, 4096),
    ),
    "flux12b": ModelSpec(
        "flux12b",
        "Flux.1-dev-shaped DiT (19 double + 38 single blocks, hidden 3072), 1024x1024, bf16",
        {
            **FLUX_CONFIG,
            "hidden_size": 3072,
            "num_heads": 24,
            "depth": 19,
            "depth_single_blocks": 38,
            "context_in_dim": 4096,
            "vec_in_dim": 768,
        },
        latent=(1, 16, 128, 128),
        context=(1, 512, 4096),
        extra={"y": (1, 768)},
        guidance=True,
    ),
}
# The same architectures, tiny, for --smoke on the CPU.
SMOKE_MODELS = {
    "wan14b": ModelSpec(
        "wan14b",
        "Wan 2.1 architecture, tiny (smoke test: times mean nothing)",
        {**WAN_CONFIG, "dim": 256, "ffn_dim": 512, "num_heads": 2, "num_layers": 4, "text_dim": 64},
        latent=(1, 16, 2, 8, 8),
        context=(1, 16, 64),
    ),
    "flux12b": ModelSpec(
        "flux12b",
        "Flux architecture, tiny (smoke test: times mean nothing)",
        {
            **FLUX_CONFIG,
            "hidden_size": 256,
            "num_heads": 2,
            "depth": 2,
            "depth_single_blocks": 2,
            "context_in_dim": 64,
            "vec_in_dim": 32,
        },
        latent=(1, 16, 8, 8),
        context=(1, 8, 64),
        extra={"y": (1, 32)},
        guidance=True,
    ),
}


@dataclass
class Comfy:
    """ComfyUI's modules and this pack, imported once."""

    mm: ModuleType
    detection: ModuleType
    patcher: ModuleType
    nodes: ModuleType  # this pack's nodes
    offload: ModuleType  # this pack's engine, as the nodes see it
    find_blocks: Callable[[torch.nn.Module], tuple[Any, list[tuple[str, torch.nn.Module]]]]


def import_comfy(smoke: bool, user_dir: Path) -> Comfy:
    """ComfyUI from $COMFYUI_PATH or the set-up one, and this pack's nodes (``harness/pack.py``)."""
    sys.path.insert(0, str(resolve_comfyui_path()))
    from comfy.cli_args import args

    if smoke:
        args.cpu = True
        os.environ["BLOCK_OFFLOAD_ALLOW_CPU"] = "1"
    import comfy.model_detection
    import comfy.model_management
    import comfy.model_patcher
    import folder_paths

    # A fresh measurement cache: the automatic placement must measure, as on a first run.
    folder_paths.set_user_directory(str(user_dir))
    nodes = importlib.import_module(f"{PACK}.nodes.offload_nodes")
    offload = importlib.import_module(f"{PACK}.offload")
    architectures = importlib.import_module(f"{PACK}.nodes.architectures")
    return Comfy(
        comfy.model_management,
        comfy.model_detection,
        comfy.model_patcher,
        nodes,
        offload,
        architectures.find_blocks,
    )


# -- the model and its inputs -------------------------------------------------------------------


def build_model(comfy: Comfy, spec: ModelSpec, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A ModelPatcher over ComfyUI's own model class, weights random N(0, 0.02) in host memory.

    The model is created with uninitialised weights (ComfyUI's ops skip initialisation) and each
    weight is drawn on ``device``, where random numbers are fast, then copied into place.
    """
    config = comfy.detection.model_config_from_unet_config(dict(spec.unet_config))
    config.set_inference_dtype(dtype, None)
    model = config.get_model({}, "")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(torch.randn(param.shape, generator=generator, device=device, dtype=param.dtype).mul_(0.02))
    model.eval()
    # Offloading is to host memory, whatever ComfyUI's VRAM state would pick for a model this size.
    return comfy.patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))


def make_inputs(spec: ModelSpec, device: torch.device, seed: int = 1) -> dict[str, torch.Tensor]:
    """One denoising step's keyword arguments for ``BaseModel.apply_model``."""
    generator = torch.Generator(device=device).manual_seed(seed)

    def noise(shape: tuple[int, ...]) -> torch.Tensor:
        return torch.randn(shape, generator=generator, device=device)

    inputs = {"x": noise(spec.latent), "t": torch.full((1,), 0.5, device=device), "c_crossattn": noise(spec.context)}
    inputs.update({name: noise(shape) for name, shape in spec.extra.items()})
    if spec.guidance:
        inputs["guidance"] = torch.full((1,), 3.5, device=device)
    return inputs


def forward(patcher, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return patcher.model.apply_model(**inputs)


# -- configurations ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Config:
    """What to load and how: the patcher it builds from the base model, ComfyUI's offload streams."""

    method: str
    budget_bytes: int | None
    prepare: Callable[[Any], Any]  # base ModelPatcher -> the ModelPatcher to load
    comfy_streams: int = 2  # ComfyUI's async offload streams (``--async-offload``; 0 = off)


def _output(node_output) -> Any:
    return node_output.result[0]


def configs(comfy: Comfy, base, budgets: list[int], prefetch_choices: tuple[int, ...] = (1, 2)) -> list[Config]:
    """Every configuration, the reference first (the ratios need it)."""
    nodes = comfy.nodes
    _, blocks = comfy.find_blocks(base.model.diffusion_model)
    sizes = [comfy.offload.module_bytes(block) for _, block in blocks]
    outside = base.model_size() - sum(sizes)

    def async_offload(resident: int, prefetch: int) -> Callable[[Any], Any]:
        return lambda model: _output(nodes.AsyncBlockOffload.execute(model, resident, prefetch, True))

    def partial(budget: int, policy: str) -> Callable[[Any], Any]:
        return lambda model: _output(nodes.PartialGPUResidency.execute(model, budget / GIB, policy, 1, True))

    def sequential(budget: int) -> Callable[[Any], Any]:
        return lambda model: _output(nodes.SequentialOffloadWrapper.execute(model, "as loaded", budget / GIB, 2, True))

    found = [Config(RESIDENT, None, lambda model: model.clone())]
    found += [Config(f"{ALL_STREAMED}, prefetch {p}", None, async_offload(0, p)) for p in prefetch_choices]
    for budget in budgets:
        found += [
            Config(f"{COMFYUI}, async offload on", budget, lambda model: model.clone(), comfy_streams=2),
            Config(f"{COMFYUI}, async offload off", budget, lambda model: model.clone(), comfy_streams=0),
        ]
        for prefetch in prefetch_choices:
            # The engine's own budget rule (OffloadPlan.build): as many leading blocks as fit beside the slots.
            fit = comfy.offload.OffloadPlan.build(sizes, budget_bytes=max(0, budget - outside), prefetch=prefetch)
            found.append(
                Config(
                    f"Async Block Offload, leading blocks that fit, prefetch {prefetch}",
                    budget,
                    async_offload(len(fit.resident), prefetch),
                )
            )
        found += [
            Config("Partial GPU Residency, trailing", budget, partial(budget, "trailing")),
            Config("Partial GPU Residency, strided", budget, partial(budget, "strided")),
            Config(AUTO, budget, partial(budget, "auto")),
            Config("Sequential Offload Wrapper, prefetch 2", budget, sequential(budget)),
        ]
    return found


# -- measuring -----------------------------------------------------------------------------------


def _placement(patcher) -> tuple[str, int, float | None, float | None, bool]:
    """What the loaded patcher placed: a summary, bytes streamed per step, overlap, predicted ms, and
    whether it was an automatic placement's measuring run."""
    engine = getattr(patcher, "offload_engine", None)
    if engine is None:
        loaded = patcher.loaded_size()
        cast = patcher.model_size() - loaded
        return f"{loaded / GIB:.2f} GiB loaded, {cast / GIB:.2f} GiB cast on demand", cast, None, None, False
    step = engine.recorder.latest()
    overlap = step.overlap if step is not None else None
    streamed = engine.plan.streamed_bytes if engine.plan is not None else (step.bytes_copied if step else 0)
    placement = engine.placement
    return placement.summary, streamed, overlap, placement.predicted_ms, placement.measuring


def measure(comfy: Comfy, base, config: Config, inputs: dict, steps: int, warmup: int) -> Measurement:
    device = base.load_device
    comfy.mm.NUM_STREAMS = config.comfy_streams  # read by ComfyUI's loader and its casts at call time
    patcher = config.prepare(base)
    budget = 1e32 if config.budget_bytes is None else config.budget_bytes
    try:
        patcher.partially_load(device, budget)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        ms = ms_per_call(lambda: forward(patcher, inputs), device, steps, warmup)
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
        placement, streamed, overlap, predicted, measuring = _placement(patcher)
        rss = psutil.Process().memory_info().rss
        pinned = comfy.offload.pinned_bytes()
    finally:
        patcher.detach(unpatch_all=True)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    progress(f"{config.method}: {ms / 1000:.3f} s/step; {placement}")
    return Measurement(
        config.method, config.budget_bytes, ms, peak, rss, streamed, overlap, predicted, placement, pinned, measuring
    )


def run_model(comfy: Comfy, spec: ModelSpec, args: argparse.Namespace, device: torch.device, bandwidth: float):
    dtype = torch.float32 if args.smoke else torch.bfloat16
    started = time.perf_counter()
    base = build_model(comfy, spec, device, dtype)
    progress(f"{spec.name}: built in {time.perf_counter() - started:.0f} s, {base.model_size() / GIB:.2f} GiB")
    inputs = make_inputs(spec, device)
    budgets = [int(fraction * base.model_size()) for fraction in args.budgets]
    measurements, out_of_memory = [], []
    for config in configs(comfy, base, budgets):
        try:
            measured = measure(comfy, base, config, inputs, args.steps, args.warmup)
            if config.method == AUTO and measured.measuring:
                # No measurements yet: this run was placed strided and measured; the next one is planned.
                measurements.append(replace(measured, method=f"{AUTO} (first run: strided, measuring)"))
                measured = measure(comfy, base, config, inputs, args.steps, args.warmup)
        except torch.OutOfMemoryError:
            # One configuration that does not fit must not cost the others: it is listed as such.
            progress(f"{config.method}: out of device memory")
            out_of_memory.append(config.method + ("" if config.budget_bytes is None else f" at {_gib(config)}"))
            continue
        measurements.append(measured)
    comfy.mm.NUM_STREAMS = 2
    meta = run_meta(device, args)
    meta["wall time"] = f"{time.perf_counter() - started:.0f} s"
    if out_of_memory:
        meta["out of device memory"] = "; ".join(out_of_memory)
    return ModelRun(spec.name, spec.title, base.model_size(), bandwidth, measurements, meta)


def _gib(config: Config) -> str:
    return f"{config.budget_bytes / GIB:.2f} GiB"


def run_meta(device: torch.device, args: argparse.Namespace) -> dict[str, str]:
    def output(*command: str) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    dirty = output("git", "status", "--porcelain")
    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        if device.type == "cuda"
        else "",
        "torch": torch.__version__,
        "commit": output("git", "rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else ""),
        "command": " ".join(["python -m bench.comfy_bench", *args.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "steps": f"{args.warmup} warm-up + {args.steps} timed",
    }
    return {key: value for key, value in meta.items() if value}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--budgets", nargs="+", type=float, default=[0.25, 0.5, 0.75], help="shares of the model's bytes"
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps first (the engine learns the call order)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times mean nothing"
    )
    args = parser.parse_args(argv)
    args.argv = argv
    if not 0 < min(args.budgets) <= max(args.budgets) < 1:
        parser.error("budgets are shares of the model's bytes, between 0 and 1")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # ComfyUI's and the pack's INFO lines: off
    if not torch.cuda.is_available() and not args.smoke:
        print(
            "comfy_bench: no CUDA device. This benchmark compares GPU offloading and its figures only mean "
            "something on a GPU; run it on a CUDA machine (docs/benchmarks.md). "
            "--smoke runs the same code with tiny shapes on the CPU, to test the script only.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared machine
    with tempfile.TemporaryDirectory(prefix="comfy_bench_user_") as user_dir:
        comfy = import_comfy(args.smoke, Path(user_dir))
        bandwidth = h2d_bandwidth_gbps(device, nbytes=(64 << 20) if args.smoke else (1 << 30))
        for name in args.models:
            spec = (SMOKE_MODELS if args.smoke else MODELS)[name]
            run = run_model(comfy, spec, args, device, bandwidth)
            data, table = write(run, args.out)
            chart = line_chart(
                series(run),
                args.out / f"{run.model}.png",
                title=f"{run.title}: step time vs VRAM budget ({run.meta.get('device', '')})",
                x_label="VRAM budget for the model's weights (GiB)",
                y_label="seconds per step",
            )
            print(markdown(run))
            print(f"wrote {data}, {table}, {chart}")
    return 0


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
