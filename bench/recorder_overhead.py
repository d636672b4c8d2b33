"""Host cost of the timeline recorder, and of the live panel's listener on top of it: the same
streamed model without either, with the recorder alone (a step's times read only when asked), with
every step read (as a listener asks), with nobody watching (the pack's recorder while no client is
connected: steps sampled), and with the recorder feeding the panel; then the device calls the recorder
makes per block call and per step, counted through its clock.

    python -m bench.recorder_overhead          # from the repository root

16 tiny blocks, all streamed, so the per-call overhead is as visible as it can be; the best of
three rounds of 200 steps each. Runs wherever torch runs (the CPU by default, CUDA if present).
The panel's listener is the pack's own (nodes/panel.py), so that part needs ComfyUI importable
(scripts/setup.sh); without a server its messages are built but go nowhere. The panel reads every
step, so "every step read" is the recorder's cost as the pack runs in ComfyUI.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from dataclasses import astuple, dataclass, fields
from types import ModuleType

import torch

from harness.transformer_stack import transformer_stack

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    OffloadPlan,
    RingOptions,
    StepTimeline,
    StreamSpec,
    TimelineRecorder,
    module_bytes,
    stream_blocks,
)
from block_offload.offload.device import Clock, Marker, copy_stream, current_stream, synchronize
from block_offload.offload.timeline import UNWATCHED_PERIOD_S

BLOCKS, STEPS, WARMUP = 16, 200, 20

Attach = Callable[[BlockStreamer, TimelineRecorder], None]


@dataclass
class ClockCalls:
    """Calls made on a clock: on a device, event creations, records, queries, synchronizations and
    elapsed-time reads."""

    created: int = 0
    marked: int = 0
    queried: int = 0
    waited: int = 0
    read: int = 0

    def __sub__(self, other: ClockCalls) -> ClockCalls:
        return ClockCalls(*(a - b for a, b in zip(astuple(self), astuple(other), strict=True)))


class CountingClock(Clock):
    """The device's own clock, counting each call made on it; every call still does what it does."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.calls = ClockCalls()

    def new_marker(self) -> Marker:
        self.calls.created += 1
        return super().new_marker()

    def mark(self, marker: Marker, stream: torch.Stream | None) -> None:
        self.calls.marked += 1
        super().mark(marker, stream)

    def reached(self, marker: Marker) -> bool:
        self.calls.queried += 1
        return super().reached(marker)

    def wait(self, marker: Marker) -> None:
        self.calls.waited += 1
        super().wait(marker)

    def since(self, start: Marker) -> Callable[[Marker], float]:
        read = super().since(start)

        def counted(marker: Marker) -> float:
            self.calls.read += 1
            return read(marker)

        return counted

    def snapshot(self) -> ClockCalls:
        return ClockCalls(*astuple(self.calls))


class StepCollector:
    """A ``TimelineListener`` that keeps every step, as the panel does for its downloadable timeline."""

    def __init__(self) -> None:
        self.blocks_called = 0
        self.steps: list[StepTimeline] = []

    def block_called(self, step: int, block: int) -> None:
        self.blocks_called += 1

    def step_resolved(self, timeline: StepTimeline) -> None:
        self.steps.append(timeline)


def markers_of(step: StepTimeline) -> int:
    """The markers a step's timeline was read from: its start and end, two per call, two per copy."""
    return 2 + 2 * len(step.spans) + 2 * sum(span.copy_start is not None for span in step.spans)


def followed(recorder: TimelineRecorder) -> TimelineRecorder:
    """``recorder``, with a listener that reads every step."""
    recorder.listener = StepCollector()
    return recorder


def unwatched(recorder: TimelineRecorder, period_s: float = UNWATCHED_PERIOD_S) -> TimelineRecorder:
    """``recorder`` as the pack runs it while no client is connected (its listener attached, nobody watching):
    its first steps recorded, then one step per ``period_s``."""
    followed(recorder).watched = lambda: False
    recorder.unwatched_period_s = period_s
    return recorder


def streaming(model: torch.nn.Module, device: torch.device, recorder: TimelineRecorder | None) -> BlockStreamer:
    streamer = stream_blocks(
        model.blocks,
        device,
        range(BLOCKS),
        StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    return streamer


def seconds_per_step(
    model: torch.nn.Module, x: torch.Tensor, recorder: TimelineRecorder | None, attach: Attach | None = None
) -> float:
    """Seconds per step of ``model`` streaming all its blocks, after ``WARMUP`` untimed steps."""
    streamer = streaming(model, x.device, recorder)
    if attach is not None:
        attach(streamer, recorder)
    with torch.inference_mode():
        for _ in range(WARMUP):
            model(x)
        synchronize(x.device)
        start = time.perf_counter()
        for _ in range(STEPS):
            model(x)
        synchronize(x.device)
        elapsed = (time.perf_counter() - start) / STEPS
    streamer.disable()
    return elapsed


def hook_seconds_per_call(recorder: TimelineRecorder, device: torch.device, steps: int = 2000) -> float:
    """The recorder's own cost, free of the model's: its hooks called as the streamer calls them for a step
    of ``BLOCKS`` streamed blocks (a copy, then the call), timed in the thread's CPU time, which other
    processes on a busy machine do not inflate. Seconds per block call."""
    compute, copies = current_stream(device), copy_stream(device)
    start = time.thread_time()
    for _ in range(steps):
        recorder.begin_step(compute)
        for block in range(BLOCKS):
            copy = recorder.copy_started(copies, 1)
            recorder.copy_finished(copy, copies)
            call = recorder.call_arrived(block, compute)
            recorder.call_started(call, copy, compute)
            recorder.call_finished(call, compute)
        recorder.end_step(compute)
    recorder.latest()
    return (time.thread_time() - start) / (steps * BLOCKS)


def calls_per_step(model: torch.nn.Module, x: torch.Tensor, follow: bool = False) -> list[ClockCalls]:
    """The clock calls of each of ``WARMUP`` steps, then of one ``latest()`` (the planner's question);
    ``follow``: with a listener reading every step."""
    clock = CountingClock(x.device)
    recorder = TimelineRecorder(x.device, clock=clock)
    if follow:
        followed(recorder)
    streamer = streaming(model, x.device, recorder)
    per_step, before = [], clock.snapshot()
    with torch.inference_mode():
        for _ in range(WARMUP):
            model(x)
            per_step.append(clock.snapshot() - before)
            before = clock.snapshot()
    recorder.latest()
    per_step.append(clock.snapshot() - before)
    streamer.disable()
    return per_step


def describe_calls(name: str, per_step: list[ClockCalls]) -> str:
    """Markers created in the first step and after it, and the steady state's calls per block call."""
    *steps, asked = per_step
    first, steady = steps[0], steps[len(steps) // 2 :]
    created_after = sum(step.created for step in steps[1:])
    per_call = {f.name: sum(getattr(s, f.name) for s in steady) / (len(steady) * BLOCKS) for f in fields(ClockCalls)}
    return (
        f"{name}: {first.created} markers created in the first step, {created_after} in the {len(steps) - 1} after; "
        f"per block call {per_call['marked']:.2f} marks, {per_call['read']:.2f} reads, "
        f"{per_call['queried'] * BLOCKS:.1f} queries and {per_call['waited'] * BLOCKS:.0f} waits per step; "
        f"latest() afterwards: {asked.read} reads, {asked.waited} waits"
    )


def import_panel(device: torch.device) -> tuple[ModuleType, ModuleType] | None:
    """The pack's engine and report modules (they need ComfyUI importable); None without ComfyUI."""
    from harness.comfy_host import ComfyHostError, resolve_comfyui_path  # the engine's rows need no host

    try:
        comfyui = resolve_comfyui_path()
    except ComfyHostError as exc:
        print(f"no panel figures: {exc}")
        return None
    sys.path.insert(0, str(comfyui))
    from comfy.cli_args import args

    args.cpu = device.type == "cpu"
    return importlib.import_module("block_offload.nodes.engine"), importlib.import_module("block_offload.nodes.panel")


def panel_attach(
    engines: ModuleType, report: ModuleType, model: torch.nn.Module
) -> tuple[Attach, list[TimelineRecorder]]:
    """Starts the panel's publisher on the streamer's recorder, as the patcher does for a sampling run; and the
    recorders it attached to, in order."""
    panel = report.install_panel(None)  # the panel as the pack sets it up, with no server to send to
    attached: list[TimelineRecorder] = []

    def attach(streamer: BlockStreamer, recorder: TimelineRecorder) -> None:
        plan = OffloadPlan.build([module_bytes(b) for b in model.blocks], resident_count=0)
        request = engines.OffloadRequest(node="bench")
        engine = engines.Engine(request, engines.Placement.of_plan(plan), streamer, recorder)
        panel.engine_started(engine)
        report.run_started(engine, resident_weights=0)
        attached.append(recorder)

    return attach, attached


def per_block_call_us(seconds: float, baseline: float) -> float:
    return (seconds - baseline) / BLOCKS * 1e6


def tiny_stack(device: torch.device) -> tuple[torch.nn.Module, torch.Tensor]:
    """``BLOCKS`` tiny blocks on the host (to stream), the rest of the model and an input on ``device``."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64, heads=4)
    model.embed.to(device)
    model.head.to(device)
    return model, torch.randn(1, 16, 64, device=device)


Variant = tuple[Callable[[], TimelineRecorder | None], Attach | None]


def best_seconds_per_step(model: torch.nn.Module, x: torch.Tensor, variants: dict[str, Variant]) -> dict[str, float]:
    """The best of three rounds of each variant (a recorder to make, and what to attach to it)."""
    rounds: dict[str, list[float]] = {name: [] for name in variants}
    # Rounds interleave the variants, so a machine that slows down or speeds up meanwhile biases none of them.
    for _ in range(3):
        for name, (make, attach) in variants.items():
            rounds[name].append(seconds_per_step(model, x, make(), attach))
    return {name: min(times) for name, times in rounds.items()}


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, x = tiny_stack(device)
    pack = import_panel(device)
    variants: dict[str, Variant] = {
        "off": (lambda: None, None),
        "recorder": (lambda: TimelineRecorder(device), None),
        "every step": (lambda: followed(TimelineRecorder(device)), None),
        "nobody watching": (lambda: unwatched(TimelineRecorder(device)), None),
    }
    attached: list[TimelineRecorder] = []
    if pack is not None:
        attach, attached = panel_attach(*pack, model)
        variants["panel"] = (lambda: TimelineRecorder(device), attach)
    first_seq = pack[1].install_panel(None).outbox.seq if pack is not None else 0
    best = best_seconds_per_step(model, x, variants)
    off = best["off"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {device} ({name}), torch {torch.__version__}, {BLOCKS} blocks all streamed, prefetch 1")
    print(f"{off * 1e3:.3f} ms/step without the recorder")
    print(f"recorder, times read when asked: {best['recorder'] * 1e3:.3f} ms/step, "
          f"{per_block_call_us(best['recorder'], off):.1f} us per block call")  # fmt: skip
    print(f"recorder, every step read: {best['every step'] * 1e3:.3f} ms/step, "
          f"{per_block_call_us(best['every step'], off):.1f} us per block call")  # fmt: skip
    print(f"recorder, nobody watching (one step per {UNWATCHED_PERIOD_S:.0f} s): "
          f"{best['nobody watching'] * 1e3:.3f} ms/step, "
          f"{per_block_call_us(best['nobody watching'], off):.1f} us per block call")  # fmt: skip
    asked = min(hook_seconds_per_call(TimelineRecorder(device), device) for _ in range(3))
    every = min(hook_seconds_per_call(followed(TimelineRecorder(device)), device) for _ in range(3))
    nobody = min(hook_seconds_per_call(unwatched(TimelineRecorder(device)), device) for _ in range(3))
    print(f"the recorder's hooks alone (thread CPU time): {asked * 1e6:.1f} us per block call with times read "
          f"when asked, {every * 1e6:.1f} us with every step read, {nobody * 1e6:.2f} us with nobody watching "
          f"({nobody / (off / BLOCKS) * 100:.2f} % of a streamed block call)")  # fmt: skip
    print(describe_calls("times read when asked", calls_per_step(model, x)))
    print(describe_calls("every step read", calls_per_step(model, x, follow=True)))
    if pack is None:
        return
    panel = pack[1].install_panel(None)
    sent = panel.outbox.seq - first_seq
    print(f"recorder feeding the panel: {best['panel'] * 1e3:.3f} ms/step, "
          f"{per_block_call_us(best['panel'], off):.1f} us per block call; {sent} messages built")  # fmt: skip
    listener = attached[-1].listener  # the last run's publisher
    calls = 1_000_000
    start = time.perf_counter()
    for i in range(calls):
        listener.block_called(0, i % BLOCKS)
    per_call = (time.perf_counter() - start) / calls
    latest = listener.run.steps[-1]
    start = time.perf_counter()
    for _ in range(1000):
        listener.status(latest)
    per_message = (time.perf_counter() - start) / 1000
    print(f"the listener alone: {per_call * 1e9:.0f} ns per block call (a clock read and a compare); "
          f"{per_message * 1e6:.0f} us to build a message with a {BLOCKS}-block step, at most 4 a second")  # fmt: skip


if __name__ == "__main__":
    main()
