"""ComfyUI's ModelPatcher, taught to stream blocks instead of loading them, and the load protocol and state it
keeps on the model.

ComfyUI's memory manager decides how much of a model goes to the GPU by calling
``partially_load`` / ``load`` with a byte budget, and keeps its books in
``model_loaded_weight_memory``. Block-swap nodes that move blocks with ``.to()``
behind its back leave those books wrong. Here the streamed blocks are simply
never offered to ComfyUI's loader (``_load_list`` hides them): ComfyUI loads and
counts the resident part exactly as it would for any partial load, with its
budget reduced by our device slots, and the engine streams the hidden part.

The class is a mixin over whatever patcher class the incoming MODEL has.
``ModelPatcher.clone()`` builds ``self.__class__``, so every later clone (LoRA
loaders, other patch nodes) keeps the streaming behaviour and the request,
which travels as an attachment.

ComfyUI never says why it calls. ``unpatch_model(unpatch_weights=True)`` is a real unload (``/free``, eviction,
a failed load undone) everywhere but at the start of ``partially_load``, where it only clears the old patches
before the new ones go on. ``detach(unpatch_all=False)`` hands the weights over to the next prompt's clone when
``load_models_gpu`` calls it on the clone it had loaded, and means nothing when ``ModelPatcher.__del__`` calls it
on any other clone. The phases below tell these apart; ``LoadProtocol``'s methods are the only ways between
them, each named after the ComfyUI call that triggers it. Every clone of a model shares one ``LoadProtocol``
(the base of ``ModelState``, kept on the ``nn.Module``), so the clone loaded next finds what the one before it
left.

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
    keep_fast_disk,
    load_in_recorded_dtype,
    own_classic_path,
    patch_loaded_as_dynamic_vram,
    uses_dynamic_vram,
)
from .engine import Engine, call_order_of, start_engine
from .engine_runner import PatchHistory
from .patches import refuse_patches_on_packed_weights, refuse_reshaping_patches, refuse_weight_hooks
from .placement import Fallback, Placement, describe, place, remember_costs
from .request import OffloadRequest

ATTACHMENT = "block_offload"
# Present only while the patcher's ``load`` runs: ComfyUI's module list once walked, else None
# (``BlockOffloadPatcher._module_list``).
_MODULE_LIST = "_block_offload_module_list"


def refuse_cudagraphs(model: ModelPatcher, node: str) -> None:
    """A model compiled by ComfyUI's TorchCompileModel with the cudagraphs backend cannot stream: a CUDA
    graph replays the memory addresses it captured, while the engine points each streamed block at
    whichever slot holds it and fills the slots from another stream, outside any graph."""
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
    request = dataclasses.replace(request, dynamic_vram_twin=uses_dynamic_vram(model) and not own, own_classic_path=own)
    # clone() builds self.__class__, so giving the clone our subclass makes every later clone inherit it.
    patched.__class__ = _offload_class(type(patched))
    patched.set_attachments(ATTACHMENT, request)
    return patched


class _PatcherKinds:
    """Our subclass of each patcher class, made once, so every clone of a model is of one class; and the numbers
    given to patcher objects (``patcher_id``), never reused in the process."""

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
    """One entry of ComfyUI's ``_load_list``, by name. Its layout in 0.3.75 and 0.33's classic loader is
    ``(offload_mem, module_mem, name, module, params)``; it is read here only, so a change breaks one place."""

    offload_mem: int  # what casting the module on the fly would take
    module_mem: int  # the module's weights as ComfyUI counts them
    name: str
    module: nn.Module

    @classmethod
    def of(cls, entry: Sequence[Any]) -> LoadEntry:
        offload_mem, module_mem, name, module = entry[:4]
        return cls(offload_mem, module_mem, name, module)


def loader_need(entries: Sequence[Any], streamed: frozenset[str]) -> int:
    """The budget ComfyUI's loader needs to load every module of ``entries`` (its ``_load_list``) outside
    ``streamed``. It takes modules largest first, each only while the bytes loaded so far, the module and cast
    buffers for it and the next ``NUM_STREAMS`` modules fit (``load()`` in comfy/model_patcher.py; 0.3.75 counts
    this module's cast size for each of those, 0.33 the next modules' sizes, which are no larger)."""
    kept = sorted((e for e in map(LoadEntry.of, entries) if not inside(e.name, streamed)), key=lambda e: -e.offload_mem)
    buffers = comfy.model_management.NUM_STREAMS + 1
    need = loaded = 0
    for entry in kept:
        need = max(need, loaded + entry.module_mem + buffers * entry.offload_mem)
        loaded += entry.module_mem
    return need + 1  # ComfyUI's test is strict (<)


class BlockOffloadPatcher(ModelPatcher):
    """Mixin: must come before the patcher class in the MRO (see ``_offload_class``).

    Each call on to that class passes its arguments as ComfyUI passes them: the leading ones by position, the
    flags by keyword. A class that forwards ``*args`` with a keyword-only flag of its own (ComfyUI-GGUF's
    ``partially_load`` and ``partially_unload``) would otherwise get a flag twice. One exception, the
    resident part's budget (see ``_place``)."""

    def clone(self, *args, **kwargs):
        cloned = super().clone(*args, **kwargs)
        keep_fast_disk(self, cloned)
        # ComfyUI builds ``self.__class__``, but a patcher class may set its own on every clone
        # (ComfyUI-GGUF's GGUFModelPatcher does): a LoRA loaded after the node must still stream.
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
        """This patcher object's own number (clones get theirs): unlike ``id()`` never reused, and unlike a
        weak reference still readable in ``__del__`` when the cycle collector frees the patcher."""
        number = self.__dict__.get("_block_offload_id")
        if number is None:
            number = self.__dict__["_block_offload_id"] = next(_patcher_kinds().ids)
        return number

    # -- what ComfyUI's loader may touch -----------------------------------------------------

    def _load_list(self, *args, **kwargs):
        entries = self._module_list() if not args and not kwargs else super()._load_list(*args, **kwargs)
        hidden = state_of(self.model).hidden
        return [entry for entry in entries if not inside(LoadEntry.of(entry).name, hidden)]

    def _module_list(self) -> list[Any]:
        """ComfyUI's ``_load_list()`` of every module, walked once per ``load``: the placement's loader need, the
        count of what ComfyUI is offered and ComfyUI's own load each read it, and each walk visits every module of
        the model, at every sampler's load. Within a load no module outside the streamed
        blocks changes before ComfyUI's load has read the list (the engine only repoints the streamed blocks, which
        the list hides from ComfyUI); a placement undone (``_undo_placement``) walks again. Only the call without
        arguments is kept: ComfyUI's ``default_device`` moves weights as it walks."""
        entries = self.__dict__.get(_MODULE_LIST)
        if entries is None:
            entries = super()._load_list()
            if _MODULE_LIST in self.__dict__:
                self.__dict__[_MODULE_LIST] = entries
        return entries

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        state = state_of(self.model)
        if state.begin_load(self.patcher_id, self.loaded_state(), self.offload_request):
            # Start from the host, so nothing streamed stays on the GPU. ComfyUI's own unpatch, not a real unload:
            # blocks a detached streaming clone parked stay parked, for this engine to adopt.
            super().unpatch_model(self.offload_device, unpatch_weights=True)
        # Left as the last engine parked them, the resident modules stay loaded: ComfyUI's load skips what
        # it has loaded and patched (``comfy_patched_weights``), so a queue does not copy them again.
        try:
            return super().partially_load(device_to, extra_memory, force_patch_weights=force_patch_weights)
        finally:
            state.end_load(self.patcher_id)

    def patch_weight_to_device(self, key, device_to=None, inplace_update=False, **kwargs):
        # ComfyUI's load calls this for every weight of every module it loads, before it moves the module.
        if device_to is not None and self.offload_request.dynamic_vram_twin:
            load_in_recorded_dtype(self, key, device_to)
            # A patched weight computes as on the Dynamic VRAM MODEL, which patches in the compute dtype.
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
            with one_tree_per_load():  # the placement, its fallbacks and the engine's start each ask for the blocks
                self._load(device_to, lowvram_model_memory, force_patch_weights, full_load)
        finally:
            self.__dict__.pop(_MODULE_LIST, None)

    def _load(self, device_to, lowvram_model_memory, force_patch_weights, full_load) -> None:
        request = self.offload_request
        refuse_cudagraphs(self, request.node)  # TorchCompileModel may come after the node
        state = state_of(self.model)
        engine = state.engine
        if engine is not None:  # before planning, so this load can plan from them
            remember_costs(engine.request, engine.placement, engine.recorder.latest(), self)
        budget = math.inf if full_load else lowvram_model_memory
        if math.isinf(budget) and request.automatic_budget:
            budget = self._device_room()
        asked = place(request, self, budget, lambda streamed: loader_need(self._module_list(), streamed))
        placement = asked
        fallback = state.fallback
        if fallback is not None and (fallback.request, fallback.asked) == (request, asked.plan):
            # It ran out of memory before: start from the one that fit.
            placement = describe(fallback.placed, self, asked.patch_ms)
        if placement.plan is not None:
            refuse_reshaping_patches(self, placement.streamed, request.node)  # before anything moves
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
            self.offload_engine.notices.append(state.fallback.notice)  # each new engine shows it; the log once

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
            # What ComfyUI loads computes in the recorded dtypes (its weights: ``patch_weight_to_device``); the
            # engine casts the streamed blocks itself.
            cast_unloaded_to_recorded_dtypes(self.model, placement.streamed)
        # Blocks an earlier engine pinned in place that ComfyUI now loads: their pins go back to the budget now, not
        # when their memory happens to be freed (a host on the CPU, or a LoRA's backup, keeps the tensors).
        state.parking.unpin_in_place(
            module for name, module in self.model.named_modules() if not inside(name, placement.streamed)
        )
        weights_budget = 1e32 if math.isinf(budget) else max(0.0, budget - placement.buffer_bytes)
        # In ComfyUI's own count: each module's size as it is before the load (a Dynamic VRAM twin's load may cast
        # a weight to another dtype, ComfyUI counting it as it was).
        offered = sum(LoadEntry.of(entry).module_mem for entry in self._load_list())
        # The budget by position, unlike ComfyUI: ComfyUI-GGUF's ``load`` finds it among the keywords, and after a
        # partial load moves every module whose weights are still on the host to the device and back, one by one
        # ("release mmap"), which for the streamed blocks would be the whole stack over the bus twice and a second
        # copy of it in RAM until the first step; the engine holds them itself.
        load_resident = functools.partial(
            super().load, device_to, weights_budget, force_patch_weights=force_patch_weights, full_load=False
        )
        if not placement.streamed:
            load_resident()
            state.placed(self.patcher_id, None, request)
            return
        if state.engine is None:  # it pins and packs the streamed blocks while ComfyUI loads the resident ones
            engine = start_engine(
                self, request, placement, device_to, state.parking, load_resident, state.call_order, state.patch_history
            )
            state.placed(self.patcher_id, engine, request)
            self._check_resident_loaded(request, placement, offered)
        else:  # the engine ``load`` kept: this placement is the one it streams
            load_resident()
            state.placed(self.patcher_id, state.engine, request)
        self.model.model_lowvram = True  # the streamed blocks are not on the device
        self.model.model_offload_buffer_memory += placement.buffer_bytes

    def _device_room(self) -> float:
        """The device memory this model's weights may have when ComfyUI sets no limit: a full load because the
        model fits, or because ``--highvram`` / ``--gpu-only`` (HIGH_VRAM) keeps everything loaded whatever
        the device's size. What is free, what the model holds already, less ComfyUI's inference reserve."""
        mm = comfy.model_management
        free = mm.get_free_memory(self.load_device) + self.model.model_loaded_weight_memory
        return max(0.0, free - mm.minimum_inference_memory())

    def _check_resident_loaded(self, request: OffloadRequest, placement: Placement, offered: int) -> None:
        """Whether ComfyUI loaded all it was ``offered`` (the planned resident part); says so when it did not."""
        loaded = self.model.model_loaded_weight_memory
        if loaded >= offered:
            return
        remedy = "Keep fewer blocks resident (or a smaller budget)"
        if placement.over_budget:  # no block is resident: only more device memory lets ComfyUI load the rest
            remedy = "Streaming needs more device memory than the budget (see the plan line)"
        notice = (
            f"ComfyUI loaded {loaded / GIB:.2f} of the {offered / GIB:.2f} GiB planned resident; the rest is cast "
            f"per layer by ComfyUI, more slowly. {remedy}."
        )
        logging.warning(f"Block Offload ({request.node}): {notice}")
        engine = self.offload_engine
        if engine is not None:  # just started by ``_place``, which checks after
            engine.notices.append(notice)

    def _undo_placement(self) -> None:
        """Back to where ``load`` started: no engine, nothing on the device, weight patches undone.

        ``unpatch_model`` takes the object patches off too; ``partially_load`` puts them on with
        ``patch_model(load_weights=False)`` before it calls ``load``, so the same is done here.
        """
        self.unpatch_model(self.offload_device, unpatch_weights=True)
        self.patch_model(load_weights=False)
        if _MODULE_LIST in self.__dict__:
            self.__dict__[_MODULE_LIST] = None  # the unload moved weights back, maybe in other dtypes: walk again

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        state = state_of(self.model)
        unpatch = state.unpatching(self.patcher_id, unpatch_weights)
        if unpatch is Unpatch.REPATCH:
            self._stop_streaming(park=True)
        elif unpatch is Unpatch.UNLOAD:
            # Nothing of ours may keep pinned or device memory; blocks parked earlier are ordinary weights again.
            self._stop_streaming()
            state.parking.unpark(self.model.modules())
            state.unloaded()
            unpatched = super().unpatch_model(device_to, unpatch_weights=unpatch_weights)
            back_to_file(self.model)  # a Dynamic VRAM twin keeps no copy of what ComfyUI loaded
            return unpatched
        return super().unpatch_model(device_to, unpatch_weights=unpatch_weights)

    def detach(self, unpatch_all=True):
        # A hand-over parks the engine: the streamed blocks stay on their host buffers for the next engine to adopt
        # instead of packing them again. They are valid CPU tensors, so a clone that does not stream can take
        # them over too.
        state = state_of(self.model)
        hands_over = state.hands_over(self.patcher_id, unpatch_all)
        if hands_over:
            self._stop_streaming(park=True)
        # unpatch_all: a real unload (``unpatch_model`` stops the engine)
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
        state.stopped(park)  # parked blocks stay hidden from ComfyUI's loader; the next load re-plans the set

    # -- sampling runs, for the live panel ---------------------------------------------------

    def pre_run(self):
        engine = self.offload_engine
        if engine is not None:  # hooks registered for a model ComfyUI had loaded already, with no ``load``
            refuse_weight_hooks(self, engine.placement.streamed, engine.request.node)
        super().pre_run()
        if engine is not None:
            panel.run_started(engine, resident_weights=self.model.model_loaded_weight_memory)
        elif not state_of(self.model).placed_without_streaming(self.patcher_id):
            # Placed with blocks to stream (or not by this patcher: ComfyUI loaded it without asking it), yet
            # sampling with no engine: whatever ComfyUI loaded runs, without the pack's placement.
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
                # ComfyUI calls this after sampling, interrupted or not; an interrupt on 0.33 skips the hooks.
                engine.runner.close_open_step()
                engine.note_cold_reads()
                engine.note_packing()
                panel.run_finished(engine)
        finally:
            super().cleanup()


# -- the load protocol: which of ComfyUI's calls moves a model's weights into which phase -----------------


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


# -- the pack's state on a model: one holder on the nn.Module that all of ComfyUI's clones share ----------


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
