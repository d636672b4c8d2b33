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

import logging
import math
import os
from dataclasses import dataclass, field

import comfy.utils
import torch
from comfy.model_patcher import ModelPatcher

from ..offload import (
    BlockStreamer,
    OffloadPlan,
    ResidencyPolicy,
    SequentialOffloader,
    TimelineRecorder,
    can_pin_memory,
    module_bytes,
)
from . import report
from .architectures import find_blocks

ATTACHMENT = "block_offload"
ENGINE = "block_offload_engine"
# Set by the tests and the CPU demo: exercise the whole streaming path with the CPU as "device".
ALLOW_CPU_ENV = "BLOCK_OFFLOAD_ALLOW_CPU"


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

    def stop(self) -> None:
        self.runner.disable()


def streaming_allowed(device: torch.device) -> bool:
    return device.type != "cpu" or os.environ.get(ALLOW_CPU_ENV) == "1"


def with_offload(model: ModelPatcher, request: OffloadRequest) -> ModelPatcher:
    """A clone of ``model`` that streams as ``request`` says; ``model`` itself is untouched."""
    previous = model.get_attachment(ATTACHMENT)
    if previous is not None:
        logging.info(f"Block Offload: {request.node} replaces the earlier {previous.node} on this model")
    patched = model.clone()
    # clone() builds self.__class__, so giving the clone our subclass makes every later clone inherit it.
    patched.__class__ = _offload_class(type(model))
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
            self.unpatch_model(self.offload_device, unpatch_weights=True)
        return super().partially_load(device_to, extra_memory, force_patch_weights)

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        request = self.offload_request
        engine = self.offload_engine
        budget = math.inf if full_load else lowvram_model_memory
        plan, streamed, summary = self._plan(request, budget)
        if engine is not None and (engine.request, engine.plan, engine.streamed) != (request, plan, streamed):
            self._stop_streaming()
            engine = None
        self.model.block_offload_streamed = streamed
        # ComfyUI places the rest; our slots come out of the same budget.
        slot_bytes = plan.slot_bytes if plan else 0
        weights_budget = 1e32 if math.isinf(budget) else max(0.0, budget - slot_bytes)
        super().load(device_to, weights_budget, force_patch_weights=force_patch_weights, full_load=False)
        if not streamed:
            return
        if engine is None:
            self._start_streaming(request, plan, streamed, summary, device_to)
        self.model.model_lowvram = True  # the streamed blocks are not on the device
        self.model.model_offload_buffer_memory += slot_bytes

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        if unpatch_weights:
            self._stop_streaming()
        return super().unpatch_model(device_to, unpatch_weights)

    def detach(self, unpatch_all=True):
        # A detached patcher may hand its loaded weights to a clone that does not stream.
        self._stop_streaming()
        return super().detach(unpatch_all)

    # -- planning ----------------------------------------------------------------------------

    def _plan(self, request: OffloadRequest, budget: float) -> tuple[OffloadPlan | None, frozenset[str], str]:
        diffusion_model = self.model.diffusion_model
        if request.sequential:
            names = frozenset(
                f"diffusion_model.{name}" if name else "diffusion_model"
                for name, module in diffusion_model.named_modules()
                if any(True for _ in module.parameters(recurse=False)) or any(True for _ in module.buffers(False))
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
            room = budget - outside
            if request.budget_bytes:
                room = min(room, request.budget_bytes - outside)
            if math.isinf(room):
                count = len(sizes)
            else:
                budget_bytes = int(max(0, room))
        plan = OffloadPlan.build(
            sizes,
            resident_count=count,
            budget_bytes=budget_bytes,
            policy=request.policy,
            prefetch=request.prefetch,
            pin_memory=request.pin_memory and can_pin_memory(),
        )
        streamed = frozenset(f"diffusion_model.{blocks[i][0]}" for i in plan.streamed)
        return plan, streamed, f"{arch.name}: {plan.describe(outside)}"

    # -- streaming ---------------------------------------------------------------------------

    def _start_streaming(
        self,
        request: OffloadRequest,
        plan: OffloadPlan | None,
        streamed: frozenset[str],
        summary: str,
        device: torch.device,
    ) -> None:
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
                on_promote=self._count_promoted,
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
            )
        runner.enable()
        engine = _Engine(request, plan, streamed, runner, recorder, summary)
        setattr(self.model, ENGINE, engine)
        report.engine_started(engine)
        logging.info(f"Block Offload ({request.node}): {summary}")

    def _stop_streaming(self) -> None:
        engine = self.offload_engine
        if engine is None:
            return
        engine.stop()
        delattr(self.model, ENGINE)
        self.model.block_offload_streamed = frozenset()
        report.engine_stopped(engine)

    def _count_promoted(self, nbytes: int) -> None:
        self.model.model_loaded_weight_memory += nbytes

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
                    self.patch_weight_to_device(key, device_to=device)
                    weight = comfy.utils.get_attr(self.model, key)
                    weight.data = weight.data.to(self.offload_device)
            module.comfy_patched_weights = True
