"""The pack's state on a model: one holder on the ``nn.Module`` that all of ComfyUI's clones share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from torch import nn

from ..offload import ParkingLot

if TYPE_CHECKING:
    from .engine import Engine, PatchHistory
    from .placement import Fallback

_ATTRIBUTE = "block_offload_state"


@dataclass
class ModelState:
    """What outlives one patcher: ComfyUI loads a new clone of the model for every prompt."""

    engine: Engine | None = None  # streaming now
    # The patcher whose load started ``engine`` (``BlockOffloadPatcher.patcher_id``): ComfyUI hands the weights
    # over by detaching that one, while any other clone may be detached (or deleted: ``ModelPatcher.__del__``
    # detaches) at any time, between prompts or, through the cycle collector, in the middle of one.
    owner: int | None = None
    # Module names ComfyUI's loader must not see: streamed now, or parked by the last engine (still on the
    # host, never loaded by ComfyUI; a partial unload between prompts must neither move nor count them).
    hidden: frozenset[str] = frozenset()
    fallback: Fallback | None = None  # the placement that fit when the asked one ran out of memory
    # ComfyUI's books on the model when the last engine parked (``BlockOffloadPatcher.loaded_state``): the
    # next clone keeps the resident part loaded if nothing has loaded or unloaded these weights since.
    # Recorded only by the engine's owner as it parks: a later detach of another clone (ComfyUI's cache
    # dropping an old node output after a plain model loaded these weights) must not pass the plain load
    # off as the parked one.
    parked_load: tuple | None = None
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
