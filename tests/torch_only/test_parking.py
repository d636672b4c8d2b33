"""Parking: a streamer that stops without restoring, and the next one on the same modules adopting its
host buffers, so a host that hands a model from engine to engine (ComfyUI: a new clone every prompt)
neither copies nor pins the streamed weights again: the engine, on the CPU (pinned ones need CUDA). The nodes
parking across prompts in a real ComfyUI: ``tests/test_parking_nodes.py``."""

from __future__ import annotations

import gc
import weakref
from dataclasses import replace

import pytest
import torch

from harness.parking import host_ptrs, lot_of
from harness.transformer_stack import forward_steps, transformer_stack

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    HostOptions,
    PinnedMemoryBudget,
    SequentialOptions,
    StreamSpec,
    stream_blocks,
    stream_modules,
)
from block_offload.offload.streamed_block import StreamedBlock

CPU = torch.device("cpu")


STREAMED = (1, 2, 3)


def streaming(model, device: torch.device = CPU, host: HostOptions | None = None) -> BlockStreamer:
    streamer = stream_blocks(
        model.blocks,
        device,
        STREAMED,
        StreamSpec(host=replace(host or HostOptions(), parking=lot_of(model)), calls=CallOptions(root=model)),
    )
    streamer.enable()
    return streamer


def test_parked_blocks_are_adopted_not_packed_again() -> None:
    model = transformer_stack()
    x = torch.randn(2, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    first = streaming(model)
    assert forward_steps(model, x)[-1].equal(reference)
    packed = host_ptrs(first)
    first.disable(park=True)
    # Parked: every streamed weight is a view of its block's host buffer, and the model runs from there.
    for index, buffer in packed.items():
        assert all(p.data_ptr() in buffer for p in model.blocks[index].parameters())
    assert forward_steps(model, x, steps=1)[0].equal(reference)
    second = streaming(model)
    assert host_ptrs(second) == packed  # the same buffers, taken over: no allocation, no pack
    assert forward_steps(model, x)[-1].equal(reference)
    second.disable()
    # Pageable, the buffers become the weights' own memory: stopping copies nothing, so holds nothing twice.
    for index, buffer in packed.items():
        assert all(p.data_ptr() in buffer for p in model.blocks[index].parameters())
    assert not second.host.blocks
    assert forward_steps(model, x, steps=1)[0].equal(reference)


def test_stopping_frees_each_host_buffer_before_the_next_block_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    """An unload must not hold the streamed bytes twice: when a block's pinned buffer is copied out, the host
    buffers of the blocks restored before it are gone already (its own and those of the blocks after it still
    live). The CPU cannot page-lock memory: the buffers are marked pinned, as a GPU's are, so they are copied."""
    model = transformer_stack()
    x = torch.randn(2, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    streamer = streaming(model)
    forward_steps(model, x)
    for index in STREAMED:
        streamer.host.blocks[index].pinned = True  # by index: a loop variable would keep the last block's buffer
    buffers = {index: weakref.ref(streamer.host.blocks[index].host.untyped_storage()) for index in STREAMED}
    alive_at_restore = []
    restore = StreamedBlock.restore

    def counting(self, device):
        alive_at_restore.append(sorted(index for index, buffer in buffers.items() if buffer() is not None))
        return restore(self, device)

    monkeypatch.setattr(StreamedBlock, "restore", counting)
    streamer.disable()
    assert alive_at_restore == [list(STREAMED[k:]) for k in range(len(STREAMED))]
    assert all(buffer() is None for buffer in buffers.values())
    assert forward_steps(model, x, steps=1)[0].equal(reference)


def test_a_block_changed_while_parked_is_packed_again() -> None:
    model = transformer_stack()
    x = torch.randn(2, 5, 32)
    first = streaming(model)
    packed = host_ptrs(first)
    first.disable(park=True)
    replaced = model.blocks[2].proj.weight
    replaced.data = replaced.data * 2  # what a weight patch does: a new tensor, not the parked view
    (reference,) = forward_steps(model, x, steps=1)
    second = streaming(model)
    adopted = host_ptrs(second)
    assert adopted[1] == packed[1] and adopted[3] == packed[3]
    assert adopted[2] != packed[2]
    assert forward_steps(model, x)[-1].equal(reference)
    second.disable()


def test_storage_dtype_parks_on_the_originals() -> None:
    """A rounded host copy must never replace the weights: parking points back at the originals, no copy."""
    model = transformer_stack()
    originals = {name: p.data for name, p in model.blocks[1].named_parameters()}
    streamer = streaming(model, host=HostOptions(storage_dtype=torch.bfloat16))
    streamer.disable(park=True)
    for name, p in model.blocks[1].named_parameters():
        assert p.data_ptr() == originals[name].data_ptr() and p.dtype == originals[name].dtype, name
    again = streaming(model, host=HostOptions(storage_dtype=torch.bfloat16))
    assert again.host.blocks[1].host.dtype == torch.uint8 and again.host.blocks[1].originals is not None
    again.disable()


def test_a_deleted_model_takes_its_parked_buffers_with_it() -> None:
    model = transformer_stack()
    streamer = streaming(model)
    storage = weakref.ref(streamer.host.blocks[1].host.untyped_storage())
    streamer.disable(park=True)
    del streamer
    gc.collect()
    assert storage() is not None  # the parked block's only storage
    del model
    gc.collect()
    assert storage() is None


def test_unpark_gives_the_weights_memory_of_their_own() -> None:
    model = transformer_stack()
    x = torch.randn(2, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    streamer = streaming(model)
    storage = weakref.ref(streamer.host.blocks[1].host.untyped_storage())
    streamer.disable(park=True)
    del streamer
    lot_of(model).unpark(model.modules())
    gc.collect()
    assert storage() is None
    assert forward_steps(model, x, steps=1)[0].equal(reference)


def test_sequential_offloader_parks_and_adopts() -> None:
    model = transformer_stack()
    x = torch.randn(2, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    first = stream_modules(model, CPU, StreamSpec(host=HostOptions(parking=lot_of(model))), SequentialOptions())
    first.enable()
    packed = host_ptrs(first)
    first.disable(park=True)
    second = stream_modules(model, CPU, StreamSpec(host=HostOptions(parking=lot_of(model))), SequentialOptions())
    second.enable()
    assert host_ptrs(second) == packed
    assert forward_steps(model, x)[-1].equal(reference)
    second.disable()


def test_a_parked_reservation_stays_counted_until_adopted_or_freed() -> None:
    """The budget's side of parking, on a real storage (the CPU cannot pin; the CUDA test pins)."""
    budget = PinnedMemoryBudget(100)
    share = budget.share()
    assert share.reserve(60)
    memory = torch.empty(60, dtype=torch.uint8).untyped_storage()
    parked = share.park(60, memory)
    del share
    assert budget.used == 60  # the first holder is gone, its buffer is not
    adopter = budget.share()
    assert adopter.adopt(parked) and budget.used == 60 and adopter.nbytes == 60
    assert not PinnedMemoryBudget().share().adopt(parked)  # taken once only
    adopter.release(60)
    other = budget.share()
    assert other.reserve(40)
    parked = other.park(40, memory)
    assert not PinnedMemoryBudget().share().adopt(parked)  # another budget never counted it
    del memory
    gc.collect()
    assert budget.used == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_pinned_buffers_are_adopted_without_a_second_reservation() -> None:
    cuda = torch.device("cuda")
    model = transformer_stack()
    x = torch.randn(2, 5, 32)
    # The reference on the same device: CUDA kernels need not match the CPU's bit for bit.
    (reference,) = forward_steps(model.to(cuda), x.to(cuda), steps=1)
    reference = reference.cpu()
    model.cpu()
    model.embed.to(cuda)
    model.head.to(cuda)
    for index in (0,):
        model.blocks[index].to(cuda)
    budget = PinnedMemoryBudget()
    first = streaming(model, cuda, HostOptions(pin_budget=budget))
    used = budget.used
    assert used == first.report().host_bytes > 0
    packed = host_ptrs(first)
    assert forward_steps(model, x.to(cuda))[-1].cpu().equal(reference)
    first.disable(park=True)
    del first
    gc.collect()
    assert budget.used == used
    second = streaming(model, cuda, HostOptions(pin_budget=budget))
    assert host_ptrs(second) == packed and budget.used == used and not second.report().refused_pinning
    assert forward_steps(model, x.to(cuda))[-1].cpu().equal(reference)
    second.disable(park=True)
    del second, model
    gc.collect()
    assert budget.used == 0
