"""Host cost of the timeline recorder, and of the live panel's listener on top of it: the same
streamed model without either, with the recorder, and with the recorder feeding the panel.

    python -m bench.recorder_overhead          # from the repository root

16 tiny blocks, so the per-call overhead is as visible as it can be; the best of three
rounds of 200 steps each. Runs wherever torch runs (the CPU by default, CUDA if present).
The panel's listener is the pack's own (nodes/report.py), so that part needs ComfyUI
importable (scripts/setup.sh); without a server its messages are built but go nowhere.
"""

from __future__ import annotations

import importlib
import sys
import time
from collections.abc import Callable
from types import ModuleType

import torch

from harness.comfy_host import ComfyHostError, resolve_comfyui_path
from harness.transformer_stack import transformer_stack

from block_offload.offload import BlockStreamer, OffloadPlan, TimelineRecorder, module_bytes
from block_offload.offload.device import synchronize

BLOCKS, STEPS = 16, 200

Attach = Callable[[BlockStreamer, TimelineRecorder], None]


def seconds_per_step(
    model: torch.nn.Module, x: torch.Tensor, recorder: TimelineRecorder | None, attach: Attach | None = None
) -> float:
    streamer = BlockStreamer(model.blocks, x.device, range(BLOCKS), prefetch=1, recorder=recorder, root=model)
    streamer.enable()
    if attach is not None:
        attach(streamer, recorder)
    with torch.inference_mode():
        for _ in range(20):
            model(x)
        synchronize(x.device)
        start = time.perf_counter()
        for _ in range(STEPS):
            model(x)
        synchronize(x.device)
        elapsed = (time.perf_counter() - start) / STEPS
    streamer.disable()
    return elapsed


def import_panel(device: torch.device) -> tuple[ModuleType, ModuleType] | None:
    """The pack's engine and report modules (they need ComfyUI importable); None without ComfyUI."""
    try:
        comfyui = resolve_comfyui_path()
    except ComfyHostError as exc:
        print(f"no panel figures: {exc}")
        return None
    sys.path.insert(0, str(comfyui))
    from comfy.cli_args import args

    args.cpu = device.type == "cpu"
    return importlib.import_module("block_offload.nodes.engine"), importlib.import_module("block_offload.nodes.report")


def panel_attach(engines: ModuleType, report: ModuleType, model: torch.nn.Module) -> Attach:
    """Starts the panel's publisher on the streamer's recorder, as the patcher does for a sampling run."""

    def attach(streamer: BlockStreamer, recorder: TimelineRecorder) -> None:
        plan = OffloadPlan.build([module_bytes(b) for b in model.blocks], resident_count=0)
        request = engines.OffloadRequest(node="bench")
        engine = engines.Engine(request, engines.Placement.of_plan(plan), streamer, recorder)
        report.engine_started(engine)
        report.run_started(engine, resident_weights=0)

    return attach


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = transformer_stack(num_blocks=BLOCKS, dim=64, heads=4)
    model.embed.to(device)
    model.head.to(device)
    x = torch.randn(1, 16, 64, device=device)
    pack = import_panel(device)
    attach = panel_attach(*pack, model) if pack is not None else None
    # Rounds interleave the variants, so a machine that slows down or speeds up meanwhile biases none of them.
    rounds: dict[str, list[float]] = {"off": [], "recorder": [], "panel": []}
    first_seq = pack[1]._outbox.seq if pack is not None else 0
    for _ in range(3):
        rounds["off"].append(seconds_per_step(model, x, None))
        rounds["recorder"].append(seconds_per_step(model, x, TimelineRecorder(device)))
        if attach is not None:
            rounds["panel"].append(seconds_per_step(model, x, TimelineRecorder(device), attach))
    off, on = min(rounds["off"]), min(rounds["recorder"])
    print(f"device {device}: {off * 1e3:.3f} ms/step without the recorder, {on * 1e3:.3f} ms/step with it; "
          f"{(on - off) / BLOCKS * 1e6:.1f} us per block call")  # fmt: skip
    if pack is None:
        return
    report = pack[1]
    panel = min(rounds["panel"])
    sent = report._outbox.seq - first_seq
    print(f"with the panel's listener too: {panel * 1e3:.3f} ms/step, {(panel - on) / BLOCKS * 1e6:+.2f} us per block "
          f"call against the recorder alone (within the noise); {sent} messages built")  # fmt: skip
    listener = report._current
    calls = 1_000_000
    start = time.perf_counter()
    for i in range(calls):
        listener.block_called(0, i % BLOCKS)
    per_call = (time.perf_counter() - start) / calls
    latest = listener.steps[-1]
    start = time.perf_counter()
    for _ in range(1000):
        listener.status(latest)
    per_message = (time.perf_counter() - start) / 1000
    print(f"the listener alone: {per_call * 1e9:.0f} ns per block call (a clock read and a compare); "
          f"{per_message * 1e6:.0f} us to build a message with a {BLOCKS}-block step, at most 4 a second")  # fmt: skip


if __name__ == "__main__":
    main()
