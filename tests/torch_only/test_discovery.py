"""``offload.discovery.find_blocks`` on module trees built here: which lists it takes, in which order, and what it
says when a model has none. ComfyUI's own models are in ``test_every_dit.py``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from block_offload.offload.discovery import MIN_SHARE, NoBlocksError, find_blocks


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.attn = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.attn(x))


class Refiner(nn.Module):
    """A text refiner holding a small list of its own, as HunyuanVideo's ``txt_in``."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(2))


class DualStream(nn.Module):
    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.embed = nn.Sequential(nn.Linear(width, width), nn.SiLU(), nn.Linear(width, width))
        self.refiner = Refiner(width)
        self.double_blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.single_blocks = nn.ModuleDict({f"block{i}": Block(width) for i in range(4)})
        self.final = nn.Linear(width, width)


def test_every_list_of_repeated_blocks_in_tree_order_nested_ones_included() -> None:
    model = DualStream()
    found = find_blocks(model)
    assert [found_list.path for found_list in found.lists] == ["refiner.blocks", "double_blocks", "single_blocks"]
    assert [name for name, _ in found.blocks] == [
        "refiner.blocks.0",
        "refiner.blocks.1",
        "double_blocks.0",
        "double_blocks.1",
        "double_blocks.2",
        *(f"single_blocks.block{i}" for i in range(4)),
    ]
    named = dict(model.named_modules())
    assert all(named[name] is module for name, module in found.blocks)
    # The embedder's Sequential of bare layers is no block list, nor is any list inside a block.
    assert all(".mlp" not in name and not name.startswith("embed") for name, _ in found.blocks)
    assert found.describe().startswith("DualStream (refiner.blocks: 2 x Block, double_blocks: 3 x Block, ")
    assert 0.8 < found.share < 1


class Unet(nn.Module):
    """As ComfyUI's UNetModel: lists of TimestepEmbedSequential whose layers the model calls one by one."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.input_blocks = nn.ModuleList(
            [nn.Sequential(nn.Conv2d(4, width, 3))]
            + [nn.Sequential(Block(width), Block(width)) for _ in range(2)]
            + [nn.Sequential(nn.Conv2d(width, width, 3))]
        )
        self.middle_block = nn.Sequential(Block(width), nn.Linear(width, width), Block(width))
        self.out = nn.Linear(width, 4)


def test_a_list_of_lists_stands_for_their_entries() -> None:
    found = find_blocks(Unet())
    assert [(found_list.path, found_list.kind) for found_list in found.lists] == [
        ("input_blocks.*", "mixed"),
        ("middle_block", "mixed"),
    ]
    assert [name for name, _ in found.blocks][:4] == [
        "input_blocks.0.0",
        "input_blocks.1.0",
        "input_blocks.1.1",
        "input_blocks.2.0",
    ]
    assert "middle_block.1" in dict(found.blocks)  # the list's other entries stream with it


def test_a_model_whose_lists_hold_little_has_no_blocks_and_is_told_why() -> None:
    model = nn.Sequential()
    model.add_module("embed", nn.Linear(512, 512))
    model.add_module("blocks", nn.ModuleList(Block(16) for _ in range(2)))
    with pytest.raises(NoBlocksError) as raised:
        find_blocks(model)
    message = str(raised.value)
    assert "Sequential has no lists of repeated blocks holding most of its weights" in message
    assert "blocks: 2 x Block (1%)" in message and f"{MIN_SHARE:.0%}" in message


def test_a_module_list_of_one_block_is_a_list_a_sequential_of_one_is_not() -> None:
    model = nn.Module()
    model.blocks = nn.ModuleList([Block(16)])
    assert [name for name, _ in find_blocks(model).blocks] == ["blocks.0"]
    model.blocks = nn.Sequential(Block(16), nn.Linear(16, 16))
    with pytest.raises(NoBlocksError, match="block lists found: none"):
        find_blocks(model)


def test_found_again_after_a_block_is_swapped() -> None:
    model = DualStream()
    before = dict(find_blocks(model).blocks)
    model.double_blocks[1] = Block(16)
    after = dict(find_blocks(model).blocks)
    assert after["double_blocks.1"] is model.double_blocks[1] is not before["double_blocks.1"]
