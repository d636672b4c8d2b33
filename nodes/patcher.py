"""ComfyUI's ModelPatcher taught to stream blocks instead of loading them, and the load protocol it keeps on the
model.

Moving blocks with ``.to()`` behind ComfyUI's back leaves its books (``model_loaded_weight_memory``) wrong. So the
streamed blocks are hidden from its loader (``_load_list``): ComfyUI loads and counts the resident part as any partial
load, its budget less our device slots, and the engine streams the rest. The class is a mixin over the incoming patcher
class; ``clone()`` builds ``self.__class__``, so later clones (LoRA loaders) keep streaming.

ComfyUI never says why it calls. ``unpatch_model(unpatch_weights=True)`` is an unload except at the start of
``partially_load``; ``detach(unpatch_all=False)`` is a hand-over to the next prompt's clone only on the clone that was
loaded. ``LoadProtocol``, shared by all clones on the ``nn.Module``, tells these apart with four phases:

* UNPLACED: no engine, nothing hidden. * STREAMING: the owner's engine streams the hidden blocks; ComfyUI holds the
rest. * PARKED: no engine; the blocks wait, still hidden, on their host buffers for the next engine to adopt. *
HANDED_OVER: PARKED, with ComfyUI's books as the owner's detach left them."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import math
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, NamedTuple

import comfy.model_management
import torch
from comfy.model_patcher import ModelPatcher
from comfy_api.torch_helpers.torch_compile import TORCH_COMPILE_KWARGS
from torch import nn

from ..offload import GIB, PROCESS_STATE, OffloadPlan, ParkingLot, place_falling_back
from . import panel
from .blocks import inside, one_tree_per_load
from .dynamic_vram import (
    back_to_file,
    cast_unloaded_to_recorded_dtypes,
    classic_clone,
    core_prefetching,
    keep_fast_disk,
    load_in_recorded_dtype,
    own_classic_path,
    patch_loaded_as_dynamic_vram,
    uses_dynamic_vram,
)
from .engine import Engine, PatchHistory, call_order_of, start_engine
from .patches import refuse_patches_on_packed_weights, refuse_reshaping_patches, refuse_weight_hooks
from .placement import Fallback, Placement, describe, place, remember_costs
from .request import OffloadRequest

ATTACHMENT = "block_offload"
# Only during ``load``: the cached module list (None until walked).
_MODULE_LIST = "_block_offload_module_list"


def refuse_cudagraphs(model: ModelPatcher, node: str) -> None:
    """A cudagraphs-compiled model cannot stream: a CUDA graph replays the addresses it captured, while streamed blocks
    point at a different slot each call and are filled from another stream."""
    backend = model.model_options.get(TORCH_COMPILE_KWARGS, {}).get("backend")
    if backend == "cudagraphs":
        raise ValueError(
            f"{node}: this MODEL is compiled with the cudagraphs backend, which cannot replay streamed "
            "weights (they live in a different buffer at each call). Use the inductor backend in "
            "TorchCompileModel, or no compilation, with block offloading."
        )


def with_offload(model: ModelPatcher, request: OffloadRequest) -> ModelPatcher:
    """A clone of ``model`` that streams as ``request`` says; ``model`` itself is untouched."""
    previous = model.get_attachment(ATTACHMENT)
    if previous is not None:
        logging.info(f"Block Offload: {request.node} replaces the earlier {previous.node} on this model")
    patched = classic_clone(model, request.node)
    own = own_classic_path(model)
    request = dataclasses.replace(
        request,
        dynamic_vram_twin=uses_dynamic_vram(model) and not own,
        own_classic_path=own,
        core_prefetch=core_prefetching(model),
    )
    patched.__class__ = _offload_class(type(patched))
    patched.set_attachments(ATTACHMENT, request)
    return patched


class _PatcherKinds:
    """One subclass per patcher class, so all clones share a class; and patcher numbers, never reused."""

    def __init__(self) -> None:
        self.classes: dict[type, type] = {}
        self.ids = itertools.count(1)


def _patcher_kinds() -> _PatcherKinds:
    return PROCESS_STATE.entry(
        "patcher classes", _PatcherKinds, "a patcher class and a patcher's number are shared by all its clones"
    )


def _offload_class(base: type) -> type:
    if issubclass(base, BlockOffloadPatcher):
        return base
    classes = _patcher_kinds().classes
    if base not in classes:
        classes[base] = type(f"BlockOffload{base.__name__}", (BlockOffloadPatcher, base), {})
    return classes[base]


class LoadEntry(NamedTuple):
    """One entry of ComfyUI's ``_load_list``, ``(offload_mem, module_mem, name, module, params)`` in both supported
    hosts. Read only here, so a layout change breaks one place."""

    offload_mem: int  # what casting the module on the fly takes
    module_mem: int
    name: str
    module: nn.Module

    @classmethod
    def of(cls, entry: Sequence[Any]) -> LoadEntry:
        offload_mem, module_mem, name, module = entry[:4]
        return cls(offload_mem, module_mem, name, module)


def loader_need(entries: Sequence[Any], streamed: frozenset[str]) -> int:
    """The budget ComfyUI's loader needs to load every module of ``entries`` outside ``streamed``: a mirror of
    ``load()`` in comfy/model_patcher.py, largest first, each with cast buffers for ``NUM_STREAMS`` more modules."""
    kept = sorted((e for e in map(LoadEntry.of, entries) if not inside(e.name, streamed)), key=lambda e: -e.offload_mem)
    buffers = comfy.model_management.NUM_STREAMS + 1
    need = loaded = 0
    for entry in kept:
        need = max(need, loaded + entry.module_mem + buffers * entry.offload_mem)
        loaded += entry.module_mem
    return need + 1  # ComfyUI's test is strict (<)


class BlockOffloadPatcher(ModelPatcher):
    """Mixin: must come before the patcher class in the MRO (see ``_offload_class``).

    Calls on to that class pass leading arguments by position and flags by keyword, as ComfyUI does: a class that
    forwards ``*args`` with a keyword-only flag of its own (ComfyUI-GGUF's ``partially_load``) would otherwise get a
    flag twice. The one exception is the resident budget (see ``_place``)."""

    def clone(self, *args, **kwargs):
        cloned = super().clone(*args, **kwargs)
        keep_fast_disk(self, cloned)
        # GGUFModelPatcher sets its own class on every clone; a later LoRA must still stream.
        if not isinstance(cloned, BlockOffloadPatcher):
            cloned.__class__ = _offload_class(type(cloned))
        return cloned

    @property
    def offload_request(self) -> OffloadRequest:
        return self.get_attachment(ATTACHMENT)

    @property
    def offload_engine(self) -> Engine | None:
        return state_of(self.model).engine

    @property
    def patcher_id(self) -> int:
        """This patcher's own number: unlike ``id()`` never reused, and unlike a weak reference still readable in
        ``__del__`` under the cycle collector."""
        number = self.__dict__.get("_block_offload_id")
        if number is None:
            number = self.__dict__["_block_offload_id"] = next(_patcher_kinds().ids)
        return number

    # -- what ComfyUI's loader may touch

    def _load_list(self, *args, **kwargs):
        entries = self._module_list() if not args and not kwargs else super()._load_list(*args, **kwargs)
        hidden = state_of(self.model).hidden
        return [entry for entry in entries if not inside(LoadEntry.of(entry).name, hidden)]

    def _module_list(self) -> list[Any]:
        """ComfyUI's ``_load_list()``, walked once per ``load``, since each walk visits every module and nothing
        outside the streamed blocks changes meanwhile. Only the argument-less call is cached: with
        ``default_device`` ComfyUI moves weights as it walks."""
        entries = self.__dict__.get(_MODULE_LIST)
        if entries is None:
            entries = super()._load_list()
            if _MODULE_LIST in self.__dict__:
                self.__dict__[_MODULE_LIST] = entries
        return entries

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        state = state_of(self.model)
        if state.begin_load(self.patcher_id, self.loaded_state(), self.offload_request):
            # Start from the host, through ComfyUI's own unpatch, so parked blocks stay parked.
            super().unpatch_model(self.offload_device, unpatch_weights=True)
        # ComfyUI skips resident modules left loaded (``comfy_patched_weights``): a queue does not recopy them.
        try:
            return super().partially_load(device_to, extra_memory, force_patch_weights=force_patch_weights)
        finally:
            state.end_load(self.patcher_id)

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, **kwargs):
        if device_to is not None and self.offload_request.dynamic_vram_twin:
            load_in_recorded_dtype(self, key, device_to)
            # Patch in the compute dtype, as the Dynamic VRAM MODEL does.
            if not kwargs.get("return_weight", False) and patch_loaded_as_dynamic_vram(self, key, inplace_update):
                return None
        return super().patch_weight_to_device(key, device_to=device_to, inplace_update=inplace_update, **kwargs)

    def loaded_state(self) -> LoadedBooks:
        model = self.model
        return LoadedBooks(
            model.model_loaded_weight_memory, model.model_lowvram, model.current_weight_patches_uuid, model.device
        )

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        self.__dict__[_MODULE_LIST] = None
        try:
            with one_tree_per_load():
                self._load(device_to, lowvram_model_memory, force_patch_weights, full_load)
        finally:
            self.__dict__.pop(_MODULE_LIST, None)

    def _load(self, device_to, lowvram_model_memory, force_patch_weights, full_load) -> None:
        request = self.offload_request
        refuse_cudagraphs(self, request.node)  # TorchCompileModel may come after the node
        state = state_of(self.model)
        engine = state.engine
        if engine is not None:
            remember_costs(engine.request, engine.placement, engine.recorder.latest(), self)
        budget = math.inf if full_load else lowvram_model_memory
        if math.isinf(budget) and request.automatic_budget:
            budget = self._device_room()
        asked = place(request, self, budget, lambda streamed: loader_need(self._module_list(), streamed))
        placement = asked
        fallback = state.fallback
        if fallback is not None and (fallback.request, fallback.asked) == (request, asked.plan):
            # This plan ran out of memory before: start from the one that fit.
            placement = describe(fallback.placed, self, asked.patch_ms)
        if placement.plan is not None:
            refuse_reshaping_patches(self, placement.streamed, request.node)
        refuse_patches_on_packed_weights(self, placement.streamed, request.node)
        refuse_weight_hooks(self, placement.streamed, request.node)
        if engine is not None and (engine.request, engine.placement) != (request, placement):
            self._stop_streaming()
            engine = None
        if engine is not None or placement.plan is None:
            self._place(request, placement, device_to, budget, force_patch_weights)
            return

        def place_plan(candidate: OffloadPlan) -> None:
            chosen = placement if candidate == placement.plan else describe(candidate, self, placement.patch_ms)
            self._place(request, chosen, device_to, budget, force_patch_weights)

        placed, failed = place_falling_back(placement.plan, place_plan, self._undo_placement)
        assert asked.plan is not None, "the placement has a plan: the one asked for, or the fallback found for it"
        if failed:
            notice = (
                f"Out of memory placing {len(asked.plan.resident)} resident blocks with prefetch "
                f"{asked.plan.prefetch}; fell back to {len(placed.resident)} with prefetch {placed.prefetch}."
            )
            logging.warning(f"Block Offload ({request.node}): {notice}")
            state.fallback = Fallback(request, asked.plan, placed, notice)
        if placed != asked.plan and self.offload_engine is not None:
            assert state.fallback is not None, "a plan other than the one asked for is the fallback's"
            self.offload_engine.notices.append(state.fallback.notice)  # the panel every time, the log once

    def _place(
        self,
        request: OffloadRequest,
        placement: Placement,
        device_to: torch.device,
        budget: float,
        force_patch_weights: bool,
    ) -> None:
        """ComfyUI loads all but the streamed blocks, its budget less our stream buffers; the engine streams them."""
        state = state_of(self.model)
        state.placing(placement.streamed)
        if request.dynamic_vram_twin:
            # ComfyUI's part computes in the recorded dtypes; the engine casts the streamed blocks itself.
            cast_unloaded_to_recorded_dtypes(self.model, placement.streamed)
        # Unpin blocks ComfyUI now loads at once: a LoRA backup may keep the tensors alive, and the pins with them.
        state.parking.unpin_in_place(
            module for name, module in self.model.named_modules() if not inside(name, placement.streamed)
        )
        weights_budget = 1e32 if math.isinf(budget) else max(0.0, budget - placement.buffer_bytes)
        # Counted before the load, as ComfyUI counts: a Dynamic VRAM twin's load may change a weight's dtype.
        offered = sum(LoadEntry.of(entry).module_mem for entry in self._load_list())
        # The budget by position: given by keyword, ComfyUI-GGUF's ``load`` "releases mmap" after a partial load,
        # moving every host module to the device and back, the whole streamed stack twice over the bus.
        load_resident = functools.partial(
            super().load, device_to, weights_budget, force_patch_weights=force_patch_weights, full_load=False
        )
        if not placement.streamed:
            load_resident()
            state.placed(self.patcher_id, None, request)
            return
        if state.engine is None:
            engine = start_engine(
                self, request, placement, device_to, state.parking, load_resident, state.call_order, state.patch_history
            )
            state.placed(self.patcher_id, engine, request)
            self._check_resident_loaded(request, placement, offered)
        else:
            load_resident()
            state.placed(self.patcher_id, state.engine, request)
        self.model.model_lowvram = True
        self.model.model_offload_buffer_memory += placement.buffer_bytes

    def _device_room(self) -> float:
        """The device memory the weights may use when ComfyUI sets no limit (the model fits, or HIGH_VRAM): free memory
        plus what the model holds, less ComfyUI's inference reserve."""
        mm = comfy.model_management
        free = mm.get_free_memory(self.load_device) + self.model.model_loaded_weight_memory
        return max(0.0, free - mm.minimum_inference_memory())

    def _check_resident_loaded(self, request: OffloadRequest, placement: Placement, offered: int) -> None:
        """Warns when ComfyUI loaded less than it was ``offered`` (the planned resident part)."""
        loaded = self.model.model_loaded_weight_memory
        if loaded >= offered:
            return
        remedy = "Keep fewer blocks resident (or a smaller budget)"
        if placement.over_budget:
            remedy = "Streaming needs more device memory than the budget (see the plan line)"
        notice = (
            f"ComfyUI loaded {loaded / GIB:.2f} of the {offered / GIB:.2f} GiB planned resident; the rest is cast "
            f"per layer by ComfyUI, more slowly. {remedy}."
        )
        logging.warning(f"Block Offload ({request.node}): {notice}")
        engine = self.offload_engine
        if engine is not None:
            engine.notices.append(notice)

    def _undo_placement(self) -> None:
        """Back to where ``load`` started: no engine, nothing on the device, weight patches undone, object patches
        put back as ``partially_load`` had them."""
        self.unpatch_model(self.offload_device, unpatch_weights=True)
        self.patch_model(load_weights=False)
        if _MODULE_LIST in self.__dict__:
            self.__dict__[_MODULE_LIST] = None  # the unload moved weights, maybe to other dtypes

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        state = state_of(self.model)
        unpatch = state.unpatching(self.patcher_id, unpatch_weights)
        if unpatch is Unpatch.REPATCH:
            self._stop_streaming(park=True)
        elif unpatch is Unpatch.UNLOAD:
            # Nothing of ours may keep pinned or device memory.
            self._stop_streaming()
            state.parking.unpark(self.model.modules())
            state.unloaded()
            unpatched = super().unpatch_model(device_to, unpatch_weights=unpatch_weights)
            back_to_file(self.model)  # a Dynamic VRAM twin keeps no copy of what ComfyUI loaded
            return unpatched
        return super().unpatch_model(device_to, unpatch_weights=unpatch_weights)

    def detach(self, unpatch_all=True):
        # Parked buffers are valid CPU tensors, so even a clone that does not stream can take them over.
        state = state_of(self.model)
        hands_over = state.hands_over(self.patcher_id, unpatch_all)
        if hands_over:
            self._stop_streaming(park=True)
        detached = super().detach(unpatch_all=unpatch_all)
        if hands_over:
            state.handed_over(self.loaded_state())
        return detached

    def _stop_streaming(self, park: bool = False) -> None:
        state = state_of(self.model)
        engine = state.engine
        if engine is None:
            return
        remember_costs(engine.request, engine.placement, engine.recorder.latest(), self)
        state.call_order = call_order_of(engine)
        state.patch_history = engine.patch_history(state.patch_history)
        engine.stop(park)
        state.stopped(park)

    # -- sampling runs

    def pre_run(self):
        engine = self.offload_engine
        if engine is not None:  # hooks may be added to a loaded model, which gets no ``load``
            refuse_weight_hooks(self, engine.placement.streamed, engine.request.node)
        super().pre_run()
        if engine is not None:
            panel.run_started(engine, resident_weights=self.model.model_loaded_weight_memory)
        elif not state_of(self.model).placed_without_streaming(self.patcher_id):
            # Sampling with no engine though blocks were to stream: ComfyUI loaded it without asking us.
            node = self.offload_request.node
            notice = (
                f"{node}: this MODEL is sampling without streaming: ComfyUI loaded it without the pack's "
                f"placement ({self.model.model_loaded_weight_memory / GIB:.2f} GiB of weights loaded its own "
                "way). The output is the model's, but the device memory is not what the node planned. Please "
                "report this with the workflow; queueing it again after unloading models (Free model and node "
                "cache) streams."
            )
            logging.warning(f"Block Offload ({node}): {notice}")
            panel.node_not_streaming(node, notice)

    def cleanup(self):
        try:
            engine = self.offload_engine
            if engine is not None:
                # Called after sampling even when interrupted; an interrupt on 0.33 skips the hooks.
                engine.runner.close_open_step()
                engine.note_cold_reads()
                engine.note_packing()
                panel.run_finished(engine)
        finally:
            super().cleanup()


# -- the load protocol


class Phase(Enum):
    UNPLACED = "unplaced"
    STREAMING = "streaming"
    PARKED = "parked"
    HANDED_OVER = "handed over"


class Unpatch(Enum):
    """What one ``unpatch_model`` call means (``LoadProtocol.unpatching``)."""

    REPATCH = "repatch"  # partially_load clearing old patches: the blocks park
    UNLOAD = "unload"  # outside a load: nothing of the pack's may keep memory
    OBJECTS = "objects"  # unpatch_weights=False: only object patches come off


class LoadedBooks(NamedTuple):
    """ComfyUI's books on a model's weights; any load or unload by any patcher changes them."""

    weight_memory: int  # model_loaded_weight_memory
    lowvram: bool
    patches_uuid: uuid.UUID | None  # current_weight_patches_uuid
    device: torch.device | None


@dataclass
class LoadProtocol:
    """A model's phase and what goes with it; patchers are named by ``patcher_id``."""

    phase: Phase = Phase.UNPLACED
    engine: Engine | None = None
    # The patcher whose load placed the weights; only its detach hands them over, since ``ModelPatcher.__del__``
    # may detach any other clone at any time, even mid-prompt.
    owner: int | None = None
    # Modules ComfyUI's loader must not see (streamed or parked), so a partial unload neither moves nor counts them.
    hidden: frozenset[str] = frozenset()
    # HANDED_OVER only: ComfyUI's books at the hand-over. The next clone keeps the resident part only if they
    # still hold. Only the owner records them, so another clone's late detach cannot pass a plain load off as ours.
    parked_load: LoadedBooks | None = None
    # Inside ``partially_load``, until its first ``unpatch_model``.
    repatching: int | None = None
    # The request the owner placed for: a clone of another request must place anew.
    placed_for: object = None

    # -- partially_load

    def begin_load(self, patcher: int, books: LoadedBooks, request: object) -> bool:
        """``partially_load`` begins: takes a hand-over and opens ``patcher``'s re-patch window. True when what
        ComfyUI holds is not our placement, so the load must start from the host.

        A hand-over that streamed nothing is ``patcher``'s at once for the same ``request``: ComfyUI keeps a model it
        holds whole without calling ``load``."""
        if self.repatching is not None and self.repatching != patcher:
            self._unexpected("partially_load", f"patcher {self.repatching}'s partially_load is still open")
        kept = self.phase is Phase.HANDED_OVER and self.parked_load == books
        self.repatching = patcher
        if self.phase is Phase.HANDED_OVER:
            self.parked_load = None
            if not self.hidden:
                kept = kept and request == self.placed_for
                if kept:
                    self.owner = patcher
                    self._enter(Phase.UNPLACED, "partially_load keeps the hand-over, all of it loaded")
                    return False
            self._enter(Phase.PARKED, "partially_load takes the hand-over")
        return self.phase is not Phase.STREAMING and books.weight_memory > 0 and not kept

    def unpatching(self, patcher: int, unpatch_weights: bool) -> Unpatch:
        """``unpatch_model``. The first call inside ``partially_load`` only clears changed patches; host buffers hold
        unpatched weights, so the blocks park. Any other call unpatching weights is an unload."""
        repatch = self.repatching == patcher
        if repatch:
            self.repatching = None
        if not unpatch_weights:
            return Unpatch.OBJECTS
        return Unpatch.REPATCH if repatch else Unpatch.UNLOAD

    def end_load(self, patcher: int) -> None:
        """``partially_load`` returns or raises. Both supported hosts unpatch first thing, so a window still open means
        a ComfyUI whose re-patch would be taken for an unload."""
        if self.repatching == patcher:
            self.repatching = None
            self._unexpected("partially_load", "it ended before its first unpatch_model")

    # -- load

    def placing(self, streamed: frozenset[str]) -> None:
        """Hides the blocks ``load`` streams before ComfyUI's loader runs."""
        self.hidden = streamed

    def placed(self, patcher: int, engine: Engine | None, request: object) -> None:
        """``load`` is done: ``engine`` streams, or with None nothing does; ``patcher`` owns it."""
        if self.engine is not None and self.engine is not engine:
            self._unexpected("load", "another engine is streaming; it is left running unseen")
        self.engine = engine
        self.owner = patcher
        self.placed_for = request
        self.parked_load = None
        self._enter(Phase.UNPLACED if engine is None else Phase.STREAMING, "load")

    # -- stopping

    def stopped(self, park: bool) -> None:
        self.engine = None
        if not park:
            self.hidden = frozenset()
        self._enter(Phase.PARKED if park else Phase.UNPLACED, "engine parked" if park else "engine stopped")

    def hands_over(self, patcher: int, unpatch_all: bool) -> bool:
        """Whether ``detach`` hands the weights over: only the owner's ``detach(unpatch_all=False)``, since any other
        clone may be detached or deleted at any time."""
        placed = self.phase is Phase.STREAMING or self.phase is Phase.UNPLACED
        return not unpatch_all and placed and self.owner == patcher

    def handed_over(self, books: LoadedBooks) -> None:
        """The owner's detach is done: PARKED (or owned UNPLACED) → HANDED_OVER, with ComfyUI's books then."""
        owned_unplaced = self.phase is Phase.UNPLACED and self.owner is not None
        if self.phase is not Phase.PARKED and not owned_unplaced:
            self._unexpected("detach", "the engine did not park")
            return
        self.parked_load = books
        self._enter(Phase.HANDED_OVER, "detach")

    def unloaded(self) -> None:
        if self.engine is not None:
            self._unexpected("unpatch_model", "the engine is still streaming")
        self.hidden = frozenset()
        self.parked_load = None
        self.owner = None
        self._enter(Phase.UNPLACED, "unload")

    # -- sampling

    def placed_without_streaming(self, patcher: int) -> bool:
        """Whether ``patcher``'s own placement streams nothing, so sampling without an engine is what was planned."""
        return self.phase is Phase.UNPLACED and self.owner == patcher

    def _enter(self, phase: Phase, call: str) -> None:
        logging.debug(f"Block Offload: {self.phase.value} -> {phase.value} ({call})")
        self.phase = phase

    def _unexpected(self, call: str, what: str) -> None:
        logging.warning(
            f"Block Offload: unexpected {call} while the model is {self.phase.value}: {what}. Please report this with "
            "the workflow; unloading models (Free model and node cache) starts the model afresh."
        )


# -- the pack's state on a model, shared by all of ComfyUI's clones


_ATTRIBUTE = "block_offload_state"


@dataclass
class ModelState(LoadProtocol):
    """What outlives one patcher, since ComfyUI loads a new clone for every prompt."""

    fallback: Fallback | None = None  # the placement that fit when the asked one ran out of memory
    # The last engine's call order (unit, unit count, order), so the next engine prefetches right from its first
    # step (the sequential wrapper's list order is not the call order).
    call_order: tuple[str, int, tuple[int, ...]] | None = None
    patch_history: PatchHistory | None = None  # the patches the last engines ran, and for how many steps
    # Host buffers parked by stopped engines, for the next engine; freed at a real unload.
    parking: ParkingLot = field(default_factory=ParkingLot)


def state_of(model: nn.Module) -> ModelState:
    state = getattr(model, _ATTRIBUTE, None)
    if state is None:
        state = ModelState()
        setattr(model, _ATTRIBUTE, state)
    return state
