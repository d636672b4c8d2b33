"""The planner's benchmark stacks: the block sizes and compute of the three models docs/records/log.md plans for,
at the copy speed the H100 measured, and the budgets it plans them at. Shared by the planner's reference test
and its search-time benchmark (``bench/planner_speed.py``)."""

from __future__ import annotations

from block_offload.offload.costs import StackCosts

MB = 10**6
#: Pinned host-to-device copies on the H100 (docs/records/log.md).
BANDWIDTH_GBPS = 54.0
BUDGETS = (0.25, 0.5, 0.75)


def wan14b() -> StackCosts:
    """Wan 2.1 14B: 40 blocks of 700 MB, 60 ms each (480p, 81 frames)."""
    return StackCosts.uniform(40, 60.0, 700 * MB, BANDWIDTH_GBPS)


def qwen20b() -> StackCosts:
    """Qwen-Image 20B: 60 blocks of 680 MB, 5 ms each (1024x1024)."""
    return StackCosts.uniform(60, 5.0, 680 * MB, BANDWIDTH_GBPS)


def flux12b() -> StackCosts:
    """Flux.1-dev 12B: 19 double blocks of 670 MB, then 38 single blocks of 280 MB, 170 ms of compute in all
    shared by bytes (1024x1024)."""
    sizes = (670 * MB,) * 19 + (280 * MB,) * 38
    compute = tuple(170.0 * size / sum(sizes) for size in sizes)
    return StackCosts(sizes, tuple(range(len(sizes))), compute, (0.0,) * len(sizes), 0.0, BANDWIDTH_GBPS)


SHAPES = {"wan14b": wan14b, "flux12b": flux12b, "qwen20b": qwen20b}


def budget_bytes(costs: StackCosts, share: float) -> int:
    """``share`` of the stack's bytes."""
    return int(share * sum(costs.block_bytes))
