"""ComfyUI's ModelPatcher, taught to stream blocks instead of loading them.

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
"""

from __future__ import annotations

import functools
import logging
import math
import os
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import comfy.model_management
import comfy.utils
import folder_paths
import torch
from comfy.cli_args import args
from comfy.model_patcher import ModelPatcher
from comfy_api.torch_helpers.torch_compile import TORCH_COMPILE_KWARGS

from ..offload import (
    BlockStreamer,
    CostCache,
    OffloadPlan,
    PinnedMemoryBudget,
    ResidencyPolicy,
    SequentialOffloader,
    StackCosts,
    TimelineRecorder,
    best_plan,
    buffer_bytes,
    cache_key,
    can_pin_memory,
    device_name,
    module_bytes,
    place_falling_back,
    streamed_modules,
    unpark,
)
from . import report
from .architectures import find_blocks

ATTACHMENT = "block_offload"
ENGINE = "block_offload_engine"
FALLBACK = "block_offload_fallback"
# Set by the tests and the CPU demo: exercise the whole streaming path with the CPU as "device".
ALLOW_CPU_ENV = "BLOCK_OFFLOAD_ALLOW_CPU"
# A cap, in GiB, on the page-locked RAM the pack takes (below ComfyUI's own pinned-memory budget).
PINNED_LIMIT_ENV = "BLOCK_OFFLOAD_MAX_PINNED_GB"
# Tests and demos: pretend the device has only this many bytes for a streaming model's placement,
# so the out-of-memory fallback runs on any device (the stream buffers' allocation raises beyond it).
SIMULATED_DEVICE_LIMIT_ENV = "BLOCK_OFFLOAD_SIMULATED_DEVICE_LIMIT_BYTES"
GIB = 1024**3
# What the plan line of an automatic placement's first, measuring run says (the benchmark looks for it).
MEASURING = "not measured on this device yet"


def _pinned_limit() -> int | None:
    """How many bytes all streaming models together may pin now; None: no cap known.

    Where ComfyUI pins (NVIDIA, AMD) it has a budget, MAX_PINNED_MEMORY, for the weights of the
    modules it casts on demand; the pack takes only what ComfyUI has left of it. It keeps its own
    count instead of adding to ComfyUI's TOTAL_PINNED_MEMORY, because ComfyUI sets that total to 0
    whenever its own list of pinned tensors empties, which would silently drop the pack's share.
    ``--disable-pinned-memory`` means none; ``BLOCK_OFFLOAD_MAX_PINNED_GB`` caps it further.
    """
    if args.disable_pinned_memory:
        return 0
    limits = []
    comfy_max = getattr(comfy.model_management, "MAX_PINNED_MEMORY", -1)
    if comfy_max > 0:
        limits.append(int(comfy_max - comfy.model_management.TOTAL_PINNED_MEMORY))
    setting = os.environ.get(PINNED_LIMIT_ENV)
    if setting:
        limits.append(int(float(setting) * GIB))
    return min(limits, default=None)


PINNED_MEMORY = PinnedMemoryBudget(_pinned_limit)


# ComfyUI loads the model again for every prompt: the same costs and budget give the same answer (a search
# of a 57-block Flux takes a second or two), so it is kept rather than searched again.
_best_plan = functools.lru_cache(maxsize=16)(best_plan)


def _cost_cache() -> CostCache:
    """Measured block costs, per device and model, in ComfyUI's user folder (kept across restarts)."""
    return CostCache(Path(folder_paths.get_user_directory()) / "block_offload" / "block_costs.json")


@dataclass(frozen=True)
class OffloadRequest:
    """What a node asked for. It becomes an ``OffloadPlan`` when ComfyUI loads the model,
    because only then are the budget and the device known."""

    node: str
    resident_blocks: int | None = None
    budget_bytes: int | None = None  # 0: whatever ComfyUI's budget leaves after the rest of the model
    policy: ResidencyPolicy = ResidencyPolicy.LEADING
    prefetch: int = 1
    pin_memory: bool = True
    sequential: bool = False
    storage_dtype: torch.dtype | None = None
    vram_limit_bytes: int = 0
    # Resident blocks and prefetch chosen by offload.planner from measured costs (``policy`` until measured).
    auto_placement: bool = False


@dataclass
class _Engine:
    """The streaming state of one loaded model; it lives on the model, which clones share."""

    request: OffloadRequest
    plan: OffloadPlan | None
    streamed: frozenset[str]
    runner: BlockStreamer | SequentialOffloader
    recorder: TimelineRecorder
    summary: str
    # Things the user should know about this run (a fallback taken, a cap reached): logged once, shown by the panel.
    notices: list[str] = field(default_factory=list)

    def stop(self, park: bool = False) -> None:
        self.runner.disable(park)


@dataclass(frozen=True)
class _Fallback:
    """A placement that ran out of device memory and the smaller one that fit. Kept on the model,
    so its later loads (each sampling run loads a new clone) start from the one that fit."""

    request: OffloadRequest
    asked: OffloadPlan
    placed: OffloadPlan
    notice: str


def streaming_allowed(device: torch.device) -> bool:
    return device.type != "cpu" or os.environ.get(ALLOW_CPU_ENV) == "1"


class DynamicVramError(ValueError):
    """A Dynamic VRAM model that ComfyUI cannot give a classic twin of (no reload recipe)."""


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


def uses_dynamic_vram(model: ModelPatcher) -> bool:
    """Whether ComfyUI (0.33 and later) manages this model with Dynamic VRAM (comfy-aimdo)."""
    is_dynamic = getattr(model, "is_dynamic", None)  # absent before Dynamic VRAM (0.3.75)
    return bool(is_dynamic is not None and is_dynamic())


# Per Dynamic VRAM model (its nn.Module, shared by all its clones): the classic twin ComfyUI loaded for
# the pack, as ``clone(model_override=...)`` takes it. A LoRA or another patch node before ours makes a
# new dynamic clone at each change; the twin is loaded from disk once, not once per change. The entry
# goes when the dynamic model does (the loader's output is replaced or freed).
_CLASSIC_TWINS: weakref.WeakKeyDictionary[torch.nn.Module, tuple] = weakref.WeakKeyDictionary()


def _classic_clone(model: ModelPatcher, node: str) -> ModelPatcher:
    """A clone of ``model`` whose weights ComfyUI loads the classic way (partial load, ``_load_list``).

    Dynamic VRAM places weights itself (aimdo's virtual address space, faulted in per module by its own
    priorities), so the pack streams a classic twin instead: ``clone(disable_dynamic=True)``, the call
    ComfyUI's own TorchCompileModel makes, reloads the checkpoint with ComfyUI's classic ModelPatcher
    and carries every patch, option and attachment over. The input MODEL keeps its dynamic weights.
    """
    if not uses_dynamic_vram(model):
        return model.clone()
    twin = _CLASSIC_TWINS.get(model.model)
    if twin is not None:
        return model.clone(disable_dynamic=True, model_override=twin)
    if model.cached_patcher_init is None:
        raise DynamicVramError(
            f"{node}: this MODEL uses ComfyUI's Dynamic VRAM and came from a loader that cannot load it again "
            "without it, which block streaming needs. Load the model with a core loader (Load Diffusion Model, "
            "Load Checkpoint), or start ComfyUI with --disable-dynamic-vram."
        )
    logging.info(
        f"Block Offload ({node}): this MODEL uses Dynamic VRAM; loading a classic copy of it to stream "
        "(the MODEL you connected is unchanged)"
    )
    classic = model.clone(disable_dynamic=True)
    _CLASSIC_TWINS[model.model] = classic.get_clone_model_override()
    return classic


def with_offload(model: ModelPatcher, request: OffloadRequest) -> ModelPatcher:
    """A clone of ``model`` that streams as ``request`` says; ``model`` itself is untouched."""
    previous = model.get_attachment(ATTACHMENT)
    if previous is not None:
        logging.info(f"Block Offload: {request.node} replaces the earlier {previous.node} on this model")
    patched = _classic_clone(model, request.node)
    # clone() builds self.__class__, so giving the clone our subclass makes every later clone inherit it.
    patched.__class__ = _offload_class(type(patched))
    patched.set_attachments(ATTACHMENT, request)
    return patched


_CLASSES: dict[type, type] = {}


def _offload_class(base: type) -> type:
    if issubclass(base, BlockOffloadPatcher):
        return base
    if base not in _CLASSES:
        _CLASSES[base] = type(f"BlockOffload{base.__name__}", (BlockOffloadPatcher, base), {})
    return _CLASSES[base]


def _inside(name: str, prefixes: frozenset[str]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


class BlockOffloadPatcher(ModelPatcher):
    """Mixin: must come before the patcher class in the MRO (see ``_offload_class``)."""

    @property
    def offload_request(self) -> OffloadRequest:
        return self.get_attachment(ATTACHMENT)

    @property
    def offload_engine(self) -> _Engine | None:
        return getattr(self.model, ENGINE, None)

    # -- what ComfyUI's loader may touch -----------------------------------------------------

    def _load_list(self, *args, **kwargs):
        entries = super()._load_list(*args, **kwargs)
        hidden = getattr(self.model, "block_offload_streamed", frozenset())
        # Entry layout in ComfyUI 0.3.75: (offload_mem, module_mem, name, module, params).
        return [entry for entry in entries if not _inside(entry[2], hidden)]

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        if self.offload_engine is None and self.model.model_loaded_weight_memory > 0:
            # Another patcher of these weights left them loaded its way (ComfyUI keeps a
            # detached clone's placement); start from the host so nothing streamed stays on the GPU.
            # ComfyUI's own unpatch: blocks a detached streaming clone parked stay parked, for this engine to adopt.
            super().unpatch_model(self.offload_device, unpatch_weights=True)
        return super().partially_load(device_to, extra_memory, force_patch_weights)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        request = self.offload_request
        refuse_cudagraphs(self, request.node)  # TorchCompileModel may come after the node
        engine = self.offload_engine
        if engine is not None:
            self._remember_costs(engine)  # before planning, so this load can plan from them
        budget = math.inf if full_load else lowvram_model_memory
        asked, streamed, summary = self._plan(request, budget)
        plan = asked
        fallback = getattr(self.model, FALLBACK, None)
        if fallback is not None and (fallback.request, fallback.asked) == (request, asked):
            plan = fallback.placed  # this placement ran out of memory before: start from the one that fit
            streamed, summary = self._describe(plan)
        if engine is not None and (engine.request, engine.plan, engine.streamed) != (request, plan, streamed):
            self._stop_streaming()
            engine = None
        if engine is not None or plan is None:
            self._place(request, plan, streamed, summary, device_to, budget, force_patch_weights)
            return

        def place(candidate: OffloadPlan) -> None:
            described = (streamed, summary) if candidate is plan else self._describe(candidate)
            self._place(request, candidate, *described, device_to, budget, force_patch_weights)

        placed, failed = place_falling_back(plan, place, self._undo_placement)
        if failed:
            notice = (
                f"Out of memory placing {len(asked.resident)} resident blocks with prefetch {asked.prefetch}; "
                f"fell back to {len(placed.resident)} with prefetch {placed.prefetch}."
            )
            logging.warning(f"Block Offload ({request.node}): {notice}")
            fallback = _Fallback(request, asked, placed, notice)
            setattr(self.model, FALLBACK, fallback)
        if placed != asked and self.offload_engine is not None:
            self.offload_engine.notices.append(fallback.notice)  # each new engine shows it; the log has it once

    def _place(
        self,
        request: OffloadRequest,
        plan: OffloadPlan | None,
        streamed: frozenset[str],
        summary: str,
        device_to: torch.device,
        budget: float,
        force_patch_weights: bool,
    ) -> None:
        """ComfyUI loads all but the streamed blocks, its budget less our stream buffers; the engine streams them."""
        self.model.block_offload_streamed = streamed
        slot_bytes = plan.slot_bytes if plan else self._sequential_buffer_bytes(request)
        weights_budget = 1e32 if math.isinf(budget) else max(0.0, budget - slot_bytes)
        super().load(device_to, weights_budget, force_patch_weights=force_patch_weights, full_load=False)
        if not streamed:
            return
        if self.offload_engine is None:
            self._start_streaming(request, plan, streamed, summary, device_to)
            self._check_resident_loaded(request)
        self.model.model_lowvram = True  # the streamed blocks are not on the device
        self.model.model_offload_buffer_memory += slot_bytes

    def _loader_headroom(self) -> int:
        """What ComfyUI's loader keeps free beyond the weights it loads: it loads a module only while the
        bytes loaded so far, the module and its cast buffers for (offload streams + 1) modules fit the budget
        (``load()`` in comfy/model_patcher.py). A plan that left no such room would see its last resident
        modules cast per layer by ComfyUI instead, on ComfyUI's streams, competing for the copy engine."""
        largest = max((entry[0] for entry in super()._load_list()), default=0)
        return (comfy.model_management.NUM_STREAMS + 1) * largest

    def _check_resident_loaded(self, request: OffloadRequest) -> None:
        """Whether ComfyUI loaded all it was offered (the planned resident part); says so when it did not."""
        offered = sum(entry[1] for entry in self._load_list())
        loaded = self.model.model_loaded_weight_memory
        if loaded >= offered:
            return
        notice = (
            f"ComfyUI loaded {loaded / GIB:.2f} of the {offered / GIB:.2f} GiB planned resident; the rest is cast "
            "per layer by ComfyUI, more slowly. Keep fewer blocks resident (or a smaller budget)."
        )
        logging.warning(f"Block Offload ({request.node}): {notice}")
        self.offload_engine.notices.append(notice)

    def _sequential_buffer_bytes(self, request: OffloadRequest) -> int:
        """The sequential wrapper's slot pool, which ComfyUI must count like any offload buffer: on Wan 14B
        the largest module (time_projection) alone is 315 MB, times the prefetch and nesting depth."""
        return buffer_bytes(self.model.diffusion_model, request.prefetch, request.storage_dtype)

    def _undo_placement(self) -> None:
        """Back to where ``load`` started: no engine, nothing on the device, weight patches undone.

        ``unpatch_model`` takes the object patches off too; ``partially_load`` puts them on with
        ``patch_model(load_weights=False)`` before it calls ``load``, so the same is done here.
        """
        self.unpatch_model(self.offload_device, unpatch_weights=True)
        self.patch_model(load_weights=False)

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            # A real unload (/free, eviction): nothing of ours may keep pinned or device memory.
            self._stop_streaming()
            unpark(self.model.modules())
            self.model.block_offload_streamed = frozenset()  # blocks parked earlier are ordinary weights again
        return super().unpatch_model(device_to, unpatch_weights)

    def detach(self, unpatch_all=True):
        # Without unpatch_all, ComfyUI hands these weights to a new clone (one per prompt): the engine parks,
        # leaving the streamed blocks on their host buffers for the next engine to adopt instead of packing
        # them again. They are valid CPU tensors, so a clone that does not stream can take them over too.
        self._stop_streaming(park=not unpatch_all)
        return super().detach(unpatch_all)

    # -- sampling runs, for the live panel (report) ------------------------------------------

    def pre_run(self):
        super().pre_run()
        engine = self.offload_engine
        if engine is not None:
            report.run_started(engine, resident_weights=self.model.model_loaded_weight_memory)

    def cleanup(self):
        try:
            engine = self.offload_engine
            if engine is not None:
                # ComfyUI calls this after sampling, interrupted or not; an interrupt on 0.33 skips the hooks.
                engine.runner.close_open_step()
                report.run_finished(engine)
        finally:
            super().cleanup()

    # -- planning ----------------------------------------------------------------------------

    def _plan(self, request: OffloadRequest, budget: float) -> tuple[OffloadPlan | None, frozenset[str], str]:
        diffusion_model = self.model.diffusion_model
        if request.sequential:
            names = frozenset(
                f"diffusion_model.{name}" if name else "diffusion_model"
                for name, _ in streamed_modules(diffusion_model)
            )
            limit = request.vram_limit_bytes / 2**30
            dtype = request.storage_dtype or "the model's dtype"
            summary = f"every module streamed, copied as {dtype}, modules kept on device up to {limit:.2f} GiB"
            return None, names, summary
        arch, blocks = find_blocks(diffusion_model)
        sizes = [module_bytes(block) for _, block in blocks]
        outside = self.model_size() - sum(sizes)
        count, budget_bytes = request.resident_blocks, None
        if count is None:
            room = budget - outside - self._loader_headroom()
            if request.budget_bytes:
                room = min(room, request.budget_bytes - outside)
            if math.isinf(room):
                count = len(sizes)
            else:
                budget_bytes = int(max(0, room))
        pin_memory = request.pin_memory and can_pin_memory()
        unplanned = ""  # why an automatic placement fell back to the request's policy
        if request.auto_placement and budget_bytes is not None:
            planned, unplanned = self._planned(arch.name, sizes, budget_bytes, pin_memory)
            if planned is not None:
                return planned
        plan = OffloadPlan.build(
            sizes,
            resident_count=count,
            budget_bytes=budget_bytes,
            policy=request.policy,
            prefetch=request.prefetch,
            pin_memory=pin_memory,
        )
        streamed, summary = self._describe(plan)
        return plan, streamed, summary + unplanned

    def _planned(
        self, arch: str, sizes: list[int], budget_bytes: int, pin_memory: bool
    ) -> tuple[tuple[OffloadPlan, frozenset[str], str] | None, str]:
        """The planner's fastest placement within ``budget_bytes`` from this model's measured costs on
        this device, or None and why not: not measured yet, or not even the stream buffers fit (then
        the request's policy places it, and the out-of-memory fallback decides)."""
        costs = _cost_cache().get(cache_key(device_name(self.load_device), arch, sizes))
        if costs is None or costs.block_bytes != tuple(sizes):
            return None, f"; {MEASURING}, so this run measures it and the next one is planned"
        try:
            predicted = _best_plan(costs, budget_bytes, pin_memory=pin_memory, inline_copies=self._inline)
        except ValueError as error:
            return None, f"; the planner found no placement: {error}"
        streamed, summary = self._describe(predicted.plan)
        return (predicted.plan, streamed, f"{summary}; chosen by the planner, {predicted.describe(costs)}"), ""

    @property
    def _inline(self) -> bool:
        """Without an accelerator the engine copies inline, on the host, between two computes."""
        return self.load_device.type == "cpu"

    def _remember_costs(self, engine: _Engine) -> None:
        """Keeps what an automatic placement's last step cost, when this model has no measurements on
        this device yet: every block's compute time, the gaps between them, and the copy bandwidth."""
        plan = engine.plan
        if not engine.request.auto_placement or plan is None:
            return
        arch, _ = find_blocks(self.model.diffusion_model)
        cache = _cost_cache()
        key = cache_key(device_name(self.load_device), arch.name, plan.block_bytes)
        step = engine.recorder.latest()
        if step is None or step.bandwidth_gbps is None or cache.get(key) is not None:
            return  # nothing ran yet, nothing was copied (no bandwidth to learn), or already measured
        if len({span.block for span in step.spans}) < len(plan.block_bytes):
            return  # a step cut short (an interrupted prompt) would make every later plan wrong
        costs = StackCosts.from_timeline(step, plan.block_bytes, inline_copies=self._inline)
        cache.put(key, costs)
        logging.info(
            f"Block Offload ({engine.request.node}): measured {arch.name} on {device_name(self.load_device)}: "
            f"{sum(costs.compute_ms):.1f} ms of block compute per step, {costs.bandwidth_gbps:.2f} GB/s "
            f"host to device; the next load plans the placement from them ({cache.path})"
        )

    def _describe(self, plan: OffloadPlan) -> tuple[frozenset[str], str]:
        """The streamed blocks' module names, and the summary line the log shows for ``plan``."""
        arch, blocks = find_blocks(self.model.diffusion_model)
        streamed = frozenset(f"diffusion_model.{blocks[i][0]}" for i in plan.streamed)
        return streamed, f"{arch.name}: {plan.describe(self.model_size() - sum(plan.block_bytes))}"

    # -- streaming ---------------------------------------------------------------------------

    def _start_streaming(
        self,
        request: OffloadRequest,
        plan: OffloadPlan | None,
        streamed: frozenset[str],
        summary: str,
        device: torch.device,
    ) -> None:
        # Weights ComfyUI page-locked in place (its partial unload registers what it moves to the host) are
        # unregistered through ComfyUI before the engine packs them: packing frees the originals, and
        # ComfyUI would later try to unpin memory that is gone, its pinned total never coming down.
        for key in [key for key in self.pinned if _inside(key, streamed)]:
            self.unpin_weight(key)
        self._patch_streamed_weights(streamed, device)
        diffusion_model = self.model.diffusion_model
        recorder = TimelineRecorder(device)
        if plan is None:
            runner = SequentialOffloader(
                diffusion_model,
                device,
                storage_dtype=request.storage_dtype,
                vram_limit_bytes=request.vram_limit_bytes,
                prefetch=request.prefetch,
                pin_memory=request.pin_memory,
                recorder=recorder,
                on_promote=functools.partial(_count_promoted, self.model),
                pin_budget=PINNED_MEMORY,
            )
        else:
            _, blocks = find_blocks(diffusion_model)
            runner = BlockStreamer(
                [block for _, block in blocks],
                device,
                plan.streamed,
                prefetch=plan.prefetch,
                pin_memory=plan.pin_memory,
                recorder=recorder,
                root=diffusion_model,
                pin_budget=PINNED_MEMORY,
                device_limit_bytes=self._simulated_device_room(),
            )
        runner.enable()
        try:
            runner.allocate_device_buffers()  # now, where ComfyUI counted them, not at the first call
        except torch.OutOfMemoryError:
            runner.disable()
            raise
        engine = _Engine(request, plan, streamed, runner, recorder, summary, notices=_pinning_notices(request, runner))
        setattr(self.model, ENGINE, engine)
        report.engine_started(engine)
        logging.info(f"Block Offload ({request.node}): {summary}")

    def _stop_streaming(self, park: bool = False) -> None:
        engine = self.offload_engine
        if engine is None:
            return
        self._remember_costs(engine)
        engine.stop(park)
        delattr(self.model, ENGINE)
        if not park:
            self.model.block_offload_streamed = frozenset()
        # Parked blocks stay hidden from ComfyUI's loader: they are on the host, never loaded by it, so a
        # partial unload between prompts must neither move nor count them (the next load re-plans the set).
        report.engine_stopped(engine)

    def _simulated_device_room(self) -> int | None:
        """What BLOCK_OFFLOAD_SIMULATED_DEVICE_LIMIT_BYTES leaves for the stream buffers after what ComfyUI
        loaded; None when it is not set."""
        limit = os.environ.get(SIMULATED_DEVICE_LIMIT_ENV)
        return None if not limit else int(limit) - self.model.model_loaded_weight_memory

    def _patch_streamed_weights(self, streamed: frozenset[str], device: torch.device) -> None:
        """Applies weight patches (LoRA, ...) to the streamed weights once, before they are packed.

        Each weight is patched on the device, as ComfyUI patches a loaded weight,
        then comes straight back to the host, so the device holds one weight at a time.
        Modules are flagged ``comfy_patched_weights`` as ComfyUI flags loaded ones, so a
        clone that takes these weights over does not patch them a second time.
        """
        for name, module in self.model.named_modules():
            if not _inside(name, streamed) or getattr(module, "comfy_patched_weights", False):
                continue
            keys = [f"{name}.{param}" for param, _ in module.named_parameters(recurse=False)]
            if not keys:
                continue
            for key in keys:
                if key in self.patches:
                    weight = comfy.utils.get_attr(self.model, key)
                    if weight.untyped_storage().nbytes() > weight.nbytes:
                        # A view of a parked host buffer: the backup ComfyUI keeps of it must not hold
                        # the whole block's (pinned) buffer alive for as long as the patch is on.
                        weight.data = weight.data.clone()
                    self.patch_weight_to_device(key, device_to=device)
                    weight = comfy.utils.get_attr(self.model, key)
                    weight.data = weight.data.to(self.offload_device)
            module.comfy_patched_weights = True


def _count_promoted(model: torch.nn.Module, nbytes: int) -> None:
    """ComfyUI counts the modules the sequential wrapper keeps on the device. A function of the model,
    not a method of the patcher: the engine lives on the model, and a patcher it referred to could not
    be freed (nor stop the engine as it goes) until Python's cycle collector came by."""
    model.model_loaded_weight_memory += nbytes


def _pinning_notices(request: OffloadRequest, runner: BlockStreamer | SequentialOffloader) -> list[str]:
    """A notice (logged once) when the pinned-memory cap sent some streamed weights to pageable RAM."""
    streamer = runner if isinstance(runner, BlockStreamer) else runner.streamer
    refused = streamer.refused_pinning
    if not refused:
        return []
    notice = (
        f"Pinned memory cap reached ({PINNED_MEMORY.limit / GIB:.2f} GiB): {len(refused)} of "
        f"{len(streamer.streamed)} streamed {'blocks' if streamer.recurse else 'modules'} "
        f"({sum(refused.values()) / GIB:.2f} GiB) stream from pageable RAM, which copies more slowly. "
        f"Unloading other models frees pinned memory; {PINNED_LIMIT_ENV} sets the pack's own cap."
    )
    logging.warning(f"Block Offload ({request.node}): {notice}")
    return [notice]
