"""The device ring: its books (``ByteRing``) and the engine's copies through it, on a recorded CPU run.

On the CPU the copies run inline, so the order the engine issues them in and the bytes each one writes
are seen exactly, by a dispatch mode that watches every copy into the ring: which block's host buffer it
reads, which bytes of the ring it writes. That is the schedule a GPU's copy stream would run, in order;
the events that order the streams are checked by the CUDA tests.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from harness.transformer_stack import Fp8Block, Stack, TransformerBlock, forward_steps

from block_offload.offload import (
    BlockStreamer,
    CallOptions,
    OffloadPlan,
    RingOptions,
    StackCosts,
    StreamSpec,
    simulate,
    stream_blocks,
)
from block_offload.offload.layout import ALIGNMENT, BlockLayout
from block_offload.offload.ring import ByteRing, aligned, ring_capacity, ring_granule

CPU = torch.device("cpu")
DIM = 64


# -- the books -------------------------------------------------------------------------------------


def test_regions_follow_each_other_and_wrap_overwriting_the_oldest() -> None:
    ring = ByteRing(1000 * ALIGNMENT)
    assert ring.place(1, 300 * ALIGNMENT, held=set()) == (0, [])
    assert ring.place(2, 500 * ALIGNMENT - 5, held=set()) == (300 * ALIGNMENT, [])  # rounded up to the alignment
    # 200 left at the end: a block of 300 wraps to the start, over block 1, copied longest ago.
    assert ring.place(3, 300 * ALIGNMENT, held=set()) == (0, [1])
    assert ring.regions == {2: (300 * ALIGNMENT, 800 * ALIGNMENT), 3: (0, 300 * ALIGNMENT)}


def test_a_held_block_is_never_overwritten_and_any_free_stretch_is_found() -> None:
    unit = ALIGNMENT
    ring = ByteRing(100 * unit)
    for block, size in enumerate((30, 30, 30)):
        ring.place(block, size * unit, held=set())
    # The head is at 90: 20 wrap to 0, over block 0, unless it is held; then 30-60 (block 1) is the next stretch.
    assert ring.place(3, 20 * unit, held={0, 2}) == (30 * unit, [1])
    # Nothing fits between the held blocks 3 (30-50), 2 (60-90) and 0 (0-30) but the 10 at 90 and at 50.
    assert ring.place(4, 11 * unit, held={0, 2, 3}) is None
    assert ring.place(4, 10 * unit, held={0, 2, 3}) == (50 * unit, [])
    regions = {0: (0, 30), 2: (60, 90), 3: (30, 50), 4: (50, 60)}
    assert ring.regions == {block: (start * unit, end * unit) for block, (start, end) in regions.items()}


def test_a_default_ring_places_regions_at_slots_of_the_largest_block() -> None:
    """Small blocks straddling two slots would make a large one wait for both: in a default ring regions
    start where equal slots would, so it is never worse than a pool of them."""
    largest = 1000
    capacity = ring_capacity(largest, prefetch=1)
    assert capacity == 2 * aligned(largest) and ring_granule(largest) == aligned(largest)
    ring = ByteRing(capacity, ring_granule(largest))
    assert ring.place(0, 300, held=set()) == (0, [])
    assert ring.place(1, 1000, held={0}) == (aligned(largest), [])  # the next slot, not right after block 0
    assert ring.place(2, 300, held={1}) == (0, [0])
    # Sized in bytes, regions follow each other at the alignment.
    assert ring_granule(largest, ring_bytes=5000) == ALIGNMENT
    assert ring_capacity(largest, prefetch=1, ring_bytes=100) == aligned(largest)  # never less than one block


# -- the engine's copies, recorded -----------------------------------------------------------------


@dataclass
class RingLog(TorchDispatchMode):
    """Every copy into the streamer's ring (block, first byte, end) and every block call's begin and end,
    in the order they happen."""

    streamer: BlockStreamer | None = None
    events: list[tuple] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__init__()

    def __torch_dispatch__(self, func: Callable, types: tuple, args: tuple = (), kwargs: dict | None = None) -> object:
        out = func(*args, **(kwargs or {}))
        ring = self.streamer.ring.memory
        if func is torch.ops.aten.copy_.default and ring is not None:
            target, source = args[0], args[1]
            if target.untyped_storage().data_ptr() == ring.untyped_storage().data_ptr():
                block = next(i for i, s in self.streamer.host.blocks.items() if s.host.data_ptr() == source.data_ptr())
                start = target.data_ptr() - ring.data_ptr()
                self.events.append(("copy", block, start, start + target.nbytes))
        return out

    def watch(self, blocks: list[nn.Module]) -> None:
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(lambda *_, i=index: self.events.append(("begin", i)), prepend=True)
            block.register_forward_hook(lambda *_, i=index: self.events.append(("end", i)))


def mixed_stack() -> Stack:
    """Eight blocks of two sizes: attention + MLP blocks (~200 KB) and fp8 blocks (~5 KB), alternating."""
    torch.manual_seed(0)
    return Stack([TransformerBlock(DIM, 4) if i % 2 == 0 else Fp8Block(DIM) for i in range(8)], DIM).eval()


def replay(events: list[tuple], streamed: set[int]) -> tuple[int, int]:
    """Checks the recorded schedule: no copy writes bytes of a block that is copied but not yet run, or
    running; every streamed call finds its block copied ahead (after the first two steps). Returns the most
    blocks ever copied ahead and waiting, and the number of calls that had to copy their own block."""
    region: dict[int, tuple[int, int]] = {}
    waiting: set[int] = set()
    running: set[int] = set()
    missing: set[int] = set()  # called before their copy: the call copies its own block
    most, misses, steps = 0, 0, 0
    for event in events:
        kind, block = event[0], event[1]
        if kind == "copy":
            start, end = event[2], event[3]
            live = [b for b in waiting | running if b != block and region[b][0] < end and start < region[b][1]]
            assert not live, f"the copy of block {block} into {start}-{end} overwrites blocks {live} before they ran"
            assert block not in running or block in missing, f"block {block} copied again while it runs"
            missing.discard(block)
            region[block] = (start, end)
            waiting.add(block)
        elif kind == "begin":
            steps += block == 0
            if block in streamed:
                most = max(most, len(waiting))
                if block not in waiting:
                    missing.add(block)
                    misses += steps > 2
                running.add(block)
        else:
            waiting.discard(block)
            running.discard(block)
    assert not missing, f"calls {missing} ran without their block copied"
    return most, misses


def record(streamed: set[int], ring: RingOptions) -> tuple[list[tuple], int]:
    """Six steps of the mixed stack streaming ``streamed``, bitwise equal to resident ones: the events
    recorded and the ring's capacity."""
    model = mixed_stack()
    x = torch.randn(1, 5, DIM)
    reference = forward_steps(model, x, steps=6)
    streamer = stream_blocks(model.blocks, CPU, streamed, StreamSpec(ring=ring, calls=CallOptions(root=model)))
    streamer.enable()
    log = RingLog(streamer)
    log.watch(list(model.blocks))
    with log:
        outputs = forward_steps(model, x, steps=6)
    assert all(torch.equal(out, ref) for out, ref in zip(outputs, reference, strict=True))
    capacity = streamer.ring.capacity
    streamer.disable()
    return log.events, capacity


def run_recorded(streamed: set[int], ring: RingOptions) -> tuple[int, int, int]:
    """``record``, checked by ``replay``: its two counts and the ring's capacity."""
    events, capacity = record(streamed, ring)
    return *replay(events, streamed), capacity


def test_a_byte_ring_copies_as_far_ahead_as_it_has_room_and_overwrites_nothing_live() -> None:
    """Block 0 stays, 1-7 stream through a ring of two large and two small blocks: while block 0 runs, the
    next four streamed blocks (small, large, small, large) are copied, where a pool of two equal slots
    (prefetch 1) holds one ahead; from the third step on no call waits for its own copy, the copies of
    the next step's first blocks running during this one's last."""
    sizes = [BlockLayout.of(block).nbytes for block in mixed_stack().blocks]
    ring = 2 * sizes[2] + 2 * sizes[1]
    streamed = set(range(1, 8))
    assert run_recorded(streamed, RingOptions(prefetch=8, ring_bytes=ring)) == (4, 0, ring)
    assert run_recorded(streamed, RingOptions(prefetch=1)) == (1, 0, 2 * max(sizes))
    # The block count stays an upper limit within a ring sized in bytes.
    assert run_recorded(streamed, RingOptions(prefetch=2, ring_bytes=ring)) == (2, 0, ring)


def test_a_ring_of_one_block_copies_each_block_as_it_is_called() -> None:
    """The least ring, one largest block: every call but the step's first copies its own block, after the
    previous call ended (the replay checks nothing live is overwritten); the first is copied as the step
    begins, with no block running."""
    sizes = [BlockLayout.of(block).nbytes for block in mixed_stack().blocks]
    assert run_recorded(set(range(8)), RingOptions(prefetch=8, ring_bytes=1)) == (1, 4 * 7, max(sizes))


def test_the_planner_replays_the_engines_copies_and_calls_exactly() -> None:
    """The planner's pipeline, given the engine's block sizes, issues the same copies into the same bytes
    of the ring, between the same calls, as the engine did, every step from the first (cold) one."""
    sizes = tuple(BlockLayout.of(block).nbytes for block in mixed_stack().blocks)
    costs = StackCosts(sizes, tuple(range(8)), (1.0,) * 8, (0.0,) * 8, 0.0, 1.0)
    placements = [
        (set(range(1, 8)), 8, 2 * sizes[2] + 2 * sizes[1]),  # a byte ring around resident block 0
        (set(range(1, 8)), 2, 2 * sizes[2] + 2 * sizes[1]),  # the same, at most two ahead
        (set(range(1, 8)), 1, 0),  # two slots
        ({1, 2, 4, 5, 7}, 8, sizes[0] + 3 * sizes[1]),  # a ring of one large block and three small
        (set(range(8)), 8, 1),  # the least ring
    ]
    for streamed, prefetch, ring in placements:
        events, _ = record(streamed, RingOptions(prefetch=prefetch, ring_bytes=ring or None))
        plan = OffloadPlan(sizes, frozenset(range(8)) - streamed, prefetch, False, None, ring)
        trace: list[tuple] = []
        simulate(costs, plan, inline_copies=True, steps=6, trace=trace)
        assert trace == events, (streamed, prefetch, ring)
