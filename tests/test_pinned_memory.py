"""Pinned memory the pack shares with ComfyUI, and the platforms it steps aside on: in-process on the CPU,
against the real ComfyUI, with what only a GPU machine has recreated.

* Pinning: nothing can be pinned on the CPU, so CUDA's runtime is replaced by a fake ``cudart`` whose
  ``cudaHostRegister`` succeeds or fails as a test says, behind the pack's real registrar (the one the
  nodes install on a CUDA machine): registration, ComfyUI's books, the error clearing and the fallback
  to pageable memory all run as they would there, only the driver call is simulated.
* ComfyUI's pinned budget made small (``MAX_PINNED_MEMORY``, what ComfyUI pinned itself, available RAM).
* MPS and DirectML devices, a torch without the accelerator functions, ``--disable-pinned-memory``,
  ``--highvram``'s unlimited budget, a cost cache that cannot be written.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION

from harness.device_limit import limited
from harness.fake_cudart import FakeCudart
from harness.inprocess import async_offload, sample, wan
from harness.packing_gate import PackingGate

from block_offload.offload import (
    GIB,
    CallOptions,
    CudaHostRegistrar,
    PinnedMemoryBudget,
    StreamSpec,
    cost_cache,
    pinning,
    planner,
    ring,
    stream_blocks,
    use_host_registrar,
)
from block_offload.offload import device as device_module
from block_offload.offload.file_source import FileChangedError
from block_offload.offload.pinning import HostMemory

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

STREAMED = 4  # async_offload(resident=1) of the tiny Wan's 5 blocks
MIB = 2**20


@pytest.fixture
def cudart(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeCudart]:
    """Pinning through the nodes' own registrar and a fake CUDA runtime; ComfyUI's pinned budget set (as on
    NVIDIA) to 64 MiB with nothing pinned by ComfyUI itself; every error clearing counted."""
    fake = FakeCudart()
    cleared: list[int] = []
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(comfy.mm, "MAX_PINNED_MEMORY", 64 * MIB)
    monkeypatch.setattr(comfy.mm, "TOTAL_PINNED_MEMORY", 0)
    monkeypatch.delenv(comfy.pinned.PINNED_LIMIT_ENV, raising=False)
    if hasattr(comfy.mm, "discard_cuda_async_error"):  # 0.33: ComfyUI's own clearing
        monkeypatch.setattr(comfy.mm, "discard_cuda_async_error", lambda: cleared.append(1))
    else:  # 0.3.75 has none: the engine's
        monkeypatch.setattr(pinning, "discard_async_error", lambda: cleared.append(1))
    monkeypatch.setattr(comfy.pinned, "ram_admits", lambda nbytes: True)
    use_host_registrar(comfy.pinned.comfyui_registrar())
    fake.cleared = cleared
    yield fake
    comfy.mm.unload_all_models()
    use_host_registrar(None)
    assert fake.pinned == 0, "something the pack pinned was never unpinned"


def streamed_block_bytes(patched) -> int:
    return patched.offload_engine.plan.block_bytes[1]


def two_experts_in_one_experts_pins(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch):
    """Wan 2.2's two experts (two loads of one model), the model's output, and a streamed block's bytes, with
    ComfyUI's pinned budget set to what one expert's streamed blocks take (measured on a first load, unloaded)."""
    first, second = wan(comfy), wan(comfy)
    reference = sample(comfy, first)
    probe = async_offload(comfy, first, resident=1)
    sample(comfy, probe)
    block = streamed_block_bytes(probe)
    comfy.mm.unload_all_models()
    monkeypatch.setattr(comfy.mm, "MAX_PINNED_MEMORY", STREAMED * block)
    return first, second, reference, block


def let_pin(gate: PackingGate, cudart: FakeCudart, blocks: int, block: int) -> None:
    """Lets the held packing thread pin ``blocks`` blocks of ``block`` bytes in place, and waits until it has."""
    gate.let(blocks)
    deadline = time.monotonic() + 30
    while cudart.pinned < blocks * block and time.monotonic() < deadline:
        time.sleep(0.01)
    assert cudart.pinned == blocks * block, (cudart.pinned, blocks * block)


def test_the_packs_pins_are_in_comfyuis_books_and_survive_its_reset(comfy: SimpleNamespace, cudart: FakeCudart) -> None:
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, patched), reference)
    pinned = STREAMED * streamed_block_bytes(patched)
    assert cudart.pinned == pinned and cudart.flags == {1}  # portable registrations, as ComfyUI's
    # Registered where the loader's tensors lie, as ComfyUI's classic loader pins its weights: no host buffer,
    # nothing copied, each registration the storage of a streamed block's own tensor, in memory already.
    blocks = patched.offload_engine.runner.host.blocks.values()
    assert all(state.pinned_in_place and state.host.numel() == 0 for state in blocks)
    storages = {tensor.untyped_storage().data_ptr() for state in blocks for tensor in state.layout.current()}
    assert cudart.registered.keys() == storages
    assert all(cudart.resident_at_registration[pointer] == 1.0 for pointer in storages)
    assert comfy.mm.TOTAL_PINNED_MEMORY == pinned == comfy.pinned.PINNED_MEMORY.used
    assert comfy.mm.PINNED_MEMORY[comfy.pinned.COMFY_TABLE_KEY] == pinned
    # ComfyUI pins and unpins a tensor of its own: 0.3.75 resets its total when its table empties.
    own = torch.nn.Parameter(torch.empty(1 * MIB, dtype=torch.uint8), requires_grad=False)
    assert comfy.mm.pin_memory(own)
    assert pinned + own.nbytes == comfy.mm.TOTAL_PINNED_MEMORY
    assert comfy.mm.unpin_memory(own)
    assert pinned == comfy.mm.TOTAL_PINNED_MEMORY
    comfy.mm.unload_all_models()
    assert comfy.mm.TOTAL_PINNED_MEMORY == 0 and comfy.pinned.COMFY_TABLE_KEY not in comfy.mm.PINNED_MEMORY
    assert cudart.pinned == 0 and not cudart.cleared


def test_a_first_load_streams_at_once_and_cancel_while_pinning_leaves_the_model_usable(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The first prompt does not wait for pinning: with the packing thread held, the whole prompt runs, every
    streamed block copied from the loader's tensors, and its plan line says what is left to pin. Cancel pressed
    in the middle of a step while pinning waits leaves the model loaded and usable: the next prompt finishes
    the pinning and computes the same, and a later clone takes the pinned buffers over without packing."""
    model = wan(comfy)
    reference = sample(comfy, model)
    gate = PackingGate(monkeypatch)

    def cancel_pressed(*_: object) -> None:  # mid-step, as ComfyUI 0.33's interrupt raises inside the model
        comfy.mm.interrupt_current_processing()
        comfy.mm.throw_exception_if_processing_interrupted()

    patched = async_offload(comfy, model, resident=1)
    with caplog.at_level(logging.INFO):
        assert torch.equal(sample(comfy, patched), reference)
    report = patched.offload_engine.runner.report()
    block = streamed_block_bytes(patched)
    assert cudart.pinned == 0 and report.waiting_bytes == STREAMED * block and report.packed_bytes == 0
    (line,) = [r.getMessage() for r in caplog.records if "blocks resident" in r.getMessage()]
    clause = f"; {STREAMED * block / GIB:.2f} GiB pinned or packed in the background while the first steps run"
    assert clause in line, line
    assert f"(pinned 0.00 of {STREAMED * block / GIB:.2f} GiB so far)" in line, line
    hook = patched.model.diffusion_model.blocks[2].register_forward_pre_hook(cancel_pressed)
    with pytest.raises(comfy.mm.InterruptProcessingException):
        sample(comfy, patched)
    hook.remove()
    comfy.mm.interrupt_current_processing(False)
    assert patched.offload_engine is not None and cudart.pinned == 0  # still loaded, still nothing pinned
    gate.let(2 * STREAMED)  # some may go to the loaded engine's thread, stopped as the next prompt takes over
    assert torch.equal(sample(comfy, patched), reference)
    runner = patched.offload_engine.runner
    runner.finish_packing()
    report = runner.report()
    assert report.waiting_bytes == 0 and report.pinning_progress == (STREAMED * block, STREAMED * block)
    assert cudart.pinned == STREAMED * block == comfy.mm.TOTAL_PINNED_MEMORY
    later = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, later), reference)
    report = later.offload_engine.runner.report()
    assert report.packed_bytes == 0 and report.waiting_bytes == 0
    comfy.mm.unload_all_models()


def block_bytes_of(model, index: int) -> int:
    """The bytes of the tiny Wan's block ``index`` as the engine streams them (every tensor of it)."""
    return sum(tensor.nbytes for tensor in model.model.diffusion_model.blocks[index].state_dict().values())


def hold_comfyuis_load_until(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch, ready) -> list[bool]:
    """Holds each weight ComfyUI's load moves to the device (``patch_weight_to_device`` with a device) until
    ``ready()``; the list says, for each weight, whether it was. After 10 s of waiting, no weight is held again."""
    load_weight = comfy.patcher.BlockOffloadPatcher.patch_weight_to_device
    held: list[bool] = []

    def loading(patcher, key, device_to=None, *args, **kwargs):
        if device_to is not None:
            deadline = time.monotonic() + (10 if all(held) else 0)
            while not ready() and time.monotonic() < deadline:
                time.sleep(0.005)
            held.append(ready())
        return load_weight(patcher, key, device_to, *args, **kwargs)

    monkeypatch.setattr(comfy.patcher.BlockOffloadPatcher, "patch_weight_to_device", loading)
    return held


@pytest.mark.parametrize(
    "loader",
    [
        "classic",
        pytest.param(
            "dynamic_vram",
            marks=pytest.mark.skipif(
                HOST_VERSION.startswith("0.3."), reason=f"ComfyUI {HOST_VERSION} has no Dynamic VRAM"
            ),
        ),
    ],
)
def test_the_streamed_blocks_are_pinned_while_comfyui_loads_the_resident_ones(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch, request, loader: str
) -> None:
    """The first step finds the streamed blocks pinned: the engine starts pinning them before ComfyUI loads the
    resident part, so the pinning (0.65 s for Flux's 11.87 GiB on the H100, registered in place) runs under that
    load (about 2 s there) instead of after it, beside the first step's copies from pageable memory. ComfyUI's
    load is held at each resident weight until every streamed block is pinned: on the order before (the engine
    started once the load had ended) nothing was, and the load went on after 10 s. A classic loader's blocks are
    pinned where they lie; a Dynamic VRAM model's (views of its file, 0.33's default) packed into pinned buffers."""
    if loader == "classic":
        model = wan(comfy)
        reference = sample(comfy, model)
        streamed = sum(block_bytes_of(model, index) for index in range(1, 1 + STREAMED))
    else:
        dynamic_vram, path = request.getfixturevalue("dynamic_vram"), request.getfixturevalue("stored_wan")["bf16"]
        reference = sample(comfy, dynamic_vram.load_classic(path, torch.bfloat16))
        # What its streamed blocks pin once packed, measured on a load of its own (unloaded after).
        probe = async_offload(comfy, dynamic_vram.load(path, torch.bfloat16), resident=1)
        sample(comfy, probe)
        probe.offload_engine.runner.finish_packing()
        streamed = cudart.pinned
        comfy.mm.unload_all_models()
        assert streamed > 0 and cudart.pinned == 0
        model = dynamic_vram.load(path, torch.bfloat16)
    held = hold_comfyuis_load_until(comfy, monkeypatch, lambda: cudart.pinned == streamed)
    patched = async_offload(comfy, model, resident=1)
    first_call: list[int] = []

    def note_pinned(*_: object) -> None:
        if not first_call:
            first_call.append(patched.offload_engine.runner.report().pinning_progress[0])

    hook = patched.model.diffusion_model.blocks[1].register_forward_pre_hook(note_pinned)
    assert torch.equal(sample(comfy, patched), reference)
    hook.remove()
    assert held and all(held), "ComfyUI loaded resident weights before the streamed blocks were pinned"
    assert first_call == [streamed] and cudart.pinned == streamed == comfy.mm.TOTAL_PINNED_MEMORY
    blocks = patched.offload_engine.runner.host.blocks.values()
    if loader == "classic":
        assert streamed == STREAMED * streamed_block_bytes(patched)
        assert all(state.pinned_in_place and state.host.numel() == 0 for state in blocks)
    else:
        assert all(state.pinned and not state.pinned_in_place and state.host.numel() > 0 for state in blocks)
    comfy.mm.unload_all_models()
    assert cudart.pinned == comfy.mm.TOTAL_PINNED_MEMORY == 0


def test_comfyuis_load_failing_while_the_blocks_pin_gives_every_pin_back(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """ComfyUI's load of the resident part fails after the streamed blocks were pinned. Out of device memory (a
    device too small for 2 resident blocks): the engine that pinned them stops, every registration undone and
    every reservation back in ComfyUI's books, and the fallback placement streams one more block, pinned anew,
    computing as the model. Another error raised by the load leaves nothing pinned, and the next prompt
    streams."""
    model = wan(comfy)
    reference = sample(comfy, model)
    one_resident = async_offload(comfy, model, resident=1)
    sample(comfy, one_resident)
    fits = one_resident.model.model_loaded_weight_memory + one_resident.offload_engine.placement.buffer_bytes
    comfy.mm.unload_all_models()
    start_engine = comfy.patcher.start_engine
    monkeypatch.setattr(comfy.patcher, "start_engine", limited(start_engine, fits))
    three_streamed = sum(block_bytes_of(model, index) for index in range(2, 5))
    held = hold_comfyuis_load_until(comfy, monkeypatch, lambda: cudart.pinned >= three_streamed)
    patched = async_offload(comfy, model, resident=2)
    with caplog.at_level(logging.WARNING):
        assert torch.equal(sample(comfy, patched), reference)
    assert held and all(held), "the blocks were not pinned while ComfyUI loaded the resident ones"
    assert any("Out of memory placing 2 resident blocks" in r.getMessage() for r in caplog.records)
    assert patched.offload_engine.plan.streamed == frozenset(range(1, 5))
    patched.offload_engine.runner.finish_packing()
    four_streamed = three_streamed + block_bytes_of(model, 1)
    assert cudart.pinned == four_streamed == comfy.mm.TOTAL_PINNED_MEMORY == comfy.pinned.PINNED_MEMORY.used
    comfy.mm.unload_all_models()
    assert cudart.pinned == comfy.mm.TOTAL_PINNED_MEMORY == comfy.pinned.PINNED_MEMORY.used == 0

    monkeypatch.setattr(comfy.patcher, "start_engine", start_engine)
    load_weight = comfy.patcher.BlockOffloadPatcher.patch_weight_to_device
    pinned_at_failure: list[int] = []

    def load_fails(patcher, key, device_to=None, *args, **kwargs):
        if device_to is not None:  # once the blocks are pinned
            deadline = time.monotonic() + 10
            while cudart.pinned < four_streamed and time.monotonic() < deadline:
                time.sleep(0.005)
            pinned_at_failure.append(cudart.pinned)
            raise RuntimeError("a weight ComfyUI could not load")
        return load_weight(patcher, key, device_to, *args, **kwargs)

    monkeypatch.setattr(comfy.patcher.BlockOffloadPatcher, "patch_weight_to_device", load_fails)
    patched = async_offload(comfy, model, resident=1)
    with pytest.raises(RuntimeError, match="could not load"):
        sample(comfy, patched)
    assert pinned_at_failure == [four_streamed] and patched.offload_engine is None
    assert cudart.pinned == comfy.mm.TOTAL_PINNED_MEMORY == comfy.pinned.PINNED_MEMORY.used == 0
    monkeypatch.setattr(comfy.patcher.BlockOffloadPatcher, "patch_weight_to_device", load_weight)
    assert torch.equal(sample(comfy, patched), reference)
    assert patched.offload_engine is not None and patched.offload_engine.plan.streamed == frozenset(range(1, 5))
    comfy.mm.unload_all_models()


def test_a_lora_added_while_pinning_runs_computes_as_comfyui_and_the_books_stay_true(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49's odd state: a prompt with a LoRA arrives while the plain prompt's blocks are still being pinned
    where they lie (two of four pinned, the packing thread held). It computes what ComfyUI computes with the
    LoRA, bitwise, at every mix of pinned and unpinned blocks; at every moment the driver's registrations are
    what the engine reports and within ComfyUI's books; once its pinning ends every streamed block is pinned
    once, and the plain prompt after it computes the plain model's output."""
    model = wan(comfy)
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))
    plain_reference = sample(comfy, model)
    lora_reference = sample(comfy, comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0])
    assert not torch.equal(plain_reference, lora_reference)
    gate = PackingGate(monkeypatch)
    patched = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, patched), plain_reference)
    block = streamed_block_bytes(patched)
    let_pin(gate, cudart, 2, block)

    def books_are_true(patcher) -> None:
        """ComfyUI's books hold what the driver has registered (the blocks pinned so far, and the LoRA adapters the
        engine streams with them, pinned at its start) and the reservations of the blocks still waiting, which
        nothing else may take meanwhile; the engine reports its blocks' progress."""
        pinned, total = patcher.offload_engine.runner.report().pinning_progress
        books = comfy.mm.TOTAL_PINNED_MEMORY
        assert total == STREAMED * block and pinned <= cudart.pinned, (pinned, total, cudart.pinned)
        assert books == cudart.pinned + total - pinned, (books, cudart.pinned, total, pinned)

    books_are_true(patched)
    registered, calls = dict(cudart.registered), cudart.calls
    with_lora = comfy.sd.load_lora_for_models(patched, None, lora, 1.0, 0)[0]
    assert torch.equal(sample(comfy, with_lora), lora_reference)  # two blocks pinned, two not
    books_are_true(with_lora)
    # The two blocks' pins taken over as they were: each call since registered something new, none refused.
    assert registered.items() <= cudart.registered.items() and cudart.failures == 0
    assert cudart.calls - calls == len(cudart.registered) - len(registered) > 0
    gate.let(4 * STREAMED)
    with_lora.offload_engine.runner.finish_packing()
    assert torch.equal(sample(comfy, with_lora), lora_reference)  # every block pinned
    books_are_true(with_lora)
    assert with_lora.offload_engine.runner.report().pinning_progress == (STREAMED * block, STREAMED * block)
    assert torch.equal(sample(comfy, patched), plain_reference)
    books_are_true(patched)
    comfy.mm.unload_all_models()
    assert cudart.pinned == comfy.mm.TOTAL_PINNED_MEMORY == 0


def test_comfyuis_own_pins_and_available_ram_leave_the_pack_less(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, patched), reference)
    block = streamed_block_bytes(patched)
    comfy.mm.unload_all_models()
    # ComfyUI has pinned all but 2.5 blocks' worth of its budget: the pack pins 2 blocks, the others are pageable.
    monkeypatch.setattr(comfy.mm, "TOTAL_PINNED_MEMORY", 64 * MIB - int(2.5 * block))
    assert torch.equal(sample(comfy, patched), reference)
    runner = patched.offload_engine.runner
    assert len(runner.report().refused_pinning) == 2 and cudart.pinned == 2 * block
    assert comfy.mm.TOTAL_PINNED_MEMORY <= comfy.mm.MAX_PINNED_MEMORY
    comfy.mm.unload_all_models()
    monkeypatch.setattr(comfy.mm, "TOTAL_PINNED_MEMORY", 0)
    # Available RAM below ComfyUI's headroom: nothing is pinned.
    monkeypatch.setattr(comfy.pinned, "ram_admits", lambda nbytes: False)
    assert torch.equal(sample(comfy, patched), reference)
    assert len(patched.offload_engine.runner.report().refused_pinning) == STREAMED and cudart.pinned == 0


def test_the_available_ram_check_is_comfyuis(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """0.33 asks its own ``ensure_pin_budget`` (which may unpin Dynamic VRAM buffers to pass); 0.3.75 has
    none, and the same 2 GiB headroom rule applies."""
    available = {"bytes": 10 * 2**30}
    # psutil is one module for ComfyUI and the pack: both read this.
    monkeypatch.setattr(
        comfy.pinned.psutil, "virtual_memory", lambda: SimpleNamespace(available=available["bytes"], total=2**36)
    )
    assert comfy.pinned.ram_admits(1 * 2**30)
    available["bytes"] = 2 * 2**30
    assert not comfy.pinned.ram_admits(1 * 2**30)


def test_a_failed_registration_is_cleared_and_the_blocks_stream_from_pageable_memory(
    comfy: SimpleNamespace, cudart: FakeCudart, caplog: pytest.LogCaptureFixture
) -> None:
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=1)
    cudart.fail = True
    with caplog.at_level(logging.INFO):
        assert torch.equal(sample(comfy, patched), reference)
        engine = patched.offload_engine
        engine.runner.finish_packing()
        patched.cleanup()  # as ComfyUI calls it after sampling: the engine tells what packing did
    # Asked for the first block's tensors where they lie, then for a buffer of its own, refused both times, each
    # error cleared; the driver is not asked again for this model's other blocks.
    assert cudart.failures == 2 and len(cudart.cleared) == 2
    # The refused buffers were filled before they were offered, and are kept as they are: one copy each.
    assert engine.runner.host.background.packed_bytes == STREAMED * streamed_block_bytes(patched)
    assert len(engine.runner.report().failed_pinning) == STREAMED and not engine.runner.report().refused_pinning
    assert comfy.pinned.PINNED_MEMORY.used == 0 and comfy.mm.TOTAL_PINNED_MEMORY == 0
    (notice,) = engine.notices
    assert notice.startswith(f"The driver refused to pin {STREAMED} of {STREAMED} streamed blocks")
    assert len([r for r in caplog.records if r.getMessage().endswith(notice)]) == 1  # logged once
    report = comfy.panel.snapshot()
    assert report["plan"] == engine.summary and notice in report["notices"]


def test_a_second_model_gets_half_of_a_budget_the_first_filled(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Wan 2.2's two experts: the first pins its 4 blocks, all the budget; the second gets 2, the first
    unpinning 2 of its own (they go on streaming, pageable). Both compute what they computed before."""
    first, second, reference, block = two_experts_in_one_experts_pins(comfy, monkeypatch)
    high, low = async_offload(comfy, first, resident=1), async_offload(comfy, second, resident=1)
    assert torch.equal(sample(comfy, high), reference)
    assert not high.offload_engine.runner.report().refused_pinning and cudart.pinned == STREAMED * block
    assert torch.equal(sample(comfy, low), reference)
    assert len(low.offload_engine.runner.report().refused_pinning) == STREAMED // 2
    assert len(high.offload_engine.runner.report().refused_pinning) == STREAMED // 2  # gave back its second half
    assert cudart.pinned == STREAMED * block == comfy.mm.TOTAL_PINNED_MEMORY
    assert torch.equal(sample(comfy, high), reference)


def test_a_clone_placing_otherwise_takes_over_what_an_earlier_clone_half_pinned(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49's odd state: a model whose blocks an earlier clone had partly pinned in place (two of its four
    streamed blocks, the packing thread held) streams through a clone that keeps one more block resident. The
    block now resident is unpinned (ComfyUI loads it), the other pinned one is taken over as it is, the rest are
    pinned by the new clone's engine; both clones compute the model's output."""
    model = wan(comfy)
    reference = sample(comfy, model)
    gate = PackingGate(monkeypatch)
    earlier = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, earlier), reference)
    block = streamed_block_bytes(earlier)
    let_pin(gate, cudart, 2, block)
    blocks = earlier.model.diffusion_model.blocks

    def registered(index: int) -> set[int]:
        storages = {tensor.untyped_storage().data_ptr() for tensor in blocks[index].state_dict().values()}
        return storages & cudart.registered.keys()

    pinned_first = [index for index in range(1, 5) if registered(index)]
    assert pinned_first == [1, 2], pinned_first  # in the order the steps call them
    kept = registered(2)
    later = async_offload(comfy, model, resident=2)  # block 1 resident from now on
    assert torch.equal(sample(comfy, later), reference)
    assert not registered(1) and registered(2) == kept
    gate.let(4 * STREAMED)
    later.offload_engine.runner.finish_packing()
    streamed = STREAMED - 1
    assert later.offload_engine.runner.report().pinning_progress == (streamed * block, streamed * block)
    assert cudart.pinned == streamed * block == comfy.mm.TOTAL_PINNED_MEMORY
    assert [index for index in range(1, 5) if registered(index)] == [2, 3, 4] and registered(2) == kept
    assert torch.equal(sample(comfy, later), reference) and torch.equal(sample(comfy, earlier), reference)


def test_two_experts_loading_at_once_share_the_budget_while_their_blocks_wait(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 49's odd state: Wan 2.2's second expert loads while none of the first's blocks is pinned yet (the
    packing thread held), in a pin budget that holds one expert's. The pins are never promised beyond the budget;
    once both threads end, each expert holds half, the driver holds what ComfyUI's books count, and both
    compute what the model computes at every step on the way."""
    first, second, reference, block = two_experts_in_one_experts_pins(comfy, monkeypatch)
    budget = STREAMED * block
    gate = PackingGate(monkeypatch)
    high, low = async_offload(comfy, first, resident=1), async_offload(comfy, second, resident=1)
    assert torch.equal(sample(comfy, high), reference)
    assert cudart.pinned == 0 and budget == comfy.mm.TOTAL_PINNED_MEMORY  # every block waiting, its pin reserved
    assert torch.equal(sample(comfy, low), reference)
    assert cudart.pinned == 0 and budget >= comfy.mm.TOTAL_PINNED_MEMORY
    gate.let(4 * STREAMED)
    for expert in (high, low):
        expert.offload_engine.runner.finish_packing()
    refused = [len(expert.offload_engine.runner.report().refused_pinning) for expert in (high, low)]
    assert refused == [STREAMED // 2, STREAMED // 2], refused
    assert cudart.pinned == comfy.mm.TOTAL_PINNED_MEMORY == budget
    assert torch.equal(sample(comfy, high), reference) and torch.equal(sample(comfy, low), reference)
    assert cudart.pinned == comfy.mm.TOTAL_PINNED_MEMORY == budget


def test_a_buffer_whose_filling_fails_keeps_nothing_reserved_or_registered(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host buffer is filled, then registered (the engine's own registrar, over a fake ``cudart``). A fill that
    raises (a block read from a file that changed under it) leaves nothing in the pin budget and nothing
    registered; the next buffer is filled, registered, and unregistered when its memory goes."""
    fake = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)

    def fail(host: torch.Tensor) -> None:
        raise FileChangedError("the checkpoint changed")

    use_host_registrar(CudaHostRegistrar())
    try:
        budget = PinnedMemoryBudget(MIB)
        memory = HostMemory(True, budget.share())
        with pytest.raises(FileChangedError):
            memory.buffer(4096, fail)
        assert budget.used == 0 and fake.registered == {}
        host, reserved, pageable_because = memory.buffer(4096, lambda host: host.fill_(7))
        assert (reserved, pageable_because, budget.used) == (4096, None, 4096) and bool((host == 7).all())
        assert fake.registered == {host.data_ptr(): 4096}
        del host
        assert fake.registered == {}
    finally:
        use_host_registrar(None)


def test_even_split_of_the_pin_budget() -> None:
    """The budget alone: a holder above an even split gives back what another asks, down to the split."""
    budget = PinnedMemoryBudget(100)
    given: list[int] = []

    class Holder:
        def give_back(self, nbytes: int) -> int:
            given.append(nbytes)
            first.release(nbytes)
            return nbytes

    holder = Holder()
    first = budget.share(holder.give_back)
    assert first.reserve(100)
    second = budget.share()
    assert second.reserve(30) and given == [30]
    assert second.reserve(20) and given == [30, 20] and first.nbytes == 50
    assert not second.reserve(1) and first.nbytes == 50  # the split reached: the rest stays the first's
    del holder  # a holder gone gives nothing back
    assert not second.reserve(1)


def test_disable_pinned_memory_pins_nothing_and_the_plan_line_says_why(
    comfy: SimpleNamespace, cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(comfy.pinned.args, "disable_pinned_memory", True)
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = async_offload(comfy, model, resident=1)
    with caplog.at_level(logging.INFO):
        assert torch.equal(sample(comfy, patched), reference)
    engine = patched.offload_engine
    assert cudart.pinned == 0 and not cudart.flags and engine.notices == []
    assert "from pinned memory" not in engine.summary
    assert "streamed from pageable memory: ComfyUI runs with --disable-pinned-memory; " in engine.summary
    assert "GiB pinned or packed in the background while the first steps run" in engine.summary
    assert "pinned 0.00 of" not in engine.summary  # nothing is to be pinned
    assert not [r for r in caplog.records if "Pinned memory cap" in r.getMessage()]


@pytest.mark.parametrize("device", ["mps", "privateuseone"])
def test_mps_and_directml_step_aside_and_say_why(comfy: SimpleNamespace, device: str) -> None:
    model = wan(comfy)
    model.load_device = torch.device(device)
    returned = async_offload(comfy, model, resident=1)
    assert returned is model
    (notice,) = comfy.panel.snapshot()["notices"]
    assert f"stepped aside; ComfyUI runs the model itself: on {device}, " in notice
    assert "ComfyUI's own loading" in notice


def test_a_torch_without_the_accelerator_functions_is_refused_before_any_work(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ComfyUI 0.33 runs on torch 2.7, whose torch.accelerator lacks the memory functions; its device modules
    have them. With neither, the node says what is missing instead of failing mid-prompt."""
    cuda = torch.device("cuda")
    assert device_module.unsupported_torch(cuda) is None
    monkeypatch.delattr(torch.accelerator, "memory_allocated")
    assert device_module.unsupported_torch(cuda) is None  # torch.cuda has it
    monkeypatch.delattr(torch.cuda, "memory_allocated")
    problem = device_module.unsupported_torch(cuda)
    assert problem is not None and "torch.accelerator.memory_allocated" in problem and torch.__version__ in problem
    model = wan(comfy)
    model.load_device = cuda
    with pytest.raises(ValueError, match="lacks torch.accelerator.memory_allocated for cuda"):
        async_offload(comfy, model, resident=1)


def test_highvram_s_unlimited_budget_leaves_the_automatic_budget_to_the_device(
    comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under --highvram ComfyUI loads in full whatever the device's size (``full_load``): Partial GPU Residency
    at 0 GiB must plan within what the device has, not keep every block."""
    model = wan(comfy)
    reference = sample(comfy, model)
    patched = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.0, policy="leading", prefetch_blocks=1, pin_memory=True
    ).result[0]
    assert torch.equal(sample(comfy, patched), reference)
    assert patched.offload_engine is None  # the CPU's RAM holds it all: every block resident
    comfy.mm.unload_all_models()
    weights = patched.model_size()
    # A device with room for 90 % of the weights beside ComfyUI's inference reserve.
    for_weights = int(0.9 * weights)
    room = comfy.mm.minimum_inference_memory() + for_weights

    def free_memory(device=None, torch_free_too=False):
        return (room, room) if torch_free_too else room

    monkeypatch.setattr(comfy.mm, "get_free_memory", free_memory)
    assert torch.equal(sample(comfy, patched), reference)
    plan = patched.offload_engine.plan
    assert 0 < len(plan.resident) < len(plan.block_bytes)
    assert patched.model.model_loaded_weight_memory + plan.slot_bytes <= for_weights


def test_a_cost_cache_that_cannot_be_written_costs_the_measurement_only(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """On Windows a reader holding the file makes the rename raise PermissionError, as an unload writes it."""
    cache = cost_cache.CostCache(tmp_path / "costs.json")

    def refused(*args: object) -> None:
        raise PermissionError(13, "The process cannot access the file because it is being used by another process")

    monkeypatch.setattr(cost_cache.os, "replace", refused)
    costs = planner.StackCosts.uniform(num_blocks=2, compute_ms=1.0, block_bytes=10, bandwidth_gbps=1.0)
    with caplog.at_level(logging.WARNING):
        cache.put("key", costs)
    assert cache.get("key") is None and list(tmp_path.iterdir()) == []
    assert "could not keep the measured costs" in caplog.text


def test_the_ring_is_checked_against_the_devices_free_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the driver's system-memory fallback an oversized ring would not fail, it would spill: the
    engine refuses it as out of memory, which the placement's fallback catches."""
    from harness.transformer_stack import transformer_stack

    model = transformer_stack(num_blocks=4, dim=32)
    streamer = stream_blocks(
        model.blocks,
        torch.device("cpu"),
        range(1, 4),
        StreamSpec(calls=CallOptions(root=model)),
    )
    streamer.enable()
    monkeypatch.setattr(ring, "free_device_bytes", lambda device: streamer.ring.capacity - 1)
    with pytest.raises(torch.OutOfMemoryError, match="spill into shared host memory"):
        streamer.allocate_device_buffers()
    monkeypatch.setattr(ring, "free_device_bytes", lambda device: streamer.ring.capacity)
    streamer.allocate_device_buffers()
    streamer.disable()
