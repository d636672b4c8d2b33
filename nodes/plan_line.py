"""What an engine's start tells the user, besides the placement's own summary: the plan line's clauses on what
was copied, what streams from pageable memory and where the streamed weights wait, and the notices logged once.
"""

from __future__ import annotations

import os

from ..offload import GIB, Runner, file_source
from .comfy_memory import PINNED_LIMIT_ENV, PINNED_MEMORY, host_ram


def packing_clause(runner: Runner, seconds: float) -> str:
    """The plan line's word on what the start copied into host buffers, and how long it took (what a first load
    pays and a later prompt taking the buffers over does not), and on what is packed in the background while
    the first steps stream those blocks from where they are: a first step slower than the next explains itself."""
    packed = runner.packed_bytes
    clause = f"; packed {packed / GIB:.2f} GiB into host buffers in {seconds:.2f} s" if packed else ""
    _, later = runner.background_packing
    if later:
        clause += f"; {later / GIB:.2f} GiB pinned or packed in the background while the first steps run"
        progress = pinning_progress(runner)
        clause += f" ({progress} so far)" if progress else ""
    return clause


def pinning_progress(runner: Runner) -> str | None:
    """How far pinning has got while blocks are still packed in the background ("pinned 6.20 of 11.90 GiB"); None
    once they are, or when none of them is to be pinned."""
    pinned, total = runner.pinning_progress
    if not runner.waiting_bytes or not total:
        return None
    return f"pinned {pinned / GIB:.2f} of {total / GIB:.2f} GiB"


def pageable_clause(runner: Runner) -> str:
    """The plan line's word on streamed units that wanted pinned memory and got pageable memory."""
    reasons = {"the pinned-memory cap": runner.refused_pinning, "the driver refused to pin": runner.failed_pinning}
    said = [f"{len(units)} from pageable memory ({reason})" for reason, units in reasons.items() if units]
    return f"; of {len(runner.streamed)} streamed {runner.unit}s, {', '.join(said)}" if said else ""


def tiers_clause(runner: Runner, bandwidth: float | None, fast_disk: bool) -> str:
    """The plan line's word on where the streamed weights wait: host buffers, or their checkpoint file."""
    read = runner.read_each_step
    streamed = len(runner.streamed)
    host = runner.host_bytes / GIB
    in_ram = streamed - len(read)
    held = f"{in_ram} of the {streamed} streamed {runner.unit}s in host memory ({host:.2f} GiB of host buffers)"
    if fast_disk:
        kept = f"{PINNED_LIMIT_ENV} keeps" if os.environ.get(PINNED_LIMIT_ENV) else f"set {PINNED_LIMIT_ENV} to keep"
        held += f" (ComfyUI chose fast-disk for this checkpoint: no host buffers; {kept} some in RAM)"
    if not read:
        return f"; {held}, none read from the checkpoint file"
    cgroup = host_ram().cgroup
    if cgroup is not None and not fast_disk:
        held += f" (within this process's memory limit, {cgroup.limit / GIB:.2f} GiB: cgroup {cgroup.path})"
    read_from = (
        f"{len(read)} read from the checkpoint file each step through {runner.staging_bytes / GIB:.2f} GiB of "
        f"staging slots ({runner.file_tier_bytes / GIB:.2f} GiB as stored"
    )
    threads = file_source.read_threads(source.handle for source in runner.file_slices())
    read_from += f", read by {threads_said(threads)}"
    read_ms = least_read_ms(runner, bandwidth)
    if read_ms is not None and bandwidth:
        read_from += f", {bandwidth / 1e9:.2f} GB/s as the page cache holds it now: {read_ms:.1f} ms per step at least"
    return f"; {held}, {read_from})"


def threads_said(threads: int) -> str:
    """How many threads read the checkpoint, and why, for the plan line."""
    if threads > 1:
        return f"{threads} threads at once"
    if file_source.POSITIONAL_READ is None:
        return "one thread copying from the file's mapping, this system having no positional read"
    return "one thread, the file's disk being rotational (several readers would make it seek)"


def least_read_ms(runner: Runner, bandwidth: float | None) -> float | None:
    """The least a step can take while the file tier is read at ``bandwidth`` (bytes/s; None: no file tier)."""
    return runner.file_tier_bytes / bandwidth * 1e3 if bandwidth else None


def pinning_notices(runner: Runner, driver: bool = True) -> list[str]:
    """A notice for each reason some streamed weights went to pageable RAM, which copies more slowly: the
    pinned-memory cap, or (``driver``) the driver refusing to pin (its caller logs each once)."""
    notices = []
    of = f"of {len(runner.streamed)} streamed {runner.unit}s"
    refused = runner.refused_pinning
    if refused:
        notices.append(
            f"Pinned memory cap reached ({(PINNED_MEMORY.limit or 0) / GIB:.2f} GiB, shared with ComfyUI and the "
            f"other streaming models): {len(refused)} {of} ({sum(refused.values()) / GIB:.2f} GiB) stream from "
            f"pageable RAM, which copies more slowly. Unloading other models frees pinned memory; "
            f"{PINNED_LIMIT_ENV} sets the pack's own cap."
        )
    failed = runner.failed_pinning if driver else {}
    if failed:
        notices.append(
            f"The driver refused to pin {len(failed)} {of} ({sum(failed.values()) / GIB:.2f} GiB): they stream from "
            "pageable RAM, which copies more slowly (the error was cleared, the run goes on). Too much pinned "
            f"memory system-wide is the usual cause: close other GPU programs, or lower {PINNED_LIMIT_ENV}."
        )
    return notices
