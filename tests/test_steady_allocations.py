"""A streamed step allocates what the same step of the model fully resident allocates, nothing more.

ComfyUI's compiler (0.35+, on by default with Dynamic VRAM on CUDA) records the device allocations of each
block call and replays them; a custom node that allocates inside a block call, differently from step to step,
breaks the recording. From the third step on, every node's hooks, ring copies, file-tier reads and casts use
memory allocated at placement: the allocations of each step (``harness/allocations.py``: every operator
output that is not a view of its inputs, on the CPU) are those of the same model loaded the classic way and
fully resident, operator for operator. A LoRA on a streamed weight is patched where it arrives, in scratch the
engine allocated at placement (``nodes/loaded_patch.py``), so it counts like the rest. A weight in a quantized
format (the fp8 rows: ComfyUI's scaled fp8 layout) is dequantized and re-quantized by its format's own code, as
ComfyUI's load does it, the LoRA between the two in the scratch: that code is logged apart, the same at every
step.

On a GPU (``tests/torch_only/test_engine_cuda.py``, ``test_a_streamed_step_allocates_no_device_memory_of_its_own``), the
caching allocator's own counts.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from safetensors.torch import load_file
from test_quantized import loader  # noqa: F401 - the fixture

from harness import tiny_models as tm
from harness.allocations import AllocationLog, Step, logged_steps
from harness.dynamic_vram import DynamicVram
from harness.inprocess import Unstreamed, every_block_streamed, sample, wan
from harness.prompts import ASYNC, PARTIAL, SEQUENTIAL

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

STEPS = 5
STEADY = 2  # the first steps learn the call order and may allocate what they reuse later (the third on may not)
KINDS = ["bf16", "bf16 + LoRA", "fp8", "fp8 + LoRA", "file tier", "file tier + LoRA"]


def with_lora(comfy: SimpleNamespace, model):
    return comfy.sd.load_lora_for_models(model, None, load_file(comfy.models[tm.WAN21_LORA]), 0.8, 0)[0]


def model_of(kind: str, comfy: SimpleNamespace, request: pytest.FixtureRequest, resident: bool) -> object:
    """The model to stream for ``kind``, or (``resident``) its fully resident reference: a classic load."""
    if kind.startswith("file tier"):
        if HOST_VERSION.startswith("0.3."):
            pytest.skip(f"ComfyUI {HOST_VERSION} has no Dynamic VRAM, whose models the file tier streams")
        from block_offload.nodes.comfy_memory import PINNED_LIMIT_ENV

        request.getfixturevalue("monkeypatch").setenv(PINNED_LIMIT_ENV, "1e-9")  # no host buffer: every block read
        dynamic_vram: DynamicVram = request.getfixturevalue("dynamic_vram")
        path = request.getfixturevalue("stored_wan")["bf16"]
        model = (dynamic_vram.load_classic if resident else dynamic_vram.load)(path, torch.bfloat16)
    elif kind.startswith("fp8"):
        model = request.getfixturevalue("loader")(tm.WAN21_FP8)
    else:
        model = wan(comfy)
    return with_lora(comfy, model) if kind.endswith("LoRA") else model


def steps_of(comfy: SimpleNamespace, model, log: AllocationLog | None = None) -> list[Step]:
    """The allocations of each sampling step, ``[0]`` the load's."""
    steps = logged_steps(model, lambda: sample(comfy, model, steps=STEPS), log)
    assert len(steps) == STEPS + 1
    return steps


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_streamed_step_allocates_what_the_resident_step_allocates(
    comfy: SimpleNamespace, request: pytest.FixtureRequest, unstreamed: Unstreamed, node: str, kind: str
) -> None:
    def resident_run() -> list[Step]:
        steps = steps_of(comfy, model_of(kind, comfy, request, resident=True))
        comfy.mm.unload_all_models()
        return steps

    resident = unstreamed.once(kind, resident_run)
    streaming = every_block_streamed(comfy, node, model_of(kind, comfy, request, resident=False))
    streamed = steps_of(comfy, streaming)
    runner = streaming.offload_engine.runner
    assert runner.report().streamed and streaming.offload_engine.recorder.latest().spans, "nothing streamed"
    if kind.startswith("file tier"):
        assert runner.report().read_each_step, "no block was read from the file"
    for index in range(STEADY + 1, STEPS + 1):
        assert streamed[index].own == resident[index].own, f"step {index}: {diff(streamed[index], resident[index])}"
        assert not resident[index].format_patch
        # The format's own code, the same at every step: what a recording replays. The LoRA's arithmetic is in
        # the engine's scratch even there: no product of up and down is allocated.
        assert streamed[index].format_patch == streamed[STEADY + 1].format_patch
        assert not [a for a in streamed[index].format_patch if a[0] == "aten.mm.default"], streamed[index].format_patch
    assert bool(streamed[STEADY + 1].format_patch) == (kind == "fp8 + LoRA")
    comfy.mm.unload_all_models()


def diff(streamed: Step, resident: Step) -> str:
    from collections import Counter

    extra, missing = Counter(streamed.own), Counter(resident.own)
    extra.subtract(resident.own)
    missing.subtract(streamed.own)
    return f"allocated beyond the resident step: {+extra}; not allocated: {+missing}"


# -- ComfyUI's compiler (0.35+) -----------------------------------------------------------------------------


def test_where_comfyui_has_no_compiler_the_engine_pauses_nothing(comfy: SimpleNamespace) -> None:
    from contextlib import nullcontext

    from block_offload.nodes.comfy_memory import outside_the_recording

    assert outside_the_recording() is nullcontext  # 0.33 has comfy.model_prefetch, without a recording; 0.3.75 none


class CompilerPause:
    """``comfy.model_prefetch.pause_malloc_graph(sync=False)`` of ComfyUI 0.35+ as the engine sees it: a context
    keeping allocations out of the recording; here, logging them as ``paused``, and how each pause was asked."""

    def __init__(self, log: AllocationLog) -> None:
        self.log = log
        self.syncs: list[bool] = []

    def __call__(self, sync: bool = False):
        self.syncs.append(sync)
        return self.log.scope("paused")


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason=f"ComfyUI {HOST_VERSION} has no comfy.model_prefetch")
@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_the_engines_device_buffers_are_allocated_outside_the_compilers_recording(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, node: str
) -> None:
    """The ring and staging buffers, allocated at placement and again at the first block call after ComfyUI took
    their memory back (``release_device_buffers`` between the second and the third step), are made under the
    compiler's pause, with ``sync``; nothing else the pack allocates is, and no step allocates them outside it."""
    import importlib

    log = AllocationLog()
    pause = CompilerPause(log)
    monkeypatch.setattr(importlib.import_module("comfy.model_prefetch"), "pause_malloc_graph", pause, raising=False)
    streaming = every_block_streamed(comfy, node, wan(comfy))
    released = []

    def release_before_the_third_step(*_: object) -> None:
        if len(log.steps) == STEADY + 1:  # before the third call (this hook runs before the log's)
            runner = streaming.offload_engine.runner
            runner.release_device_buffers()
            released.append(True)

    handle = streaming.model.diffusion_model.register_forward_pre_hook(release_before_the_third_step)
    try:
        steps = steps_of(comfy, streaming, log)
    finally:
        handle.remove()
    assert released
    ring = streaming.offload_engine.runner.report().device_buffer_bytes
    buffers = [(op, shape, dtype) for op, shape, dtype in steps[0].paused if dtype == torch.uint8]
    assert sum(shape[0] for _, shape, _ in buffers) == ring, (buffers, ring)
    assert steps[STEADY + 1].paused == steps[0].paused  # the ring again, after its release
    assert all(not step.paused for index, step in enumerate(steps) if index not in (0, STEADY + 1))
    assert all(sync for sync in pause.syncs)
    for step in steps:
        assert not [a for a in step.own if a[2] == torch.uint8 and len(a[1]) == 1 and a[1][0] in (ring,)], step.own
    comfy.mm.unload_all_models()
