"""A LoRA on a quantized checkpoint computes through every node exactly as ComfyUI computes it without one.

ComfyUI's load patches a quantized layer's weight and stores it back in the layer's format (its
``set_weight``: ``requantize_from_float``), so the layer keeps running its format's own kernel. The pack
patches a streamed layer's weight the same way where it arrives on the device, in place (``LoadedPatch.
write_in_place``), never as a dequantized weight function. Each stored format this host loads
(``harness/tiny_models.py``: every per-layer ``comfy_quant`` format of ComfyUI 0.33, and 0.3.75's own) x a
LoRA before the node, after it x the three nodes with the placement a user gets (``auto``, where the
patch-cost probe runs): bitwise the latent of the same model without the node, and every read of a streamed
module's weights, ComfyUI's fused ones included (``comfy.ops.cast_bias_weight`` from a parent's code, as
``linear_input_act``), made from the engine's device buffers.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from test_quantized import loader  # noqa: F401 - the fixture

from harness import tiny_models as tm
from harness.inprocess import sample
from harness.prompts import ASYNC, PARTIAL, SEQUENTIAL, differs

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

ON_033 = not HOST_VERSION.startswith("0.3.")
#: The safetensors formats (GGUF has its own tests: its patches ride on the tensor to ComfyUI-GGUF's ops).
FORMATS = [artifact.name for artifact in tm.QUANTIZED_ARTIFACTS if not artifact.is_gguf]


def auto(comfy: SimpleNamespace, node: str, model: object) -> object:
    """``model`` through ``node`` as dragged into a workflow: automatic placement (the patch-cost probe runs),
    every block streamed but what the node keeps."""
    if node == ASYNC:
        run = comfy.nodes.AsyncBlockOffload.execute(
            model, resident_blocks=1, prefetch_blocks=1, pin_memory=True, policy="auto"
        )
    elif node == PARTIAL:
        run = comfy.nodes.PartialGPUResidency.execute(
            model, vram_budget_gb=0.001, policy="auto", prefetch_blocks=1, pin_memory=True
        )
    else:
        run = comfy.nodes.SequentialOffloadWrapper.execute(
            model, storage_dtype="as loaded", vram_limit_gb=0.0, prefetch_modules=1, pin_memory=True
        )
    return run.result[0]


def streamed_modules_of(patched: object) -> dict[int, torch.nn.Module]:
    """The modules with weights of the engine's streamed units, by id."""
    runner = patched.offload_engine.runner
    if runner.report().unit == "module":
        units = [runner.blocks[index] for index in runner.report().streamed]
        return {id(module): module for module in units}
    blocks = [runner.blocks[index] for index in runner.report().streamed]
    return {id(m): m for block in blocks for m in block.modules() if list(m.parameters(recurse=False))}


@contextmanager
def reads_outside_the_engine(comfy: SimpleNamespace, patched: object) -> Iterator[list[str]]:
    """Records, while sampling, each streamed module whose weights a computation read from anywhere but the
    engine's device buffers: at the end of its forward (the engine's own hook runs after this one and
    releases it) and in every ``comfy.ops.cast_bias_weight`` call, which fused paths make on a child from
    its parent's code. Yields the list, filled as it samples."""
    import comfy.ops

    outside: list[str] = []
    names = {id(module): name for name, module in patched.model.diffusion_model.named_modules()}
    streamed: dict[int, torch.nn.Module] = {}

    def check(module: torch.nn.Module) -> None:
        engine = patched.offload_engine
        if engine is None:
            return
        if not streamed:
            streamed.update(streamed_modules_of(patched))
        if id(module) in streamed:
            for param, tensor in module.named_parameters(recurse=False):
                if not engine.runner.ring.holds(tensor):
                    outside.append(f"{names[id(module)]}.{param}")

    original = comfy.ops.cast_bias_weight

    def cast_bias_weight(s: torch.nn.Module, *args: object, **kwargs: object) -> object:
        check(s)
        return original(s, *args, **kwargs)

    handles = [
        module.register_forward_hook(lambda module, args, output: check(module))
        for module in patched.model.diffusion_model.modules()
        if list(module.parameters(recurse=False))
    ]
    comfy.ops.cast_bias_weight = cast_bias_weight
    try:
        yield outside
    finally:
        comfy.ops.cast_bias_weight = original
        for handle in handles:
            handle.remove()


def assert_samples_from_the_engine(
    comfy: SimpleNamespace, streamed: object, run: Callable[[object], torch.Tensor], reference: torch.Tensor
) -> None:
    """``run(streamed)`` streams and gives ``reference`` bit for bit, every streamed weight read from the engine's
    buffers; the models are unloaded after it."""
    with reads_outside_the_engine(comfy, streamed) as outside:
        latent = run(streamed)
    assert streamed.offload_engine is not None, "not streamed"
    comfy.mm.unload_all_models()
    assert torch.equal(latent, reference), differs(latent, reference)
    assert not outside, f"read outside the engine's buffers: {sorted(set(outside))[:5]}"


def with_lora(comfy: SimpleNamespace, model: object) -> object:
    lora = comfy.utils.load_torch_file(str(comfy.models[tm.WAN21_LORA]))
    return comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0)[0]


@pytest.mark.parametrize("name", FORMATS)
def test_a_lora_computes_as_comfyui_in_every_format(
    comfy: SimpleNamespace,
    loader: Callable[[str], object],  # noqa: F811 - the fixture
    name: str,
) -> None:
    with torch.inference_mode():  # as the server samples
        model = loader(name)
        plain, reference = sample(comfy, model), sample(comfy, with_lora(comfy, model))
        comfy.mm.unload_all_models()
        assert not torch.equal(plain, reference), "the LoRA changes nothing: the test would prove nothing"
        failures = []
        for node in (ASYNC, PARTIAL, SEQUENTIAL):
            branches = {  # without a LoRA: test_quantized.py's test_every_node_streams_the_format_as_stored_bitwise
                "LoRA, then the node": (auto(comfy, node, with_lora(comfy, model)), reference),
                "the node, then LoRA": (with_lora(comfy, auto(comfy, node, model)), reference),
            }
            for order, (patched, expected) in branches.items():
                with reads_outside_the_engine(comfy, patched) as outside:
                    latent = sample(comfy, patched)
                if patched.offload_engine is None:
                    failures.append(f"{node}, {order}: did not stream")
                elif not torch.equal(latent, expected):
                    failures.append(f"{node}, {order}: {differs(latent, expected)}")
                if outside:
                    failures.append(f"{node}, {order}: read from host memory: {sorted(set(outside))[:6]}")
                comfy.mm.unload_all_models()
        assert torch.equal(sample(comfy, model), plain), "the loader's MODEL changed"
        comfy.mm.unload_all_models()
    assert not failures, "\n".join(failures)


def test_a_patch_cost_probe_that_fails_plans_without_it(
    comfy: SimpleNamespace,
    loader: Callable[[str], object],  # noqa: F811 - the fixture
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An adapter the probe cannot time (another custom node's): placed without its cost, said once in the log
    and in the plan line, streamed bitwise."""
    from block_offload.nodes import device_patches

    def unknown_adapter(*args: object) -> float:
        raise NotImplementedError("an adapter type of another custom node")

    monkeypatch.setattr(device_patches, "_time_patch", unknown_adapter)
    monkeypatch.setattr(device_patches.patch_timings(), "ms", {})
    monkeypatch.setattr(device_patches.patch_timings(), "untimable", set())
    name = tm.WAN21_FP8_METADATA
    with torch.inference_mode(), caplog.at_level(logging.INFO):
        model = with_lora(comfy, loader(name))
        reference = sample(comfy, model)
        comfy.mm.unload_all_models()
        for node in (ASYNC, PARTIAL):
            patched = auto(comfy, node, model)
            latent = sample(comfy, patched)
            assert torch.equal(latent, reference), f"{node}: {differs(latent, reference)}"
            assert "could not be timed" in patched.offload_engine.summary, patched.offload_engine.summary
            comfy.mm.unload_all_models()
    said = [r.message for r in caplog.records if "could not time the patches" in r.message]
    assert said and all("an adapter type of another custom node" in line for line in said), said
    assert len(said) == len({line.split(" of ")[1].split(" to plan")[0] for line in said})  # once a weight kind
