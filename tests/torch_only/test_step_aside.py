"""The rule by which a node leaves a model to ComfyUI's Dynamic VRAM (``offload/plan.py``), on
injected sizes: the decision depends on nothing else."""

from __future__ import annotations

from block_offload.offload import GIB, step_aside


def test_a_model_that_fits_the_room_for_weights_is_left_to_the_host() -> None:
    aside = step_aside(model_bytes=10 * GIB, room_bytes=10 * GIB, streams_any=True)
    assert aside is not None and "whole model (10.00 GiB) fits the 10.00 GiB" in aside.reason


def test_a_model_larger_than_the_room_streams() -> None:
    assert step_aside(model_bytes=10 * GIB + 1, room_bytes=10 * GIB, streams_any=True) is None


def test_settings_that_stream_nothing_are_left_to_the_host_whatever_the_room() -> None:
    aside = step_aside(model_bytes=40 * GIB, room_bytes=8 * GIB, streams_any=False)
    assert aside is not None and "stream no block" in aside.reason
