"""Host cost of the timeline recorder: the same streamed model with and without it.

    python bench/recorder_overhead.py

16 tiny blocks, so the per-call overhead is as visible as it can be; the best of three
rounds of 200 steps each. Runs wherever torch runs (the CPU by default, CUDA if present).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[1] / "tests")]

from transformer_stack import transformer_stack  # noqa: E402

from offload import BlockStreamer, TimelineRecorder  # noqa: E402
from offload.device import synchronize  # noqa: E402

BLOCKS, STEPS = 16, 200


def seconds_per_step(model: torch.nn.Module, x: torch.Tensor, recorder: TimelineRecorder | None) -> float:
    streamer = BlockStreamer(model.blocks, x.device, range(BLOCKS), prefetch=1, recorder=recorder, root=model)
    streamer.enable()
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


def main() -> None:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = transformer_stack(num_blocks=BLOCKS, dim=64, heads=4)
    model.embed.to(device)
    model.head.to(device)
    x = torch.randn(1, 16, 64, device=device)
    off = min(seconds_per_step(model, x, None) for _ in range(3))
    on = min(seconds_per_step(model, x, TimelineRecorder(device)) for _ in range(3))
    print(f"device {device}: {off * 1e3:.3f} ms/step without the recorder, {on * 1e3:.3f} ms/step with it; "
          f"{(on - off) / BLOCKS * 1e6:.1f} us per block call")  # fmt: skip


if __name__ == "__main__":
    main()
