"""The patcher's load and unload protocol: which of ComfyUI's calls moves a model's weights into which phase.

ComfyUI never says why it calls. ``unpatch_model(unpatch_weights=True)`` is a real unload (``/free``, eviction,
a failed load undone) everywhere but at the start of ``partially_load``, where it only clears the old patches
before the new ones go on. ``detach(unpatch_all=False)`` hands the weights over to the next prompt's clone when
``load_models_gpu`` calls it on the clone it had loaded, and means nothing when ``ModelPatcher.__del__`` calls it
on any other clone. The phases below tell these apart; ``LoadProtocol``'s methods are the only ways between
them, each named after the ComfyUI call that triggers it. Every clone of a model shares one ``LoadProtocol``
(the base of ``ModelState``), so the clone loaded next finds what the one before it left.

* UNPLACED: no engine, nothing hidden from ComfyUI's loader, which loads every module its own way. At the start,
  after a real unload, after a placement that streams nothing.
* STREAMING: the owner's engine streams the hidden blocks; ComfyUI holds the rest. After the pack's ``load``
  (which hides the blocks it streams before ComfyUI's loader runs, then starts or keeps the engine).
* PARKED: no engine; the last one's blocks wait on their host buffers, still hidden, for the next engine to adopt
  (no pack, no pin again). After a re-patch, or once the next load took a hand-over.
* HANDED_OVER: PARKED, with ComfyUI's books as the owner left them. After the owner's ``detach(unpatch_all=False)``.
  A placement that streams nothing is handed over too, ComfyUI holding all of it: the next clone of the same
  request keeps it loaded, as ComfyUI keeps a model it loaded, instead of loading the whole model again.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING, NamedTuple

import torch

if TYPE_CHECKING:
    from .engine import Engine


class Phase(Enum):
    UNPLACED = "unplaced"
    STREAMING = "streaming"
    PARKED = "parked"
    HANDED_OVER = "handed over"


class Unpatch(Enum):
    """What one call of ``unpatch_model`` is (``LoadProtocol.unpatching``)."""

    REPATCH = "repatch"  # partially_load clears the old patches before it loads with new ones: the blocks park
    UNLOAD = "unload"  # the weights unpatched outside a load: nothing of the pack's may keep memory
    OBJECTS = "objects"  # unpatch_weights=False: object patches come off, the weights stay as they are


class LoadedBooks(NamedTuple):
    """ComfyUI's books on a model's weights (on its ``BaseModel``): any load or unload by any patcher changes them."""

    weight_memory: int  # model_loaded_weight_memory
    lowvram: bool
    patches_uuid: uuid.UUID | None  # current_weight_patches_uuid: the patches the loaded weights carry
    device: torch.device | None


@dataclass
class LoadProtocol:
    """A model's phase and what goes with it; a patcher (``BlockOffloadPatcher.patcher_id``) is named by its number."""

    phase: Phase = Phase.UNPLACED
    engine: Engine | None = None  # STREAMING only
    # The patcher whose load placed the weights as they are: STREAMING, the engine's (the only clone whose
    # detach hands the weights over: any other may be detached, or deleted, as ``ModelPatcher.__del__``
    # detaches, at any time, through the cycle collector even in the middle of a prompt); UNPLACED, the one
    # whose placement streams nothing (its sampling without an engine is no surprise).
    owner: int | None = None
    # Module names ComfyUI's loader must not see: streamed now, or parked by the last engine (still on the host,
    # never loaded by ComfyUI; a partial unload between prompts must neither move nor count them).
    hidden: frozenset[str] = frozenset()
    # HANDED_OVER only: ComfyUI's books as the owner handed the weights over. The next clone keeps the resident
    # part loaded if they still hold, that is if nothing (a plain clone, say) loaded or unloaded the weights since.
    # Only the owner records them: a later detach of another clone (ComfyUI's cache dropping an old node output
    # after a plain model loaded these weights) must not pass the plain load off as the parked one.
    parked_load: LoadedBooks | None = None
    # The patcher inside ``partially_load`` whose first ``unpatch_model`` has not come yet.
    repatching: int | None = None
    # What the owner's placement was made for (its node's request, compared by equality): a clone of another
    # request must place anew, not keep the weights as the owner's placement left them.
    placed_for: object = None

    # -- partially_load: load_models_gpu, once per prompt, per model -----------------------------------------------

    def begin_load(self, patcher: int, books: LoadedBooks, request: object) -> bool:
        """``partially_load`` begins: a hand-over is taken (HANDED_OVER → PARKED) and ``patcher``'s re-patch window
        opens. True when what ComfyUI holds loaded is not the pack's placement (a detached clone's own load, which
        ComfyUI keeps, or a hand-over whose books changed since): the load must start from the host.

        A placement that streamed nothing, handed over for the same ``request``, is ``patcher``'s at once (UNPLACED,
        owned): ComfyUI's partially_load keeps a model it holds whole without calling ``load``, so the pack would
        not see it placed. For another request it starts from the host, or ComfyUI would keep it unplaced."""
        if self.repatching is not None and self.repatching != patcher:
            self._unexpected("partially_load", f"patcher {self.repatching}'s partially_load is still open")
        kept = self.phase is Phase.HANDED_OVER and self.parked_load == books
        self.repatching = patcher
        if self.phase is Phase.HANDED_OVER:
            self.parked_load = None
            if not self.hidden:  # a placement that streamed nothing
                kept = kept and request == self.placed_for
                if kept:
                    self.owner = patcher
                    self._enter(Phase.UNPLACED, "partially_load keeps the hand-over, all of it loaded")
                    return False
            self._enter(Phase.PARKED, "partially_load takes the hand-over")
        return self.phase is not Phase.STREAMING and books.weight_memory > 0 and not kept

    def unpatching(self, patcher: int, unpatch_weights: bool) -> Unpatch:
        """``unpatch_model``: ComfyUI's partially_load calls it first, unpatching the weights when this clone's
        patches differ from those loaded (a LoRA added or removed, another strength). That one is no unload: the
        streamed blocks' host buffers hold the weights unpatched (their patches are applied on the device), so they
        park for the next engine. Any other call unpatching the weights unloads them. The patcher stops the
        engine; ``stopped`` and ``unloaded`` change the phase."""
        repatch = self.repatching == patcher
        if repatch:
            self.repatching = None
        if not unpatch_weights:
            return Unpatch.OBJECTS
        return Unpatch.REPATCH if repatch else Unpatch.UNLOAD

    def end_load(self, patcher: int) -> None:
        """``partially_load`` returns (or raises): ``patcher``'s window closes. ComfyUI 0.3.75 and 0.33 both unpatch
        first thing; a window still open means a ComfyUI whose re-patch the pack would take for an unload."""
        if self.repatching == patcher:
            self.repatching = None
            self._unexpected("partially_load", "it ended before its first unpatch_model")

    # -- load: the pack's placement --------------------------------------------------------------------------------

    def placing(self, streamed: frozenset[str]) -> None:
        """``load`` places: the blocks it streams are hidden before ComfyUI's loader runs (parked ones included:
        their engine adopts them; those it no longer streams become ordinary weights, for ComfyUI to load)."""
        self.hidden = streamed

    def placed(self, patcher: int, engine: Engine | None, request: object) -> None:
        """``load`` is done: ``engine`` streams (STREAMING; started or kept from an earlier load of the same
        placement), or, with None, the placement streams nothing (UNPLACED). ``patcher`` owns either, placed for
        ``request``."""
        if self.engine is not None and self.engine is not engine:
            self._unexpected("load", "another engine is streaming; it is left running unseen")
        self.engine = engine
        self.owner = patcher
        self.placed_for = request
        self.parked_load = None
        self._enter(Phase.UNPLACED if engine is None else Phase.STREAMING, "load")

    # -- stopping ------------------------------------------------------------------------------------------------

    def stopped(self, park: bool) -> None:
        """The engine stopped: its blocks parked (PARKED: a re-patch, a hand-over) or given back (UNPLACED: a real
        unload, a load replacing the placement)."""
        self.engine = None
        if not park:
            self.hidden = frozenset()
        self._enter(Phase.PARKED if park else Phase.UNPLACED, "engine parked" if park else "engine stopped")

    def hands_over(self, patcher: int, unpatch_all: bool) -> bool:
        """``detach(unpatch_all=False)``: ComfyUI hands the weights to a new clone (one per prompt) by detaching
        the one it loaded. Only the owner hands over: of a streaming engine (which parks, then ``handed_over``), or
        of a placement that streams nothing; another clone detached or deleted now is not what is loaded.
        ``detach()`` unpatches all: an unload."""
        placed = self.phase is Phase.STREAMING or self.phase is Phase.UNPLACED
        return not unpatch_all and placed and self.owner == patcher

    def handed_over(self, books: LoadedBooks) -> None:
        """The owner's detach is done: PARKED (or UNPLACED, owned: its placement streamed nothing) → HANDED_OVER,
        with ComfyUI's books as it left them."""
        owned_unplaced = self.phase is Phase.UNPLACED and self.owner is not None
        if self.phase is not Phase.PARKED and not owned_unplaced:
            self._unexpected("detach", "the engine did not park")
            return
        self.parked_load = books
        self._enter(Phase.HANDED_OVER, "detach")

    def unloaded(self) -> None:
        """A real unload, the engine stopped and the parked blocks given memory of their own: UNPLACED, no owner."""
        if self.engine is not None:
            self._unexpected("unpatch_model", "the engine is still streaming")
        self.hidden = frozenset()
        self.parked_load = None
        self.owner = None
        self._enter(Phase.UNPLACED, "unload")

    # -- sampling --------------------------------------------------------------------------------------------------

    def placed_without_streaming(self, patcher: int) -> bool:
        """Whether ``patcher``'s own placement streams nothing (``pre_run``: sampling without an engine is then
        what was planned)."""
        return self.phase is Phase.UNPLACED and self.owner == patcher

    def _enter(self, phase: Phase, call: str) -> None:
        logging.debug(f"Block Offload: {self.phase.value} -> {phase.value} ({call})")
        self.phase = phase

    def _unexpected(self, call: str, what: str) -> None:
        logging.warning(
            f"Block Offload: unexpected {call} while the model is {self.phase.value}: {what}. Please report this with "
            "the workflow; unloading models (Free model and node cache) starts the model afresh."
        )
