"""How long the placement search takes, on the benchmark stacks at each budget share, and what it chose.

    .venv/bin/python -m bench.planner_speed [--shapes wan14b flux12b qwen20b] [--runs 5]

Each search is timed in CPU time of this process (``time.process_time``: what another process on a busy machine
takes from it does not count), the median of ``--runs`` searches; the planner is pure Python on one core.
"""

from __future__ import annotations

import argparse
import statistics
import time

from harness.planner_shapes import BUDGETS, SHAPES, budget_bytes

from block_offload.offload.planner import best_plan


def time_search(shape: str, share: float, runs: int) -> tuple[float, str]:
    """The median CPU seconds of ``runs`` searches, and the chosen placement with its prediction."""
    costs = SHAPES[shape]()
    budget = budget_bytes(costs, share)
    seconds = []
    for _ in range(runs):
        start = time.process_time()
        found = best_plan(costs, budget)
        seconds.append(time.process_time() - start)
    plan = found.plan
    buffers = f"ring {plan.slot_bytes / 1e9:.2f} GB" if plan.ring_bytes else f"prefetch {plan.prefetch}"
    chosen = f"{found.step_ms:.1f} ms predicted, {len(plan.resident)} resident, {buffers}"
    return statistics.median(seconds), chosen


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), default=list(SHAPES))
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args(argv)
    print("| shape | budget | search (CPU s, median) | chosen |")
    print("|---|---|---|---|")
    for shape in args.shapes:
        for share in BUDGETS:
            seconds, chosen = time_search(shape, share, args.runs)
            print(f"| {shape} | {share:.0%} | {seconds:.3f} | {chosen} |", flush=True)


if __name__ == "__main__":
    main()
