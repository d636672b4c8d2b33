"""The pack's state on a model: one holder on the ``nn.Module`` that all of ComfyUI's clones share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from ..offload import ParkingLot
from .load_protocol import LoadProtocol

if TYPE_CHECKING:
    from .engine_runner import PatchHistory
    from .placement import Fallback

_ATTRIBUTE = "block_offload_state"


@dataclass
class ModelState(LoadProtocol):
    """What outlives one patcher: ComfyUI loads a new clone of the model for every prompt. The engine, its owner,
    the modules hidden from ComfyUI's loader and the hand-over's books are the load protocol's (``LoadProtocol``)."""

    fallback: Fallback | None = None  # the placement that fit when the asked one ran out of memory
    # The last engine's call order (its unit, its count of units, the order): the next engine of the model
    # copies and reads ahead in it from its first step (the sequential wrapper's list order is not the calls').
    call_order: tuple[str, int, tuple[int, ...]] | None = None
    patch_history: PatchHistory | None = None  # the patches the last engines ran, and for how many steps
    # The host buffers the model's engines parked on stopping, for the next engine to take over; freed (the
    # blocks given memory of their own) at a real unload.
    parking: ParkingLot = field(default_factory=ParkingLot)


def state_of(model: nn.Module) -> ModelState:
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        state = ModelState()
        setattr(model, _ATTRIBUTE, state)
    return state
