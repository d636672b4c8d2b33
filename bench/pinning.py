"""How a first load best ends with its streamed weights pinned: four ways side by side in one process, as ratios.

    python -m bench.pinning [--gib 4] [--block-mib 330] [--parts 26] [--rounds 3] [--dry-run]

From the repository root, in a host's venv, on a CUDA machine (``--dry-run``: the CPU). The source is what
ComfyUI's classic loader leaves: each block's weights as tensors of their own, already touched (``--parts`` per
block, half of them large, half a few KiB like biases and norms). Each way is timed from those tensors to pinned
bytes ready to copy, then one copy of every block to the device from what it made:

* register first (the pack's pinned buffers): a fresh buffer registered (``cudaHostRegister``), the block
  copied in;
* copy first: a fresh buffer, the block copied in (the first touch of its fresh pages then runs on the copy's
  threads, not inside the driver's registration), then registered;
* in place (ComfyUI's classic loader, ``pin_memory``): each weight registered where it lies, nothing copied;
  a weight whose pages another weight shares is refused, and counted;
* torch's pinned allocator: a fresh pinned buffer (``cudaHostAlloc``), the block copied in.

The first load's cost on a GPU is what this decides (docs/benchmarks.md, "the whole first load"). With
``--dry-run`` nothing is registered and there is no device copy: the code runs, the figures are the CPU's copies.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

import harness  # noqa: F401 (makes the pack importable as block_offload)

from block_offload.offload.page_lock import CudaHostRegistrar

MIB = 2**20
SMALL_PART = 4096  # bytes of a bias or a norm weight

#: What one way made from one block: its pinned tensors (one buffer, or the weights themselves) and the
#: registrations to undo, as pointers.
Made = tuple[list[torch.Tensor], list[int]]


def block_parts(block_bytes: int, parts: int) -> list[torch.Tensor]:
    """One block's weights as ComfyUI holds them: ``parts`` tensors, each its own allocation, touched."""
    small = parts // 2
    large = parts - small
    size = (block_bytes - small * SMALL_PART) // large
    sizes = [size] * large + [SMALL_PART] * small
    return [torch.ones(nbytes, dtype=torch.uint8) for nbytes in sizes]


def packed(weights: list[torch.Tensor], buffer: torch.Tensor) -> torch.Tensor:
    """``weights`` copied one after another into ``buffer`` (the pack's host buffer, without its alignment)."""
    offset = 0
    for weight in weights:
        buffer[offset : offset + weight.numel()].copy_(weight)
        offset += weight.numel()
    return buffer


class Ways:
    """The four ways (see the module docstring); ``registrar`` None: the dry run, nothing registered."""

    def __init__(self, registrar: CudaHostRegistrar | None) -> None:
        self.registrar = registrar
        self.refused = 0  # weights the driver refused to register in place

    def _register(self, tensor: torch.Tensor) -> bool:
        return self.registrar is None or self.registrar.register(tensor.data_ptr(), tensor.numel())

    def register_first(self, weights: list[torch.Tensor]) -> Made:
        buffer = torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8)
        registered = [buffer.data_ptr()] if self._register(buffer) and self.registrar else []
        return [packed(weights, buffer)], registered

    def copy_first(self, weights: list[torch.Tensor]) -> Made:
        buffer = packed(weights, torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8))
        registered = [buffer.data_ptr()] if self._register(buffer) and self.registrar else []
        return [buffer], registered

    def in_place(self, weights: list[torch.Tensor]) -> Made:
        registered = []
        for weight in weights:
            if not self._register(weight):
                self.refused += 1
            elif self.registrar is not None:
                registered.append(weight.data_ptr())
        return list(weights), registered

    def torch_allocator(self, weights: list[torch.Tensor]) -> Made:
        pinned = self.registrar is not None  # the CPU build of torch has no pinned allocator
        buffer = torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8, pin_memory=pinned)
        return [packed(weights, buffer)], []

    def undo(self, made: Made) -> None:
        if self.registrar is not None:
            for pointer in made[1]:
                self.registrar.unregister(pointer)


def to_device_gbps(made: list[Made], device: torch.device) -> float | None:
    """Every block copied once into one device slot, as the engine's copy stream does (a buffer at once, weights
    one by one); None without a device."""
    if device.type != "cuda":
        return None
    slot = torch.empty(max(sum(t.numel() for t in tensors) for tensors, _ in made), dtype=torch.uint8, device=device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for tensors, _ in made:
        offset = 0
        for tensor in tensors:
            slot[offset : offset + tensor.numel()].copy_(tensor, non_blocking=True)
            offset += tensor.numel()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return sum(t.numel() for tensors, _ in made for t in tensors) / seconds / 1e9


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=4.0, help="the streamed weights, in GiB")
    parser.add_argument("--block-mib", type=float, default=330.0, help="one block (Wan 2.1 14B's: 330 MiB in bf16)")
    parser.add_argument("--parts", type=int, default=26, help="weights per block (Wan's: 26)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dry-run", action="store_true", help="on the CPU: the copies alone")
    args = parser.parse_args(argv)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        print("bench.pinning: no CUDA device; --dry-run runs the copies on the CPU", file=sys.stderr)
        raise SystemExit(2)
    device = torch.device("cuda" if cuda else "cpu")
    block_bytes = int(args.block_mib * MIB)
    count = max(1, round(args.gib * 1024 / args.block_mib))
    source = [block_parts(block_bytes, args.parts) for _ in range(count)]
    total = sum(w.numel() for weights in source for w in weights)
    ways = Ways(CudaHostRegistrar() if cuda else None)
    named: dict[str, Callable[[list[torch.Tensor]], Made]] = {
        "register first": ways.register_first,
        "copy first": ways.copy_first,
        "in place": ways.in_place,
        "torch's pinned allocator": ways.torch_allocator,
    }
    seconds: dict[str, list[float]] = {name: [] for name in named}
    h2d: dict[str, list[float]] = {name: [] for name in named}
    for round_ in range(args.rounds):
        order = list(named) if round_ % 2 == 0 else list(reversed(named))
        for name in order:
            start = time.perf_counter()
            made = [named[name](weights) for weights in source]
            seconds[name].append(time.perf_counter() - start)
            gbps = to_device_gbps(made, device)
            if gbps is not None:
                h2d[name].append(gbps)
            for one in made:
                ways.undo(one)
            del made
    print(f"{count} blocks of {args.block_mib:.0f} MiB in {args.parts} weights ({total / 2**30:.2f} GiB), {device}, "
          f"medians of {args.rounds} rounds")  # fmt: skip
    baseline = statistics.median(seconds["register first"])
    result = {}
    for name in named:
        took = statistics.median(seconds[name])
        copy = f", then to the device {statistics.median(h2d[name]):.1f} GB/s" if h2d[name] else ""
        ratio = took / baseline
        print(f"{name}: {took:.3f} s to pinned ({total / took / 1e9:.2f} GB/s, {ratio:.2f}x register first){copy}")
        result[name] = took
    refused = ways.refused // max(1, args.rounds)
    print(f"in place: {refused} of {count * args.parts} weights refused by the driver per round (pages shared)")
    return result


if __name__ == "__main__":
    main()
