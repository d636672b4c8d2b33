"""How long the placement search takes, on the benchmark stacks at each budget share, and what it chose.

    .venv/bin/python -m bench.planner_speed [--shapes wan14b flux12b qwen20b] [--runs 7]

Each search is timed in CPU time of this process (``time.process_time``; the planner is pure Python on one core),
``--runs`` times. The least of them is the search's own cost: on a shared machine a neighbour slows a run (caches,
clock, steal), never speeds it up; the median is printed beside it. So is the work, which does not vary: the
block calls the search simulated.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any
from unittest import mock

from harness.planner_shapes import BUDGETS, SHAPES, budget_bytes

from block_offload.offload.costs import _Pipeline
from block_offload.offload.planner import best_plan


def time_search(shape: str, share: float, runs: int) -> tuple[list[float], int, str]:
    """The CPU seconds of ``runs`` searches, the block calls one simulated, and the placement it chose."""
    costs = SHAPES[shape]()
    budget = budget_bytes(costs, share)
    seconds = []
    for _ in range(runs):
        start = time.process_time()
        found = best_plan(costs, budget)
        seconds.append(time.process_time() - start)
    calls = simulated_calls(lambda: best_plan(costs, budget))
    plan = found.plan
    buffers = f"ring {plan.slot_bytes / 1e9:.2f} GB" if plan.ring_bytes else f"prefetch {plan.prefetch}"
    chosen = f"{found.step_ms:.1f} ms predicted, {len(plan.resident)} resident, {buffers}"
    return seconds, calls, chosen


def simulated_calls(search: Callable[[], object]) -> int:
    """The block calls ``search`` simulates (the planner's pipeline replays one per call of each step)."""
    calls = 0
    replay = _Pipeline._call

    def counted(self: _Pipeline, *args: Any) -> None:
        nonlocal calls
        calls += 1
        replay(self, *args)

    with mock.patch.object(_Pipeline, "_call", counted):
        search()
    return calls


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args(argv)
    print(f"| shape | budget | search, CPU s: least of {args.runs} (median) | block calls simulated | chosen |")
    print("|---|---|---|---|---|")
    for shape in args.shapes:
        for share in BUDGETS:
            seconds, calls, chosen = time_search(shape, share, args.runs)
            least, median = min(seconds), statistics.median(seconds)
            print(f"| {shape} | {share:.0%} | {least:.3f} ({median:.3f}) | {calls} | {chosen} |", flush=True)


if __name__ == "__main__":
    main()
