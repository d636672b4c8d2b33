"""A placement plan: which blocks stay on the device, which stream, how far ahead."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from .layout import module_stored_bytes
from .residency import ResidencyPolicy, resident_for_budget, resident_indices

GIB = 1024**3


def slot_count(prefetch: int, nesting: int = 1) -> int:
    """Device slots a stream needs: one per block copied ahead (``prefetch``) and one per block running
    (``nesting``: more than one where streamed modules run inside each other)."""
    return prefetch + nesting


def slot_pool_bytes(largest: int, prefetch: int, nesting: int = 1, staging: int = 0) -> int:
    """Device bytes of that slot pool: each slot as large as the largest streamed block, plus, with a
    storage dtype, a staging copy of it in that dtype (copied into before the cast)."""
    return slot_count(prefetch, nesting) * (largest + staging)


def module_bytes(module: nn.Module) -> int:
    """Bytes of all parameters and buffers of ``module`` as they are stored (and streamed): a quantized
    weight counts its quantized data and scales, not the size it dequantizes to. Counted once each."""
    return module_stored_bytes(module)


@dataclass(frozen=True)
class OffloadPlan:
    """Where each block of a stack lives, and what that costs on the device."""

    block_bytes: tuple[int, ...]
    resident: frozenset[int]
    prefetch: int = 1
    pin_memory: bool = True
    # None: the resident set was chosen block by block (offload.planner), not by a position policy.
    policy: ResidencyPolicy | None = ResidencyPolicy.LEADING

    @classmethod
    def build(
        cls,
        block_bytes: Sequence[int],
        *,
        resident_count: int | None = None,
        budget_bytes: int | None = None,
        policy: ResidencyPolicy = ResidencyPolicy.LEADING,
        prefetch: int = 1,
        pin_memory: bool = True,
    ) -> OffloadPlan:
        """Resident blocks by ``resident_count``, or as many as fit ``budget_bytes`` with the slots."""
        if (resident_count is None) == (budget_bytes is None):
            raise ValueError("give exactly one of resident_count and budget_bytes")
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {prefetch}")
        sizes = tuple(block_bytes)
        if resident_count is not None:
            resident = resident_indices(len(sizes), resident_count, policy)
        else:
            # The slot pool comes out of the same budget as the resident blocks.
            slots = slot_pool_bytes(max(sizes, default=0), prefetch)
            resident = resident_for_budget(sizes, max(0, budget_bytes - slots), policy)
        return cls(sizes, resident, prefetch, pin_memory, policy)

    @property
    def streamed(self) -> frozenset[int]:
        return frozenset(range(len(self.block_bytes))) - self.resident

    @property
    def resident_bytes(self) -> int:
        return sum(self.block_bytes[i] for i in self.resident)

    @property
    def streamed_bytes(self) -> int:
        return sum(self.block_bytes[i] for i in self.streamed)

    @property
    def slot_bytes(self) -> int:
        """Device bytes of the reusable buffers the streamed blocks pass through."""
        if not self.streamed:
            return 0
        return slot_pool_bytes(max(self.block_bytes[i] for i in self.streamed), self.prefetch)

    def device_bytes(self, outside_blocks: int = 0) -> int:
        """Weights on the device at the peak: resident blocks, slots, and what lies outside the blocks."""
        return self.resident_bytes + self.slot_bytes + outside_blocks

    def fallback(self) -> OffloadPlan | None:
        """The next placement to try when this one ran out of device memory, or None when every
        block already streams synchronously.

        Half the resident blocks first (the ones kept are picked from the resident set by the
        same policy, so leading stays leading and strided stays spread), then one block less
        of prefetch, which frees one stream buffer.
        """
        if self.resident:
            ordered = sorted(self.resident)
            picked = resident_indices(len(ordered), len(ordered) // 2, self.policy or ResidencyPolicy.STRIDED)
            return replace(self, resident=frozenset(ordered[i] for i in picked))
        if self.prefetch > 0:
            return replace(self, prefetch=self.prefetch - 1)
        return None

    def describe(self, outside_blocks: int = 0) -> str:
        """The one-line summary the log shows when a model loads with this plan."""
        count = len(self.block_bytes)
        resident = _ranges(sorted(self.resident)) or "none"
        chosen_by = self.policy.value if self.policy else "planned"
        return (
            f"{len(self.resident)}/{count} blocks resident ({resident}, {chosen_by}), "
            f"{len(self.streamed)} streamed with prefetch {self.prefetch}"
            f"{' from pinned memory' if self.pin_memory and self.streamed else ''}; "
            f"resident {self.resident_bytes / GIB:.2f} GiB, streamed {self.streamed_bytes / GIB:.2f} GiB, "
            f"buffers {self.slot_bytes / GIB:.2f} GiB, weights on device at peak "
            f"{self.device_bytes(outside_blocks) / GIB:.2f} GiB"
        )


def _ranges(indices: list[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][1] == i - 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in runs)


def place_falling_back(
    plan: OffloadPlan, place: Callable[[OffloadPlan], None], undo: Callable[[], None]
) -> tuple[OffloadPlan, list[OffloadPlan]]:
    """Places ``plan``, or, while the device runs out of memory, each smaller ``fallback()`` in turn.

    ``undo`` must leave the model as it was before ``place`` began. Returns the plan placed and
    the plans that did not fit, in the order tried; raises the last out-of-memory error when
    not even every block streaming synchronously fits.
    """
    failed: list[OffloadPlan] = []
    while True:
        try:
            place(plan)
            return plan, failed
        except torch.OutOfMemoryError:
            smaller = plan.fallback()
            if smaller is None:
                undo()
                raise
        # Undone outside the handler: the error's traceback holds the failed attempt's tensors.
        undo()
        failed.append(plan)
        plan = smaller
