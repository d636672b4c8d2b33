"""Packing in the background (``HostOptions(pack_in_background=True)``, what the nodes use): the first step
runs before any block is packed, each step is bitwise whatever mix of packed and waiting blocks it copies, and
stopping, parking, a refused registration or a changed file mid-packing leave nothing behind.

The packing thread is held at a gate (``harness/packing_gate.py``) so each test decides how far packing has got;
CUDA's runtime is faked behind the engine's real registrar (``harness/fake_cudart.py``)."""

from __future__ import annotations

import gc
import os
import threading
import time
import weakref
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from harness.fake_cudart import FakeCudart
from harness.host_memory import peak_during
from harness.mapped_file import MappedFile
from harness.packing_gate import PackingGate
from harness.parking import lot_of
from harness.stream_spies import EventSpy
from harness.transformer_stack import assert_same_tensors, forward_steps, snapshot, transformer_stack

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    FileChangedError,
    FileOptions,
    HostOptions,
    PinnedMemoryBudget,
    RingOptions,
    StreamSpec,
    TimelineRecorder,
    stream_blocks,
)
from block_offload.offload.timeline import BlockSpan, StepTimeline

CPU = torch.device("cpu")
BLOCKS = 6


def _waiting(streamer: BlockStreamer) -> list[int]:
    return sorted(index for index, state in streamer.host.blocks.items() if state.waiting)


def _wait_for(streamer: BlockStreamer, waiting: int) -> None:
    deadline = time.monotonic() + 60
    while len(_waiting(streamer)) > waiting:
        assert time.monotonic() < deadline, f"still {len(_waiting(streamer))} blocks waiting"
        time.sleep(0.005)


def _stack(dim: int = 32, tokens: int = 5, batch: int = 1) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """A stack of ``BLOCKS`` blocks, an input, and the stack's output for it, resident."""
    model = transformer_stack(num_blocks=BLOCKS, dim=dim)
    x = torch.randn(batch, tokens, dim)
    return model, x, forward_steps(model, x, steps=1)[0]


def _streamer(
    model,
    host: HostOptions | None = None,
    ring: RingOptions | None = None,
    files: FileOptions | None = None,
    recorder: TimelineRecorder | None = None,
) -> BlockStreamer:
    return stream_blocks(
        model.blocks,
        CPU,
        range(BLOCKS),
        StreamSpec(
            host=replace(host or HostOptions(), pack_in_background=True),
            ring=ring or RingOptions(),
            files=files or FileOptions(),
            calls=CallOptions(root=model),
            recorder=recorder,
        ),
    )


def _pinned_where_it_lies(streamer: BlockStreamer, cudart: FakeCudart, index: int) -> bool:
    """Block ``index`` streams from its own tensors, each one's storage registered with the driver, and has no
    host buffer of its own."""
    state = streamer.host.blocks[index]
    storages = {t.untyped_storage().data_ptr() for t in streamer.blocks[index].parameters()}
    return (
        state.pinned
        and bool(state.pinned_in_place)
        and state.host.numel() == 0
        and storages <= cudart.registered.keys()
    )


def _packing_threads() -> list[threading.Thread]:
    return [thread for thread in threading.enumerate() if thread.name == "block-offload-pack"]


def test_the_first_step_runs_before_any_block_is_packed_and_every_mix_is_bitwise(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack(dim=64, tokens=9, batch=2)
    before = snapshot(model)
    budget = PinnedMemoryBudget()
    recorder = TimelineRecorder(CPU)
    streamer = _streamer(model, HostOptions(pin_budget=budget), RingOptions(prefetch=1), recorder=recorder)
    streamer.enable()
    # Nothing packed, nothing pinned, yet the whole first step runs, every block copied from the model's tensors.
    assert _waiting(streamer) == list(range(BLOCKS)) and streamer.report().packed_bytes == 0 and cudart.pinned == 0
    total = streamer.report().waiting_bytes
    assert streamer.report().pinning_progress == (0, total) and budget.used == total  # reserved as it began
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    first = recorder.latest()
    assert len(first.spans) == BLOCKS and first.unpacked_bytes == first.bytes_copied > 0
    assert first.packed_bandwidth_gbps is None  # nothing for the planner to learn the later steps' copies from
    for packed in (1, 4, BLOCKS):  # steps that copy some blocks from host buffers, some from where they were
        gate.let(packed - (BLOCKS - len(_waiting(streamer))))
        _wait_for(streamer, BLOCKS - packed)
        assert torch.equal(forward_steps(model, x, steps=1)[0], reference), packed
    streamer.finish_packing()
    assert not streamer.host.background.running and streamer.report().waiting_bytes == 0 and not _packing_threads()
    assert streamer.report().pinning_progress == (total, total) and cudart.pinned == total == budget.used
    assert streamer.report().packed_bytes == 0 and streamer.host.background.packed_bytes == total
    assert all(_pinned_where_it_lies(streamer, cudart, index) for index in range(BLOCKS))
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    assert recorder.latest().unpacked_bytes == 0 and recorder.latest().packed_bandwidth_gbps is not None
    streamer.disable()
    assert cudart.registered == {} and budget.used == 0
    assert_same_tensors(model, before, CPU)


def test_a_registration_refused_halfway_leaves_the_rest_pageable(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack()
    budget = PinnedMemoryBudget()
    streamer = _streamer(model, HostOptions(pin_budget=budget))
    streamer.enable()
    gate.let(1)
    _wait_for(streamer, BLOCKS - 1)
    first = cudart.pinned  # block 0's tensors, registered where they lie
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in model.blocks[0].state_dict().values()
    }
    assert first == sum(storages.values()) and storages.keys() == cudart.registered.keys()
    cudart.fail = True
    gate.let(BLOCKS)
    streamer.finish_packing()
    # Asked for the next block's tensors where they lie, then for a buffer of its own, refused both times, and
    # not asked again: the rest are packed pageable and stream from there.
    assert cudart.failures == 2 and cudart.pinned == first == budget.used
    assert sorted(streamer.report().failed_pinning) == list(range(1, BLOCKS)) and not streamer.report().refused_pinning
    assert streamer.report().pinning_progress == (first, first)
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()
    assert budget.used == 0


def test_a_block_refused_halfway_is_unregistered_only_while_no_copy_from_it_can_be_issued(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The driver registers a block's first tensor where it lies and refuses the next: a copy from the first issued
    meanwhile runs asynchronously on a GPU (page-locked memory), so the first is unregistered under the lock the
    copies from the block are issued under, and the block is packed instead; every step stays bitwise."""
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack()
    budget = PinnedMemoryBudget()
    streamer = _streamer(model, HostOptions(pin_budget=budget))
    register, unregister = cudart.cudaHostRegister, cudart.cudaHostUnregister
    held_at_unregister: list[bool] = []

    def refuse_the_second(pointer: int, nbytes: int, flags: int) -> int:
        cudart.fail = cudart.calls == 1
        return register(pointer, nbytes, flags)

    def noting_the_lock(pointer: int) -> int:
        held_at_unregister.append(streamer.host.lock.locked())
        return unregister(pointer)

    monkeypatch.setattr(cudart, "cudaHostRegister", refuse_the_second)
    monkeypatch.setattr(cudart, "cudaHostUnregister", noting_the_lock)
    streamer.enable()
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    gate.let(BLOCKS)
    streamer.finish_packing()
    assert cudart.failures == 1 and held_at_unregister == [True]  # block 0's first tensor, under the lock
    first = streamer.host.blocks[0]
    assert not first.pinned_in_place and first.pinned and first.host.numel() > 0  # packed into a buffer of its own
    del first
    assert all(_pinned_where_it_lies(streamer, cudart, index) for index in range(1, BLOCKS))
    assert cudart.pinned == budget.used
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()
    assert cudart.registered == {} and budget.used == 0


def test_tensors_another_holder_pinned_are_not_registered_again(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A weight page-locked already (ComfyUI pinning the same model's weights): the driver would refuse a second
    registration, and may leave an error for a later kernel launch as it does, so the block is packed into a
    buffer of its own without its tensors being offered to the driver."""
    model, x, reference = _stack()
    block = {t.untyped_storage().data_ptr() for t in model.blocks[2].state_dict().values()}
    foreign = {next(model.blocks[2].parameters()).untyped_storage().data_ptr()}
    is_pinned = torch.Tensor.is_pinned
    monkeypatch.setattr(torch.Tensor, "is_pinned", lambda self, *a: self.data_ptr() in foreign or is_pinned(self, *a))
    offered: list[int] = []
    register = cudart.cudaHostRegister

    def noting(pointer: int, nbytes: int, flags: int) -> int:
        offered.append(pointer)
        return register(pointer, nbytes, flags)

    monkeypatch.setattr(cudart, "cudaHostRegister", noting)
    streamer = _streamer(model, HostOptions(pin_budget=PinnedMemoryBudget()))
    streamer.enable()
    streamer.finish_packing()
    state = streamer.host.blocks[2]
    assert cudart.failures == 0 and not block & set(offered), "a tensor pinned by another was offered again"
    assert not state.pinned_in_place and state.pinned and state.host.data_ptr() in cudart.registered
    del state
    assert all(_pinned_where_it_lies(streamer, cudart, index) for index in (0, 1, 3, 4, 5))
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()
    assert cudart.registered == {}


def test_the_event_the_hand_over_waits_for_covers_every_copy_from_a_blocks_sources(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block copied from its sources (the loader's tensors) while it waits to be packed: the packing thread, once
    it has handed the block over, waits for the block's ready event before it frees the sources. That event is
    recorded before the hand-over lock is let go, right after the copies, so no hand-over falls between a copy and
    the record that covers it (on a GPU a copy from page-locked sources still reads them after it returns)."""
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack()
    streamer = _streamer(model, HostOptions(pin_budget=PinnedMemoryBudget()))
    streamer.enable()
    spies = {index: EventSpy(streamer.host.lock) for index in range(BLOCKS)}
    for index, spy in spies.items():
        streamer.host.blocks[index].ready = spy  # type: ignore[assignment]  # the CPU's copies have no events
    assert _waiting(streamer) == list(range(BLOCKS))
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    assert all(spy.records and spy.records[0] for spy in spies.values()), {i: s.records for i, s in spies.items()}
    gate.let(BLOCKS)
    streamer.finish_packing()
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()


def test_a_packed_blocks_sources_are_freed_only_once_the_copies_from_them_are_done(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A block packed into a buffer of its own (the driver refused its tensors in place, and is not asked again:
    the others stay where they lie, pageable) was copied from its sources while it waited; the packing thread hands
    it over, waits for its ready event (on a GPU, a copy from page-locked sources still reads them after it
    returns), and only then lets the sources go: freed then, so the weights are not held twice either."""
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack()
    streamer = _streamer(model, HostOptions(pin_budget=PinnedMemoryBudget()))
    freed: list[int] = []
    for index, block in enumerate(model.blocks):
        for tensor in block.state_dict().values():
            weakref.finalize(tensor.untyped_storage(), freed.append, index)
    streamer.enable()
    spies = {index: EventSpy(streamer.host.lock, lambda index=index: freed.count(index)) for index in range(BLOCKS)}
    for index, spy in spies.items():
        streamer.host.blocks[index].ready = spy  # type: ignore[assignment]  # the CPU's copies have no events
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)  # every block copied from its sources
    cudart.fail = True
    gate.let(BLOCKS)
    streamer.finish_packing()
    gc.collect()
    assert [index for index, state in streamer.host.blocks.items() if not state.in_place] == [0]
    assert spies[0].synchronized == [0], "block 0's sources were freed before the copies from them were done"
    assert set(freed) == {0}, "block 0's sources are still held beside its buffer"
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()


def test_stopping_while_packing_gives_every_pin_back_and_restores_the_model(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ComfyUI unloading the model (or ``/free``) while the thread packs: it stops at its next copy, the block
    it was packing is dropped, every registration is undone and the budget is whole again."""
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack()
    before = snapshot(model)
    budget = PinnedMemoryBudget()
    streamer = _streamer(model, HostOptions(pin_budget=budget))
    streamer.enable()
    gate.let(2)
    _wait_for(streamer, BLOCKS - 2)
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    streamer.disable()
    assert not _packing_threads() and cudart.registered == {} and budget.used == 0
    assert_same_tensors(model, before, CPU)
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)


def test_a_prompt_interrupted_while_packing_hands_its_packed_blocks_to_the_next(
    cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parking mid-pinning (the next prompt's clone takes the model over): the blocks pinned where they lie stay
    pinned, parked, the others keep their own tensors; the next streamer adopts the first as they are (not
    registered again) and pins the rest."""
    gate = PackingGate(monkeypatch)
    model, x, reference = _stack()
    budget = PinnedMemoryBudget()
    lot = lot_of(model)
    first = _streamer(model, HostOptions(pin_budget=budget, parking=lot))
    first.enable()
    gate.let(2)
    _wait_for(first, BLOCKS - 2)
    packed = [index for index in range(BLOCKS) if index not in _waiting(first)]
    assert all(_pinned_where_it_lies(first, cudart, index) for index in packed)
    registered, calls = dict(cudart.registered), cudart.calls
    first.disable(park=True)
    assert len(packed) == 2 and cudart.registered == registered and cudart.pinned == budget.used  # parked, pinned
    second = _streamer(model, HostOptions(pin_budget=budget, parking=lot))
    second.enable()
    assert all(_pinned_where_it_lies(second, cudart, index) for index in packed)
    assert cudart.calls == calls and cudart.registered == registered  # taken over as they are
    assert _waiting(second) == sorted(set(range(BLOCKS)) - set(packed))
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    gate.let(BLOCKS)
    second.finish_packing()
    assert second.report().waiting_bytes == 0 and cudart.pinned == budget.used == second.report().pinning_progress[1]
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    second.disable()
    assert budget.used == 0 and cudart.registered == {}


def test_a_file_changed_under_waiting_blocks_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks still waiting are copied from their file's mapping: a file truncated meanwhile is named at the next
    step, before any copy reads a page that is gone."""
    PackingGate(monkeypatch)  # held: every block still waits
    model = transformer_stack(num_blocks=BLOCKS, dim=32)
    mapped = MappedFile(transformer_stack(num_blocks=BLOCKS, dim=32), tmp_path / "stack.safetensors", torch.float32)
    x = torch.randn(1, 5, 32)
    streamer = _streamer(
        mapped.module, HostOptions(parking=lot_of(mapped.module)), files=FileOptions(file_slice=mapped.file_slice)
    )
    streamer.enable()
    assert torch.equal(forward_steps(mapped.module, x, steps=1)[0], forward_steps(model, x, steps=1)[0])
    streamer.release_device_buffers()
    with open(mapped.path, "r+b") as file:
        file.truncate(os.path.getsize(mapped.path) // 2)
    with pytest.raises(FileChangedError, match=r"stack.safetensors changed while .*load the model again"):
        forward_steps(mapped.module, x, steps=1)
    streamer.close_open_step()
    streamer.disable()
    assert not streamer.enabled and not _packing_threads()


def _anon_growth(background: bool) -> tuple[int, int]:
    """RssAnon's growth at its peak (sampled) over a streamer's start, its packing (the model stepping meanwhile)
    and a step after, for 8 blocks of about 50 MB; and the largest block's bytes."""
    model = transformer_stack(num_blocks=8, dim=1024, heads=8)
    x = torch.randn(1, 4, 1024)
    block = max(sum(p.numel() * p.element_size() for p in b.parameters()) for b in model.blocks)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(8),
        StreamSpec(
            host=HostOptions(pack_in_background=background), ring=RingOptions(prefetch=1), calls=CallOptions(root=model)
        ),
    )
    gc.collect()
    with peak_during(os.getpid()) as peak:
        streamer.enable()
        while streamer.host.background.running:
            forward_steps(model, x, steps=1)
        streamer.finish_packing()
        forward_steps(model, x, steps=1)
    assert (
        streamer.report().waiting_bytes == 0
        and streamer.report().packed_bytes + streamer.host.background.packed_bytes >= 8 * block
    )
    streamer.disable()
    return peak.anon_growth, block


def test_packing_in_the_background_never_holds_a_second_copy() -> None:
    """Beside packing before the first step (what the engine did before), the peak grows by at most the one block
    being packed: on the CPU the ring is host memory too, and now it is allocated while that block is packed.
    A second copy of the streamed weights would be 8 blocks more."""
    _anon_growth(True)  # the packing thread's first allocations (its malloc arena) are made once per process
    before, block = _anon_growth(False)
    growth, _ = _anon_growth(True)
    assert growth <= before + block + 16 * 2**20, (growth / 2**20, before / 2**20, block / 2**20)


def test_the_planner_learns_the_bandwidth_of_packed_copies_only() -> None:
    """An automatic placement learns the copy bandwidth of the steps to come: a step's copies from blocks still
    waiting to be packed (part by part, pageable) are left out of it, and a step that copied nothing else
    teaches none (``nodes/placement.py`` then waits for a later step)."""
    spans = (
        BlockSpan(0, 2.0, 3.0, 0.0, copy_start=0.0, copy_end=2.0, bytes_copied=2_000_000),  # from its sources
        BlockSpan(1, 3.0, 4.0, 0.0, copy_start=1.0, copy_end=1.5, bytes_copied=1_000_000),  # from its host buffer
    )
    step = StepTimeline(0, 5.0, spans, unpacked_bytes=2_000_000, unpacked_copy_ms=2.0)
    assert step.bandwidth_gbps == pytest.approx(1.2)  # 3 MB in 2.5 ms
    assert step.packed_bandwidth_gbps == pytest.approx(2.0)  # 1 MB in 0.5 ms
    waiting_only = StepTimeline(0, 5.0, spans, unpacked_bytes=3_000_000, unpacked_copy_ms=2.5)
    assert waiting_only.packed_bandwidth_gbps is None
