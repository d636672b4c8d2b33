"""What a LoRA costs per step when its patches are applied on the device as each streamed block arrives (the
streamed blocks' ``LoadedPatch``, nodes/loaded_patch.py), against the same model without the LoRA, and against ComfyUI
fully loaded, which patches once at load; side by side in one process, as ratios. Then what a strength change
costs from queue to the end of the first step, streamed and fully loaded.

    python -m bench.lora_cost [--arch wan|flux] [--real] [--device cpu|cuda] [--blocks N] [--rank N] [--steps N]
                              [--rounds N] [--latent D ...] [--dtype float32|bfloat16|float16]

From the repository root, in a host's venv. By default a Wan 2.1 architecture at dim 512 on the CPU, a rank-16
LoRA on every attention and FFN Linear (Flux: attention and the single blocks' output Linear), Async Block
Offload with no block resident; ``--real`` gives the blocks the real model's widths (Wan 2.1 14B, Flux.1-dev),
for a GPU. On the CPU the copies are RAM to RAM and the compute is the CPU's: the ratio is the point, not the
times. Each round samples every configuration in turn (loaded, then timed over one step and over ``--steps`` +
1: the difference is per step); the median of ``--rounds`` rounds is kept.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness import tiny_models as tm
from harness import tiny_specs
from harness.comfy_host import interrupt_on_sigterm, resolve_comfyui_path

from bench.checkpoints import resized

#: Per architecture: the checkpoint and LoRA layouts, the block count's constant, and the widths of the CPU run
#: and of the real model (``--real``).
ARCHS = {
    "wan": {
        "specs": (tiny_specs.wan21_specs, tiny_specs.wan21_lora_specs),
        "blocks": ("WAN21_LAYERS",),
        "cpu": {"WAN21_DIM": 512, "WAN21_FFN_DIM": 1024},
        "real": {"WAN21_DIM": 5120, "WAN21_FFN_DIM": 13824},
        "latent": (2, 16, 16),
    },
    "flux": {
        "specs": (tiny_specs.flux_specs, tiny_specs.flux_lora_specs),
        "blocks": ("FLUX_DOUBLE_BLOCKS", "FLUX_SINGLE_BLOCKS"),  # as many of each
        "cpu": {},
        "real": {"FLUX_CONTEXT_DIM": 4096},
        "latent": (16, 16),
    },
}
TEXT_TOKENS = 16


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", choices=list(ARCHS), default="wan")
    parser.add_argument("--real", action="store_true", help="the real model's widths (for a GPU)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--blocks", type=int, default=8, help="blocks (Flux: of each kind)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    parser.add_argument("--latent", type=int, nargs="+", help="latent frames, height, width (Flux: height, width)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    arch = ARCHS[args.arch]
    sys.path.insert(0, str(resolve_comfyui_path()))
    from comfy.cli_args import args as comfy_args

    if args.device == "cpu":
        comfy_args.cpu = True
        os.environ["BLOCK_OFFLOAD_ALLOW_CPU"] = "1"
    import comfy.sample
    import comfy.sd
    import comfy.utils

    from block_offload.nodes.blocks import find_blocks
    from block_offload.nodes.device_patches import patch_ms_per_unit
    from block_offload.nodes.offload_nodes import AsyncBlockOffload

    sizes = {
        **arch["real" if args.real else "cpu"],
        **dict.fromkeys(arch["blocks"], args.blocks),
        "LORA_RANK": args.rank,
    }
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory(prefix="lora-cost-") as folder:
        files = {}
        for name, specs in zip(("model", "lora"), arch["specs"], strict=True):
            files[name] = Path(folder) / f"{name}.safetensors"
            tm.Artifact(f"lora_cost_{name}", resized(specs, **sizes), dtype).write(files[name])
        model = comfy.sd.load_diffusion_model(str(files["model"]))
        lora = comfy.utils.load_torch_file(str(files["lora"]))

    def with_lora(patcher, strength: float):
        return comfy.sd.load_lora_for_models(patcher, None, lora, strength, 0)[0]

    noise, latent, cond = inputs(model, tuple(args.latent or arch["latent"]))

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

    plain_streamed = streamed(model)
    patched_on_device = "streamed, LoRA after the node (patched on the device each step)"
    loaded_with_lora = "fully loaded, LoRA (patched once at load)"
    configs = {
        "fully loaded": model,
        loaded_with_lora: with_lora(model, 1.0),
        "streamed": plain_streamed,
        patched_on_device: with_lora(plain_streamed, 1.0),
    }
    times: dict[str, list[float]] = {name: [] for name in configs}
    for _ in range(args.rounds):  # interleaved: the machine's drift falls on every configuration alike
        for name, patcher in configs.items():
            times[name].append(per_step_ms(patcher))
    rows = {name: statistics.median(values) for name, values in times.items()}
    base = rows["streamed"]
    device = torch.device(args.device)
    print(
        f"{args.arch} architecture ({'real widths' if args.real else 'CPU widths'}), {args.blocks} blocks, "
        f"rank-{args.rank} LoRA, {args.dtype}, latent {args.latent or arch['latent']}; "
        f"{args.steps} steps x {args.rounds} rounds"
    )
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"torch {torch.__version__}, {name}")
    for row, ms in rows.items():
        print(f"  {row:<66} {ms:8.1f} ms/step  {ms / base:5.3f}x streamed")
    # What the planner counts for these patches (every block streams): each kind of patched weight timed once.
    blocks = [f"diffusion_model.{block}" for block, _ in find_blocks(model.model.diffusion_model).blocks]
    predicted = rows["planner's patch cost"] = sum(patch_ms_per_unit(configs[patched_on_device], blocks, device))
    measured = rows[patched_on_device] - base
    print(f"  the planner's patch cost {predicted:.1f} ms/step; measured {measured:.1f} ms/step more than streamed")
    # A strength change: a new clone with other patches, queued; the time to the end of its first step.
    for row, patcher in ((patched_on_device, plain_streamed), (loaded_with_lora, model)):
        sampled_ms(configs[row], 1)  # loaded as it was
        changed = sampled_ms(with_lora(patcher, 0.5), 1)
        again = sampled_ms(configs[row], 1)  # back to strength 1.0: another change
        rows[f"strength change, {row}"] = ms = statistics.mean([changed, again])
        print(f"  a strength change, queue to the end of the first step: {row:<66} {ms:8.1f} ms")
    return rows


def inputs(model, latent_size: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Noise, an empty latent and a conditioning for ``model`` (Wan: a video latent; Flux: an image latent, with a
    pooled text vector and guidance)."""
    diffusion_model = model.model.diffusion_model
    generator = torch.Generator().manual_seed(1)
    latent = torch.zeros(1, 16, *latent_size)
    if hasattr(diffusion_model, "txt_in"):
        context = torch.randn(1, TEXT_TOKENS, diffusion_model.txt_in.in_features, generator=generator)
        pooled = torch.randn(1, diffusion_model.vector_in.in_layer.in_features, generator=generator)
        cond = [[context, {"pooled_output": pooled, "guidance": 3.5}]]
    else:
        cond = [[torch.randn(1, TEXT_TOKENS, diffusion_model.text_embedding[0].in_features, generator=generator), {}]]
    return torch.randn(latent.shape, generator=generator), latent, cond


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()
