"""The engine on a CUDA device: equality, the peak-memory bound, and hidden copies.

Skipped without CUDA; run on the GPU machine before resolving (see docs/records/gpu-campaign.md).
"""

from __future__ import annotations

import gc

import pytest
import torch

from harness.private_views import gpu_sleep
from harness.stack_offloader import BlockOffloader
from harness.transformer_stack import snapshot, transformer_stack

from bench.engine_microbench import time_forward
from bench.recorder_overhead import (
    BLOCKS,
    CountingClock,
    best_seconds_per_step,
    followed,
    hook_seconds_per_call,
    markers_of,
    per_block_call_us,
    tiny_stack,
    unwatched,
)
from block_offload.offload import (
    CallOptions,
    HostOptions,
    OffloadPlan,
    RingOptions,
    SequentialOptions,
    StreamSpec,
    TimelineRecorder,
    module_bytes,
    pinned_bytes,
    stream_blocks,
    stream_modules,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
CUDA = torch.device("cuda")


def forward(model: torch.nn.Module, x: torch.Tensor, steps: int = 1) -> torch.Tensor:
    with torch.inference_mode():
        for _ in range(steps):
            out = model(x)
    torch.cuda.synchronize()
    return out


def test_streamed_and_sequential_outputs_equal_resident_on_cuda() -> None:
    model = transformer_stack(num_blocks=6, dim=256, heads=4)
    x = torch.randn(2, 64, 256, device=CUDA)
    model.to(CUDA)
    reference = forward(model, x)
    model.cpu()
    offloader = BlockOffloader(model, model.blocks, CUDA)
    for prefetch in (0, 1, 2, 3):
        for resident in (0, 3, 6):
            offloader.apply(OffloadPlan.build(offloader.block_bytes(), resident_count=resident, prefetch=prefetch))
            assert torch.equal(forward(model, x, steps=2), reference), (prefetch, resident)
    offloader.remove()
    wrapper = stream_modules(model, CUDA, StreamSpec(ring=RingOptions(prefetch=2)), SequentialOptions())
    wrapper.enable()
    assert torch.equal(forward(model, x, steps=2), reference)
    wrapper.disable()


def test_peak_memory_is_resident_plus_slots_plus_activations() -> None:
    dim, blocks, prefetch = 1024, 8, 2
    model = transformer_stack(num_blocks=blocks, dim=dim, heads=8)
    x = torch.randn(1, 256, dim, device=CUDA)
    block = module_bytes(model.blocks[0])
    outside = module_bytes(model) - module_bytes(model.blocks)
    # The first matmul on a stream makes torch allocate cuBLAS's workspaces through the caching allocator
    # and keep them for the process's life: 32 MiB on Hopper (8 MiB before) and 1 MiB for cuBLASLt. On an
    # H100 they were the 34.6 MB (33 MiB) by which the engine seemed to exceed this bound: they are neither
    # the engine's nor activations, so a warm-up allocates them before anything is measured.
    probe = transformer_stack(num_blocks=1, dim=dim, heads=8).to(CUDA)
    forward(probe, x)
    # Activations of one block, measured resident: the peak minus what was allocated before.
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    forward(probe, x)
    activations = torch.cuda.max_memory_allocated() - base
    del probe
    torch.cuda.empty_cache()  # the probe's freed blocks are not handed to the placement, with their slack
    before = torch.cuda.memory_allocated()  # the input and the cuBLAS workspaces
    offloader = BlockOffloader(model, model.blocks, CUDA)
    offloader.apply(OffloadPlan.build(offloader.block_bytes(), resident_count=2, prefetch=prefetch))
    torch.cuda.synchronize()
    placed = torch.cuda.memory_allocated() - before
    slots = offloader.streamer.report().device_buffer_bytes
    assert slots == (prefetch + 1) * block
    # Exactly the engine's: every tensor here is a multiple of the allocator's 512-byte rounding, and each
    # large one fills its segment or leaves more than the 1 MiB beyond which the allocator splits it off.
    assert placed == 2 * block + outside + slots, f"placed {placed}, expected {2 * block + outside + slots}"
    torch.cuda.reset_peak_memory_stats()
    forward(model, x, steps=2)
    peak = torch.cuda.max_memory_allocated() - before
    # The first step's output is still alive while the second step runs (the probe ran one step).
    bound = placed + activations + x.nbytes
    assert peak <= bound, f"peak {peak / 2**20:.1f} MiB > bound {bound / 2**20:.1f} MiB"
    offloader.remove()


def test_copies_hide_behind_compute_when_compute_dominates() -> None:
    # dim 1024, 4096 tokens: each block's compute is several times its 50 MB copy on any PCIe/NVLink host.
    model = transformer_stack(num_blocks=8, dim=1024, heads=8)
    x = torch.randn(1, 4096, 1024, device=CUDA)
    model.to(CUDA)
    resident_ms = time_forward(model, x)
    model.cpu()
    recorder = TimelineRecorder(CUDA)
    streamer = stream_blocks(
        model.blocks,
        CUDA,
        range(8),
        StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    model.embed.to(CUDA)
    model.head.to(CUDA)
    streamed_ms = time_forward(model, x)
    step = recorder.latest()
    streamer.disable()
    sync = stream_blocks(
        model.blocks, CUDA, range(8), StreamSpec(ring=RingOptions(prefetch=0), calls=CallOptions(root=model))
    )
    sync.enable()
    sync_ms = time_forward(model, x)
    sync.disable()
    print(
        f"resident {resident_ms:.2f} ms, streamed {streamed_ms:.2f} ms, "
        f"synchronous {sync_ms:.2f} ms, overlap {step.overlap:.1%}"
    )
    assert streamed_ms <= 1.10 * resident_ms
    assert step.overlap >= 0.90
    assert sync_ms > 1.05 * streamed_ms


def test_disable_restores_bitwise_on_cuda() -> None:
    model = transformer_stack()
    before = snapshot(model)
    streamer = stream_blocks(
        model.blocks, CUDA, range(4), StreamSpec(ring=RingOptions(prefetch=2), calls=CallOptions(root=model))
    )
    streamer.enable()
    assert all(p.is_pinned() for p in model.blocks[0].parameters())
    model.embed.to(CUDA)
    model.head.to(CUDA)
    forward(model, torch.randn(1, 4, 32, device=CUDA), steps=2)
    streamer.disable()
    model.cpu()
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]) and not value.is_pinned()


def test_a_fresh_slot_is_not_written_before_the_compute_stream_is_done_with_its_memory() -> None:
    """The caching allocator hands a new slot memory whose last reader may still be queued on the compute
    stream; the first copy into it must wait for that reader (1 s of queued work, then the read)."""
    model = transformer_stack(num_blocks=4, dim=512, heads=8)
    nbytes = module_bytes(model.blocks[0])
    model.embed.to(CUDA), model.head.to(CUDA)
    streamer = stream_blocks(
        model.blocks, CUDA, range(4), StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    streamer.enable()
    corrupted = 0
    for _ in range(3):
        streamer.release_device_buffers()
        ones = torch.ones(nbytes, dtype=torch.uint8, device=CUDA)
        gpu_sleep(2_000_000_000)  # compute-stream work queued ahead of the read
        total = ones.sum(dtype=torch.int64)
        del ones  # back to the allocator, reusable on the compute stream at once
        streamer.allocate_device_buffers()
        streamer.steps.begin_step()  # prefetch: a copy-stream write into the fresh slot
        streamer.steps.end_step()
        corrupted += int(total.item() != nbytes)
    streamer.disable()
    assert corrupted == 0, f"{corrupted}/3 reads saw a streamed block's bytes"


def test_one_copy_stream_per_device() -> None:
    """Each engine on a device copies on the same dedicated stream, not on one more pooled stream
    (the pool is round-robin and shared with ComfyUI's offload streams)."""
    model = transformer_stack(num_blocks=2)
    first = stream_blocks(model.blocks, CUDA, [0], StreamSpec())
    second = stream_blocks(model.blocks, CUDA, [1], StreamSpec())
    assert first.ring.copy_stream is second.ring.copy_stream is not None
    assert first.ring.copy_stream != torch.cuda.current_stream(CUDA)


def test_each_step_reports_its_own_peak() -> None:
    """The recorder's peak is the step's, not the process's: a big allocation before the step is not in it."""
    model = transformer_stack(num_blocks=3, dim=64).to(CUDA)
    big = torch.empty(256 * 2**20, dtype=torch.uint8, device=CUDA)
    del big
    recorder = TimelineRecorder(CUDA)
    streamer = stream_blocks(model.blocks, CUDA, [1], StreamSpec(calls=CallOptions(root=model), recorder=recorder))
    streamer.enable()
    forward(model, torch.randn(1, 8, 64, device=CUDA))
    streamer.disable()
    step = recorder.latest()
    assert step is not None and step.peak_allocated < 256 * 2**20, step.peak_allocated


def test_streamed_blocks_pin_exactly_their_bytes_and_give_them_back() -> None:
    """Pinned by registering the engine's own buffers: exactly the blocks' bytes (torch's caching host
    allocator would round each up to a power of two and keep it pinned after it is freed)."""
    model = transformer_stack(num_blocks=3, dim=96)
    before = pinned_bytes()
    streamer = stream_blocks(model.blocks, CUDA, range(3), StreamSpec())
    streamer.enable()
    report = streamer.report()
    assert report.host_bytes & (report.host_bytes - 1), "a power of two would not show the rounding"
    assert pinned_bytes() - before == report.host_bytes and not report.refused_pinning
    assert all(p.is_pinned() for p in model.blocks.parameters())
    streamer.disable()
    gc.collect()
    assert pinned_bytes() == before


def test_pageable_blocks_still_overlap_their_copies() -> None:
    """Without pinned memory a copy holds the host thread; issued from the previous block's post-hook, with
    that block's kernels already queued, it still runs while the device computes (unlike prefetch 0)."""
    model = transformer_stack(num_blocks=8, dim=1024, heads=8)
    x = torch.randn(1, 4096, 1024, device=CUDA)
    model.embed.to(CUDA), model.head.to(CUDA)
    timings = {}
    for name, prefetch in (("async", 1), ("sync", 0)):
        streamer = stream_blocks(
            model.blocks,
            CUDA,
            range(8),
            StreamSpec(
                host=HostOptions(pin_memory=False), ring=RingOptions(prefetch=prefetch), calls=CallOptions(root=model)
            ),
        )
        streamer.enable()
        assert streamer.report().refused_pinning == {} and not any(p.is_pinned() for p in model.blocks.parameters())
        timings[name] = time_forward(model, x)
        streamer.disable()
    print(f"pageable: prefetch 1 {timings['async']:.2f} ms, synchronous {timings['sync']:.2f} ms")
    assert timings["async"] < 0.85 * timings["sync"]


def test_the_ring_is_not_overwritten_while_heavy_compute_still_reads_it() -> None:
    """Tiny weights and heavy compute: copies finish long before the blocks that read the ring do, so
    any copy that skipped its wait on a released event would change the output. Slots (prefetch 1-3), and
    rings sized in bytes: two and a half blocks (each block lands at another offset every step, over parts
    of two earlier ones) and four."""
    model = transformer_stack(num_blocks=6, dim=256, heads=4).to(CUDA)
    x = torch.randn(1, 16384, 256, device=CUDA)
    reference = forward(model, x)
    model.cpu()
    model.embed.to(CUDA), model.head.to(CUDA)
    block = module_bytes(model.blocks[0])
    for prefetch, ring in ((1, None), (2, None), (3, None), (6, block * 5 // 2), (6, block * 4)):
        streamer = stream_blocks(
            model.blocks,
            CUDA,
            range(6),
            StreamSpec(ring=RingOptions(prefetch=prefetch, ring_bytes=ring), calls=CallOptions(root=model)),
        )
        streamer.enable()
        assert all(torch.equal(forward(model, x), reference) for _ in range(10)), (prefetch, ring)
        streamer.disable()


def test_a_storage_dtype_keeps_no_original_on_the_device() -> None:
    """A block that was on the GPU when streaming starts, streamed in bf16: its float32 originals (kept to
    restore it exactly) wait on the host, so its device memory is given back."""
    model = transformer_stack(num_blocks=3, dim=256, heads=4).to(CUDA)
    expected = snapshot(model)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated(CUDA)
    streamer = stream_blocks(model.blocks, CUDA, [1], StreamSpec(host=HostOptions(storage_dtype=torch.bfloat16)))
    streamer.enable()
    torch.cuda.synchronize()
    assert before - torch.cuda.memory_allocated(CUDA) >= module_bytes(model.blocks[1])
    streamer.disable()
    for key, value in snapshot(model).items():
        assert torch.equal(value, expected[key].to(value.device)), key


def test_the_recorder_creates_no_events_after_its_first_step_and_never_waits_inside_one() -> None:
    """Every CUDA call the recorder makes goes through its clock, counted here: events come from a pool,
    each step records two events per call and two per copy, and each is read once, without a synchronize,
    at the next step boundary (the device has finished the step by then: it is synchronized between steps)."""
    model = transformer_stack(num_blocks=6, dim=256, heads=4)
    model.embed.to(CUDA), model.head.to(CUDA)
    clock = CountingClock(CUDA)
    recorder = followed(TimelineRecorder(CUDA, clock=clock))
    streamer = stream_blocks(
        model.blocks,
        CUDA,
        [1, 2, 4, 5],
        StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    x = torch.randn(1, 64, 256, device=CUDA)
    per_step = []
    with torch.inference_mode():
        for _ in range(8):
            before = clock.snapshot()
            model(x)
            per_step.append(clock.snapshot() - before)
            torch.cuda.synchronize()
    streamer.disable()
    assert per_step[0].created > 0 and [step.created for step in per_step[1:]] == [0] * 7, per_step
    assert all(step.waited == 0 and step.queried <= 2 for step in per_step), per_step
    # The step's start and end; per call, arrival and end; per copy (4 streamed blocks, 2 slots), start and end.
    assert all(step.marked == 2 + 2 * 6 + 2 * 4 for step in per_step[1:]), per_step
    # The last step is read at the next boundary, or already at its own end if the device was that quick.
    heard = recorder.listener.steps
    assert len(heard) in (7, 8) and sum(step.read for step in per_step) == sum(markers_of(s) - 1 for s in heard)


def test_while_nobody_watches_the_recorder_costs_under_1_percent_of_a_tiny_block_call() -> None:
    """bench/recorder_overhead.py's tiny stack, every block streamed, where the recorder shows most: with every
    step read (as the panel does) it cost 38 us per block call on an H200, 11 % of the call (2026-11-26), so
    while no client watches the pack samples steps. Its hooks' host time then, against a streamed call's."""
    model, x = tiny_stack(CUDA)
    variants = {
        "off": (lambda: None, None),
        "every step": (lambda: followed(TimelineRecorder(CUDA)), None),
        "nobody watching": (lambda: unwatched(TimelineRecorder(CUDA)), None),
    }
    best = best_seconds_per_step(model, x, variants)
    call_s = best["off"] / BLOCKS
    hooks_s = min(hook_seconds_per_call(unwatched(TimelineRecorder(CUDA)), CUDA) for _ in range(3))
    print(
        f"recorder: {per_block_call_us(best['every step'], best['off']):.1f} us per block call with every step "
        f"read, {per_block_call_us(best['nobody watching'], best['off']):.1f} us with nobody watching (hooks alone "
        f"{hooks_s * 1e6:.2f} us); {BLOCKS} blocks, {best['off'] * 1e3:.3f} ms/step without it"
    )
    assert hooks_s <= 0.01 * call_s, f"{hooks_s * 1e6:.2f} us of {call_s * 1e6:.1f} us per block call"


def test_a_streamed_step_allocates_no_device_memory_of_its_own() -> None:
    """The caching allocator's counts per step (``tests/test_steady_allocations.py`` on the CPU): streaming every
    block and every module, from the third step on no segment comes from the driver and each step makes as
    many allocations as the resident model's step, in the same bytes."""
    model = transformer_stack(num_blocks=6, dim=256, heads=4)
    x = torch.randn(2, 64, 256, device=CUDA)
    resident = per_step_allocations(model.to(CUDA), x)
    model.cpu()
    for streaming in (
        stream_blocks(
            model.blocks,
            CUDA,
            range(len(model.blocks)),
            StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model)),
        ),
        stream_modules(model, CUDA, StreamSpec(ring=RingOptions(prefetch=1)), SequentialOptions()),
    ):
        model.embed.to(CUDA)
        model.head.to(CUDA)
        streaming.enable()
        streamed = per_step_allocations(model, x)
        streaming.disable()
        for index in range(2, len(streamed)):
            assert streamed[index]["segments"] == 0, (type(streaming).__name__, streamed)
            assert streamed[index]["allocations"] == resident[index]["allocations"], (streamed, resident)
            assert streamed[index]["bytes"] == resident[index]["bytes"], (streamed, resident)


def per_step_allocations(model: torch.nn.Module, x: torch.Tensor, steps: int = 5) -> list[dict[str, int]]:
    """Per forward step: the segments the allocator took from the driver, its allocations and their bytes."""
    keys = {"segments": "segment.all.allocated", "allocations": "allocation.all.allocated"}
    counts = []
    with torch.inference_mode():
        for _ in range(steps):
            torch.cuda.synchronize()
            before = torch.cuda.memory_stats()
            model(x)
            torch.cuda.synchronize()
            after = torch.cuda.memory_stats()
            step = {name: after[key] - before[key] for name, key in keys.items()}
            step["bytes"] = after["allocated_bytes.all.allocated"] - before["allocated_bytes.all.allocated"]
            counts.append(step)
    return counts
