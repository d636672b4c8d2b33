"""What ``bench/comfy_bench.py`` measures: one ``Config`` per row (fully resident, every block streamed,
ComfyUI's own offloading, the pack's nodes, on a classic and a Dynamic VRAM model), in groups that take their rounds
in turn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from bench.comfy_models import Comfy
from bench.results import (
    AGAIN,
    ALL_STREAMED,
    CARD,
    COMFYUI,
    GIB,
    RESIDENT,
    SHARE,
    Budget,
)

DYNAMIC = "on a Dynamic VRAM model"
COMFYUI_DYNAMIC = f"{COMFYUI}, Dynamic VRAM"


@dataclass(frozen=True, eq=False)
class Config:
    """What to load and how: the patcher to load, its budget, ComfyUI's offload streams."""

    method: str
    budget: Budget | None
    prepare: Callable[[], Any]  # -> the ModelPatcher to load
    comfy_streams: int = 2  # ComfyUI's async offload streams (``--async-offload``; 0 = off)

    def again(self) -> Config:
        """The same configuration as a second row: the noise control."""
        return Config(self.method + AGAIN, self.budget, self.prepare, self.comfy_streams)


def _output(node_output) -> Any:
    return node_output.result[0]


@dataclass
class Bases:
    """The models every configuration starts from, and the figures the budgets are worked out from."""

    classic: Any
    dynamic: Any | None  # None: no Dynamic VRAM here
    block_bytes: list[int]
    outside_bytes: int  # weights outside the blocks (embeddings, head), always resident
    activation_bytes: int  # what ComfyUI reserves for sampling beside the weights (its estimate and minimum)


def configs(
    comfy: Comfy, bases: Bases, budgets: list[Budget], rows: Sequence[str] = (), prefetch_choices=(1, 2)
) -> list[list[Config]]:
    """Every configuration whose method starts with one of ``rows`` (all without), in groups that take their
    rounds in turn, one group per budget (the budget-free rows first: the ratios need the resident one);
    each group ends with its first row measured again."""
    nodes = comfy.nodes

    def async_offload(model, resident: int, prefetch: int) -> Callable[[], Any]:
        return lambda: _output(nodes.AsyncBlockOffload.execute(model, resident, prefetch, True))

    def partial(model, weights_budget: int, policy: str) -> Callable[[], Any]:
        return lambda: _output(nodes.PartialGPUResidency.execute(model, weights_budget / GIB, policy, 1, True))

    def sequential(model, weights_budget: int) -> Callable[[], Any]:
        return lambda: _output(
            nodes.SequentialOffloadWrapper.execute(model, "as loaded", weights_budget / GIB, 2, True)
        )

    def leading_that_fit(model, weights_budget: int, prefetch: int) -> Callable[[], Any]:
        # The engine's own budget rule (OffloadPlan.build): as many leading blocks as fit beside the slots.
        room = max(0, weights_budget - bases.outside_bytes)
        fit = comfy.offload.OffloadPlan.build(bases.block_bytes, budget_bytes=room, prefetch=prefetch)
        return async_offload(model, len(fit.resident), prefetch)

    classic = bases.classic
    groups = [
        [Config(RESIDENT, None, classic.clone)]
        + [Config(f"{ALL_STREAMED}, prefetch {p}", None, async_offload(classic, 0, p)) for p in prefetch_choices]
    ]
    for budget in budgets:
        comfyui = [
            Config(f"{COMFYUI}, async offload on", budget, classic.clone, comfy_streams=2),
            Config(f"{COMFYUI}, async offload off", budget, classic.clone, comfy_streams=0),
        ]
        if budget.kind == SHARE:
            weights = budget.nbytes
            pack = [
                Config(
                    f"Async Block Offload, leading blocks that fit, prefetch {p}",
                    budget,
                    leading_that_fit(classic, weights, p),
                )
                for p in prefetch_choices
            ] + [Config(f"Partial GPU Residency, {policy}", budget, partial(classic, weights, policy)) for policy in
                 ("trailing", "strided", "auto")]  # fmt: skip
        else:
            # On a card, ComfyUI's loader grants the weights what its reserve and the activations leave;
            # Partial GPU Residency takes that grant itself (budget 0: automatic), the others need a figure.
            weights = budget.nbytes - bases.activation_bytes
            pack = [
                Config("Async Block Offload, leading blocks that fit, prefetch 1", budget,
                       leading_that_fit(classic, weights, 1)),
                *(Config(f"Partial GPU Residency, {policy}", budget, partial(classic, 0, policy)) for policy in
                  ("strided", "auto")),
            ]  # fmt: skip
        pack.append(Config("Sequential Offload Wrapper, prefetch 2", budget, sequential(classic, weights)))
        dynamic = []
        if budget.kind == CARD and bases.dynamic is not None:
            model = bases.dynamic
            dynamic = [
                Config(COMFYUI_DYNAMIC, budget, model.clone),
                Config(f"Async Block Offload {DYNAMIC}", budget, leading_that_fit(model, weights, 1)),
                Config(f"Partial GPU Residency, auto {DYNAMIC}", budget, partial(model, 0, "auto")),
                Config(f"Sequential Offload Wrapper {DYNAMIC}", budget, sequential(model, weights)),
            ]
        groups.append(comfyui + dynamic + pack)
    chosen = [[c for c in group if not rows or c.method.startswith(tuple(rows))] for group in groups]
    return [[*group, group[0].again()] for group in chosen if group]


T = TypeVar("T")


def interleaved(groups: Sequence[Sequence[T]], rounds: int) -> list[T]:
    """The order rows are measured in: each group's rows in turn, ``rounds`` times (A B C A B C), group after
    group, so a drift of the machine during a group touches all its rows alike."""
    return [row for group in groups for _ in range(rounds) for row in group]
