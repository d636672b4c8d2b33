"""The pack's state on a model: one holder on the ``nn.Module`` that all of ComfyUI's clones share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from .engine import Engine
    from .placement import Fallback

_ATTRIBUTE = "block_offload_state"


@dataclass
class ModelState:
    """What outlives one patcher: ComfyUI loads a new clone of the model for every prompt."""

    engine: Engine | None = None  # streaming now
    # Module names ComfyUI's loader must not see: streamed now, or parked by the last engine (still on the
    # host, never loaded by ComfyUI; a partial unload between prompts must neither move nor count them).
    hidden: frozenset[str] = frozenset()
    fallback: Fallback | None = None  # the placement that fit when the asked one ran out of memory
    # ComfyUI's books on the model when the last engine parked (``BlockOffloadPatcher.loaded_state``): the
    # next clone keeps the resident part loaded if nothing has loaded or unloaded these weights since.
    parked_load: tuple | None = None


def state_of(model: nn.Module) -> ModelState:
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        state = ModelState()
        setattr(model, _ATTRIBUTE, state)
    return state
