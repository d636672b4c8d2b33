"""How a first load best ends with its streamed weights pinned: seven ways side by side in one process, as ratios.

    python -m bench.pinning [--gib 4] [--block-mib 330] [--parts 26] [--rounds 3] [--folder DIR] [--dry-run]

From the repository root, in a host's venv, on a CUDA machine (``--dry-run``: the CPU). The source is what
ComfyUI's classic loader leaves: each block's weights as tensors of their own, already touched (``--parts`` per
block, half of them large, half a few KiB like biases and norms). Each way is timed from those tensors to pinned
bytes ready to copy, then one copy of every block to the device from what it made:

* register first (the pack's pinned buffers before 2026-11-27): a fresh buffer registered (``cudaHostRegister``),
  the block copied in;
* copy first (the pack's way since then, ``offload.pinning.filled_host_buffer``): a fresh buffer, the block
  copied in (the first touch of its fresh pages then runs on the copy's threads, not inside the driver's
  registration), then registered;
* in place (ComfyUI's classic loader, ``pin_memory``): each weight registered where it lies, nothing copied;
  a weight whose pages another weight shares is refused, and counted;
* torch's pinned allocator: a fresh pinned buffer (``cudaHostAlloc``), the block copied in.

And from a checkpoint file, as a Dynamic VRAM model holds its weights: views of the file mapped read-only, private
(as comfy-aimdo maps it), its pages in the page cache (the file written into ``--folder``, each block's bytes
back to back and the block padded to a page, so that no page holds two blocks):

* file copied first (the pack's way for a Dynamic VRAM model): a fresh buffer, the block copied in from the
  mapping, then registered;
* file read (comfy-aimdo's way: ``pread`` into pinned windows): a fresh buffer of torch's pinned allocator, the
  block read into it from the file;
* file in place: the block's pages of the mapping registered where they lie with ``cudaHostRegisterReadOnly``
  (nothing copied, the page cache pinned); one the driver refuses is counted, and copied from pageable pages.

The first load's cost on a GPU is what this decides (docs/records/log.md, "the whole first load"). With
``--dry-run`` there is no device: what a registration does to the pages, faulting every one of them in for
writing on the calling thread (for reading, the file's), is done by ``madvise(MADV_POPULATE_WRITE)``
(``MADV_POPULATE_READ``; Linux 5.14 on; elsewhere nothing), nothing is pinned and nothing is copied to a device.
The order's cost on the pages shows; the driver's does not.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

import harness  # noqa: F401 (makes the pack importable as block_offload)
from harness.comfy_host import interrupt_on_sigterm

from block_offload.offload.pinning import CudaHostRegistrar, HostRegistrar

MIB = 2**20
SMALL_PART = 4096  # bytes of a bias or a norm weight
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23  # <linux/mman.h>, Linux 5.14
# cudaHostRegisterPortable | cudaHostRegisterReadOnly: pages the process may only read (a file mapped read-only).
READ_ONLY_FLAGS = 0x01 | 0x08

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


class PageToucher:
    """The dry run's registrar: what ``cudaHostRegister`` does to a range's pages (the kernel faults each one
    in, on the calling thread), by ``madvise(advice)``: ``MADV_POPULATE_WRITE``, or ``MADV_POPULATE_READ`` for
    read-only pages; nothing is pinned. Where the kernel has no such advice (not Linux, or before 5.14) it does
    nothing."""

    def __init__(self, advice: int = MADV_POPULATE_WRITE) -> None:
        self.advice = advice
        self.madvise = getattr(ctypes.CDLL(None, use_errno=True), "madvise", None) if sys.platform == "linux" else None

    def register(self, pointer: int, nbytes: int) -> bool:
        if self.madvise is not None:
            start = pointer - pointer % mmap.PAGESIZE  # madvise takes whole pages
            if self.madvise(ctypes.c_void_p(start), ctypes.c_size_t(nbytes + pointer - start), self.advice):
                self.madvise = None  # an older kernel: the dry run's figures are the copies alone
        return True

    def unregister(self, pointer: int) -> bool:
        return True


class Ways:
    """The four ways (see the module docstring), registering through ``registrar``; ``pins``: whether it
    really pins (torch's pinned allocator is then used too)."""

    def __init__(self, registrar: HostRegistrar, pins: bool) -> None:
        self.registrar = registrar
        self.pins = pins
        self.refused = 0  # weights the driver refused to register in place

    def _registered(self, tensor: torch.Tensor) -> list[int]:
        """``tensor`` registered: its pointer to unregister; none if refused."""
        return [tensor.data_ptr()] if self.registrar.register(tensor.data_ptr(), tensor.numel()) else []

    def register_first(self, weights: list[torch.Tensor]) -> Made:
        buffer = torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8)
        registered = self._registered(buffer)
        return [packed(weights, buffer)], registered

    def copy_first(self, weights: list[torch.Tensor]) -> Made:
        buffer = packed(weights, torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8))
        return [buffer], self._registered(buffer)

    def in_place(self, weights: list[torch.Tensor]) -> Made:
        registered = []
        for weight in weights:
            pointer = self._registered(weight)
            self.refused += not pointer
            registered += pointer
        return list(weights), registered

    def torch_allocator(self, weights: list[torch.Tensor]) -> Made:
        # The CPU build of torch has no pinned allocator.
        buffer = torch.empty(sum(w.numel() for w in weights), dtype=torch.uint8, pin_memory=self.pins)
        return [packed(weights, buffer)], []

    def undo(self, made: Made) -> None:
        for pointer in made[1]:
            self.registrar.unregister(pointer)


class ReadOnlyRegistrar(CudaHostRegistrar):
    """``cudaHostRegister`` with ``cudaHostRegisterReadOnly``: pages the process may only read, as a checkpoint
    file mapped read-only (the driver refuses them without it)."""

    def register(self, pointer: int, nbytes: int) -> bool:
        return self._succeeded(torch.cuda.cudart().cudaHostRegister(pointer, nbytes, READ_ONLY_FLAGS))


class FileWays:
    """The three ways from a checkpoint file (see the module docstring): ``source``'s blocks written to one file
    in ``folder``, each padded to a page, and mapped read-only and private while the instance is open."""

    def __init__(self, source: list[list[torch.Tensor]], folder: Path, ways: Ways, read_only: HostRegistrar) -> None:
        self.ways = ways
        self.read_only = read_only
        self.refused = 0  # blocks whose file pages the driver refused to register
        self._stack = contextlib.ExitStack()
        path = self._stack.enter_context(tempfile.TemporaryDirectory(dir=folder)) + "/blocks.bin"
        self.offsets: list[tuple[int, int]] = []  # each block's (offset, bytes) in the file
        with open(path, "wb") as file:
            for weights in source:
                offset = file.tell()
                for weight in weights:
                    file.write(weight.numpy().tobytes())
                self.offsets.append((offset, file.tell() - offset))
                file.write(bytes(-file.tell() % mmap.PAGESIZE))
            file.flush()
            os.fsync(file.fileno())  # no writeback under the timed ways; the pages stay in the page cache
        self.fd = os.open(path, os.O_RDONLY)
        self._stack.callback(os.close, self.fd)
        mapping = mmap.mmap(self.fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)
        self._stack.callback(mapping.close)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that the mapping is not writable: it is only read
            whole = torch.frombuffer(mapping, dtype=torch.uint8)
        self._stack.callback(lambda: self.__dict__.pop("blocks"))  # the views go before the mapping closes
        self.blocks = [whole[offset : offset + nbytes] for offset, nbytes in self.offsets]
        del whole

    def close(self) -> None:
        self._stack.close()

    def named(self) -> dict[str, Callable[[int], Made]]:
        return {
            "file copied first": lambda index: self.ways.copy_first([self.blocks[index]]),
            "file read": self.read,
            "file in place": self.in_place,
        }

    def read(self, index: int) -> Made:
        offset, nbytes = self.offsets[index]
        buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.ways.pins)
        done = os.preadv(self.fd, [buffer.numpy()], offset)
        assert done == nbytes, (done, nbytes)
        return [buffer], []

    def in_place(self, index: int) -> Made:
        block = self.blocks[index]
        if self.read_only.register(block.data_ptr(), block.numel()):
            return [block], [block.data_ptr()]
        self.refused += 1
        return [block], []

    def undo(self, made: Made) -> None:
        for pointer in made[1]:
            self.read_only.unregister(pointer)


@contextlib.contextmanager
def file_ways(source: list[list[torch.Tensor]], folder: Path, ways: Ways, cuda: bool) -> Iterator[FileWays]:
    opened = FileWays(source, folder, ways, ReadOnlyRegistrar() if cuda else PageToucher(MADV_POPULATE_READ))
    try:
        yield opened
    finally:
        opened.close()


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
    parser.add_argument("--folder", type=Path, default=None, help="where the file is written (default: /tmp)")
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="on the CPU: the copies, and the pages' first touch as a registration makes it",
    )
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
    ways = Ways(CudaHostRegistrar() if cuda else PageToucher(), pins=cuda)
    with file_ways(source, args.folder or Path(tempfile.gettempdir()), ways, cuda) as from_file:
        named: dict[str, Callable[[int], Made]] = {
            "register first": lambda index: ways.register_first(source[index]),
            "copy first": lambda index: ways.copy_first(source[index]),
            "in place": lambda index: ways.in_place(source[index]),
            "torch's pinned allocator": lambda index: ways.torch_allocator(source[index]),
            **from_file.named(),
        }
        undo = {name: from_file.undo if name in from_file.named() else ways.undo for name in named}
        seconds: dict[str, list[float]] = {name: [] for name in named}
        h2d: dict[str, list[float]] = {name: [] for name in named}
        for round_ in range(args.rounds):
            order = list(named) if round_ % 2 == 0 else list(reversed(named))
            for name in order:
                start = time.perf_counter()
                made = [named[name](index) for index in range(count)]
                seconds[name].append(time.perf_counter() - start)
                gbps = to_device_gbps(made, device)
                if gbps is not None:
                    h2d[name].append(gbps)
                # As measured: a run stopped by its time cap (a device call's) still leaves these in its log.
                then = "" if gbps is None else f", then {gbps:.1f} GB/s to the device"
                print(
                    f"round {round_ + 1}, {name}: {seconds[name][-1]:.3f} s to pinned{then}",
                    file=sys.stderr,
                    flush=True,
                )
                for one in made:
                    undo[name](one)
                del made
        refused_files = from_file.refused // max(1, args.rounds)
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
    print(f"file in place: {refused_files} of {count} blocks refused by the driver per round (read-only pages)")
    return result


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()
