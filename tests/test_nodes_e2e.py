"""The three nodes end to end, through a real ComfyUI (POST /prompt, websocket, /history).

For each tiny architecture ONE prompt samples, from the same UNETLoader output and with the
same seed, conditioning and latent:

* ``ref``: the model as loaded (no node);
* one branch per node: AsyncBlockOffload (1 block resident), PartialGPUResidency (a 1 MiB
  budget: every block streams), SequentialOffloadWrapper (every module streams, as loaded);
* ``lora_ref``: LoraLoaderModelOnly (strength 1.0), and per node ``lora_then_<node>`` (LoRA ->
  node) and ``<node>_then_lora`` (node -> LoRA).

Every streamed latent must equal its reference bit for bit (streaming moves weights, it must
not change a single one), the LoRA reference must differ from the plain one (or the LoRA
branches would prove nothing), and the server log must show each branch's plan line. The
plain branch is also sampled in prompts of its own, before and after the big one, from the
same (cached) loader output: the MODEL the nodes were given is unchanged by them.

The tiny Flux is 3072 wide (ComfyUI fixes that width), one block of each kind: 0.54 billion
parameters, 2 GiB in float32 on the CPU. It still gets every branch, most of this file's time, and
the server peaks near 5.4 GiB of RAM while it streams.
"""

from __future__ import annotations

import re
import uuid

import pytest
import torch

from harness import tiny_models as tm
from harness.big_model import TINY_FLUX
from harness.comfy_host import ComfyHost
from harness.prompts import (
    ARCHS,
    ASYNC,
    NODES,
    SEQUENTIAL,
    Arch,
    PromptBuilder,
    cached_nodes,
    differs,
    evict_cached_models,
    plan_lines,
    run,
)
from harness.workflows import STEPS

pytestmark = pytest.mark.usefixtures("tiny_models")


def full_prompt(arch: Arch, prefix: str) -> PromptBuilder:
    b = PromptBuilder(arch, prefix)
    b.sample("ref", b.model)
    for node in arch.nodes:
        b.sample(node, b.offload(b.model, node))
    b.sample("lora_ref", b.lora(b.model))
    for node in arch.nodes:
        b.sample(f"lora_then_{node}", b.offload(b.lora(b.model), node))
        b.sample(f"{node}_then_lora", b.lora(b.offload(b.model, node)))
    return b


def plain_prompt(arch: Arch, prefix: str, no_ops: int) -> PromptBuilder:
    """Only the plain branch. ``no_ops`` LatentMultiply(1.0) nodes (x * 1.0 == x, bit for bit) give
    the KSampler another cache key than the big prompt's, so ComfyUI samples again instead of
    answering from its cache, while the loader's MODEL still comes from the cache: the same object."""
    b = PromptBuilder(arch, prefix)
    latent = b.latent
    for _ in range(no_ops):
        latent = b.add("LatentMultiply", samples=latent, multiplier=1.0)
    b.sample("ref", b.model, latent)
    return b


def sample_around(
    host: ComfyHost, arch: Arch, prefix: str, big: PromptBuilder
) -> tuple[torch.Tensor, dict[str, torch.Tensor], str, torch.Tensor, str]:
    """Runs the plain branch alone, then ``big``, then the plain branch alone again on the same
    cached MODEL; returns (before, big's latents, big's log, after, the plain runs' log)."""
    before, before_log, _ = run(host, plain_prompt(arch, f"{prefix}/before", no_ops=1))
    latents, log, _ = run(host, big)
    after_prompt = plain_prompt(arch, f"{prefix}/after", no_ops=2)
    after, after_log, after_result = run(host, after_prompt)
    # The "after" prompt sampled the very MODEL object the big prompt's nodes were given.
    assert after_prompt.prompt[after_prompt.model[0]] == big.prompt[big.model[0]]
    assert after_prompt.model[0] in cached_nodes(after_result), "the loader ran again: not the same MODEL"
    return before["ref"], latents, log, after["ref"], before_log + after_log


@pytest.mark.parametrize("arch_name", [pytest.param(n, marks=TINY_FLUX) if n == tm.FLUX else n for n in ARCHS])
def test_streamed_latents_equal_the_reference(comfy_host: ComfyHost, arch_name: str) -> None:
    arch = ARCHS[arch_name]
    prefix = f"tests/e2e/{uuid.uuid4().hex[:8]}/{arch.name}"
    before, latents, log, after, plain_log = sample_around(comfy_host, arch, prefix, full_prompt(arch, prefix))

    ref, lora_ref = latents["ref"], latents["lora_ref"]
    assert bool(ref.isfinite().all()) and ref.abs().max() > 0
    lora_changes = not torch.equal(ref, lora_ref)
    assert lora_changes, "the LoRA does not change the result: the LoRA branches prove nothing"
    same_alone = torch.equal(before, ref)
    assert same_alone, "the plain branch alone vs in the big prompt: " + differs(before, ref)
    same_after = torch.equal(after, ref)
    assert same_after, "the loader's MODEL, sampled again after the nodes ran, changed: " + differs(after, ref)
    assert "Block Offload (" not in plain_log, "the plain branch streamed:\n" + plain_log

    mismatches = []
    for branch, latent in latents.items():
        expected = lora_ref if "lora" in branch else ref
        if not torch.equal(latent, expected):
            mismatches.append(f"{branch}: {differs(latent, expected)}")
    assert not mismatches, "streamed latents differ from their reference:\n" + "\n".join(mismatches)

    # Each node's branches (plain, LoRA -> node, node -> LoRA) loaded a streaming model.
    for node in arch.nodes:
        lines = plan_lines(log, node)
        assert len(lines) == 3, f"expected 3 plan lines for {node}, got {lines}\n--- log ---\n{log}"
        for line in lines:
            if node == SEQUENTIAL:
                assert "every module streamed" in line, line
                continue
            match = re.search(r"(\d+)/(\d+) blocks resident", line)
            assert match, line
            resident, total = int(match[1]), int(match[2])
            assert total == arch.blocks, line
            assert resident == (1 if node == ASYNC else 0), line

    report = comfy_host.get_json("/block_offload/report")
    assert report.get("node") in {NODES[n][2] for n in arch.nodes}, report
    assert report.get("plan"), report


def test_lossy_storage_dtype_leaves_the_input_model_unchanged(comfy_host: ComfyHost) -> None:
    """SequentialOffloadWrapper with fp8 storage rounds the weights it streams; the loader's MODEL must
    not be rounded with them.
    """
    arch = ARCHS[tm.WAN21]
    prefix = f"tests/e2e/{uuid.uuid4().hex[:8]}/{arch.name}_fp8"
    big = PromptBuilder(arch, prefix)
    class_type, widgets, _ = NODES[SEQUENTIAL]
    big.sample("fp8", big.add(class_type, model=big.model, **{**widgets, "storage_dtype": "fp8_e4m3fn"}))
    try:
        before, latents, log, after, _ = sample_around(comfy_host, arch, prefix, big)
    finally:
        evict_cached_models(comfy_host)  # a rounded model must not serve the next test's loader
    assert len(plan_lines(log, SEQUENTIAL)) == 1, log
    rounded = not torch.equal(latents["fp8"], before)
    assert rounded, "fp8 storage should change the streamed model's result"
    assert torch.equal(after, before), differs(after, before)


def test_a_first_load_starts_its_steps_at_once_and_packs_in_the_background(comfy_host: ComfyHost) -> None:
    """The browser's view of a first load: ComfyUI's progress messages for the KSampler (the node whose
    ``load_models_gpu`` starts the engine) count its steps only: no bar holds them up while blocks are packed.
    The plan line says what is packed in the background while the first steps run, and a line of the node's
    says when that is done."""
    evict_cached_models(comfy_host)  # a fresh loader output: its first load packs
    arch = ARCHS[tm.WAN21]
    builder = PromptBuilder(arch, f"tests/e2e/{uuid.uuid4().hex[:8]}/packing")
    builder.sample("x", builder.offload(builder.model, ASYNC))
    _, log, result = run(comfy_host, builder)
    (sampler,) = [node for node, spec in builder.prompt.items() if spec["class_type"] == "KSampler"]
    bars = [(e.data["value"], e.data["max"]) for e in result.events_of("progress") if e.data.get("node") == sampler]
    assert arch.blocks - 1 != STEPS and bars and all(total == STEPS for _, total in bars), bars
    (line,) = plan_lines(log, ASYNC)
    assert re.search(r"; \d+\.\d\d GiB pinned or packed in the background while the first steps run", line), line
    assert "; packed " not in line, line  # nothing was packed before the first step
