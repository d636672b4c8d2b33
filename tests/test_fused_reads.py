"""The modules whose weights ComfyUI reads from their parent's code (``nodes/blocks.py``), found in the
code of ComfyUI 0.33's own classes: every call of ``cast_bias_weight`` or ``linear_input_act`` on a child in
its models (the Sequential Offload Wrapper brings those children in with the parent's call; that they are then
read from the engine's device buffers is asserted in tests/test_quantized_lora.py)."""

from __future__ import annotations

import importlib

import pytest
from conftest import HOST_VERSION

#: Each class of ComfyUI 0.33's models whose code reads a child's weights, and the children it reads.
READERS = {
    ("comfy.ldm.wan.model", "WanFeedForward"): {(2,)},
    ("comfy.ldm.lightricks.model", "FeedForward"): {("net", 2)},
    ("comfy.ldm.lumina.model", "JointAttention"): {("q_norm",), ("k_norm",)},
    ("comfy.ldm.cosmos.predict2", "Attention"): {("q_norm",), ("k_norm",)},
    ("comfy.ldm.ernie.model", "ErnieImageAttention"): {("norm_q",), ("norm_k",)},
    ("comfy.ldm.joyimage.model", "JoyImageAttention"): {("img_attn_q_norm",), ("img_attn_k_norm",)},
    ("comfy.ldm.ideogram4.model", "Ideogram4Attention"): {("norm_q",), ("norm_k",)},
    ("comfy.ldm.minimax.model", "MLP"): {("fc2",)},
}


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason="ComfyUI 0.3.75 has no fused reads of a child's weights")
@pytest.mark.usefixtures("comfy")
@pytest.mark.parametrize(("module", "name"), list(READERS))
def test_the_children_a_class_reads_are_found_in_its_code(module: str, name: str) -> None:
    from block_offload.nodes.blocks import read_paths

    cls = getattr(importlib.import_module(module), name)
    assert set(read_paths(cls)) == READERS[module, name]


@pytest.mark.usefixtures("comfy")
def test_a_class_that_calls_its_children_reads_none() -> None:
    import comfy.ldm.flux.layers

    from block_offload.nodes.blocks import read_paths

    assert read_paths(comfy.ldm.flux.layers.DoubleStreamBlock) == ()
