"""The offload engine: pure PyTorch, no ComfyUI.

A host describes what it wants in one frozen ``StreamSpec`` and passes it to ``stream_blocks`` (a ``BlockStreamer`` over
chosen blocks of a stack) or ``stream_modules`` (a ``SequentialOffloader`` over every tensor-owning module); it then
uses either through ``Runner`` and reads its numbers as one ``StreamReport``. ``OffloadPlan`` says which blocks stay
resident, ``best_plan`` picks the fastest one for a budget from measured ``StackCosts``, and ``find_blocks`` finds a
model's blocks from its module tree."""

from .cost_cache import CostCache, cache_key, cached_best_plan
from .costs import Prediction, StackCosts, lower_bound_ms, simulate
from .device import PROCESS_STATE, MemorySnapshot, device_ms, device_name, memory_snapshot, unsupported_torch
from .discovery import FoundBlocks, NoBlocksError, entry_methods, find_blocks
from .file_source import FileChangedError, FileSlice, read_bandwidth
from .file_tier import host_tier
from .parking import ParkingLot
from .pinning import (
    CudaHostRegistrar,
    HostRegistrar,
    PinnedMemoryBudget,
    can_pin_memory,
    pinned_bytes,
    use_host_registrar,
)
from .plan import (
    GIB,
    OffloadPlan,
    ResidencyPolicy,
    StepAside,
    module_bytes,
    place_falling_back,
    platform_aside,
    resident_for_budget,
    resident_indices,
    step_aside,
)
from .planner import PREFETCH_CHOICES, BakeDecision, bake_decision, best_plan
from .runner import PackProgress, Runner, StreamReport
from .sequential import ModuleState, SequentialOffloader, buffer_bytes, stream_modules, streamed_modules
from .spec import CallOptions, FileOptions, HostOptions, RingOptions, SequentialOptions, StreamSpec, Transform
from .streamer import BlockStreamer, stream_blocks
from .system_memory import HostRam, clamp_to_cgroups, release_freed_host_memory
from .timeline import BlockSpan, ReadSpan, StepTimeline, TimelineRecorder

__all__ = [
    "GIB",
    "PREFETCH_CHOICES",
    "PROCESS_STATE",
    "BlockSpan",
    "BlockStreamer",
    "FoundBlocks",
    "HostRam",
    "NoBlocksError",
    "entry_methods",
    "find_blocks",
    "host_tier",
    "BakeDecision",
    "CallOptions",
    "FileOptions",
    "HostOptions",
    "RingOptions",
    "SequentialOptions",
    "StreamSpec",
    "CostCache",
    "CudaHostRegistrar",
    "FileChangedError",
    "FileSlice",
    "HostRegistrar",
    "MemorySnapshot",
    "ModuleState",
    "OffloadPlan",
    "ParkingLot",
    "PinnedMemoryBudget",
    "ReadSpan",
    "Prediction",
    "ResidencyPolicy",
    "PackProgress",
    "Runner",
    "StreamReport",
    "SequentialOffloader",
    "StackCosts",
    "StepAside",
    "StepTimeline",
    "TimelineRecorder",
    "Transform",
    "bake_decision",
    "best_plan",
    "buffer_bytes",
    "cache_key",
    "cached_best_plan",
    "can_pin_memory",
    "device_ms",
    "device_name",
    "lower_bound_ms",
    "memory_snapshot",
    "module_bytes",
    "pinned_bytes",
    "read_bandwidth",
    "place_falling_back",
    "platform_aside",
    "release_freed_host_memory",
    "clamp_to_cgroups",
    "resident_for_budget",
    "resident_indices",
    "simulate",
    "step_aside",
    "stream_blocks",
    "stream_modules",
    "streamed_modules",
    "unsupported_torch",
    "use_host_registrar",
]
