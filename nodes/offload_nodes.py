"""The three nodes: each takes a MODEL, clones it, and returns the clone set to stream; and their inputs: the
widgets, the ranges ComfyUI's widgets allow, and the checks ``validate_inputs`` and ``execute`` make of the
values (each problem found says what to do).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from types import MappingProxyType
from typing import TypedDict

import comfy.model_management
import torch
from comfy.model_patcher import ModelPatcher
from comfy_api.latest import io

from ..offload import (
    GIB,
    NoBlocksError,
    ResidencyPolicy,
    StepAside,
    platform_aside,
    step_aside,
    unsupported_torch,
)
from . import panel
from .blocks import find_blocks, module_by_module_notice
from .dynamic_vram import room_for_weights, uses_dynamic_vram, weight_bytes
from .patcher import refuse_cudagraphs, with_offload
from .request import ALLOW_CPU_ENV, OffloadRequest, may_step_aside, streaming_allowed

# -- the nodes' inputs


# The placing nodes' default policy: the planner picks the resident blocks and the prefetch depth.
AUTO_POLICY = "auto"
POLICIES = (AUTO_POLICY, *(p.value for p in ResidencyPolicy))
# The widgets' ranges. A node that validates an input itself is not range-checked by ComfyUI, so
# ``validate_inputs`` checks them against these too (API clients can send any value).
MAX_PREFETCH = 8
MAX_RESIDENT_BLOCKS = 1000
MAX_GIB = 1024.0
STORAGE_DTYPES: Mapping[str, torch.dtype | None] = MappingProxyType(
    {
        "as loaded": None,
        "bf16": torch.bfloat16,
        "fp16": torch.float16,
        "fp8_e4m3fn": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
    }
)

MODEL_INPUT = io.Model.Input("model", tooltip="The diffusion model to stream. The model you connect stays unchanged.")
OUTPUT = io.Model.Output(tooltip="A copy of the model that streams its blocks when it runs.")


def prefetch_input(what: str) -> io.Int.Input:
    return io.Int.Input(
        f"prefetch_{what}",
        default=1,
        min=0,
        max=MAX_PREFETCH,
        tooltip=f"How many {what} ahead are copied while the current one computes. Each costs one more "
        f"buffer the size of the largest {what[:-1]}. 0 copies on demand (synchronous, for comparison).",
    )


PIN_INPUT = io.Boolean.Input(
    "pin_memory",
    default=True,
    tooltip="Keep streamed weights in page-locked RAM so copies run asynchronously at full bus speed. "
    "Turn off only if the system is short of RAM.",
)


def problems(*problems: str | None) -> bool | str:
    """``validate_inputs``' answer: True, or every problem found, each saying what to do.

    An input fed by another node's output has no value yet when ComfyUI validates the prompt, and
    is left out of the call: the ``validate_inputs`` parameters default to None, the checks skip it,
    and ``execute`` (the engine's own checks) catches a bad value when the node runs."""
    found = [problem for problem in problems if problem]
    return " ".join(found) if found else True


def refuse(answer: bool | str) -> None:
    """In ``execute``: what ``validate_inputs`` could not see (a value fed by another node) is checked now."""
    if answer is not True:
        raise ValueError(answer)


def count_problem(name: str, value: int | None, high: int, advice: str) -> str | None:
    if value is None or 0 <= value <= high:
        return None
    return f"{name} is {value}; {advice}"


def prefetch_problem(name: str, value: int | None) -> str | None:
    return count_problem(name, value, MAX_PREFETCH, f"use 0 (copy on demand) to {MAX_PREFETCH}.")


def gib_problem(name: str, value: float | None, zero_means: str) -> str | None:
    """A GiB amount: within the widget's range, and no more than the device ComfyUI runs models on has."""
    if value is None:
        return None
    if not 0 <= value <= MAX_GIB:
        return f"{name} is {value}; use 0 ({zero_means}) or a positive number of GiB up to {MAX_GIB:.0f}."
    device = comfy.model_management.get_torch_device()
    if value == 0 or not streaming_allowed(device):  # the node passes the model through on the CPU
        return None
    total = comfy.model_management.get_total_memory(device)
    if value * GIB > total:
        return (
            f"{name} is {value:.1f} GiB but the device ({device}) has {total / GIB:.1f} GiB; "
            f"use less, or 0 ({zero_means})."
        )
    return None


def storage_dtype_problem(name: str | None) -> str | None:
    if name is None:
        return None
    if name not in STORAGE_DTYPES:
        return f"storage_dtype is {name!r}; use one of: {', '.join(STORAGE_DTYPES)}."
    dtype = STORAGE_DTYPES[name]
    device = comfy.model_management.get_torch_device()
    if dtype is not None and not comfy.model_management.supports_cast(device, dtype):
        return (
            f"storage_dtype is {name} but ComfyUI cannot cast {name} weights on this device ({device}); "
            "use fp16, bf16 or as loaded."
        )
    return None


class PolicyFields(TypedDict):
    """The fields of an ``OffloadRequest`` a policy widget sets."""

    policy: ResidencyPolicy
    auto_placement: bool


def policy_fields(name: str) -> PolicyFields:
    """A policy widget's request fields. An automatic placement's first, measuring run is strided."""
    if name not in POLICIES:
        raise ValueError(f"policy is {name!r}; use one of: {', '.join(POLICIES)}.")
    auto = name == AUTO_POLICY
    return {"policy": ResidencyPolicy.STRIDED if auto else ResidencyPolicy(name), "auto_placement": auto}


# -- the nodes


CATEGORY = "offload"


def _prepare(model: ModelPatcher, request: OffloadRequest) -> io.NodeOutput:
    """Checks what can only be checked against the model, then returns the streaming clone."""
    node = request.node
    device = model.load_device
    if not streaming_allowed(device):
        logging.warning(
            f"Block Offload ({node}): ComfyUI runs this model on the CPU, so there is no GPU memory to save; "
            f"passing the model through unchanged. (Set {ALLOW_CPU_ENV}=1 to exercise streaming on the CPU.)"
        )
        return io.NodeOutput(model)
    aside = platform_aside(device)
    if aside is not None:
        return _stepped_aside(model, node, aside)
    unsupported = unsupported_torch(device)
    if unsupported is not None:
        raise ValueError(f"{node}: {unsupported}")
    # Whether the request streams some weights whatever the device: the sequential wrapper, or a fixed count
    # below all the blocks. A budget's placement depends on the device (``room_for_weights``).
    streams_any = True
    if not request.sequential:
        try:
            blocks = find_blocks(model.model.diffusion_model).blocks
        except NoBlocksError as error:
            request = request.module_by_module(module_by_module_notice(error))
            logging.warning(f"Block Offload ({node}): {request.notice}")
            blocks = ()
        if request.resident_blocks is not None and request.resident_blocks > len(blocks):
            raise ValueError(
                f"resident_blocks is {request.resident_blocks} but this model has {len(blocks)} blocks; "
                f"use 0 to {len(blocks)}."
            )
        streams_any = request.resident_blocks is None or request.resident_blocks < len(blocks)
    refuse_cudagraphs(model, node)
    if uses_dynamic_vram(model) and may_step_aside():
        aside = step_aside(weight_bytes(model), room_for_weights(model, request), streams_any)
        if aside is not None:
            return _stepped_aside(model, node, aside)
    return io.NodeOutput(with_offload(model, request))


def _stepped_aside(model: ModelPatcher, node: str, aside: StepAside) -> io.NodeOutput:
    logging.info(f"Block Offload ({node}): steps aside, returning the model unchanged: {aside.reason}")
    panel.node_stepped_aside(node, aside.reason)
    return io.NodeOutput(model)


class AsyncBlockOffload(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="AsyncBlockOffload",
            display_name="Async Block Offload",
            category=CATEGORY,
            description="Keeps a number of transformer blocks on the GPU and streams the others from RAM, "
            "each copy hidden behind the compute of the block before it.",
            inputs=[
                MODEL_INPUT,
                io.Int.Input(
                    "resident_blocks",
                    default=0,
                    min=0,
                    max=MAX_RESIDENT_BLOCKS,
                    tooltip="How many blocks stay on the GPU (which ones: policy). The rest stream. More resident "
                    "blocks: faster, more VRAM.",
                ),
                prefetch_input("blocks"),
                PIN_INPUT,
                io.Combo.Input(
                    "policy",
                    options=list(POLICIES),
                    default=AUTO_POLICY,
                    optional=True,  # workflows and API prompts from before it still load, planned
                    tooltip="Which of the resident blocks stay: the first (leading), the last (trailing), or spread "
                    "evenly (strided). auto: the first run is strided and measures each block's compute time and "
                    "the copy speed; from the next run on, the blocks and the prefetch depth (up to "
                    "prefetch_blocks) are the ones predicted fastest.",
                ),
            ],
            outputs=[OUTPUT],
        )

    @classmethod
    def validate_inputs(cls, resident_blocks: int | None = None, prefetch_blocks: int | None = None) -> bool | str:
        return problems(
            count_problem(
                "resident_blocks",
                resident_blocks,
                MAX_RESIDENT_BLOCKS,
                "use 0 (every block streams) up to the model's number of blocks.",
            ),
            prefetch_problem("prefetch_blocks", prefetch_blocks),
        )

    @classmethod
    def execute(
        cls,
        model: ModelPatcher,
        resident_blocks: int,
        prefetch_blocks: int,
        pin_memory: bool,
        policy: str = AUTO_POLICY,
    ):
        refuse(cls.validate_inputs(resident_blocks, prefetch_blocks))
        request = OffloadRequest(
            "Async Block Offload",
            resident_blocks=resident_blocks,
            prefetch=prefetch_blocks,
            pin_memory=pin_memory,
            **policy_fields(policy),
        )
        return _prepare(model, request)


class PartialGPUResidency(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="PartialGPUResidency",
            display_name="Partial GPU Residency",
            category=CATEGORY,
            description="Keeps as many blocks on the GPU as fit a VRAM budget and streams the rest.",
            inputs=[
                MODEL_INPUT,
                io.Float.Input(
                    "vram_budget_gb",
                    default=0.0,
                    min=0.0,
                    max=MAX_GIB,
                    step=0.1,
                    tooltip="GPU memory for this model's weights, stream buffers included, in GiB. 0 = automatic: "
                    "what ComfyUI leaves free after its reserve and the sampling activations.",
                ),
                io.Combo.Input(
                    "policy",
                    options=list(POLICIES),
                    default=AUTO_POLICY,
                    tooltip="Which blocks stay: the first (leading), the last (trailing), or spread evenly "
                    "(strided), which gives each streamed block's copy a resident block to hide behind. "
                    "auto: the first run is strided and measures each block's compute time and the copy "
                    "speed (kept per GPU and model in ComfyUI's user folder); from the next run on, the "
                    "resident blocks and the stream buffers are the ones predicted fastest within the budget: "
                    "a prefetch depth, or a ring of every byte the resident blocks leave, copying as far ahead "
                    "as it holds (prefetch_blocks then applies to the other policies only).",
                ),
                prefetch_input("blocks"),
                PIN_INPUT,
            ],
            outputs=[OUTPUT],
        )

    @classmethod
    def validate_inputs(cls, vram_budget_gb: float | None = None, prefetch_blocks: int | None = None) -> bool | str:
        return problems(
            gib_problem("vram_budget_gb", vram_budget_gb, "automatic"),
            prefetch_problem("prefetch_blocks", prefetch_blocks),
        )

    @classmethod
    def execute(cls, model: ModelPatcher, vram_budget_gb: float, policy: str, prefetch_blocks: int, pin_memory: bool):
        refuse(cls.validate_inputs(vram_budget_gb, prefetch_blocks))
        request = OffloadRequest(
            "Partial GPU Residency",
            budget_bytes=int(vram_budget_gb * GIB),
            prefetch=prefetch_blocks,
            pin_memory=pin_memory,
            **policy_fields(policy),
        )
        return _prepare(model, request)


class SequentialOffloadWrapper(io.ComfyNode):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="SequentialOffloadWrapper",
            display_name="Sequential Offload Wrapper",
            category=CATEGORY,
            description="Streams the model module by module; works for any model, block lists or not (the block "
            "nodes stream a model without block lists this way themselves).",
            inputs=[
                MODEL_INPUT,
                io.Combo.Input(
                    "storage_dtype",
                    options=list(STORAGE_DTYPES),
                    default="as loaded",
                    tooltip="The dtype weights are copied to the GPU in, then cast back to the model's dtype there. "
                    "Smaller cuts copy time but rounds the weights this node runs; the originals stay in RAM, "
                    "so the model you connect is unchanged.",
                ),
                io.Float.Input(
                    "vram_limit_gb",
                    default=0.0,
                    min=0.0,
                    max=MAX_GIB,
                    step=0.1,
                    tooltip="After the first step, the most frequently used modules are kept on the GPU "
                    "up to this many GiB. 0 keeps none.",
                ),
                prefetch_input("modules"),
                PIN_INPUT,
            ],
            outputs=[OUTPUT],
        )

    @classmethod
    def validate_inputs(
        cls, storage_dtype: str | None = None, vram_limit_gb: float | None = None, prefetch_modules: int | None = None
    ) -> bool | str:
        return problems(
            storage_dtype_problem(storage_dtype),
            gib_problem("vram_limit_gb", vram_limit_gb, "keep no module on the device"),
            prefetch_problem("prefetch_modules", prefetch_modules),
        )

    @classmethod
    def execute(
        cls, model: ModelPatcher, storage_dtype: str, vram_limit_gb: float, prefetch_modules: int, pin_memory: bool
    ):
        refuse(cls.validate_inputs(storage_dtype, vram_limit_gb, prefetch_modules))
        request = OffloadRequest(
            "Sequential Offload Wrapper",
            sequential=True,
            storage_dtype=STORAGE_DTYPES[storage_dtype],
            vram_limit_bytes=int(vram_limit_gb * GIB),
            prefetch=prefetch_modules,
            pin_memory=pin_memory,
        )
        return _prepare(model, request)


NODES: tuple[type[io.ComfyNode], ...] = (AsyncBlockOffload, PartialGPUResidency, SequentialOffloadWrapper)
