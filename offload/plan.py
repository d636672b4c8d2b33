"""A placement plan: which blocks stay on the device, which stream, how far ahead."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from .layout import ALIGNMENT, DtypeOf, aligned, module_stored_bytes
from .residency import ResidencyPolicy, resident_for_budget, resident_indices
from .ring import ring_capacity

GIB = 1024**3


def stream_buffer_bytes(largest: int, prefetch: int, nesting: int = 1, staging: int = 0) -> int:
    """Device bytes a stream allocates by default: its ring (``ring_capacity``) and, with a storage dtype,
    one staging buffer as large as the largest block in that dtype (copied into before the cast)."""
    return ring_capacity(largest, prefetch, nesting) + staging


def module_bytes(module: nn.Module, dtype_of: DtypeOf | None = None) -> int:
    """Bytes of all parameters and buffers of ``module`` as they are stored (and streamed): a quantized
    weight counts its quantized data and scales, not the size it dequantizes to. Counted once each.
    ``dtype_of``: plain tensors counted in the dtype they are computed in (on the device)."""
    return module_stored_bytes(module, dtype_of=dtype_of)


@dataclass(frozen=True)
class OffloadPlan:
    """Where each block of a stack lives, and what that costs on the device."""

    block_bytes: tuple[int, ...]
    resident: frozenset[int]
    prefetch: int = 1
    pin_memory: bool = True
    # None: the resident set was chosen block by block (offload.planner), not by a position policy.
    policy: ResidencyPolicy | None = ResidencyPolicy.LEADING
    # The device ring's bytes, as the planner sized it from a budget; 0: ``prefetch + 1`` of the largest block.
    ring_bytes: int = 0

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
            assert budget_bytes is not None  # exactly one of the two was given
            # The ring comes out of the same budget as the resident blocks.
            slots = ring_capacity(max(sizes, default=0), prefetch)
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
        """Device bytes of the ring the streamed blocks pass through."""
        if not self.streamed:
            return 0
        return ring_capacity(max(self.block_bytes[i] for i in self.streamed), self.prefetch, ring_bytes=self.ring_bytes)

    @classmethod
    def with_ring(
        cls,
        block_bytes: Sequence[int],
        resident: frozenset[int],
        budget_bytes: int,
        pin_memory: bool = True,
        policy: ResidencyPolicy | None = None,
    ) -> OffloadPlan | None:
        """``resident`` blocks, and a ring of what ``budget_bytes`` leaves (no more than every streamed block
        takes), copies running as far ahead as it has room; None when it leaves less than the largest
        streamed block. The planner's placements within a budget are these."""
        streamed = [size for i, size in enumerate(block_bytes) if i not in resident]
        if not streamed:
            return None
        room = budget_bytes - sum(block_bytes[i] for i in resident)
        ring = min(room - room % ALIGNMENT, sum(aligned(size) for size in streamed))
        if ring < aligned(max(streamed)):
            return None
        return cls(tuple(block_bytes), resident, len(block_bytes), pin_memory, policy, ring)

    def device_bytes(self, outside_blocks: int = 0) -> int:
        """Weights on the device at the peak: resident blocks, slots, and what lies outside the blocks."""
        return self.resident_bytes + self.slot_bytes + outside_blocks

    def fallback(self) -> OffloadPlan | None:
        """The next placement to try when this one ran out of device memory, or None when every
        block already streams synchronously.

        Half the resident blocks first (the ones kept are picked from the resident set by the
        same policy, so leading stays leading and strided stays spread), then a ring sized in
        bytes gives way to two blocks' worth (prefetch 1) or, when it was no larger, to one;
        then one block less of prefetch, which frees one block's worth of the ring.
        """
        if self.resident:
            ordered = sorted(self.resident)
            picked = resident_indices(len(ordered), len(ordered) // 2, self.policy or ResidencyPolicy.STRIDED)
            return replace(self, resident=frozenset(ordered[i] for i in picked))
        if self.ring_bytes:
            pool = replace(self, ring_bytes=0, prefetch=1)
            return pool if pool.slot_bytes < self.slot_bytes else replace(pool, prefetch=0)
        if self.prefetch > 0:
            return replace(self, prefetch=self.prefetch - 1)
        return None

    def describe(self, outside_blocks: int = 0) -> str:
        """The one-line summary the log shows when a model loads with this plan."""
        count = len(self.block_bytes)
        resident = _ranges(sorted(self.resident)) or "none"
        chosen_by = self.policy.value if self.policy else "planned"
        streamed = len(self.streamed)
        copies = f"with prefetch {self.prefetch}"
        if self.ring_bytes:
            limit = f", at most {self.prefetch} ahead" if self.prefetch < streamed else ""
            copies = f"through a {self.slot_bytes / GIB:.2f} GiB ring{limit}"
        return (
            f"{len(self.resident)}/{count} blocks resident ({resident}, {chosen_by}), "
            f"{streamed} streamed {copies}"
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
