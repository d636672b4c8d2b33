"""The engine's reliability mechanisms on their own: the out-of-memory fallback and the pinned-memory cap.

On the CPU the device limit is simulated (``device_limit_bytes``: the allocation raises
``torch.OutOfMemoryError`` as the allocator would) and pinning is refused by a budget of 0 bytes
before any pinning is tried. The CUDA variants use a real cap, ``torch.cuda.set_per_process_memory_fraction``,
and really pin; they skip without CUDA.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest
import torch

from harness.stack_offloader import BlockOffloader
from harness.transformer_stack import assert_same_tensors, snapshot, transformer_stack

from block_offload.offload import (
    CallOptions,
    HostOptions,
    OffloadPlan,
    PinnedMemoryBudget,
    ResidencyPolicy,
    RingOptions,
    StreamSpec,
    module_bytes,
    stream_blocks,
)
from block_offload.offload import streamer as streamer_module
from block_offload.offload.layout import BlockLayout

CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def forward(model: torch.nn.Module, x: torch.Tensor, steps: int = 2) -> torch.Tensor:
    with torch.inference_mode():
        for _ in range(steps):
            out = model(x)
    return out


@pytest.mark.parametrize(
    ("policy", "kept"),
    [
        (ResidencyPolicy.LEADING, [{0, 1, 2, 3}, {0, 1}, {0}]),
        (ResidencyPolicy.TRAILING, [{4, 5, 6, 7}, {6, 7}, {7}]),
        (ResidencyPolicy.STRIDED, [{1, 3, 5, 7}, {3, 7}, {7}]),
    ],
)
def test_fallback_halves_the_resident_set_by_its_policy_then_prefetch(
    policy: ResidencyPolicy, kept: list[set[int]]
) -> None:
    plan = OffloadPlan.build([10] * 8, resident_count=8, policy=policy, prefetch=2)
    chain = []
    while (plan := plan.fallback()) is not None:
        chain.append((set(plan.resident), plan.prefetch))
    assert chain == [(k, 2) for k in kept] + [(set(), 2), (set(), 1), (set(), 0)]


def test_fallback_of_a_plan_chosen_block_by_block_keeps_its_blocks_spread() -> None:
    plan = OffloadPlan((10,) * 8, frozenset({1, 2, 5, 7}), prefetch=0, policy=None)
    assert plan.fallback().resident == frozenset({2, 7})  # half of the chosen set, spread
    assert OffloadPlan((10,) * 8, frozenset(), prefetch=0).fallback() is None


def test_out_of_memory_falls_back_until_the_placement_fits() -> None:
    """A device with room for the model outside its blocks and 3.5 blocks: 8 resident blocks do not fit,
    nor 4, nor 2 (with the 2 stream buffers of prefetch 1): 1 does, and computes the same."""
    model = transformer_stack(num_blocks=8, dim=32)
    x = torch.randn(2, 5, 32)
    reference = forward(model, x)
    before = snapshot(model)
    block = module_bytes(model.blocks[0])
    outside = module_bytes(model) - module_bytes(model.blocks)
    offloader = BlockOffloader(model, model.blocks, CPU, device_limit_bytes=outside + 3 * block + block // 2)
    placed = offloader.apply(OffloadPlan.build(offloader.block_bytes(), resident_count=8, prefetch=1))
    assert [len(p.resident) for p in offloader.failed] == [8, 4, 2]
    assert placed.resident == frozenset({0}) and placed.prefetch == 1
    assert offloader.streamer.streamed == frozenset(range(1, 8))
    assert torch.equal(forward(model, x), reference)
    offloader.remove()
    assert_same_tensors(model, before, CPU)


def test_out_of_memory_with_nothing_left_to_stream_raises_and_restores() -> None:
    model = transformer_stack(num_blocks=3, dim=32)
    before = snapshot(model)
    outside = module_bytes(model) - module_bytes(model.blocks)
    offloader = BlockOffloader(model, model.blocks, CPU, device_limit_bytes=outside)  # not even one buffer
    with pytest.raises(torch.OutOfMemoryError, match="simulated device limit"):
        offloader.apply(OffloadPlan.build(offloader.block_bytes(), resident_count=2, prefetch=1))
    assert offloader.streamer is None and offloader.plan is None
    assert_same_tensors(model, before, CPU)
    # Still usable with a placement that fits.
    roomy = BlockOffloader(model, model.blocks, CPU)
    roomy.apply(OffloadPlan.build(roomy.block_bytes(), resident_count=1, prefetch=1))
    assert not roomy.failed
    roomy.remove()


def test_pinned_budget_counts_reservations_and_shares_return_what_they_hold() -> None:
    room = [100]
    budget = PinnedMemoryBudget(lambda: room[0])
    share = budget.share()
    assert share.reserve(60) and not share.reserve(50) and budget.used == 60
    room[0] = 50  # the host pinned memory of its own meanwhile
    assert not budget.reserve(1)
    share.release(20)
    assert budget.used == 40 and budget.reserve(10) and budget.used == 50
    budget.release(10)
    other = budget.share()
    assert other.reserve(5) and budget.used == 45
    del share  # a holder dropped without releasing (a model deleted mid-use)
    gc.collect()
    assert budget.used == 5
    assert PinnedMemoryBudget(None).reserve(10**15)


def test_a_spent_pin_budget_streams_from_pageable_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """With pinning possible but the budget spent, every block is refused before anything is pinned
    (on a machine without an accelerator, trying to pin would raise) and the output is unchanged."""
    monkeypatch.setattr(streamer_module, "can_pin_memory", lambda: True)
    model = transformer_stack(num_blocks=4, dim=32)
    x = torch.randn(1, 5, 32)
    reference = forward(model, x)
    budget = PinnedMemoryBudget(0)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(1, 4),
        StreamSpec(host=HostOptions(pin_budget=budget), ring=RingOptions(prefetch=1), calls=CallOptions(root=model)),
    )
    streamer.enable()
    block = BlockLayout.of(model.blocks[1]).nbytes
    assert streamer.report().refused_pinning == {1: block, 2: block, 3: block}
    assert torch.equal(forward(model, x), reference)
    streamer.disable()
    assert budget.used == 0


# -- CUDA: a real allocator cap, real pinning ----------------------------------------------------


@pytest.fixture
def capped_cuda() -> Iterator[torch.device]:
    """Restores the process's whole share of the GPU after a test that capped it."""
    torch.cuda.empty_cache()
    yield torch.device("cuda")
    torch.cuda.set_per_process_memory_fraction(1.0)
    torch.cuda.empty_cache()


def on_cuda_with_reference(num_blocks: int, dim: int, heads: int, tokens: int):
    """A stack on the host, an input on the GPU, and what the stack computes from it all resident."""
    model = transformer_stack(num_blocks=num_blocks, dim=dim, heads=heads)
    x = torch.randn(1, tokens, dim, device="cuda")
    model.cuda()
    reference = forward(model, x)
    model.cpu()
    torch.cuda.synchronize()
    return model, x, reference


@needs_cuda
def test_real_out_of_memory_on_cuda_falls_back(capped_cuda: torch.device) -> None:
    """8 blocks of ~50 MB; the cap leaves room for the embedding, the head, activations and about
    4 blocks: 8 resident blocks do not fit, the fallback does, and computes what the resident model does."""
    model, x, reference = on_cuda_with_reference(num_blocks=8, dim=1024, heads=8, tokens=64)
    torch.cuda.empty_cache()
    block = module_bytes(model.blocks[0])
    outside = module_bytes(model) - module_bytes(model.blocks)
    allowed = torch.cuda.memory_reserved() + outside + 4 * block + 64 * 2**20
    torch.cuda.set_per_process_memory_fraction(allowed / torch.cuda.get_device_properties(0).total_memory)
    offloader = BlockOffloader(model, model.blocks, capped_cuda)
    placed = offloader.apply(OffloadPlan.build(offloader.block_bytes(), resident_count=8, prefetch=1))
    assert offloader.failed and len(offloader.failed[0].resident) == 8
    assert len(placed.resident) < 8
    assert torch.equal(forward(model, x), reference)
    offloader.remove()
    torch.cuda.synchronize()
    assert all(t.device.type == "cpu" for t in model.state_dict().values())


@needs_cuda
def test_pin_budget_on_cuda_pins_what_fits_and_frees_it_all() -> None:
    cuda = torch.device("cuda")
    model, x, reference = on_cuda_with_reference(num_blocks=4, dim=256, heads=4, tokens=16)
    block = BlockLayout.of(model.blocks[0]).nbytes
    budget = PinnedMemoryBudget(2 * block)
    streamer = stream_blocks(
        model.blocks,
        cuda,
        range(4),
        StreamSpec(host=HostOptions(pin_budget=budget), ring=RingOptions(prefetch=1), calls=CallOptions(root=model)),
    )
    streamer.enable()
    model.embed.to(cuda)
    model.head.to(cuda)
    assert set(streamer.report().refused_pinning) == {2, 3} and budget.used == 2 * block
    assert all(p.is_pinned() for p in model.blocks[0].parameters())
    assert not any(p.is_pinned() for p in model.blocks[3].parameters())
    assert torch.equal(forward(model, x), reference)
    # The pinned buffers go back to torch's host allocator (which may keep them cached for reuse).
    pinned = [weakref.ref(streamer.host.blocks[i].host) for i in (0, 1)]
    streamer.disable()
    assert budget.used == 0 and streamer.report().host_bytes == 0
    assert [ref() for ref in pinned] == [None, None]
    assert not any(p.is_pinned() for p in model.parameters())
