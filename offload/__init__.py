"""The offload engine: pure PyTorch, no ComfyUI.

* ``BlockStreamer`` streams chosen blocks of a stack through reusable device slots.
* ``OffloadPlan`` says which blocks stay resident (count, byte budget, policy).
* ``BlockOffloader`` applies a plan to a whole model.
* ``SequentialOffloader`` streams every tensor-owning module of any model.
* ``TimelineRecorder`` times each block's copy and compute on the device.
"""

from .device import MemorySnapshot, can_pin_memory, memory_snapshot
from .offloader import BlockOffloader
from .plan import OffloadPlan, module_bytes
from .residency import ResidencyPolicy, resident_for_budget, resident_indices
from .sequential import ModuleState, SequentialOffloader
from .streamer import BlockStreamer
from .timeline import BlockSpan, StepTimeline, TimelineRecorder

__all__ = [
    "BlockOffloader",
    "BlockSpan",
    "BlockStreamer",
    "MemorySnapshot",
    "ModuleState",
    "OffloadPlan",
    "ResidencyPolicy",
    "SequentialOffloader",
    "StepTimeline",
    "TimelineRecorder",
    "can_pin_memory",
    "memory_snapshot",
    "module_bytes",
    "resident_for_budget",
    "resident_indices",
]
