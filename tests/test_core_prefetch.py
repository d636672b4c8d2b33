"""Models ComfyUI streams itself under Dynamic VRAM (LTX-2, MiniMax H3: ``comfy.model_prefetch``): the node streams
their classic twin in its stead, says so in the plan line, and leaves the MODEL's own prefetch as it was.

ComfyUI turns its block prefetch on for a model whose patcher is dynamic (``prefetch_dynamic_vbars`` in the
transformer options the model's block loop hands ``make_prefetch_queue``); on the CPU the queue itself is never made,
so the flag the model passes is what is checked. docs/benchmarks.md says why the node keeps streaming there.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION

from harness import tiny_dit
from harness.dynamic_vram import DynamicVram
from harness.inprocess import async_offload
from harness.prompts import differs

pytestmark = [
    pytest.mark.skipif(
        HOST_VERSION.startswith("0.3."),
        reason=f"ComfyUI {HOST_VERSION} has no Dynamic VRAM, hence no block prefetch of its own",
    ),
    pytest.mark.usefixtures("allow_cpu_streaming"),
]

ZOO = {spec.name: spec for spec in tiny_dit.zoo()}


@pytest.fixture
def small_card(dynamic_vram: DynamicVram) -> DynamicVram:
    """A device with room for a fraction of the tiny models (under 1 MiB each), so the node streams them."""
    dynamic_vram.room_for_weights = 2**16
    return dynamic_vram


@contextmanager
def prefetch_flags(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[bool]]:
    """Whether ComfyUI's block prefetch was on, at each prefetch queue the model asked for."""
    import comfy.model_prefetch

    flags: list[bool] = []
    make = comfy.model_prefetch.make_prefetch_queue

    def recording(queue, device, transformer_options):
        flags.append(bool(transformer_options.get("prefetch_dynamic_vbars", False)))
        return make(queue, device, transformer_options)

    with monkeypatch.context() as patch:
        patch.setattr(comfy.model_prefetch, "make_prefetch_queue", recording)
        yield flags


@pytest.mark.parametrize("name", ["LTX-2", "MiniMax H3"])
def test_the_node_streams_a_model_comfyui_prefetches_in_its_stead(
    comfy: SimpleNamespace, small_card: DynamicVram, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    spec = ZOO[name]
    model = small_card.load_tiny_dit(spec, tmp_path)
    with prefetch_flags(monkeypatch) as alone:
        reference = tiny_dit.sample(spec, model)
    assert alone and all(alone), f"{name}: ComfyUI's own prefetch was not on for the Dynamic VRAM MODEL: {alone}"
    comfy.mm.unload_all_models()

    streaming = async_offload(comfy, model, resident=1)
    with prefetch_flags(monkeypatch) as streamed:
        latent = tiny_dit.sample(spec, streaming)
    assert torch.equal(latent, reference), differs(latent, reference)
    assert streamed and not any(streamed), f"{name}: ComfyUI's prefetch ran beside the node's engine: {streamed}"
    engine = streaming.offload_engine
    assert engine.request.core_prefetch == type(model.model.diffusion_model).__name__
    summary = engine.summary
    loader = "; weights from a Dynamic VRAM model, streamed from its checkpoint file"
    assert f"{loader}{comfy.placement.IN_PLACE_OF_CORE_PREFETCH};" in summary, summary
    comfy.mm.unload_all_models()

    with prefetch_flags(monkeypatch) as again:  # the MODEL the node was given still prefetches itself
        assert torch.equal(tiny_dit.sample(spec, model), reference)
    assert again and all(again), again
    comfy.mm.unload_all_models()


def test_a_prefetching_model_of_code_the_node_does_not_know_streams_as_any_model(
    comfy: SimpleNamespace, small_card: DynamicVram, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A class outside the pack's list whose code makes a prefetch queue (here a subclass of LTX-2's under another
    name, as a custom node or a later ComfyUI might bring): streamed as today, the plan line without the clause."""
    spec = ZOO["LTX-2"]
    model = small_card.load_tiny_dit(spec, tmp_path)
    diffusion_model = model.model.diffusion_model
    reference = tiny_dit.sample(spec, model)
    comfy.mm.unload_all_models()
    unknown = type("OwnAVModel", (type(diffusion_model),), {})
    monkeypatch.setattr(diffusion_model, "__class__", unknown)
    streaming = async_offload(comfy, model, resident=1)
    with prefetch_flags(monkeypatch) as streamed:
        assert torch.equal(tiny_dit.sample(spec, streaming), reference)
    assert streamed and not any(streamed), streamed
    engine = streaming.offload_engine
    assert engine.request.core_prefetch == ""
    assert comfy.placement.IN_PLACE_OF_CORE_PREFETCH not in engine.summary, engine.summary
    comfy.mm.unload_all_models()


def test_a_listed_class_whose_code_makes_no_prefetch_queue_streams_as_any_model(
    comfy: SimpleNamespace, small_card: DynamicVram, tmp_path: Path
) -> None:
    """Qwen-Image's class is listed for the versions whose code prefetches it (2.1 on); 0.33's makes no queue, so
    it streams as before, bitwise, its plan line without the clause."""
    from block_offload.nodes.dynamic_vram import CORE_PREFETCHING

    spec = ZOO["Qwen-Image"]
    model = small_card.load_tiny_dit(spec, tmp_path)
    assert type(model.model.diffusion_model).__name__ in CORE_PREFETCHING
    reference = tiny_dit.sample(spec, model)
    comfy.mm.unload_all_models()
    streaming = async_offload(comfy, model, resident=1)
    assert torch.equal(tiny_dit.sample(spec, streaming), reference)
    engine = streaming.offload_engine
    assert engine.request.core_prefetch == "" and engine.request.dynamic_vram_twin
    assert comfy.placement.IN_PLACE_OF_CORE_PREFETCH not in engine.summary, engine.summary
    comfy.mm.unload_all_models()
