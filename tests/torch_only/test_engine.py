"""The offload engine on the CPU: identical outputs, exact restore, recovery, no second copy in RAM."""

from __future__ import annotations

import functools
import gc
import itertools
import json
import os
from collections.abc import Callable

import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from harness.host_memory import status_bytes
from harness.stack_offloader import BlockOffloader
from harness.stream_spies import StreamSpy
from harness.transformer_stack import assert_same_tensors, forward_steps, fp8_stack, snapshot, transformer_stack

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    FileOptions,
    HostOptions,
    ModuleState,
    OffloadPlan,
    ResidencyPolicy,
    RingOptions,
    SequentialOffloader,
    SequentialOptions,
    StreamSpec,
    TimelineRecorder,
    buffer_bytes,
    module_bytes,
    release_freed_host_memory,
    stream_blocks,
    stream_modules,
    streamed_modules,
)
from block_offload.offload.layout import ALIGNMENT, BlockLayout, aligned

CPU = torch.device("cpu")


@pytest.mark.parametrize("dim", [32, 64])
def test_every_plan_gives_bitwise_identical_output(dim: int) -> None:
    model = transformer_stack(num_blocks=4, dim=dim)
    x = torch.randn(2, 9, dim)
    (reference,) = forward_steps(model, x, steps=1)
    offloader = BlockOffloader(model, model.blocks, CPU)
    sizes = offloader.block_bytes()
    for prefetch, resident, policy in itertools.product(range(0, 4), range(0, 5), ResidencyPolicy):
        plan = OffloadPlan.build(sizes, resident_count=resident, policy=policy, prefetch=prefetch)
        offloader.apply(plan)
        for out in forward_steps(model, x, steps=3):
            assert torch.equal(out, reference), (prefetch, resident, policy)
    offloader.remove()


def test_remove_restores_every_tensor_bitwise() -> None:
    model = transformer_stack()
    before = snapshot(model)
    offloader = BlockOffloader(model, model.blocks, CPU)
    offloader.apply(OffloadPlan.build(offloader.block_bytes(), resident_count=1, prefetch=2))
    forward_steps(model, torch.randn(1, 5, 32))
    offloader.remove()
    assert_same_tensors(model, before, CPU)


def test_replan_with_other_settings() -> None:
    model = transformer_stack()
    x = torch.randn(1, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    offloader = BlockOffloader(model, model.blocks, CPU)
    sizes = offloader.block_bytes()
    offloader.apply(OffloadPlan.build(sizes, resident_count=0, prefetch=1))
    assert offloader.streamer.streamed == {0, 1, 2, 3}
    # Two blocks' worth of ring (each rounded up to the ring's alignment) come out of the budget, leaving
    # room for two resident blocks, and not three.
    ring = 2 * aligned(sizes[0])
    offloader.apply(OffloadPlan.build(sizes, budget_bytes=2 * sizes[0] + ring, prefetch=1))
    assert offloader.streamer.streamed == {2, 3}
    offloader.apply(OffloadPlan.build(sizes, budget_bytes=3 * sizes[0] + ring - 1, prefetch=1))
    assert offloader.streamer.streamed == {2, 3}
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))


def test_blocks_called_twice_out_of_order_or_skipped() -> None:
    schedule = [0, 2, 2, 1, 3, 0]  # block 0 twice, block 2 twice in a row, order changes
    model = transformer_stack(num_blocks=5, schedule=schedule)  # block 4 never runs
    x = torch.randn(2, 6, 32)
    (reference,) = forward_steps(model, x, steps=1)
    recorder = TimelineRecorder(CPU)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(5),
        StreamSpec(ring=RingOptions(prefetch=2), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=3))
    assert streamer.report().last_order == tuple(schedule)
    assert [span.block for span in recorder.latest().spans] == schedule
    streamer.disable()


@pytest.mark.parametrize("error", [RuntimeError("boom inside block 3"), KeyboardInterrupt("interrupted")])
def test_a_step_that_raises_or_is_interrupted_teaches_no_call_order(error: BaseException) -> None:
    """A step stopped part-way (an error in block 3, or an interrupt: a BaseException, as ComfyUI 0.33's) has
    called only the blocks before it; learned as the call order, it would have the next step (and the next
    prompt's engine, which starts from it) copy none of the blocks after it ahead. The last complete step's order
    stays, and the next steps are bitwise."""
    model = transformer_stack(num_blocks=6)
    x = torch.randn(1, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    streamer = stream_blocks(
        model.blocks, CPU, range(6), StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    streamer.enable()
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
    full = streamer.report().last_order

    def stop(module: torch.nn.Module, args: tuple) -> None:
        raise error

    handle = model.blocks[3].mlp.register_forward_pre_hook(stop)
    with pytest.raises(type(error)):
        forward_steps(model, x, steps=1)
    handle.remove()
    streamer.close_open_step()  # what the nodes do after an interrupt, which PyTorch's always-called hooks miss
    assert full == tuple(range(6)) and streamer.report().last_order == full
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=2))
    streamer.disable()


def test_fp8_weights_with_a_scale_stream_exactly() -> None:
    model = fp8_stack()
    x = torch.randn(2, 4, 32)
    (reference,) = forward_steps(model, x, steps=1)
    before = snapshot(model)
    streamer = stream_blocks(
        model.blocks, CPU, [0, 1, 2], StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    streamer.enable()
    assert model.blocks[1].linear.weight.dtype == torch.float8_e4m3fn
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))
    streamer.disable()
    assert_same_tensors(model, before, CPU)


def test_exception_inside_a_block_leaves_the_engine_usable() -> None:
    model = transformer_stack()
    x = torch.randn(1, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    streamer = stream_blocks(
        model.blocks, CPU, [1, 2, 3], StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    streamer.enable()

    def explode(module: torch.nn.Module, args: tuple) -> None:
        raise RuntimeError("boom inside block 3")

    handle = model.blocks[3].mlp.register_forward_pre_hook(explode)
    with pytest.raises(RuntimeError, match="boom inside block 3"):
        forward_steps(model, x, steps=1)
    handle.remove()
    # Block 3's parameters went back to the host although its call never returned.
    host = streamer.host.blocks[3].host
    inside = range(host.data_ptr(), host.data_ptr() + host.numel())
    assert not streamer.calls.open and all(p.data_ptr() in inside for p in model.blocks[3].parameters())
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))
    # Releasing the device buffers between runs frees the pool; the next call allocates it again.
    streamer.release_device_buffers()
    assert streamer.report().device_buffer_bytes == 0 and all(streamer.ring.region_of(i) is None for i in (1, 2, 3))
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))
    assert streamer.report().device_buffer_bytes == streamer.ring.capacity
    streamer.disable()


def test_enable_tells_its_progress_and_an_exception_there_packs_nothing_for_good() -> None:
    """``enable(progress)`` hears each streamed block as it is packed; a host's interrupt raised from it leaves
    the streamer off with every block on memory of its own, as it was, and a later ``enable`` streams bitwise."""
    model = transformer_stack()
    x = torch.randn(1, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    before = snapshot(model)
    streamer = stream_blocks(
        model.blocks, CPU, [1, 2, 3], StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    heard: list[tuple[int, int]] = []

    def interrupted(done: int, total: int, packed_bytes: int) -> None:
        heard.append((done, total))
        if done == 2:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        streamer.enable(interrupted)
    assert heard == [(1, 3), (2, 3)] and not streamer.enabled and not streamer.host.blocks
    assert_same_tensors(model, before, CPU)
    heard.clear()
    streamer.enable(lambda done, total, packed_bytes: heard.append((done, total)))
    assert heard == [(1, 3), (2, 3), (3, 3)] and streamer.report().packed_bytes == sum(
        streamer.host.blocks[i].storage.nbytes for i in (1, 2, 3)
    )
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))
    streamer.disable()
    assert_same_tensors(model, before, CPU)


def test_sequential_wrapper_is_bitwise_identical_and_restores() -> None:
    model = transformer_stack()
    x = torch.randn(2, 7, 32)
    (reference,) = forward_steps(model, x, steps=1)
    before = snapshot(model)
    wrapper = stream_modules(model, CPU, StreamSpec(ring=RingOptions(prefetch=2)), SequentialOptions())
    wrapper.enable()
    assert {wrapper.state(m) for m in wrapper.blocks} <= {ModuleState.OFFLOADED, ModuleState.ONLOADED}
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=3))
    wrapper.disable()
    assert_same_tensors(model, before, CPU)


def test_sequential_wrapper_promotes_frequent_modules_within_the_limit() -> None:
    model = transformer_stack(schedule=[0, 1, 1, 1, 2, 3])
    x = torch.randn(1, 3, 32)
    (reference,) = forward_steps(model, x, steps=1)
    slots = buffer_bytes(model, prefetch=1)
    limit = module_bytes(model.blocks[1]) + slots  # the limit counts the slot pool too
    wrapper = stream_modules(model, CPU, StreamSpec(), SequentialOptions(vram_limit_bytes=limit))
    wrapper.enable()
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=3))
    kept = [m for m in wrapper.blocks if wrapper.state(m) is ModuleState.KEPT]
    assert kept, "nothing was promoted"
    own = [t for m in kept for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    assert wrapper.report().device_buffer_bytes == slots
    assert sum(t.numel() * t.element_size() for t in own) <= limit - slots
    # Block 1 runs three times per pass, so its modules are promoted before any other.
    assert all(any(m is k for k in model.blocks[1].modules()) for m in kept)
    wrapper.disable()


def test_sequential_storage_dtype_matches_a_model_rounded_to_it() -> None:
    model = transformer_stack()
    x = torch.randn(1, 4, 32)
    rounded = transformer_stack()
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    (reference,) = forward_steps(rounded, x, steps=1)
    before = snapshot(model)
    wrapper = stream_modules(
        model, CPU, StreamSpec(host=HostOptions(storage_dtype=torch.bfloat16)), SequentialOptions()
    )
    wrapper.enable()
    assert model.blocks[0].qkv.weight.dtype == torch.bfloat16  # stored small while offloaded
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))
    wrapper.disable()
    # The rounded copy never replaces the weights: disabling gives back the originals, bit for bit.
    assert_same_tensors(model, before, CPU)


def test_recorder_times_every_call_and_exports_json() -> None:
    model = transformer_stack()
    recorder = TimelineRecorder(CPU, keep=3)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        [1, 3],
        StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    forward_steps(model, torch.randn(1, 5, 32), steps=3)
    last = recorder.latest()
    first = recorder.steps[0]
    assert len(recorder.steps) == 3 and last.step == 2
    for step in (first, last):
        assert [span.block for span in step.spans] == [0, 1, 2, 3]
        for span in step.spans:
            assert 0 <= span.compute_start <= span.compute_end <= step.duration_ms
    # Cold, each streamed block is copied once; resident ones never are.
    copied = {span.block: span.bytes_copied for span in first.spans if span.copy_start is not None}
    assert copied == {i: streamer.host.blocks[i].host.numel() for i in (1, 3)}
    # Two slots hold both streamed blocks, so later steps copy nothing again.
    assert last.bytes_copied == 0 and last.overlap == 1.0
    data = json.loads(json.dumps(first.as_dict()))
    assert len(data["spans"]) == 4 and 0.0 <= data["overlap"] <= 1.0
    streamer.disable()


def test_plan_budget_and_summary() -> None:
    sizes = [1024] * 10
    plan = OffloadPlan.build(sizes, budget_bytes=6 * 1024, policy=ResidencyPolicy.STRIDED, prefetch=1)
    assert plan.slot_bytes == 2 * 1024 and plan.resident_bytes == 4 * 1024 and len(plan.resident) == 4
    assert plan.device_bytes() <= 6 * 1024
    # Blocks of sizes off the ring's alignment take their rounded-up size in it.
    assert OffloadPlan.build([100] * 10, resident_count=0, prefetch=1).slot_bytes == 2 * ALIGNMENT
    assert OffloadPlan.build(sizes, resident_count=3, policy=ResidencyPolicy.TRAILING).resident == {7, 8, 9}
    text = OffloadPlan.build(sizes, resident_count=3).describe()
    assert text.startswith("3/10 blocks resident (0-2, leading), 7 streamed with prefetch 1")
    with pytest.raises(ValueError, match="between 0 and 10"):
        OffloadPlan.build(sizes, resident_count=11)
    with pytest.raises(ValueError, match="exactly one"):
        OffloadPlan.build(sizes)


def _anon() -> int:
    """The process's anonymous memory (what it allocated; not the library pages it maps, which grow as code
    runs for the first time), after the freed heap memory is returned as a host does after packing."""
    gc.collect()
    release_freed_host_memory()
    return status_bytes(os.getpid(), "RssAnon")


def test_streaming_keeps_no_second_copy_in_ram() -> None:
    # 8 blocks of dim 1024: about 400 MB of fp32 weights.
    model = transformer_stack(num_blocks=8, dim=1024, heads=8)
    size = module_bytes(model)
    before = _anon()
    streamer = stream_blocks(
        model.blocks, CPU, range(8), StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    streamer.enable()
    after = _anon()
    assert streamer.report().host_bytes >= module_bytes(model.blocks) > 0.9 * size
    # The originals are freed as their packed copies replace them; only slots are new.
    grown = (after - before) / 2**20
    assert after - before < 0.25 * size, f"RssAnon grew by {grown:.0f} MiB for a {size / 2**20:.0f} MiB model"
    streamer.disable()


class AllocationCounter(TorchDispatchMode):
    """Every tensor storage an operator creates while active, by address: its output's storage when it is
    none of its inputs' (views and in-place results share theirs)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: dict[int, int] = {}

    def __torch_dispatch__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        given = {
            t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
        }
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.untyped_storage().data_ptr() not in given:
                self.storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return out


@pytest.mark.parametrize("storage_dtype", [None, torch.bfloat16])
def test_the_device_bytes_the_engine_reports_are_the_bytes_it_allocates(storage_dtype: torch.dtype | None) -> None:
    """What the engine allocates on the device when a placement is applied is its ring (three blocks' worth
    with prefetch 2) and, with a storage dtype, one staging buffer; ``device_buffer_bytes`` (which the panel
    and the CUDA peak-memory test count) is exactly that: dim 40 gives tensors of odd sizes, padded in the
    ring to the layout's alignment."""
    model = transformer_stack(num_blocks=4, dim=40)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        [1, 2, 3],
        StreamSpec(host=HostOptions(storage_dtype=storage_dtype), ring=RingOptions(prefetch=2)),
    )
    streamer.enable()
    with AllocationCounter() as counter:
        streamer.allocate_device_buffers()
    largest = max(BlockLayout.of(block).nbytes for block in model.blocks)
    staging = max(BlockLayout.of(block, storage_dtype).nbytes for block in model.blocks) if storage_dtype else 0
    assert sorted(counter.storages.values()) == sorted([largest * 3] + ([staging] if staging else []))
    assert streamer.report().device_buffer_bytes == sum(counter.storages.values())
    assert largest > module_bytes(model.blocks[1])  # the alignment padding, counted
    streamer.disable()


def test_companions_travel_with_their_block_and_are_device_views_during_its_call() -> None:
    """Per-block extra tensors (a host's LoRA adapters) are copied into the ring right after their block and
    read there during its call: equal to what was given, inside the ring, and gone with the streamer."""
    model = transformer_stack(num_blocks=4, dim=32)
    x = torch.randn(2, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    companions = {i: (torch.randn(16, 8), torch.arange(i + 3, dtype=torch.int64)) for i in (1, 2, 3)}
    streamer = stream_blocks(
        model.blocks,
        CPU,
        [1, 2, 3],
        StreamSpec(
            host=HostOptions(companions=companions), ring=RingOptions(prefetch=1), calls=CallOptions(root=model)
        ),
    )
    streamer.enable()
    seen: dict[int, bool] = {}

    def check(index: int):
        def hook(*_: object) -> None:
            views = streamer.companions(index)
            ring = streamer.ring.memory
            inside = all(ring.data_ptr() <= v.data_ptr() < ring.data_ptr() + ring.numel() for v in views)
            same = all(torch.equal(v, t) for v, t in zip(views, companions[index], strict=True))
            seen[index] = inside and same

        return hook

    hooks = [model.blocks[i].register_forward_pre_hook(check(i)) for i in (1, 2, 3)]  # after the streamer's
    for out in forward_steps(model, x, steps=3):
        assert torch.equal(out, reference)
    assert seen == {1: True, 2: True, 3: True}
    assert streamer.companions(0) is None, "a resident block has none"
    weights = sum(module_bytes(model.blocks[i]) for i in (1, 2, 3))
    assert streamer.report().host_bytes >= weights + sum(
        t.numel() * t.element_size() for ts in companions.values() for t in ts
    )
    for hook in hooks:
        hook.remove()
    streamer.disable()
    assert streamer.companions(1) is None


def test_companions_as_large_as_their_block_are_copied_from_where_they_lie() -> None:
    """A model merge's companions are the other model's weights, as large as the block: kept where they lie, with no
    host buffer of their own (a second copy of the other model), and copied into the ring from there at each copy,
    beside small ones (a LoRA's adapters), which are packed."""
    model = transformer_stack(num_blocks=4, dim=32)
    x = torch.randn(2, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    other = {i: tuple(weight.detach() * 1.25 for weight in model.blocks[i].parameters()) for i in (1, 2)}
    small = {3: (torch.randn(4, 8),)}
    streamer = stream_blocks(
        model.blocks,
        CPU,
        [1, 2, 3],
        StreamSpec(
            host=HostOptions(companions=other | small), ring=RingOptions(prefetch=1), calls=CallOptions(root=model)
        ),
    )
    streamer.enable()
    seen: dict[int, bool] = {}

    def check(index: int):
        def hook(*_: object) -> None:
            ring = streamer.ring.memory
            views = streamer.companions(index)
            inside = all(ring.data_ptr() <= v.data_ptr() < ring.data_ptr() + ring.numel() for v in views)
            seen[index] = inside and all(torch.equal(v, t) for v, t in zip(views, (other | small)[index], strict=True))

        return hook

    hooks = [model.blocks[i].register_forward_pre_hook(check(i)) for i in (1, 2, 3)]
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=3))
    assert seen == {1: True, 2: True, 3: True}
    # Only the small ones were packed: the large ones take no host memory of the engine's.
    assert streamer.host.companion_bytes == aligned(4 * 8 * 4)
    # Copied from where they lie at each copy: a change there is what the next copy brings.
    other[2][0].add_(1.0)  # block 2: copied within the step (block 1 was copied as the last one ended)
    seen.clear()
    forward_steps(model, x, steps=1)
    assert seen[2]
    for hook in hooks:
        hook.remove()
    streamer.disable()


def test_transforms_apply_once_per_fresh_copy_and_never_to_the_host_buffers() -> None:
    """A host's in-place transform of a streamed block in the ring (patches re-quantized where they arrive):
    told ``copied`` once per copy, so applied once per copy whether the block stays in the ring or not."""
    model = transformer_stack(num_blocks=4)
    x = torch.randn(2, 5, 32)
    before = snapshot(model)
    shifted = transformer_stack(num_blocks=4)
    shifted.load_state_dict(model.state_dict())
    with torch.no_grad():
        for block in shifted.blocks:
            block.proj.weight.add_(1.0)
    (expected,) = forward_steps(shifted, x, steps=1)
    for ring_bytes in (None, 1 << 26):  # the ring refilled every step; the ring holding every block
        calls: list[tuple[int, bool]] = []

        def shift(index: int, copied: bool, calls: list = calls) -> None:
            calls.append((index, copied))
            if copied:
                model.blocks[index].proj.weight.data.add_(1.0)

        transforms = {index: functools.partial(shift, index) for index in range(4)}
        streamer = stream_blocks(
            model.blocks,
            CPU,
            range(4),
            StreamSpec(ring=RingOptions(ring_bytes=ring_bytes), calls=CallOptions(root=model), transforms=transforms),
        )
        streamer.enable()
        for out in forward_steps(model, x, steps=3):
            assert torch.equal(out, expected), ring_bytes
        copies = sum(copied for _, copied in calls)
        assert len(calls) == 12 and copies == (4 if ring_bytes else 12), (ring_bytes, calls)
        with pytest.raises(ValueError, match="cannot be made resident"):
            streamer.make_resident([1])
        streamer.disable()
        assert_same_tensors(model, before, CPU)


def test_a_transform_that_raises_leaves_its_region_only_after_the_copies_wait_for_its_kernels(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A host's transform that raises halfway (out of memory while patching) has kernels queued on the compute
    stream writing its block's region; the region is forgotten (copied afresh next time), so a copy later placed
    over it has no released event to wait on: the copy stream is ordered after the compute stream first. The
    next steps, the transform working again, are bitwise."""
    model = transformer_stack(num_blocks=3)
    x = torch.randn(2, 5, 32)
    (expected,) = forward_steps(model, x, steps=1)
    failing = [True]

    def transform(index: int, copied: bool) -> None:
        if index == 1 and failing[0]:
            raise torch.OutOfMemoryError("patching block 1")

    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(3),
        StreamSpec(calls=CallOptions(root=model), transforms={i: functools.partial(transform, i) for i in range(3)}),
    )
    streamer.enable()
    ring = streamer.ring
    spy = StreamSpy(lambda: ring.region_of(1))
    # What a CUDA device has: a copy stream, and a compute stream for it to wait on.
    monkeypatch.setattr(ring, "copy_stream", spy)
    monkeypatch.setattr("block_offload.offload.ring.current_stream", lambda device: "compute stream")
    with pytest.raises(torch.OutOfMemoryError, match="patching block 1"):
        forward_steps(model, x, steps=1)
    assert spy.waits[-1] is not None and ring.region_of(1) is None, spy.waits  # waited while it still held it
    failing[0] = False
    assert all(torch.equal(out, expected) for out in forward_steps(model, x, steps=2))
    streamer.disable()


def test_the_sequential_wrapper_keeps_no_transformed_module_on_the_device() -> None:
    """Kept on the device, a module's weights are its only copy: a transform in place would stay in the model."""
    model = transformer_stack(num_blocks=2)
    x = torch.randn(2, 5, 32)
    modules = [module for _, module in streamed_modules(model)]
    transformed = {modules.index(block.proj) for block in model.blocks}
    offloader = stream_modules(
        model,
        CPU,
        StreamSpec(transforms=dict.fromkeys(transformed, lambda copied: None)),
        SequentialOptions(vram_limit_bytes=1 << 30),
    )
    offloader.enable()
    forward_steps(model, x, steps=2)
    assert offloader.streamed == transformed  # every other module was kept: the limit holds them all
    offloader.disable()


def test_a_holder_brings_in_the_modules_whose_tensors_its_code_reads() -> None:
    """A parent that reads two children's weights without calling them (ComfyUI's fused ops), inside a module
    that streams too: with the children held by the parent, every read finds its weights in the engine's device
    buffers, the surrounding module's included once the parent's call has ended."""

    class Fused(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gain = torch.nn.Parameter(torch.rand(16))
            self.up, self.down, self.norm = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16), torch.nn.LayerNorm(16)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if engines:
                reads.append(all(engines[-1].ring.holds(t) for t in (self.down.weight, self.norm.weight, self.gain)))
            y = torch.nn.functional.linear(torch.relu(self.up(x)), self.down.weight, self.down.bias)
            return torch.nn.functional.layer_norm(y, (16,), self.norm.weight, self.norm.bias) * self.gain

    class Outer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.shift = torch.nn.Parameter(torch.rand(16))
            self.fused = Fused()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.fused(x)
            if engines:
                reads.append(engines[-1].ring.holds(self.shift))
            return y + self.shift

    reads: list[bool] = []
    engines: list[SequentialOffloader] = []
    model = torch.nn.Sequential(Outer(), Outer())
    x = torch.randn(3, 16)
    reference = model(x)
    modules = [module for _, module in streamed_modules(model)]
    holders = {modules.index(outer.fused.down): outer.fused for outer in model}
    holders |= {modules.index(outer.fused.norm): outer.fused for outer in model}
    offloader = stream_modules(model, CPU, StreamSpec(calls=CallOptions(holders=holders)), SequentialOptions())
    engines.append(offloader)
    offloader.enable()
    assert torch.equal(model(x), reference) and torch.equal(model(x), reference)
    assert reads == [True] * 8
    offloader.disable()
    assert buffer_bytes(model, 1, holders=holders) > buffer_bytes(model, 1)  # the parent holds two more
    reads.clear()
    offloader = stream_modules(model, CPU, StreamSpec(), SequentialOptions())
    engines.append(offloader)
    offloader.enable()
    assert torch.equal(model(x), reference)
    assert reads == [False, True, False, True]  # without the holders, the children are read where they rest
    offloader.disable()


def test_the_sequential_wrapper_sets_its_own_root_recurse_and_nesting() -> None:
    """The wrapper streams every module of its root, one module's own tensors each: a spec that sets these
    itself is refused before anything is touched."""
    model = transformer_stack(num_blocks=2, dim=8)
    before = snapshot(model)
    for spec in (
        StreamSpec(calls=CallOptions(root=model)),
        StreamSpec(calls=CallOptions(recurse=False)),
        StreamSpec(ring=RingOptions(nesting=2)),
    ):
        with pytest.raises(ValueError, match="sets the spec's root, recurse and nesting itself"):
            stream_modules(model, CPU, spec, SequentialOptions())
    assert_same_tensors(model, before, CPU)


def test_a_spec_that_does_not_fit_is_refused_however_the_engine_is_built() -> None:
    """The entry point and the class itself refuse the same specs with the same errors, before anything is
    touched."""
    model = transformer_stack(num_blocks=2, dim=8)
    before = snapshot(model)
    refused = [
        ([1], StreamSpec(ring=RingOptions(prefetch=-1)), "prefetch must be 0 (synchronous) or more, got -1"),
        ([1, 2], StreamSpec(), "streamed block indices [2] are outside 0..1"),
        (
            [1],
            StreamSpec(files=FileOptions(read_each_step=frozenset({0}))),
            "blocks [0] are to be read from their file each step but are not streamed",
        ),
        (
            [1],
            StreamSpec(files=FileOptions(read_each_step=frozenset({1}))),
            "blocks read from their file each step need a file_slice and at least one staging slot",
        ),
    ]
    for streamed, spec, error in refused:
        with pytest.raises(ValueError) as through_entry:
            stream_blocks(model.blocks, CPU, streamed, spec)
        with pytest.raises(ValueError) as through_class:
            BlockStreamer(list(model.blocks), CPU, frozenset(streamed), spec)
        assert str(through_entry.value) == str(through_class.value) == error
    assert_same_tensors(model, before, CPU)
