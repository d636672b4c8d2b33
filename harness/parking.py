"""A parking lot per model for the engine's own tests, as the pack keeps one on each model's state
(``nodes/patcher.py``'s ``ModelState``): streamers of one model park into it and adopt from it. And where a
streamer's host buffers lie, to tell whether the next streamer took them over."""

from __future__ import annotations

from torch import nn

from block_offload.offload import BlockStreamer, ParkingLot

_ATTRIBUTE = "block_offload_test_parking"


def lot_of(model: nn.Module) -> ParkingLot:
    """``model``'s lot, made on first use and kept on the model (it goes with it)."""
    lot = model.__dict__.get(_ATTRIBUTE)
    if lot is None:
        lot = ParkingLot()
        model.__dict__[_ATTRIBUTE] = lot
    return lot


def host_ptrs(streamer: BlockStreamer) -> dict[int, range]:
    """Each streamed block's host buffer, as the range of addresses it covers."""
    ranges = {}
    for index in streamer.streamed:
        host = streamer.host.blocks[index].host
        ranges[index] = range(host.data_ptr(), host.data_ptr() + host.numel())
    return ranges
