"""A placement: which blocks stay on the device and which stream, how far ahead (``OffloadPlan``), by what position
policy (``ResidencyPolicy``), and when a node leaves the model to its host's loader (``step_aside``).

Streaming pays only for weights that cannot stay: a host managing device memory itself (Dynamic VRAM) runs a model that
fits faster resident, so a node steps aside when nothing would stream or the whole model fits."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from enum import Enum
from types import MappingProxyType

import torch
from torch import nn

from .layout import ALIGNMENT, DtypeOf, aligned, module_stored_bytes
from .ring import ring_capacity

GIB = 1024**3


class ResidencyPolicy(str, Enum):
    """Where the resident blocks sit in the stack. ``strided`` spreads them, so each streamed copy can hide behind
    resident neighbours' compute instead of all copies queueing at one end."""

    LEADING = "leading"
    TRAILING = "trailing"
    STRIDED = "strided"


def resident_indices(num_blocks: int, count: int, policy: ResidencyPolicy) -> frozenset[int]:
    if not 0 <= count <= num_blocks:
        raise ValueError(f"resident block count must be between 0 and {num_blocks}, got {count}")
    if policy is ResidencyPolicy.LEADING:
        return frozenset(range(count))
    if policy is ResidencyPolicy.TRAILING:
        return frozenset(range(num_blocks - count, num_blocks))
    # Evenly spaced, centred in each of ``count`` equal spans: 10 blocks, 3 resident -> 1, 5, 8.
    return frozenset(int((i + 0.5) * num_blocks / count) for i in range(count))


def resident_for_budget(block_bytes: Sequence[int], budget_bytes: int, policy: ResidencyPolicy) -> frozenset[int]:
    for count in range(len(block_bytes), -1, -1):
        chosen = resident_indices(len(block_bytes), count, policy)
        if sum(block_bytes[i] for i in chosen) <= budget_bytes:
            return chosen
    return frozenset()


def stream_buffer_bytes(largest: int, prefetch: int, nesting: int = 1, staging: int = 0) -> int:
    """Device bytes a stream allocates by default: its ring and, with a storage dtype, a staging buffer for the
    largest block."""
    return ring_capacity(largest, prefetch, nesting) + staging


def module_bytes(module: nn.Module, dtype_of: DtypeOf | None = None) -> int:
    """Bytes of ``module``'s tensors as stored and streamed (a quantized weight's data and scales), each once;
    ``dtype_of``: plain tensors in their compute dtype."""
    return module_stored_bytes(module, dtype_of=dtype_of)


@dataclass(frozen=True)
class OffloadPlan:
    """Where each block of a stack lives, and what that costs on the device."""

    block_bytes: tuple[int, ...]
    resident: frozenset[int]
    prefetch: int = 1
    pin_memory: bool = True
    policy: ResidencyPolicy | None = ResidencyPolicy.LEADING  # None: chosen by the planner
    ring_bytes: int = 0  # as the planner sized it; 0: ``prefetch + 1`` of the largest block

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
        """Resident blocks by ``resident_count``, or as many as fit ``budget_bytes`` with the ring."""
        if (resident_count is None) == (budget_bytes is None):
            raise ValueError("give exactly one of resident_count and budget_bytes")
        if prefetch < 0:
            raise ValueError(f"prefetch must be 0 (synchronous) or more, got {prefetch}")
        sizes = tuple(block_bytes)
        if resident_count is not None:
            resident = resident_indices(len(sizes), resident_count, policy)
        else:
            assert budget_bytes is not None
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
        """``resident`` blocks and a ring of what ``budget_bytes`` leaves (no more than all streamed blocks), copying
        as far ahead as it has room; None when that is less than the largest streamed block."""
        streamed = [size for i, size in enumerate(block_bytes) if i not in resident]
        if not streamed:
            return None
        room = budget_bytes - sum(block_bytes[i] for i in resident)
        ring = min(room - room % ALIGNMENT, sum(aligned(size) for size in streamed))
        if ring < aligned(max(streamed)):
            return None
        return cls(tuple(block_bytes), resident, len(block_bytes), pin_memory, policy, ring)

    def device_bytes(self, outside_blocks: int = 0) -> int:
        """Weights on the device at the peak: resident blocks, ring, and what lies outside the blocks."""
        return self.resident_bytes + self.slot_bytes + outside_blocks

    def fallback(self) -> OffloadPlan | None:
        """The next placement to try after running out of device memory; None once every block streams synchronously.

        Half the resident blocks first, picked by the same policy so it keeps its shape; then a byte-sized ring gives
        way to prefetch 1 (or 0 when that is no smaller); then one less prefetch at a time."""
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
    """Places ``plan``, or each smaller ``fallback()`` in turn while the device runs out of memory.

    ``undo`` must leave the model as before ``place``. Returns the plan placed and those that failed, in order; raises
    the last out-of-memory error when even synchronous streaming does not fit."""
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


@dataclass(frozen=True)
class StepAside:
    reason: str


def step_aside(model_bytes: int, room_bytes: int, streams_any: bool) -> StepAside | None:
    """Whether a node steps aside, for a model of ``model_bytes`` on a device with ``room_bytes`` for weights."""
    if not streams_any:
        return StepAside("the settings stream no block, so the host's own loader runs the model as fast")
    if model_bytes <= room_bytes:
        return StepAside(
            f"the whole model ({model_bytes / GIB:.2f} GiB) fits the {room_bytes / GIB:.2f} GiB the device has "
            "for weights, where the host's loader keeps it resident, faster than any streamed placement"
        )
    return None


_NO_GAIN = MappingProxyType(
    {
        "mps": "Apple Silicon's memory is unified (the GPU computes from the same RAM the blocks would stream from), "
        "and its copies run on the compute stream, so streaming costs RAM and copies and saves no memory; ComfyUI's "
        "own loading is the better choice there",
        "privateuseone": "DirectML has no copy stream or events for a copy to overlap compute, so every block would "
        "wait for its own copy; ComfyUI's own loading (--lowvram) is the better choice there",
    }
)


def platform_aside(device: torch.device) -> StepAside | None:
    reason = _NO_GAIN.get(device.type)
    return StepAside(f"on {device.type}, {reason}") if reason is not None else None
