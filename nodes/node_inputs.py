"""The nodes' inputs: their widgets, the ranges ComfyUI's widgets allow, and the checks ``validate_inputs`` and
``execute`` make of the values (each problem found says what to do)."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import TypedDict

import comfy.model_management
import torch
from comfy_api.latest import io

from ..offload import GIB, ResidencyPolicy
from .request import streaming_allowed

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
