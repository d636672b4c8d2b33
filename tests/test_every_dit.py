"""Every image and video diffusion model ComfyUI ships streams block by block, its blocks found from the model.

Each model of ``harness.tiny_dit.zoo()`` is built from this ComfyUI's own classes and config (tiny, random
weights) and sampled through each of the three nodes: the latent equals the plain model's bit for bit, every
streamed unit was copied in each step, and every read of a streamed weight (a child read from its parent's
code too) came from the engine's device buffers. Models this ComfyUI lacks are skipped, saying so. Then: a
LoRA before the node on three models the old block table did not know, fp8 weights on two, Partial GPU Residency
``auto`` planning one, a model without block lists streamed module by module by the block nodes, a block
swapped by an object patch between prompts, and docs/models.md's list of models, generated from this file's.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from test_quantized_lora import reads_outside_the_engine

from harness import tiny_dit
from harness.inprocess import every_block_streamed, offloaded
from harness.prompts import ASYNC, NODES, PARTIAL, SEQUENTIAL, differs

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

ZOO = {spec.name: spec for spec in tiny_dit.zoo()}
MODELS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "models.md"


def built(name: str, weight_dtype: torch.dtype | None = None) -> tuple[tiny_dit.TinyDiT, object]:
    spec = ZOO[name]
    if not spec.available():
        pytest.skip(f"ComfyUI {HOST_VERSION} has no {spec.config}")
    return spec, tiny_dit.build(spec, weight_dtype)


def assert_streams_bitwise(comfy: SimpleNamespace, spec: tiny_dit.TinyDiT, model: object, node: str) -> object:
    """``model`` through ``node``, every block streamed, samples its plain latent, every streamed unit copied at
    each step, every streamed weight read from the engine's buffers. Returns the engine (stopped since)."""
    reference = tiny_dit.sample(spec, model)
    patched = every_block_streamed(comfy, node, model)
    with reads_outside_the_engine(comfy, patched) as outside:
        latent = tiny_dit.sample(spec, patched)
    assert torch.equal(latent, reference), f"{spec.name}, {node}: {differs(latent, reference)}"
    engine = patched.offload_engine
    assert engine is not None, f"{spec.name}, {node}: not streamed"
    assert not outside, f"{spec.name}, {node}: read outside the engine's buffers: {sorted(set(outside))[:5]}"
    assert engine.recorder.steps_ended == tiny_dit.STEPS, (spec.name, node, engine.recorder.steps_ended)
    step = engine.recorder.latest()  # the last step: the call order learned, every streamed unit copied again
    copied = {span.block for span in step.spans if span.bytes_copied}
    streamed = set(engine.runner.report().streamed) & {span.block for span in step.spans}
    # Every block streams (Async Block Offload keeps none here): more than the two a ring of prefetch 1 holds, so
    # each is copied again at each step; the first may have been copied as the step before ended.
    assert len(streamed) > 2 and copied <= streamed and len(streamed - copied) <= 1, (
        spec.name,
        node,
        sorted(copied),
        sorted(streamed),
    )
    comfy.mm.unload_all_models()
    return engine


@pytest.mark.parametrize("name", list(ZOO))
def test_every_node_streams_the_model_bitwise(comfy: SimpleNamespace, name: str) -> None:
    spec, model = built(name)
    found = comfy.placement.find_blocks(model.model.diffusion_model)
    assert found.share >= 0.5 and len(found.blocks) >= 3
    reference = tiny_dit.sample(spec, model)
    for node in NODES:
        engine = assert_streams_bitwise(comfy, spec, model, node)
        assert engine.runner.report().unit == ("module" if node == SEQUENTIAL else "block")
    assert torch.equal(tiny_dit.sample(spec, model), reference), "the loader's MODEL changed"
    comfy.mm.unload_all_models()


#: Models the block table of earlier releases refused: video, image, and the largest ComfyUI ships (MiniMax H3).
NEW_MODELS = ["Kandinsky 5 (video)", "Cosmos Predict2 T2I", "MiniMax H3"]
#: Wan Animate 2 runs each block through two of its methods per step, never calling it (``offload/discovery.py``):
#: a LoRA is applied at the first of them after each copy and kept for the second.
BLOCKS_BY_METHODS = ["Wan Animate 2"]


def lora_for(model: object, found_blocks: list[tuple[str, torch.nn.Module]]) -> dict[str, torch.Tensor]:
    """A rank-4 LoRA on every 2-D weight of the blocks, in ComfyUI's generic key format (``diffusion_model.<layer>
    .lora_up.weight``), seeded."""
    generator = torch.Generator().manual_seed(7)
    lora: dict[str, torch.Tensor] = {}
    for block_name, block in found_blocks:
        for name, weight in block.named_parameters():
            if weight.dim() != 2 or not name.endswith(".weight"):
                continue
            key = f"diffusion_model.{block_name}.{name.removesuffix('.weight')}"
            out_features, in_features = weight.shape
            lora[f"{key}.lora_up.weight"] = torch.randn(out_features, 4, generator=generator) * 0.1
            lora[f"{key}.lora_down.weight"] = torch.randn(4, in_features, generator=generator) * 0.1
    return lora


@pytest.mark.parametrize("name", NEW_MODELS + BLOCKS_BY_METHODS)
def test_a_lora_before_the_node_on_new_models(comfy: SimpleNamespace, name: str) -> None:
    spec, model = built(name)
    found = comfy.placement.find_blocks(model.model.diffusion_model)
    lora = lora_for(model, list(found.blocks))
    with_lora = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]
    assert not torch.equal(tiny_dit.sample(spec, with_lora), tiny_dit.sample(spec, model)), "the LoRA does nothing"
    for node in NODES:
        assert_streams_bitwise(comfy, spec, with_lora, node)


#: MiniMax H3's fused q/k-norm rope kernel takes no fp8 norm weight on the CPU (comfy_kitchen's eager backend):
#: ComfyUI itself cannot sample it in fp8 here.
FP8_MODELS = NEW_MODELS[:2] + BLOCKS_BY_METHODS


@pytest.mark.parametrize("name", FP8_MODELS)
def test_fp8_weights_on_new_models(comfy: SimpleNamespace, name: str) -> None:
    """Stored as UNETLoader's ``weight_dtype`` fp8_e4m3fn stores them, computed in float32 by ComfyUI's casts."""
    spec, fp8 = built(name, torch.float8_e4m3fn)
    blocks = comfy.placement.find_blocks(fp8.model.diffusion_model).blocks
    weights = [w for _, block in blocks for w in block.parameters() if w.dim() == 2]
    assert weights and all(w.dtype == torch.float8_e4m3fn for w in weights)
    for node in NODES:
        engine = assert_streams_bitwise(comfy, spec, fp8, node)
        assert engine.recorder.latest().bytes_copied > 0


def test_partial_gpu_residency_auto_plans_a_discovered_model(comfy: SimpleNamespace) -> None:
    spec, model = built("Cosmos Predict2 T2I")  # on both hosts
    cache = comfy.placement.cost_cache()
    cache.path.unlink(missing_ok=True)  # measured on its first run, planned from the second
    found = comfy.placement.find_blocks(model.model.diffusion_model)
    outside = model.model_size() - found.nbytes
    budget_gb = (outside + found.nbytes / 2) / 2**30
    reference = tiny_dit.sample(spec, model)
    patched = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=budget_gb, policy="auto", prefetch_blocks=1, pin_memory=True
    ).result[0]
    assert torch.equal(tiny_dit.sample(spec, patched), reference)
    assert patched.offload_engine.placement.measuring
    comfy.mm.unload_all_models()
    assert torch.equal(tiny_dit.sample(spec, patched), reference)
    planned = patched.offload_engine.placement
    assert "chosen by the planner, predicted" in planned.summary, planned.summary
    assert planned.summary.startswith(found.describe()), planned.summary
    assert planned.plan.block_bytes == tuple(comfy.placement.module_bytes(block) for _, block in found.blocks)
    comfy.mm.unload_all_models()


#: A Wan 2.1 of one block, its text embedder (from 512 wide) outweighing it: its one list holds under half of the
#: weights, so the block nodes find no blocks to stream.
ONE_BLOCK = tiny_dit.TinyDiT(
    "Wan 2.1, one block",
    ZOO["Wan 2.1 T2V"].config,
    {**ZOO["Wan 2.1 T2V"].unet_config, "num_layers": 1, "text_dim": 512},
    ZOO["Wan 2.1 T2V"].latent,
    (7, 512),
)


def test_the_block_nodes_stream_a_model_without_block_lists_module_by_module(
    comfy: SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    model = tiny_dit.build(ONE_BLOCK)
    for node in (ASYNC, PARTIAL):
        caplog.clear()
        engine = assert_streams_bitwise(comfy, ONE_BLOCK, model, node)
        request = engine.request
        assert request.sequential and "WanModel has no lists of repeated blocks" in request.notice
        assert "module by module" in caplog.text
        assert engine.runner.report().unit == "module" and request.notice in engine.notices  # the panel shows it
        assert "WanModel, no block lists: every module streamed" in engine.summary


def test_a_block_swapped_by_an_object_patch_streams_as_swapped(comfy: SimpleNamespace) -> None:
    """Blocks are found again at each load: a block an object patch replaces between prompts streams as the
    replacement, never from the list found before."""
    spec, model = built("Wan 2.1 T2V")
    diffusion_model = model.model.diffusion_model
    patched = offloaded(comfy, ASYNC, model)
    first = tiny_dit.sample(spec, patched)
    comfy.mm.unload_all_models()
    swapped_block = copy.deepcopy(diffusion_model.blocks[1])  # the same class, other weights
    with torch.no_grad():
        for param in swapped_block.parameters():
            param.mul_(-1.5)
    swapped = patched.clone()
    swapped.add_object_patch("diffusion_model.blocks.1", swapped_block)
    plain = model.clone()
    plain.add_object_patch("diffusion_model.blocks.1", swapped_block)
    reference = tiny_dit.sample(spec, plain)
    comfy.mm.unload_all_models()
    assert not torch.equal(reference, first), "the swap changes nothing: the test would prove nothing"
    latent = tiny_dit.sample(spec, swapped)
    assert torch.equal(latent, reference), differs(latent, reference)
    engine = swapped.offload_engine
    assert engine.runner.blocks[1] is swapped_block and 1 in engine.runner.report().streamed
    comfy.mm.unload_all_models()
    assert diffusion_model.blocks[1] is not swapped_block  # the patch is taken off with the load


def test_a_layer_inside_a_streamed_block_swapped_by_an_object_patch_streams_as_swapped(comfy: SimpleNamespace) -> None:
    """An object patch that replaces a layer inside a streamed block (a "config" patch of newer ComfyUI does
    this): the block streams with the replacement's weights, read from the engine's buffers, bitwise the
    plain patched model; the MODEL's own layer is back after."""
    spec, model = built("Wan 2.1 T2V")
    diffusion_model = model.model.diffusion_model
    layer = diffusion_model.blocks[1].ffn
    replacement = copy.deepcopy(layer)  # the same class, other weights
    with torch.no_grad():
        for param in replacement.parameters():
            param.mul_(-1.5)
    plain = model.clone()
    plain.add_object_patch("diffusion_model.blocks.1.ffn", replacement)
    reference = tiny_dit.sample(spec, plain)
    comfy.mm.unload_all_models()
    assert not torch.equal(reference, tiny_dit.sample(spec, model)), "the swap changes nothing: it proves nothing"
    swapped = every_block_streamed(comfy, ASYNC, model).clone()
    swapped.add_object_patch("diffusion_model.blocks.1.ffn", replacement)
    with reads_outside_the_engine(comfy, swapped) as outside:
        latent = tiny_dit.sample(spec, swapped)
    assert torch.equal(latent, reference), differs(latent, reference)
    engine = swapped.offload_engine
    assert not outside and 1 in engine.runner.report().streamed and engine.runner.blocks[1].ffn is replacement
    comfy.mm.unload_all_models()
    assert diffusion_model.blocks[1].ffn is layer  # the patch is taken off with the load


# -- docs/models.md's list, generated from this file's models -------------------------------------------


@pytest.mark.skipif(HOST_VERSION.startswith("0.3."), reason="docs/models.md lists what ComfyUI 0.33.0 ships")
def test_the_models_page_lists_every_tested_model(comfy: SimpleNamespace) -> None:
    """``scripts/supported_models.sh`` writes the section; here it must be what it would write."""
    text = MODELS_PAGE.read_text()
    assert text == tiny_dit.with_models_table(text), "docs/models.md's list is stale: run scripts/supported_models.sh"
    count = re.search(r"Every image and video diffusion model of ComfyUI 0\.33\.0: (\d+) models, tested", text)
    assert count and int(count[1]) == len(ZOO)
