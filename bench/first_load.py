"""The first load of a streamed model against ComfyUI's own load of it, on this machine's CPU, as a ratio.

    .venv/bin/python -m bench.first_load [--dim 1280 --ffn 3456 --layers 40] [--rounds 5] [--node partial]

The model is a Wan 2.1 14B-shaped checkpoint (its 40 blocks and key layout; ``--dim`` and ``--ffn`` narrower,
so it fits this machine: at 1280 / 3456 a block holds 44 MB in bf16), written as a safetensors file and loaded
by ComfyUI's own ``load_diffusion_model``. A round times, from the file, to the model loaded
(``load_models_gpu``) and to the end of the first sampler step (one step through ``comfy.sample``, ComfyUI
in-process on the CPU):

* ComfyUI alone: load, then the step;
* the pack: load, the node (``--node``: Partial GPU Residency, ``--budget`` of the model's bytes, policy auto,
  or Async Block Offload with every block streamed), then the step: what its first load adds (clone, twin, pack,
  pin where it can, plan).

The two take their turns within each round, in alternating order, so the page cache serves both alike (the
first round reads the file from the cache too: it was just written). Printed: each side's medians over
``--rounds`` and the ratios. The automatic placement measures on its first load, searches on its second and
places from the kept search after that (``offload/cost_cache.py``). The times are the CPU's: the pack's first
load packs every streamed block into a host buffer, which ComfyUI on the CPU never copies, and its steps copy
the streamed blocks inline.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import torch

from harness import tiny_specs
from harness.comfy_host import interrupt_on_sigterm, resolve_comfyui_path
from harness.inprocess import in_process_comfy, sample

from bench.checkpoints import CHECKPOINTS, WAN14B, Checkpoint, resized
from bench.comfy_models import write_checkpoint

NODES = ("partial", "async")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dim", type=int, default=1280)
    parser.add_argument("--ffn", type=int, default=3456)
    parser.add_argument("--layers", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--node", choices=NODES, default="partial")
    parser.add_argument("--budget", type=float, default=0.5, help="Partial GPU Residency's, a share of the model")
    parser.add_argument("--folder", type=Path, default=None, help="where to write the file (default: a temp dir)")
    return parser.parse_args(argv)


def wan_checkpoint(dim: int, ffn: int, layers: int) -> Checkpoint:
    """The benchmark's Wan 2.1 14B checkpoint with ``layers`` blocks at width ``dim`` (``ffn`` in its MLPs)."""
    layout = resized(tiny_specs.wan21_specs, WAN21_DIM=dim, WAN21_FFN_DIM=ffn, WAN21_LAYERS=layers)
    return dataclasses.replace(CHECKPOINTS[WAN14B], name=f"wan-{layers}-blocks", layout=layout)


def streamed(comfy: SimpleNamespace, node: str, model, budget: float):
    """``model`` through the pack's node as a user would set it for a model larger than their card."""
    if node == "partial":
        budget_gb = model.model_size() * budget / 1024**3
        run = comfy.nodes.PartialGPUResidency.execute
        return run(model, vram_budget_gb=budget_gb, policy="auto", prefetch_blocks=1, pin_memory=True).result[0]
    run = comfy.nodes.AsyncBlockOffload.execute
    return run(model, resident_blocks=0, prefetch_blocks=1, pin_memory=True, policy="leading").result[0]


def first_step(comfy: SimpleNamespace, path: Path, wrap: Callable | None) -> tuple[float, float]:
    """Seconds from the file to the model loaded (``load_models_gpu``, as the sampler calls it), and to the end
    of the first sampler step; ``wrap`` applied to the model as it comes from the file."""
    start = time.perf_counter()
    model = comfy.sd.load_diffusion_model(str(path))
    if wrap is not None:
        model = wrap(model)
    comfy.mm.load_models_gpu([model])
    loaded = time.perf_counter() - start
    sample(comfy, model, steps=1)
    stepped = time.perf_counter() - start
    engine = getattr(model, "offload_engine", None)
    if engine is not None:  # the rest of the prompt, untimed: once packed, a step the planner learns its costs from
        engine.runner.finish_packing()
        sample(comfy, model, steps=1)
    del model
    comfy.mm.unload_all_models()
    gc.collect()
    return loaded, stepped


def main(argv: list[str] | None = None) -> dict[str, float]:
    """The pack's time over ComfyUI's, to the model loaded and to the first step done."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")  # the pack's plan lines, as ComfyUI logs them
    sys.path.insert(0, str(resolve_comfyui_path()))
    os.environ["BLOCK_OFFLOAD_ALLOW_CPU"] = "1"  # the nodes stream on the CPU (else they pass the model through)
    comfy = in_process_comfy({})
    import folder_paths

    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        folder_paths.set_user_directory(folder)  # no measured costs: the automatic placement's first load
        checkpoint = wan_checkpoint(args.dim, args.ffn, args.layers)
        shapes = checkpoint.shapes(torch.bfloat16)
        path = write_checkpoint(checkpoint, shapes, torch.device("cpu"), torch.bfloat16, Path(folder))
        size = path.stat().st_size
        print(f"checkpoint: {args.layers} Wan 2.1 blocks at width {args.dim}, {size / 1e9:.2f} GB (bf16)")
        sides: dict[str, Callable | None] = {
            "ComfyUI": None,
            "pack": lambda model: streamed(comfy, args.node, model, args.budget),
        }
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in sides}
        for round_ in range(args.rounds):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for name in order:
                times[name].append(first_step(comfy, path, sides[name]))
            said = ", ".join(f"{name} {times[name][-1][0]:.2f} / {times[name][-1][1]:.2f} s" for name in sides)
            print(f"round {round_ + 1} (loaded / first step done): {said}", flush=True)
    result = {}
    for part, label in enumerate(("loaded", "first step done")):
        medians = {name: statistics.median(pair[part] for pair in pairs) for name, pairs in times.items()}
        ratio = medians["pack"] / medians["ComfyUI"]
        print(
            f"{label}, median of {args.rounds}: ComfyUI {medians['ComfyUI']:.2f} s, the pack ({args.node}) "
            f"{medians['pack']:.2f} s: {ratio:.2f}x"
        )
        result[label] = ratio
    return result


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()
