"""How ``bench/comfy_bench.py`` measures a row: one round loads the configuration and runs its steps, timed on the
device, with its peaks (VRAM and anonymous host memory sampled while it runs, the resident set's high-water mark,
pinned bytes) and what it placed; the rows of a group take their rounds in turn.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType

import torch

from harness.card import card as smaller_card
from harness.host_memory import peak_during

from bench.comfy_models import Comfy, forward
from bench.configs import Config, interleaved
from bench.results import (
    AUTO,
    CARD,
    GIB,
    Budget,
    Measurement,
    Round,
)
from bench.timing import ms_of_each_call
from block_offload.offload.device import synchronize

# Why a row was dropped when a budget leaves it too little device memory: a result, not a failure.
OUT_OF_MEMORY = "out of device memory"
# Host memory is sampled less often than the device: a sample reads /proc, and the steps must not feel it.
HOST_SAMPLE_INTERVAL_S = 0.01


@dataclass(frozen=True)
class Placed:
    """What a loaded patcher placed: a summary, a key equal for equal placements, bytes streamed per step,
    overlap, the planner's prediction, and whether it was an automatic placement's measuring run."""

    placement: str
    placement_key: str
    streamed_bytes: int
    overlap: float | None
    predicted_ms: float | None
    measuring: bool
    copied_bytes: int | None = None  # the pack's engine, its last step (its recorder)
    file_bytes: int = 0  # of ``streamed_bytes``, read from the checkpoint file at every step (the pack's file tier)


def placed(patcher) -> Placed:
    engine = getattr(patcher, "offload_engine", None)
    if engine is None:
        loaded = patcher.loaded_size()
        cast = patcher.model_size() - loaded
        summary = f"{loaded / GIB:.2f} GiB loaded, {cast / GIB:.2f} GiB cast on demand"
        return Placed(summary, "", cast, None, None, False)
    step = engine.recorder.latest()
    plan = engine.plan
    streamed = plan.streamed_bytes if plan is not None else (step.bytes_copied if step else 0)
    key = "" if plan is None else f"resident {sorted(plan.resident)}, prefetch {plan.prefetch}, pin {plan.pin_memory}"
    placement = engine.placement
    overlap = step.overlap if step is not None else None
    copied = step.bytes_copied if step is not None else None
    file_bytes = engine.runner.report().file_tier_bytes
    return Placed(
        placement.summary, key, streamed, overlap, engine.predicted_ms, placement.measuring, copied, file_bytes
    )


@contextlib.contextmanager
def card(mm: ModuleType, device: torch.device, budget: Budget | None) -> Iterator[int]:
    """For a card budget, the card of ``harness/card.py`` while the row loads and runs; yields the filler's
    bytes (0 for a share of the model)."""
    if budget is None or budget.kind != CARD:
        yield 0
        return
    with smaller_card(mm, device, budget.nbytes) as filled:
        yield filled


class DevicePeak:
    """The most device memory the process used while it was open, as the driver counts it
    (``cudaMemGetInfo``, sampled every millisecond on a thread), above what was used when it opened: the same
    measure for every row, whoever allocates (torch's allocator, comfy-aimdo's own mappings, cuBLAS)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._used() - self._base)

    def __enter__(self) -> DevicePeak:
        self._base = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used() - self._base)


def pinned_host_bytes(comfy: Comfy) -> int:
    """Page-locked host memory now, counted alike for every row: ComfyUI's books (``TOTAL_PINNED_MEMORY``: its
    classic loader's pins, Dynamic VRAM's registered host buffers, and the pack's, which it enters there), or
    on a host without them the pack's own count."""
    books = getattr(comfy.mm, "TOTAL_PINNED_MEMORY", None)
    return comfy.offload.pinned_bytes() if books is None else int(books)


def measure_round(comfy: Comfy, config: Config, inputs: dict, steps: int, need_bytes: int) -> tuple[Round, Placed]:
    """Loads ``config``, runs ``steps`` steps on it and unloads it: one round."""
    device = next(iter(inputs.values())).device
    comfy.mm.NUM_STREAMS = config.comfy_streams  # read by ComfyUI's loader and its casts at call time
    cuda = device.type == "cuda"
    with (
        card(comfy.mm, device, config.budget),
        DevicePeak(device) if cuda else contextlib.nullcontext() as sampled,
        contextlib.ExitStack() as loaded_and_stepped,
    ):
        host = loaded_and_stepped.enter_context(peak_during(os.getpid(), HOST_SAMPLE_INTERVAL_S))
        started = time.perf_counter()
        patcher = config.prepare()
        try:
            if config.budget is not None and config.budget.kind == CARD:
                comfy.mm.load_models_gpu([patcher], memory_required=need_bytes, minimum_memory_required=need_bytes)
            else:
                patcher.partially_load(device, 1e32 if config.budget is None else config.budget.nbytes)
            synchronize(device)
            loaded = time.perf_counter()
            forward(patcher, inputs)
            synchronize(device)
            first = time.perf_counter()
            engine = getattr(patcher, "offload_engine", None)
            first_step = None if engine is None else engine.recorder.latest()
            step_ms = ms_of_each_call(lambda: forward(patcher, inputs), device, steps - 1)
            wall = time.perf_counter()
            loaded_and_stepped.close()  # the host's peak over the load and the steps, not the unload
            peak = sampled.peak if cuda else None
            report = None if engine is None else engine.runner.report()
            done = Round(
                started,
                (first - started) * 1000,
                tuple(step_ms),
                (wall - started) * 1000,
                peak,
                host.anon_peak,
                host.rss_peak,
                pinned_host_bytes(comfy),
                None if engine is None else engine.packing_s * 1000,
                None if report is None else report.packed_bytes + report.background_packing[0],
                (loaded - started) * 1000,
                None if first_step is None else first_step.copy_ms,
                None if first_step is None else first_step.unpacked_copy_ms,
                None if first_step is None else first_step.unpacked_bytes,
            )
            where = placed(patcher)
        finally:
            comfy.mm.unload_all_models()
            patcher.detach(unpatch_all=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return done, where


def measure_all(
    groups: list[list[Config]],
    rounds: int,
    measure: Callable[[Config], tuple[Round, Placed]],
    dropped: dict[str, str],
) -> list[Measurement]:
    """Every configuration over ``rounds`` interleaved rounds, in the groups' order. An automatic placement
    measures its costs on its first load: that load is a row of its own, before the rounds. A configuration
    that runs out of device memory or fails is dropped, and named in ``dropped`` (row: why), rather than cost
    the others their figures (a device session is scarce: one row's bug must not lose the table)."""
    done: dict[Config, list[Round]] = {}
    where: dict[Config, Placed] = {}
    first_runs: dict[Config, Measurement] = {}
    failed: set[Config] = set()

    def attempt(config: Config) -> tuple[Round, Placed] | None:
        try:
            return measure(config)
        except Exception as error:  # noqa: BLE001 - any row's failure: named, and the others measured
            budget = "" if config.budget is None else f" at {config.budget.nbytes / GIB:.2f} GiB ({config.budget.kind})"
            why = OUT_OF_MEMORY if isinstance(error, torch.OutOfMemoryError) else repr(error)
            progress(f"{config.method}{budget}: {why}")
            if why != OUT_OF_MEMORY:
                progress(traceback.format_exc())
            dropped[config.method + budget] = why
            failed.add(config)
            return None

    # The costs are kept per device and model, whatever the budget: the first automatic row measures them.
    auto = next((c for group in groups for c in group if c.method == AUTO), None)
    measured = None if auto is None else attempt(auto)
    if measured is not None and measured[1].measuring:
        first_runs[auto] = _measurement(f"{AUTO} (first run: strided, measuring)", auto, [measured[0]], measured[1])
    for config in interleaved(groups, rounds):
        if config in failed:
            continue
        measured = attempt(config)
        if measured is not None:
            done.setdefault(config, []).append(measured[0])
            where[config] = measured[1]
            # Each round's figures as measured, so a run stopped by its time limit still leaves them in its log.
            done_round = measured[0]
            steps = sorted(done_round.step_ms)
            peak = done_round.peak_vram_bytes
            vram = "" if peak is None else f", peak VRAM {peak / GIB:.2f} GiB"
            packing = done_round.packing_ms
            packed = done_round.packed_bytes or 0
            packing_said = (
                ""
                if packing is None
                else f" (packed {packed / GIB:.2f} GiB; {packing / 1000:.2f} s before the first step)"
            )
            if done_round.load_ms is not None:
                packing_said += f"; the load {done_round.load_ms / 1000:.2f} s"
            if done_round.first_copy_ms is not None:
                unpacked = (done_round.first_unpacked_bytes or 0) / GIB
                packing_said += (
                    f", the first step's copies {done_round.first_copy_ms / 1000:.2f} s, of them "
                    f"{(done_round.first_unpacked_ms or 0) / 1000:.2f} s for {unpacked:.2f} GiB not pinned or packed"
                )
            progress(
                f"{config.method}: median {steps[len(steps) // 2] / 1000:.3f} s/step, at most {steps[-1] / 1000:.3f}, "
                f"load + first step {done_round.load_first_ms / 1000:.2f} s{packing_said}{vram}; "
                f"{measured[1].placement}"
            )
    found = []
    for config in (c for group in groups for c in group):
        if config in first_runs:
            found.append(first_runs[config])
        if config in done:
            found.append(_measurement(config.method, config, done[config], where[config]))
    return found


def _measurement(method: str, config: Config, rounds: list[Round], where: Placed) -> Measurement:
    return Measurement(
        method,
        config.budget,
        tuple(rounds),
        where.streamed_bytes,
        where.overlap,
        where.predicted_ms,
        where.placement,
        where.placement_key,
        where.measuring,
        where.copied_bytes,
        where.file_bytes,
    )


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
