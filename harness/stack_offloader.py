"""A whole stack placed by an ``OffloadPlan``, for the engine's tests and benchmarks.

In ComfyUI the ModelPatcher places the model (it loads the resident part) and the nodes drive a
``BlockStreamer`` directly; here ``BlockOffloader`` plays ComfyUI's part for a bare stack: it puts
everything outside the streamed blocks on the device and streams the rest, falling back to smaller
plans when the device runs out of memory, as the nodes do.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    HostOptions,
    OffloadPlan,
    RingOptions,
    StreamSpec,
    TimelineRecorder,
    module_bytes,
    place_falling_back,
    stream_blocks,
)


class BlockOffloader:
    """Applies an ``OffloadPlan`` to ``root`` whose block stack is ``blocks``.

    ``device_limit_bytes`` simulates a device with only that much room for the model's weights and
    stream buffers: a placement beyond it raises ``torch.OutOfMemoryError`` as the allocator would, so
    the out-of-memory fallback can be exercised anywhere.
    """

    def __init__(
        self,
        root: nn.Module,
        blocks: Sequence[nn.Module],
        device: torch.device | str,
        recorder: TimelineRecorder | None = None,
        device_limit_bytes: int | None = None,
    ) -> None:
        self.root = root
        self.blocks = list(blocks)
        self.device = torch.device(device)
        self.recorder = recorder
        self.device_limit_bytes = device_limit_bytes
        self.streamer: BlockStreamer | None = None
        self.plan: OffloadPlan | None = None
        # Plans that ran out of device memory in the last ``apply``, in the order tried.
        self.failed: list[OffloadPlan] = []
        self._origin: torch.device | None = None

    def block_bytes(self) -> list[int]:
        return [module_bytes(block) for block in self.blocks]

    def apply(self, plan: OffloadPlan) -> OffloadPlan:
        """Places the model by ``plan``; applying another plan first undoes this one.

        When the device runs out of memory, the smaller plans of ``plan.fallback()`` are tried in
        turn (``failed`` lists those that did not fit). Returns the plan placed.
        """
        if len(plan.block_bytes) != len(self.blocks):
            raise ValueError(f"the plan is for {len(plan.block_bytes)} blocks, the model has {len(self.blocks)}")
        self.remove()
        first = next(iter(self.root.state_dict(keep_vars=True).values()), None)
        self._origin = first.device if first is not None else self.device
        self.plan, self.failed = place_falling_back(plan, self._place, self.remove)
        return self.plan

    def _place(self, plan: OffloadPlan) -> None:
        self.streamer = stream_blocks(
            self.blocks,
            self.device,
            plan.streamed,
            StreamSpec(
                host=HostOptions(pin_memory=plan.pin_memory),
                ring=RingOptions(prefetch=plan.prefetch, ring_bytes=plan.ring_bytes or None),
                calls=CallOptions(root=self.root),
                recorder=self.recorder,
            ),
        )
        self.streamer.enable()
        self._move_unstreamed(self.device)
        self.streamer.allocate_device_buffers()
        on_device = module_bytes(self.root) - plan.streamed_bytes + self.streamer.report().device_buffer_bytes
        if self.device_limit_bytes is not None and on_device > self.device_limit_bytes:
            raise torch.OutOfMemoryError(
                f"simulated device limit: {on_device} bytes of weights and stream buffers, "
                f"{self.device_limit_bytes} available"
            )

    def remove(self) -> None:
        """Puts the whole model back on the device it came from, bit for bit."""
        if self.streamer is None:
            return
        self._move_unstreamed(self._origin)
        self.streamer.disable()
        self.streamer = None
        self.plan = None

    def _move_unstreamed(self, device: torch.device) -> None:
        streamed = {id(m) for i in self.streamer.streamed for m in self.blocks[i].modules()}
        for module in self.root.modules():
            if id(module) not in streamed:
                module._apply(lambda t: t.to(device), recurse=False)
