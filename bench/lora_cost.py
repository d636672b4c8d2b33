"""What a LoRA costs per step when its patches are applied on the device at compute time (the streamed blocks'
``LoadedPatch``, nodes/device_patches.py), against the same model without the LoRA, and against ComfyUI
fully loaded, which patches once at load; side by side in one process, as ratios.

    python -m bench.lora_cost [--blocks N] [--steps N] [--rounds N]   # from the repository root, in a host's venv

A Wan 2.1 architecture at dim 512 (ComfyUI's own loader and sampler, in-process), a rank-16 LoRA on every
attention and FFN Linear, Async Block Offload with no block resident. On the CPU the copies are RAM to RAM and
the compute is the CPU's: the ratio is the point, not the times. Each round samples every configuration in
turn (loaded, then timed over one step and over ``--steps`` + 1: the difference is per step); the median of
``--rounds`` rounds is kept.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import tiny_models as tm
from harness.comfy_host import resolve_comfyui_path

from bench.checkpoints import resized

SIZES = {"WAN21_DIM": 512, "WAN21_FFN_DIM": 1024, "LORA_RANK": 16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    sys.path.insert(0, str(resolve_comfyui_path()))
    from comfy.cli_args import args as comfy_args

    comfy_args.cpu = True
    import os

    os.environ["BLOCK_OFFLOAD_ALLOW_CPU"] = "1"
    import comfy.sample
    import comfy.sd
    import comfy.utils

    from block_offload.nodes.device_patches import patch_ms_per_unit
    from block_offload.nodes.offload_nodes import AsyncBlockOffload

    sizes = {**SIZES, "WAN21_LAYERS": args.blocks}
    with tempfile.TemporaryDirectory(prefix="lora-cost-") as folder:
        files = {}
        for name, specs in (("wan", tm.wan21_specs), ("lora", tm.wan21_lora_specs)):
            files[name] = Path(folder) / f"{name}.safetensors"
            tm.Artifact(f"lora_cost_{name}", resized(specs, **sizes), torch.float32).write(files[name])
        model = comfy.sd.load_diffusion_model(str(files["wan"]))
        lora = comfy.utils.load_torch_file(str(files["lora"]))
    with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]

    generator = torch.Generator().manual_seed(1)
    latent = torch.zeros(1, 16, 2, 16, 16)
    cond = [[torch.randn(1, 16, tm.WAN21_TEXT_DIM, generator=generator), {}]]
    noise = torch.randn(latent.shape, generator=generator)

    def sampled_ms(patcher, steps: int) -> float:
        start = time.perf_counter()
        comfy.sample.sample(
            patcher, noise, steps, 1.0, "euler", "normal", cond, cond, latent, seed=1, disable_pbar=True
        )
        return (time.perf_counter() - start) * 1000

    def per_step_ms(patcher) -> float:
        """One round: loaded (untimed), then the time of ``--steps`` more steps than one, per step; the load,
        the first step's set-up and the sampler's own overhead cancel out."""
        sampled_ms(patcher, 1)
        one = sampled_ms(patcher, 1)
        return (sampled_ms(patcher, 1 + args.steps) - one) / args.steps

    def streamed(patcher):
        return AsyncBlockOffload.execute(
            patcher, resident_blocks=0, prefetch_blocks=1, pin_memory=True, policy="leading"
        ).result[0]

    patched_on_device = "streamed, LoRA after the node (patched on the device each step)"
    configs = {
        "fully loaded": model,
        "fully loaded, LoRA (patched once at load)": with_lora,
        "streamed": streamed(model),
        patched_on_device: comfy.sd.load_lora_for_models(streamed(model), None, lora, 1.0, 0)[0],
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):  # interleaved: the machine's drift falls on every configuration alike
        for name, patcher in configs.items():
            times[name].append(per_step_ms(patcher))
    rows = {name: statistics.median(values) for name, values in times.items()}
    base = rows["streamed"]
    print(f"Wan 2.1 architecture, dim 512, {args.blocks} blocks, rank-16 LoRA; {args.steps} steps x {args.rounds}")
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, CPU")
    for name, ms in rows.items():
        print(f"  {name:<66} {ms:8.1f} ms/step  {ms / base:5.3f}x streamed")
    # What the planner counts for these patches (every block streams): each kind of patched weight timed once.
    blocks = [f"diffusion_model.blocks.{index}" for index in range(args.blocks)]
    predicted = sum(patch_ms_per_unit(configs[patched_on_device], blocks, torch.device("cpu")))
    measured = rows[patched_on_device] - base
    print(f"  the planner's patch cost {predicted:.1f} ms/step; measured {measured:.1f} ms/step more than streamed")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
