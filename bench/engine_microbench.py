"""Engine micro-benchmark: one process, one model, side by side.

    python -m bench.engine_microbench [--blocks 16 --dim 2048 --tokens 4096] [--steps 5]

Prints the step time of: fully resident, synchronous offload (prefetch 0), async
streaming with prefetch 1 and 2, each as a ratio to resident and as the time each streamed
call adds to the resident step, with the overlap the recorder measured, plus the pinned
host-to-device bandwidth. Needs a CUDA device; ``--allow-cpu`` runs the same code on the CPU
(the step times mean nothing there, but at a tiny width, ``--dim 64 --tokens 16``, what a
streamed call adds is the engine's own work on the host: its hooks, bookkeeping and copies).
"""

from __future__ import annotations

import argparse
import sys

import torch

from harness.transformer_stack import transformer_stack

from bench.timing import h2d_bandwidth_gbps, ms_per_call
from block_offload.offload import CallOptions, RingOptions, StreamSpec, TimelineRecorder, stream_blocks


def time_forward(model: torch.nn.Module, x: torch.Tensor, steps: int = 5) -> float:
    """Milliseconds per forward, after two warm-up forwards (the engine learns the call order)."""
    with torch.inference_mode():
        return ms_per_call(lambda: model(x), x.device, steps, warmup=2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=2048)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=5, help="timed forwards per configuration")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU as a smoke test")
    args = parser.parse_args()
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        sys.exit(
            "engine_microbench: no CUDA device. The figures only mean something on a GPU; "
            "pass --allow-cpu to smoke-test the code path on the CPU."
        )
    dtype = getattr(torch, args.dtype)
    model = transformer_stack(num_blocks=args.blocks, dim=args.dim, heads=max(1, args.dim // 128)).to(dtype)
    x = torch.randn(1, args.tokens, args.dim, device=device, dtype=dtype)
    rows: list[tuple[str, float, float | None]] = []
    model.to(device)
    resident = time_forward(model, x, args.steps)
    rows.append(("resident", resident, None))
    model.cpu()
    model.embed.to(device)
    model.head.to(device)
    for name, prefetch in (("synchronous offload", 0), ("async, prefetch 1", 1), ("async, prefetch 2", 2)):
        recorder = TimelineRecorder(device)
        streamer = stream_blocks(
            model.blocks,
            device,
            range(args.blocks),
            StreamSpec(ring=RingOptions(prefetch=prefetch), calls=CallOptions(root=model), recorder=recorder),
        )
        streamer.enable()
        ms = time_forward(model, x, args.steps)
        rows.append((name, ms, recorder.latest().overlap))
        streamer.disable()
    print(
        f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
        f"{args.blocks} blocks x dim {args.dim}, {args.tokens} tokens, {args.dtype}"
    )
    print(f"pinned host-to-device bandwidth: {h2d_bandwidth_gbps(device):.1f} GB/s")
    print(f"{'configuration':<22}{'ms/step':>10}{'x resident':>12}{'us/call added':>15}{'overlap':>10}")
    for name, ms, overlap in rows:
        hidden = "" if overlap is None else f"{overlap:.1%}"
        added = "" if overlap is None else f"{(ms - resident) * 1e3 / args.blocks:.0f}"
        print(f"{name:<22}{ms:>10.2f}{ms / resident:>12.3f}{added:>15}{hidden:>10}")


if __name__ == "__main__":
    main()
