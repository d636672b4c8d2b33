"""How fast the file tier reads a checkpoint: the engine's reader on one thread against its pool of
``READ_THREADS`` threads reading chunks of ``READ_CHUNK`` bytes, side by side, warm and cold page cache; and, beside
them, the way a packing thread fills a Dynamic VRAM model's block buffers: one thread copying from the file's
mapping (``HostBlocks`` packs from the weights, which are views of the mapping), where page faults read the file.

    python -m bench.file_reads [--gib 2] [--rounds 3] [--folder DIR]

A file of ``--gib`` GiB of random bytes is written once and read as Wan 2.1 14B blocks' tensors are stored (per
block, eight attention weights of 5120 x 5120 and two feed-forward weights of 5120 x 13824, bf16: 50 and 135
MiB) by ``read_bandwidth``, the engine's own measure of the file tier's reads (``offload/file_source.py``: the
slices read by a ``SliceReader``, as many at once as fit the largest one's bytes, into a buffer faulted in
beforehand, as a staging slot is). Warm: the pages as a read just left them (cached); cold: dropped from the
page cache before each read (``posix_fadvise(DONTNEED)``, no root needed), what a checkpoint larger than the
RAM costs, or a first prompt after the checkpoint left the page cache. Each round reads every case once, the three
ways in turn and in alternating order, so that what else runs on the machine touches them alike; printed: each
case's median, the pool's and the mapping's ratio to one thread, and which thread count the engine chooses for the
file (``read_threads``: one where its disk seeks).
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from harness.comfy_host import REPO, interrupt_on_sigterm

from bench.timing import drop_from_cache
from block_offload.offload.file_source import READ_CHUNK, READ_THREADS, FileSlice, read_bandwidth, read_threads

MIB = 2**20
WRITE_CHUNK = 64 * MIB
#: A Wan 2.1 14B block's large weights as its file stores them, in bytes (bf16).
WAN14B_BLOCK = (5120 * 5120 * 2,) * 8 + (5120 * 13824 * 2,) * 2


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0, help="the file's size")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--folder", type=Path, default=None, help="where the file is written (default: a temp dir)")
    return parser.parse_args(argv)


def write_random(path: Path, nbytes: int) -> None:
    with path.open("wb") as file:
        for at in range(0, nbytes, WRITE_CHUNK):
            file.write(os.urandom(min(WRITE_CHUNK, nbytes - at)))
        file.flush()
        os.fsync(file.fileno())


def commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=REPO)
    return done.stdout.strip() or "unknown"


def wan_slices(handle: int, nbytes: int) -> list[FileSlice]:
    """``nbytes`` of the file as consecutive slices of Wan 14B blocks' weights' sizes (the last one cut short)."""
    unused = torch.empty(0, dtype=torch.uint8)  # the mapping, read from only where there is no positional read
    slices, at = [], 0
    while at < nbytes:
        for size in WAN14B_BLOCK:
            size = min(size, nbytes - at)
            if size:
                slices.append(FileSlice(handle, at, size, unused))
                at += size
    return slices


def mapping_copy_bandwidth(path: Path, slices: list[FileSlice]) -> float:
    """Bytes per second copying ``slices`` out of a fresh mapping of ``path`` on this thread, as a packing thread
    copies a Dynamic VRAM model's weights (views of comfy-aimdo's mapping of the file) into a block's host buffer:
    into a buffer of the largest slice's size faulted in beforehand, as ``read_bandwidth`` reads. The mapping is
    private and never written (a view needs a writable buffer); it is unmapped after, so the page cache can drop
    the file's pages again."""
    scratch = torch.zeros(max(source.nbytes for source in slices), dtype=torch.uint8)
    with path.open("rb") as file, mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_COPY) as mapped:
        mapping = torch.frombuffer(mapped, dtype=torch.uint8)
        start = time.perf_counter()
        for source in slices:
            scratch[: source.nbytes].copy_(mapping[source.offset : source.offset + source.nbytes])
        seconds = time.perf_counter() - start
        del mapping  # the view exports the mapping's buffer: released before it is closed
    return sum(source.nbytes for source in slices) / max(seconds, 1e-9)


#: The ways a case is read, in the table's order: the engine's reader on one thread and on its pool, and the
#: mapping copied by one thread.
WAYS = ("1 thread", f"{READ_THREADS} threads", "mapping")


def main(argv: list[str] | None = None) -> dict[tuple[str, str], float]:
    """Returns each case's median GB/s, by (cache, way), the ways those of ``WAYS``."""
    args = parse_args(argv)
    nbytes = int(args.gib * 2**30)
    threads = {WAYS[0]: 1, WAYS[1]: READ_THREADS}
    gbps: dict[tuple[str, str], list[float]] = {(cache, way): [] for cache in ("warm", "cold") for way in WAYS}
    with tempfile.TemporaryDirectory(dir=args.folder) as folder:
        path = Path(folder) / "checkpoint.bin"
        write_random(path, nbytes)
        handle = os.open(path, os.O_RDONLY)
        try:
            slices = wan_slices(handle, nbytes)
            chosen = read_threads([handle])
            for round_ in range(args.rounds):
                for cache in ("warm", "cold"):
                    for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
                        if cache == "cold":
                            drop_from_cache(path)
                        else:
                            read_bandwidth(slices, nbytes)  # the page cache as a read leaves it
                        if way in threads:
                            measured = read_bandwidth(slices, nbytes, threads[way])
                            assert measured is not None
                        else:
                            measured = mapping_copy_bandwidth(path, slices)
                        gbps[cache, way].append(measured / 1e9)
                        # As measured: a run stopped by its time cap still leaves these in its log.
                        print(
                            f"round {round_ + 1}, {cache}, {way}: {measured / 1e9:.2f} GB/s",
                            file=sys.stderr,
                            flush=True,
                        )
        finally:
            os.close(handle)
    medians = {case: statistics.median(values) for case, values in gbps.items()}
    why = "1 thread: its disk seeks (rotational)" if chosen == 1 else f"{chosen} threads: its disk does not seek"
    print(
        f"{nbytes / 2**30:.2f} GiB read as Wan 14B blocks' weights, medians of {args.rounds} rounds; the engine "
        f"reads this file with {why}"
    )
    print(
        f"| page cache | 1 thread (GB/s) | {READ_THREADS} threads of {READ_CHUNK // MIB} MiB (GB/s) | ratio | the "
        "mapping copied, 1 thread, as a Dynamic VRAM model's blocks are packed (GB/s) | ratio |"
    )
    print("|---|---:|---:|---:|---:|---:|")
    for cache in ("warm", "cold"):
        one, pool, mapping = (medians[cache, way] for way in WAYS)
        print(f"| {cache} | {one:.2f} | {pool:.2f} | {pool / one:.2f}x | {mapping:.2f} | {mapping / one:.2f}x |")
    when = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    load = " / ".join(f"{value:.2f}" for value in os.getloadavg())
    print(f"\nMeasured on: {os.cpu_count()} CPUs, commit {commit()}, {when}, load average {load} (1 / 5 / 15 min)")
    return medians


if __name__ == "__main__":
    interrupt_on_sigterm()
    main()
