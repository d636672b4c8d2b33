"""The offload engine: pure PyTorch, no ComfyUI.

* ``BlockStreamer`` streams chosen blocks of a stack through reusable device slots.
* ``OffloadPlan`` says which blocks stay resident (count, byte budget, policy).
* ``BlockOffloader`` applies a plan to a whole model.
* ``SequentialOffloader`` streams every tensor-owning module of any model.
* ``TimelineRecorder`` times each block's copy and compute on the device.
* ``PinnedMemoryBudget`` caps the page-locked host memory the streamers take.
* ``best_plan`` picks the fastest placement for a budget from measured ``StackCosts``.
"""

from .device import MemorySnapshot, can_pin_memory, device_name, memory_snapshot, pinned_bytes
from .offloader import BlockOffloader
from .pinning import PinnedMemoryBudget
from .plan import OffloadPlan, module_bytes, place_falling_back
from .planner import CostCache, Prediction, StackCosts, best_plan, cache_key, lower_bound_ms, simulate
from .residency import ResidencyPolicy, resident_for_budget, resident_indices
from .sequential import ModuleState, SequentialOffloader, buffer_bytes, streamed_modules
from .streamer import BlockStreamer, unpark
from .timeline import BlockSpan, StepTimeline, TimelineRecorder

__all__ = [
    "BlockOffloader",
    "BlockSpan",
    "BlockStreamer",
    "CostCache",
    "MemorySnapshot",
    "ModuleState",
    "OffloadPlan",
    "PinnedMemoryBudget",
    "Prediction",
    "ResidencyPolicy",
    "SequentialOffloader",
    "StackCosts",
    "StepTimeline",
    "TimelineRecorder",
    "best_plan",
    "buffer_bytes",
    "cache_key",
    "can_pin_memory",
    "device_name",
    "lower_bound_ms",
    "memory_snapshot",
    "module_bytes",
    "pinned_bytes",
    "place_falling_back",
    "resident_for_budget",
    "resident_indices",
    "simulate",
    "streamed_modules",
    "unpark",
]
