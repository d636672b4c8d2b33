"""Streamed blocks pinned where their tensors lie (issue 49): a classic loader's weights are page-locked in place
in the background, as ComfyUI pins its own, instead of copied into fresh pinned buffers, so nothing is copied or
held twice; parking keeps them registered for the next prompt, and every way out unregisters them.

CUDA's runtime is faked behind the engine's real registrar (``harness/fake_cudart.py``): it refuses a range that
is registered already, as the driver does."""

from __future__ import annotations

import gc
import os

import torch

from harness.fake_cudart import FakeCudart
from harness.host_memory import peak_during
from harness.parking import lot_of
from harness.transformer_stack import assert_same_tensors, forward_steps, snapshot, transformer_stack

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    HostOptions,
    ParkingLot,
    PinnedMemoryBudget,
    RingOptions,
    StreamSpec,
    stream_blocks,
)

CPU = torch.device("cpu")
BLOCKS = 6


def _storages(module: torch.nn.Module) -> dict[int, int]:
    """The storages under ``module``'s tensors: address, bytes."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in module.state_dict().values()}


def _started(model: torch.nn.Module, budget: PinnedMemoryBudget, parking: ParkingLot | None = None) -> BlockStreamer:
    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(BLOCKS),
        StreamSpec(
            host=HostOptions(pack_in_background=True, pin_budget=budget, parking=parking), calls=CallOptions(root=model)
        ),
    )
    streamer.enable()
    streamer.finish_packing()
    return streamer


def _pinned_in_place_growth(cudart: FakeCudart) -> tuple[int, int]:
    """RssAnon's growth at its peak (sampled) over a streamer's start, its pinning in place (the model stepping
    meanwhile, bitwise) and a step after, for 8 blocks of about 50 MB; and the ring's bytes (host memory on the
    CPU). Checks every block was pinned where it lies and every registration undone at the end."""
    model = transformer_stack(num_blocks=8, dim=1024, heads=8)
    x = torch.randn(1, 4, 1024)
    reference = forward_steps(model, x, steps=1)[0]
    budget = PinnedMemoryBudget()
    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(8),
        StreamSpec(
            host=HostOptions(pack_in_background=True, pin_budget=budget),
            ring=RingOptions(prefetch=1),
            calls=CallOptions(root=model),
        ),
    )
    gc.collect()
    with peak_during(os.getpid()) as peak:
        streamer.enable()
        while streamer.host.background.running:
            assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
        streamer.finish_packing()
        assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    ring = streamer.ring.capacity
    assert all(state.pinned_in_place and state.host.numel() == 0 for state in streamer.host.blocks.values())
    assert (
        streamer.host.buffer_bytes == 0
        and streamer.host.background.packed_bytes == streamer.host.background.total_bytes > 0
    )
    storages = _storages(model.blocks)
    assert (
        cudart.registered == storages and budget.used == sum(storages.values()) == streamer.report().pinning_progress[0]
    )
    streamer.disable()
    assert cudart.registered == {} and budget.used == 0
    return peak.anon_growth, ring


def test_pinning_in_place_copies_nothing_and_holds_nothing_twice(cudart: FakeCudart) -> None:
    """The peak grows by the ring alone (two blocks with prefetch 1), where packing in the background grew by
    a block and more (the buffer being filled; measured 140 MiB against this test's 96 MiB) and a second copy
    of the weights would be 8 blocks (400 MB)."""
    _pinned_in_place_growth(cudart)  # a process's first streamer makes allocations of its own once (threads, arenas)
    growth, ring = _pinned_in_place_growth(cudart)
    assert growth <= ring + 16 * 2**20, (growth / 2**20, ring / 2**20)


def test_tensors_another_holder_pinned_are_packed_into_a_pinned_buffer_of_their_own(cudart: FakeCudart) -> None:
    """ComfyUI (or another pack) registered a weight of block 2 itself: the driver refuses it again, so that block
    is packed into a buffer of its own and pinned there; the others are pinned in place; the other holder's
    registration is left as it is."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64)
    x = torch.randn(2, 9, 64)
    reference = forward_steps(model, x, steps=1)[0]
    before = snapshot(model)
    theirs = model.blocks[2].qkv.weight
    pointer, nbytes = theirs.data_ptr(), theirs.nbytes
    assert cudart.cudaHostRegister(pointer, nbytes, 1) == 0
    budget = PinnedMemoryBudget()
    streamer = _started(model, budget)
    blocks = streamer.host.blocks
    assert [index for index, state in blocks.items() if not state.pinned_in_place] == [2]
    assert blocks[2].pinned and blocks[2].host.numel() > 0 and cudart.failures == 1
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()
    assert cudart.registered == {pointer: nbytes} and budget.used == 0
    assert_same_tensors(model, before, CPU)


def test_blocks_parked_in_place_stay_registered_until_the_hosts_unload(cudart: FakeCudart) -> None:
    """A prompt's end parks the blocks as they are (registered, counted); the next streamer takes them over without
    registering anything; the host's real unload (``ParkingLot.unpark``) unregisters them and gives their bytes
    back, the tensors untouched."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64)
    x = torch.randn(2, 9, 64)
    reference = forward_steps(model, x, steps=1)[0]
    before = snapshot(model)
    budget, lot = PinnedMemoryBudget(), lot_of(model)
    first = _started(model, budget, parking=lot)
    registered, calls, used = dict(cudart.registered), cudart.calls, budget.used
    first.disable(park=True)
    assert cudart.registered == registered == _storages(model.blocks) and budget.used == used > 0
    second = _started(model, budget, parking=lot)
    assert cudart.calls == calls and all(state.pinned_in_place for state in second.host.blocks.values())
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    second.disable(park=True)
    lot.unpark(model.blocks)
    assert cudart.registered == {} and budget.used == 0
    assert_same_tensors(model, before, CPU)
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)


def test_a_weight_replaced_while_parked_is_pinned_anew_and_the_old_one_unpinned(cudart: FakeCudart) -> None:
    """A host replaces a parked block's weight (a LoRA patched into a new tensor): its parked registrations are
    undone, not adopted, and its tensors as they are now are pinned in place."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64)
    x = torch.randn(2, 9, 64)
    budget, lot = PinnedMemoryBudget(), lot_of(model)
    _started(model, budget, parking=lot).disable(park=True)
    old = model.blocks[1].mlp[0].weight
    with torch.no_grad():
        model.blocks[1].mlp[0].weight = torch.nn.Parameter(old * 0.5, requires_grad=False)
    reference = forward_steps(model, x, steps=1)[0]
    second = _started(model, budget, parking=lot)
    assert old.data_ptr() not in cudart.registered and cudart.registered == _storages(model.blocks)
    assert budget.used == sum(cudart.registered.values())
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    second.disable()
    assert cudart.registered == {} and budget.used == 0


def test_a_weight_freed_while_parked_leaves_none_of_its_blocks_tensors_registered(cudart: FakeCudart) -> None:
    """A host replaces a parked block's weight and frees the old one (ComfyUI putting a LoRA's backup back): that
    storage's registration goes with it, and the block's other tensors, parked registered where they lie, are
    unregistered when the parked block is let go, not left page-locked and uncounted (the driver would refuse them
    again, and the block be copied into a buffer of its own, its page-locked tensors freed under copies still
    reading them on a GPU); the next streamer pins the block in place as it is now, and its end leaves nothing
    registered or counted."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64)
    x = torch.randn(2, 9, 64)
    budget, lot = PinnedMemoryBudget(), lot_of(model)
    _started(model, budget, parking=lot).disable(park=True)
    block = model.blocks[1]
    with torch.no_grad():
        block.mlp[0].weight = torch.nn.Parameter(block.mlp[0].weight * 0.5, requires_grad=False)
    gc.collect()  # the old weight freed: its registration undone as it went
    reference = forward_steps(model, x, steps=1)[0]
    second = _started(model, budget, parking=lot)
    assert cudart.failures == 0 and second.host.blocks[1].pinned_in_place, "block 1 was refused and packed"
    assert cudart.registered == _storages(model.blocks) and budget.used == sum(cudart.registered.values())
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    second.disable()
    assert cudart.registered == {} and budget.used == 0


def test_giving_pins_back_unpins_blocks_in_place_and_they_stream_on(cudart: FakeCudart) -> None:
    """Another model asks for pinned memory: blocks pinned in place are unregistered, last first, and go on
    streaming from the same tensors, pageable."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64)
    x = torch.randn(2, 9, 64)
    reference = forward_steps(model, x, steps=1)[0]
    budget = PinnedMemoryBudget()
    streamer = _started(model, budget)
    last = streamer.host.blocks[BLOCKS - 1].pinned_bytes
    assert streamer.give_back_pinned(1) == last
    assert sorted(streamer.report().refused_pinning) == [BLOCKS - 1] and budget.used == cudart.pinned
    assert not (_storages(model.blocks[BLOCKS - 1]).keys() & cudart.registered.keys())
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()
    assert cudart.registered == {} and budget.used == 0


def test_blocks_that_get_no_pins_stream_from_their_own_tensors_uncopied(cudart: FakeCudart) -> None:
    """A pin budget spent (here: none at all) leaves the blocks pageable: they stream from the loader's tensors as
    they are, neither registered nor copied into buffers that would gain nothing, and the plan says why."""
    model = transformer_stack(num_blocks=BLOCKS, dim=64)
    x = torch.randn(2, 9, 64)
    reference = forward_steps(model, x, steps=1)[0]
    before = {name: tensor.data_ptr() for name, tensor in model.state_dict().items()}
    budget = PinnedMemoryBudget(0)
    streamer = _started(model, budget)
    assert all(
        state.in_place and not state.pinned and state.host.numel() == 0 for state in streamer.host.blocks.values()
    )
    assert sorted(streamer.report().refused_pinning) == list(range(BLOCKS)) and cudart.calls == 0 and budget.used == 0
    assert streamer.host.buffer_bytes == 0 and streamer.report().waiting_bytes == 0
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()
    assert {name: tensor.data_ptr() for name, tensor in model.state_dict().items()} == before
