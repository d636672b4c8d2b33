"""The file tier against its limit: a stack streamed from its own checkpoint file, host buffers for a share
of its blocks, the others read from the file at every step.

    python -m bench.file_tier [--blocks 16 --dim 5120 --tokens 4096 --stored bfloat16]
                              [--host-shares 0 0.25 0.5 1] [--cold] [--folder DIR]

The stack (``harness/transformer_stack.py``, bf16 compute; at ``--dim 5120`` a block holds 12 x 5120^2
weights, 629 MB in bf16, near a Wan 2.1 14B block's 700 MB) is saved as a safetensors file in ``--stored``
and mapped read-only, as ComfyUI's Dynamic VRAM reader maps a checkpoint (``harness/mapped_file.py``). Per
share of the streamed bytes allowed host buffers (``offload/file_tier.py`` picks which blocks): the step time
of every block streamed (prefetch 2), against the resident step and the limit max(resident step, streamed
bytes / pinned host-to-device bandwidth, file-tier bytes / read bandwidth), the read bandwidth measured on
the file as the page cache holds it (warm: the file was just written). ``--cold`` also times each share
with the file's pages dropped from the page cache before every step (``posix_fadvise(DONTNEED)``, no root
needed): what a checkpoint larger than the RAM left costs.

Needs a CUDA device; ``--allow-cpu`` runs the same code on the CPU as a smoke test (the times mean nothing).
"""

from __future__ import annotations

import argparse
import copy
import sys
import tempfile
from pathlib import Path

import torch

from harness.comfy_host import interrupt_on_sigterm
from harness.mapped_file import MappedFile
from harness.transformer_stack import transformer_stack

from bench.engine_microbench import time_forward
from bench.timing import drop_from_cache, h2d_bandwidth_gbps
from block_offload.offload import (
    CallOptions,
    FileOptions,
    RingOptions,
    StreamSpec,
    TimelineRecorder,
    module_bytes,
    read_bandwidth,
    stream_blocks,
)
from block_offload.offload.file_tier import host_tier


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--dim", type=int, default=5120)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--stored", default="bfloat16", help="the dtype the file stores (compute is bf16)")
    parser.add_argument("--host-shares", type=float, nargs="+", default=[0.0, 0.25, 0.5, 1.0])
    parser.add_argument("--cold", action="store_true", help="also time every step with the file out of the cache")
    parser.add_argument("--folder", type=Path, default=None, help="where to write the file (default: a temp dir)")
    parser.add_argument("--allow-cpu", action="store_true", help="run on the CPU as a smoke test")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    if torch.cuda.is_available():
        device = torch.device("cuda")
    elif args.allow_cpu:
        device = torch.device("cpu")
    else:
        sys.exit("file_tier: no CUDA device. Pass --allow-cpu to smoke-test the code path on the CPU.")
    if args.folder:
        return measure(args, device, args.folder)
    with tempfile.TemporaryDirectory(prefix="block_offload_file_tier_") as folder:
        return measure(args, device, Path(folder))


def measure(args: argparse.Namespace, device: torch.device, folder: Path) -> list[dict]:
    """Every host share's row, the stack's file written into ``folder``."""
    model = transformer_stack(num_blocks=args.blocks, dim=args.dim, heads=max(1, args.dim // 128))
    model = model.to(torch.bfloat16)
    mapped = MappedFile(copy.deepcopy(model), folder / "stack.safetensors", getattr(torch, args.stored))
    x = torch.randn(1, args.tokens, args.dim, device=device, dtype=torch.bfloat16)
    model.to(device)
    resident = time_forward(model, x)
    with torch.inference_mode():
        reference = model(x)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for name, child in mapped.module.named_children():
        if name != "blocks":
            child.to(device, torch.bfloat16)
    blocks = list(mapped.module.blocks)
    streamed_bytes = [module_bytes(block, lambda module, name: torch.bfloat16) for block in blocks]
    h2d = (
        h2d_bandwidth_gbps(device, 256 * 2**20 if args.allow_cpu else 1 << 30) * 1e9 if device.type == "cuda" else None
    )
    read = read_bandwidth(mapped.slices.values(), limit=4 * 2**30)
    print(
        f"{args.blocks} blocks of dim {args.dim}, {sum(streamed_bytes) / 2**30:.2f} GiB in bf16, stored "
        f"{args.stored} ({mapped.file_bytes / 2**30:.2f} GiB file), {args.tokens} tokens, on {device}: resident "
        f"{resident:.1f} ms/step; pinned H2D {h2d / 1e9 if h2d else float('nan'):.1f} GB/s; file read "
        f"{read / 1e9:.2f} GB/s (page cache as found)"
    )
    rows = []
    modes = [False, True] if args.cold else [False]
    for share in args.host_shares:
        kept = host_tier(list(enumerate(streamed_bytes)), int(share * sum(streamed_bytes)))
        from_file = frozenset(range(len(blocks))) - kept
        file_bytes = sum(mapped.file_slice(t).nbytes for i in from_file for t in blocks[i].state_dict().values())
        for cold in modes:
            recorder = TimelineRecorder(device)
            streamer = stream_blocks(
                blocks,
                device,
                range(len(blocks)),
                StreamSpec(
                    ring=RingOptions(prefetch=2),
                    files=FileOptions(
                        file_slice=mapped.file_slice,
                        read_each_step=from_file,
                        dtype_of=lambda module, name: torch.bfloat16,
                    ),
                    calls=CallOptions(root=mapped.module),
                    recorder=recorder,
                ),
            )
            streamer.enable()
            hook = mapped.module.register_forward_pre_hook(lambda *_: drop_from_cache(mapped.path)) if cold else None
            ms = time_forward(mapped.module, x)
            with torch.inference_mode():
                same = torch.equal(mapped.module(x), reference)  # the same kernels: bitwise
            if hook is not None:
                hook.remove()
            step = recorder.latest()
            streamer.disable()
            limits = [resident, file_bytes / read * 1e3]
            if h2d:
                limits.append(sum(streamed_bytes) / h2d * 1e3)
            row = {
                "host_share": share,
                "cold": cold,
                "blocks_from_file": len(from_file),
                "ms_per_step": ms,
                "vs_resident": ms / resident,
                "limit_ms": max(limits),
                "vs_limit": ms / max(limits),
                "read_gbps": step.read_gbps if step else None,
                "bitwise": same,
            }
            rows.append(row)
    print("| host share | cache | from the file | ms/step | x resident | limit ms | x limit | read GB/s | bitwise |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        gbps = f"{r['read_gbps']:.2f}" if r["read_gbps"] else "-"
        print(
            f"| {r['host_share']:.2f} | {'cold' if r['cold'] else 'warm'} | {r['blocks_from_file']} | "
            f"{r['ms_per_step']:.1f} | {r['vs_resident']:.2f} | {r['limit_ms']:.1f} | {r['vs_limit']:.2f} | {gbps} | "
            f"{'yes' if r['bitwise'] else 'NO'} |"
        )
    mapped.close()
    return rows


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()
