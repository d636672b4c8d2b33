"""Reliability of the ModelPatcher integration, in-process against the real ComfyUI 0.3.75 on the CPU.

What the real server cannot show from outside: the engine's state after an interrupt that lands
inside a block, ComfyUI's accounting after an out-of-memory fallback, the pinned-memory cap
(on a CPU nothing can be pinned, so pinning is declared possible and the cap set to 0 bytes: every
block is refused before anything would be pinned), and what ComfyUI's own unloading, eviction and
garbage collection leave behind. Fixtures and helpers come from test_patcher.
"""

from __future__ import annotations

import gc
import logging
import weakref
from types import SimpleNamespace

import pytest
import torch

from harness.device_limit import limited
from harness.inprocess import async_offload, sample, wan
from harness.private_views import load_list

from block_offload.offload import streamer as streamer_module

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")  # the nodes stream on the CPU too

STREAMED_FROM_1 = frozenset(range(1, 5))


def sd3(comfy: SimpleNamespace):
    return comfy.sd.load_diffusion_model(str(comfy.models["sd3"]))


def limit_device(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, limit: int) -> None:
    """A device with ``limit`` bytes for the placement (harness/device_limit.py), until the test ends."""
    monkeypatch.setattr(comfy.patcher, "start_engine", limited(comfy.patcher.start_engine, limit))


def warnings_of(caplog: pytest.LogCaptureFixture, text: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and text in r.getMessage()]


def assert_idle(streamer) -> None:
    """No call left open, the ring its planned size, every streamed block on its host copy (its host buffer's
    views, or its own tensors kept where they lie)."""
    assert not streamer.calls.open
    assert streamer.ring.memory is not None and streamer.ring.memory.numel() == streamer.ring.capacity
    for index in streamer.streamed:
        held = {view.data_ptr() for view in streamer.host.blocks[index].host_views}
        assert all(p.data_ptr() in held for p in streamer.blocks[index].parameters()), index


@pytest.mark.parametrize("block", [1, 3])
def test_interrupt_inside_a_streamed_block_leaves_the_model_usable(comfy: SimpleNamespace, block: int) -> None:
    """ComfyUI checks for an interrupt before every op (comfy.ops.run_every_op): flagging it as block
    ``block`` begins raises inside that block, its slot in use and the next blocks' copies issued."""
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=1, prefetch=2)
    assert torch.equal(sample(comfy, patched), reference)
    buffers = patched.offload_engine.runner.report().device_buffer_bytes
    interrupted = []

    def interrupt(*_: object) -> None:
        interrupted.append(patched.offload_engine.runner)
        comfy.mm.interrupt_current_processing()

    for attempt in range(2):
        hook = patched.model.diffusion_model.blocks[block].register_forward_pre_hook(interrupt)
        try:
            with pytest.raises(comfy.mm.InterruptProcessingException):
                sample(comfy, patched, seed=6 + attempt)
        finally:
            hook.remove()
        streamer = interrupted[-1]
        assert streamer is patched.offload_engine.runner and streamer.streamed == STREAMED_FROM_1
        assert_idle(streamer)
        assert streamer.report().device_buffer_bytes == buffers
    assert torch.equal(sample(comfy, patched), reference)
    # The interrupted engines were replaced by later loads and are gone, buffers and all.
    gone = [weakref.ref(streamer) for streamer in interrupted]
    interrupted.clear()
    del streamer
    gc.collect()
    assert [ref() for ref in gone] == [None, None]
    comfy.mm.unload_all_models()


def test_out_of_memory_falls_back_to_more_streaming(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The simulated device holds what a 1-resident-block placement needs (ComfyUI's part plus the stream
    buffers) and half a block more: 4 resident blocks do not fit, nor 2; the model streams with 1."""
    model = wan(comfy)
    reference = sample(comfy, model)
    fits = async_offload(comfy, model, resident=1)
    comfy.mm.load_models_gpu([fits])
    loaded, buffers = fits.loaded_size(), fits.offload_engine.runner.report().device_buffer_bytes
    block = fits.offload_engine.plan.block_bytes[0]
    comfy.mm.unload_all_models()
    limit_device(comfy, monkeypatch, loaded + buffers + block // 2)

    patched = async_offload(comfy, model, resident=4)
    with caplog.at_level(logging.INFO):
        assert torch.equal(sample(comfy, patched), reference)
    engine = patched.offload_engine
    assert engine.plan.resident == frozenset({0}) and engine.plan.prefetch == 1
    notice = "Out of memory placing 4 resident blocks with prefetch 1; fell back to 1 with prefetch 1."
    assert engine.notices == [notice]
    assert warnings_of(caplog, notice) == [f"Block Offload (Async Block Offload): {notice}"]
    plan_lines = [r.getMessage() for r in caplog.records if "blocks resident (" in r.getMessage()]
    assert len(plan_lines) == 1 and "1/5 blocks resident (0, leading), 4 streamed" in plan_lines[0]
    # ComfyUI counts what is really on the device: what its loader was offered, as for a clean placement.
    assert (
        patched.loaded_size()
        == sum(comfy.patcher.LoadEntry.of(entry).module_mem for entry in load_list(patched))
        == loaded
    )
    assert engine.runner.report().device_buffer_bytes == buffers

    caplog.clear()
    with caplog.at_level(logging.INFO):
        assert torch.equal(sample(comfy, patched), reference)
    # Each sampling run loads a new engine: it starts from the placement that fit, and still says why.
    again = patched.offload_engine
    assert again.plan == engine.plan and again.notices == [notice]
    assert not warnings_of(caplog, "Out of memory")  # not tried again, not logged again
    comfy.mm.unload_all_models()
    assert patched.offload_engine is None and patched.loaded_size() == 0


def test_out_of_memory_with_nothing_left_to_stream_fails_the_prompt_cleanly(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = wan(comfy)
    reference = sample(comfy, model)
    unlimited = comfy.patcher.start_engine
    limit_device(comfy, monkeypatch, 0)
    patched = async_offload(comfy, model, resident=2, prefetch=1)
    with pytest.raises(torch.OutOfMemoryError, match="simulated device limit"):
        sample(comfy, patched)
    assert patched.offload_engine is None
    monkeypatch.setattr(comfy.patcher, "start_engine", unlimited)  # the device has its memory back
    assert torch.equal(sample(comfy, patched), reference)  # the same node output runs once memory is back
    assert torch.equal(sample(comfy, model), reference)
    comfy.mm.unload_all_models()


@pytest.fixture
def pinning_possible(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU cannot pin: declare it can, so the cap decides. With a cap of 0 nothing is ever pinned."""
    monkeypatch.setattr(comfy.placement, "can_pin_memory", lambda: True)
    monkeypatch.setattr(streamer_module, "can_pin_memory", lambda: True)
    monkeypatch.setenv(comfy.pinned.PINNED_LIMIT_ENV, "0")


@pytest.mark.usefixtures("pinning_possible")
@pytest.mark.parametrize("node", ["async", "sequential"])
def test_pinned_memory_cap_streams_from_pageable_memory_and_says_so(
    comfy: SimpleNamespace, caplog: pytest.LogCaptureFixture, node: str
) -> None:
    model = wan(comfy)
    reference = sample(comfy, model)
    if node == "async":
        patched = async_offload(comfy, model, resident=1)
        refused = "4 of 4 streamed blocks"
    else:
        patched = sequential(comfy, model)
        refused = "streamed modules"
    with caplog.at_level(logging.INFO):
        assert torch.equal(sample(comfy, patched), reference)
    engine = patched.offload_engine
    (notice,) = engine.notices
    assert notice.startswith("Pinned memory cap reached (0.00 GiB, ") and refused in notice, notice
    assert "stream from pageable RAM" in notice and comfy.pinned.PINNED_LIMIT_ENV in notice
    assert warnings_of(caplog, "Pinned memory cap reached") == [f"Block Offload ({engine.request.node}): {notice}"]
    assert comfy.pinned.PINNED_MEMORY.used == 0
    comfy.mm.unload_all_models()


def test_pinned_cap_defaults_to_what_comfyui_has_left(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI's own budget where it has one, less what ComfyUI pinned; the setting caps it further."""
    monkeypatch.delenv(comfy.pinned.PINNED_LIMIT_ENV, raising=False)
    monkeypatch.setattr(comfy.mm, "MAX_PINNED_MEMORY", 10 * 2**30)
    monkeypatch.setattr(comfy.mm, "TOTAL_PINNED_MEMORY", 3 * 2**30)
    assert comfy.pinned.PINNED_MEMORY.limit == 7 * 2**30
    monkeypatch.setenv(comfy.pinned.PINNED_LIMIT_ENV, "2.5")
    assert comfy.pinned.PINNED_MEMORY.limit == int(2.5 * 2**30)
    monkeypatch.setattr(comfy.mm, "MAX_PINNED_MEMORY", -1)  # a host where ComfyUI does not pin
    assert comfy.pinned.PINNED_MEMORY.limit == int(2.5 * 2**30)
    monkeypatch.delenv(comfy.pinned.PINNED_LIMIT_ENV)
    assert comfy.pinned.PINNED_MEMORY.limit is None


def sequential(comfy: SimpleNamespace, model):
    return comfy.nodes.SequentialOffloadWrapper.execute(
        model, storage_dtype="as loaded", vram_limit_gb=0.001, prefetch_modules=1, pin_memory=True
    ).result[0]


def streaming(comfy: SimpleNamespace, loader, node=async_offload) -> tuple[object, weakref.ref, object]:
    """A streaming clone of a freshly loaded model, loaded by ComfyUI; its engine (by weak reference) and
    the engine's runner."""
    patched = node(comfy, loader(comfy))
    comfy.mm.load_models_gpu([patched])
    engine = patched.offload_engine
    assert engine.runner.enabled
    return patched, weakref.ref(engine), engine.runner


def assert_released(engine: weakref.ref, streamer) -> None:
    assert engine() is None, "the engine outlived its model's unloading"
    assert not streamer.enabled and streamer.report().device_buffer_bytes == 0 and streamer.report().host_bytes == 0


def test_unload_models_as_free_does_leaves_nothing(comfy: SimpleNamespace) -> None:
    """POST /free with unload_models calls unload_all_models: every engine stops and frees its buffers."""
    wan_model, wan_engine, wan_streamer = streaming(comfy, wan)
    sd3_model, sd3_engine, sd3_streamer = streaming(comfy, sd3)
    comfy.mm.unload_all_models()
    assert_released(wan_engine, wan_streamer)
    assert_released(sd3_engine, sd3_streamer)
    assert comfy.pinned.PINNED_MEMORY.used == 0
    assert wan_model.loaded_size() == 0 and sd3_model.loaded_size() == 0


def test_comfyui_evicting_a_streaming_model_for_another_leaves_nothing(comfy: SimpleNamespace) -> None:
    """ComfyUI's free_memory (what load_models_gpu calls when a new model needs room) unloads the
    streaming model that is not kept; its engine goes with it, the kept one streams on."""
    wan_model, wan_engine, wan_streamer = streaming(comfy, wan)
    sd3_model, sd3_engine, _ = streaming(comfy, sd3)
    keep = [loaded for loaded in comfy.mm.current_loaded_models if loaded.model is sd3_model]
    unloaded = comfy.mm.free_memory(1e30, torch.device("cpu"), keep_loaded=keep)
    assert [loaded.model for loaded in unloaded] == [wan_model]
    assert_released(wan_engine, wan_streamer)
    assert sd3_engine() is not None and sd3_engine().runner.enabled
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [async_offload, sequential], ids=["async", "sequential"])
def test_deleting_the_workflows_model_frees_its_engine_at_once(comfy: SimpleNamespace, node) -> None:
    """A workflow that drops the model (ComfyUI's cache lets go of the loader's output) while it is
    loaded and streaming: no unload is called, yet the engine, its buffers and pins go at once, by
    reference counting (the patcher's ``__del__`` detaches it, which stops the engine), without
    waiting for Python's cycle collector, which ComfyUI runs only every 10 s between prompts."""
    patched, engine, streamer = streaming(comfy, wan, node)
    streamer = weakref.ref(streamer)
    gc.disable()
    try:
        del patched
        assert engine() is None and streamer() is None
    finally:
        gc.enable()
    comfy.mm.cleanup_models()
    assert comfy.pinned.PINNED_MEMORY.used == 0
    assert comfy.mm.current_loaded_models == []  # ComfyUI saw the model go, too
