"""The timeline recorder's device calls, counted through its clock on a real streaming run (CPU).

Every device call the recorder makes (event creations, records, queries, synchronizations, elapsed-time
reads) goes through its ``Clock``; ``CountingClock`` (bench/recorder_overhead.py) is that clock counting
as it goes, so these counts are the ones a CUDA run makes (tests/torch_only/test_engine_cuda.py counts them there).
"""

from __future__ import annotations

import torch

from harness.transformer_stack import transformer_stack

from bench.recorder_overhead import ClockCalls, CountingClock, StepCollector, markers_of, unwatched
from block_offload.offload import CallOptions, RingOptions, StreamSpec, TimelineRecorder, stream_blocks
from block_offload.offload.timeline import FIRST_STEPS_RECORDED, always_watched

CPU = torch.device("cpu")
STREAMED = [1, 2, 4, 5]  # of 6 blocks, through 2 slots (prefetch 1): every streamed call copies, every step


def run_counted(recorder: TimelineRecorder, clock: CountingClock, steps: int, prefetch: int = 1) -> list[ClockCalls]:
    """Streams a 6-block stack for ``steps`` steps; the clock calls each step made, begin to end."""
    model = transformer_stack(num_blocks=6)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        STREAMED,
        StreamSpec(ring=RingOptions(prefetch=prefetch), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    x = torch.randn(1, 5, 32)
    per_step = []
    with torch.inference_mode():
        for _ in range(steps):
            before = clock.snapshot()
            model(x)
            per_step.append(clock.snapshot() - before)
    streamer.disable()
    return per_step


def test_a_followed_run_creates_no_markers_after_its_first_step_and_never_waits() -> None:
    clock = CountingClock(CPU)
    recorder = TimelineRecorder(CPU, clock=clock)
    recorder.listener = collector = StepCollector()
    per_step = run_counted(recorder, clock, steps=6)
    assert per_step[0].created > 0
    assert [step.created for step in per_step[1:]] == [0] * 5, per_step
    assert all(step.waited == 0 for step in per_step), per_step
    assert len(collector.steps) == 6 and collector.blocks_called == 36
    for calls, step in zip(per_step[1:], collector.steps[1:], strict=True):
        assert sum(span.copy_start is not None for span in step.spans) == len(STREAMED)
        # Two marks per call and two per copy; each marker read once (against the step's start).
        assert calls.marked == markers_of(step) == 2 + 2 * 6 + 2 * len(STREAMED)
        assert calls.read == calls.marked - 1


def test_without_a_listener_a_step_is_read_only_when_asked() -> None:
    clock = CountingClock(CPU)
    recorder = TimelineRecorder(CPU, clock=clock)
    per_step = run_counted(recorder, clock, steps=6)
    assert all(step.read == step.waited == step.queried == 0 for step in per_step), per_step
    # The last step is kept for whoever asks; the one before it is reused unread from the third step on.
    assert per_step[1].created > 0 and [step.created for step in per_step[2:]] == [0] * 4, per_step
    before = clock.snapshot()
    last = recorder.latest()
    asked = clock.snapshot() - before
    assert last is not None and last.step == 5 and [span.block for span in last.spans] == list(range(6))
    assert asked.read == markers_of(last) - 1 and asked.created == asked.marked == 0
    assert recorder.steps == (last,) and (clock.snapshot() - before).read == asked.read  # read once


def test_the_compute_start_is_the_later_of_arrival_and_copy_end() -> None:
    """Synchronous streaming (prefetch 0): each streamed call waits for its own copy, so its compute
    starts when the copy ends and the wait is its stall; the resident calls never wait."""
    recorder = TimelineRecorder(CPU)
    recorder.listener = collector = StepCollector()
    run_counted(recorder, CountingClock(CPU), steps=2, prefetch=0)
    for span in collector.steps[-1].spans:
        if span.block in STREAMED:
            assert span.copy_start is not None and span.compute_start == span.copy_end
            assert span.stall > 0 and span.copy_start >= span.compute_start - span.stall
        else:
            assert span.copy_start is None and span.stall == 0
        assert span.compute_start <= span.compute_end


def recorded_steps(recorder: TimelineRecorder) -> list[int]:
    recorder.latest()  # the last steps, resolved
    assert isinstance(recorder.listener, StepCollector)
    return [step.step for step in recorder.listener.steps]


def test_while_nobody_watches_the_first_steps_are_recorded_and_then_none_within_the_period() -> None:
    """A step not recorded makes no device call at all, and the copies recorded ahead of it go back to the pool."""
    clock = CountingClock(CPU)
    recorder = unwatched(TimelineRecorder(CPU, clock=clock), period_s=3600.0)
    per_step = run_counted(recorder, clock, steps=10)
    assert recorder.steps_ended == 10  # every step counts (the patch history's steps), recorded or not
    assert recorded_steps(recorder) == list(range(FIRST_STEPS_RECORDED))
    # Step 3 reads step 2 at its boundary; from then on the recorder touches the device for nothing.
    assert all(step == ClockCalls() for step in per_step[FIRST_STEPS_RECORDED + 1 :]), per_step
    assert per_step[0].created > 0 and [step.created for step in per_step[1:]] == [0] * 9, per_step
    assert isinstance(recorder.listener, StepCollector)
    for step in recorder.listener.steps[1:]:
        assert sum(span.copy_start is not None for span in step.spans) == len(STREAMED)


def test_while_nobody_watches_a_step_is_recorded_once_the_period_has_passed() -> None:
    recorder = unwatched(TimelineRecorder(CPU), period_s=0.0)
    run_counted(recorder, CountingClock(CPU), steps=6)
    assert recorded_steps(recorder) == list(range(6))


def test_when_someone_starts_watching_the_step_after_the_next_is_recorded_with_its_copies() -> None:
    """Whether a step is recorded is decided as the step before it begins, with the copies issued ahead for it."""
    recorder = unwatched(TimelineRecorder(CPU), period_s=3600.0)
    model = transformer_stack(num_blocks=6)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        STREAMED,
        StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model), recorder=recorder),
    )
    streamer.enable()
    x = torch.randn(1, 5, 32)
    with torch.inference_mode():
        for step in range(10):
            if step == 6:
                recorder.watched = always_watched  # a client connects between steps 5 and 6
            model(x)
    streamer.disable()
    assert recorded_steps(recorder) == [0, 1, 2, 7, 8, 9]
    assert isinstance(recorder.listener, StepCollector)
    for step in recorder.listener.steps[3:]:
        assert sum(span.copy_start is not None for span in step.spans) == len(STREAMED), step.step
