"""When a node should leave a model to its host's own loader: the rule that keeps the pack never slower
than not using it, where the host can keep the whole model on the device by itself.

Streaming pays off only for weights that cannot stay on the device. A host that manages device memory
itself (ComfyUI's Dynamic VRAM) runs a model that fits fully resident, which no streamed placement beats
(a streamed block costs a copy, hidden at best); streaming it anyway would also load a second copy of the
checkpoint. So a node steps aside when nothing would stream, or when the whole model fits the device room
the host has for it. On some devices streaming cannot gain at all (``platform_aside``).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch

from .plan import GIB


@dataclass(frozen=True)
class StepAside:
    """Why a node returned the model unchanged, for the log and the panel."""

    reason: str


def step_aside(model_bytes: int, room_bytes: int, streams_any: bool) -> StepAside | None:
    """The decision for a model of ``model_bytes`` weights, on a device with ``room_bytes`` for weights
    (its memory less the host's reserve for inference), whose request would stream ``streams_any``."""
    if not streams_any:
        return StepAside("the settings stream no block, so the host's own loader runs the model as fast")
    if model_bytes <= room_bytes:
        return StepAside(
            f"the whole model ({model_bytes / GIB:.2f} GiB) fits the {room_bytes / GIB:.2f} GiB the device has "
            "for weights, where the host's loader keeps it resident, faster than any streamed placement"
        )
    return None


# Devices where the engine's copies cannot pay: why, for the log and the panel.
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
    """The decision for a device where streaming gains nothing whatever the model (None: it may gain)."""
    reason = _NO_GAIN.get(device.type)
    return StepAside(f"on {device.type}, {reason}") if reason is not None else None
