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

The tiny Flux is 3072 wide (ComfyUI fixes that width): about 1 billion parameters, 3.6 GiB in
float32 on the CPU. It still gets every branch: ~50 s of this file's ~1 minute on two idle CPU
cores, and the server peaks near 12 GiB of RAM while it streams.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
import tiny_models as tm
import torch
from comfy_host import ComfyHost, RunResult
from safetensors.torch import load_file
from workflows import SAMPLER, SCHEDULER, SEED, STEPS

pytestmark = pytest.mark.usefixtures("tiny_models")

ASYNC, PARTIAL, SEQUENTIAL = "async", "partial", "sequential"
#: node key -> (class_type, widget inputs, the node name its log line carries)
NODES: dict[str, tuple[str, dict[str, Any], str]] = {
    ASYNC: (
        "AsyncBlockOffload",
        {"resident_blocks": 1, "prefetch_blocks": 1, "pin_memory": True},
        "Async Block Offload",
    ),
    PARTIAL: (
        "PartialGPUResidency",
        {"vram_budget_gb": 0.001, "policy": "strided", "prefetch_blocks": 1, "pin_memory": True},
        "Partial GPU Residency",
    ),
    SEQUENTIAL: (
        "SequentialOffloadWrapper",
        {"storage_dtype": "as loaded", "vram_limit_gb": 0.0, "prefetch_modules": 1, "pin_memory": True},
        "Sequential Offload Wrapper",
    ),
}


@dataclass(frozen=True)
class Arch:
    name: str
    latent: dict[str, Any]  # inputs of tm.EMPTY_LATENT_NODE[name]
    cfg: float
    blocks: int  # what find_blocks counts: the plan line says "<resident>/<blocks> blocks resident"
    nodes: tuple[str, ...] = (ASYNC, PARTIAL, SEQUENTIAL)


ARCHS = {
    tm.WAN21: Arch(tm.WAN21, {"width": 32, "height": 32, "length": 5, "batch_size": 1}, 6.0, tm.WAN21_LAYERS),
    tm.FLUX: Arch(
        tm.FLUX, {"width": 32, "height": 32, "batch_size": 1}, 1.0, tm.FLUX_DOUBLE_BLOCKS + tm.FLUX_SINGLE_BLOCKS
    ),
    tm.SD3: Arch(tm.SD3, {"width": 64, "height": 64, "batch_size": 1}, 4.0, tm.SD3_DEPTH),
}


class PromptBuilder:
    """Grows an API-format prompt around shared loader / conditioning / latent nodes."""

    def __init__(self, arch: Arch, prefix: str) -> None:
        self.arch, self.prefix = arch, prefix
        self.prompt: dict[str, dict[str, Any]] = {}
        self.saves: dict[str, str] = {}  # branch -> SaveLatent node id
        self.model = self.add("UNETLoader", unet_name=tm.FILES[arch.name], weight_dtype="default")
        clip = self.add("CLIPLoader", clip_name=tm.CLIP_L_FILE, type=tm.CLIP_TYPE[arch.name], device="default")
        self.positive = self.add("CLIPTextEncode", text="a lighthouse on a cliff at dusk", clip=clip)
        self.negative = self.add("CLIPTextEncode", text="", clip=clip)
        self.latent = self.add(tm.EMPTY_LATENT_NODE[arch.name], **arch.latent)

    def add(self, class_type: str, **inputs: Any) -> list[Any]:
        node_id = str(len(self.prompt) + 1)
        self.prompt[node_id] = {"class_type": class_type, "inputs": inputs}
        return [node_id, 0]

    def offload(self, model: list[Any], node: str) -> list[Any]:
        class_type, widgets, _ = NODES[node]
        return self.add(class_type, model=model, **widgets)

    def lora(self, model: list[Any]) -> list[Any]:
        lora = tm.FILES[tm.LORA_FOR[self.arch.name]]
        return self.add("LoraLoaderModelOnly", model=model, lora_name=lora, strength_model=1.0)

    def sample(self, branch: str, model: list[Any], latent: list[Any] | None = None) -> None:
        samples = self.add(
            "KSampler",
            model=model,
            seed=SEED,
            steps=STEPS,
            cfg=self.arch.cfg,
            sampler_name=SAMPLER,
            scheduler=SCHEDULER,
            positive=self.positive,
            negative=self.negative,
            latent_image=latent or self.latent,
            denoise=1.0,
        )
        save = self.add("SaveLatent", samples=samples, filename_prefix=f"{self.prefix}/{branch}")
        self.saves[branch] = save[0]


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


def run(
    host: ComfyHost, builder: PromptBuilder, timeout: float = 300
) -> tuple[dict[str, torch.Tensor], str, RunResult]:
    """Runs the prompt; returns each branch's latent, what the server logged meanwhile, and the result."""
    log_start = len(host.log_text())
    result = host.run(builder.prompt, timeout=timeout)
    log = host.log_text()[log_start:]
    assert result.ok, result.error_text() + "\n" + host.log_tail(60)
    sampled = _executed_nodes(result)
    latents = {}
    for branch, save_id in builder.saves.items():
        (item,) = result.outputs()[save_id]["latents"]
        path = result.output_dir / item["subfolder"] / item["filename"]
        latents[branch] = load_file(str(path))["latent_tensor"]
        ksampler = builder.prompt[save_id]["inputs"]["samples"][0]
        assert ksampler in sampled, f"{branch}: KSampler {ksampler} was answered from the cache, not sampled"
    return latents, log, result


def _executed_nodes(result: RunResult) -> list[str]:
    return [e.data["node"] for e in result.events_of("executing") if e.data.get("node") is not None]


def _cached_nodes(result: RunResult) -> list[str]:
    return [node for e in result.events_of("execution_cached") for node in e.data.get("nodes", [])]


def plan_lines(log: str, node: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith(f"Block Offload ({NODES[node][2]}): ")]


def _differs(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    diff = (a.double() - b.double()).abs()
    return f"max |diff| {diff.max().item():.3g}, {int((diff > 0).sum())}/{diff.numel()} elements differ"


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
    assert after_prompt.model[0] in _cached_nodes(after_result), "the loader ran again: not the same MODEL"
    return before["ref"], latents, log, after["ref"], before_log + after_log


@pytest.mark.parametrize("arch_name", list(ARCHS))
def test_streamed_latents_equal_the_reference(comfy_host: ComfyHost, arch_name: str) -> None:
    arch = ARCHS[arch_name]
    prefix = f"tests/e2e/{uuid.uuid4().hex[:8]}/{arch.name}"
    before, latents, log, after, plain_log = sample_around(comfy_host, arch, prefix, full_prompt(arch, prefix))

    ref, lora_ref = latents["ref"], latents["lora_ref"]
    assert bool(ref.isfinite().all()) and ref.abs().max() > 0
    lora_changes = not torch.equal(ref, lora_ref)
    assert lora_changes, "the LoRA does not change the result: the LoRA branches prove nothing"
    same_alone = torch.equal(before, ref)
    assert same_alone, "the plain branch alone vs in the big prompt: " + _differs(before, ref)
    same_after = torch.equal(after, ref)
    assert same_after, "the loader's MODEL, sampled again after the nodes ran, changed: " + _differs(after, ref)
    assert "Block Offload (" not in plain_log, "the plain branch streamed:\n" + plain_log

    mismatches = []
    for branch, latent in latents.items():
        expected = lora_ref if "lora" in branch else ref
        if not torch.equal(latent, expected):
            mismatches.append(f"{branch}: {_differs(latent, expected)}")
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
    assert torch.equal(after, before), _differs(after, before)


def evict_cached_models(host: ComfyHost) -> None:
    """ComfyUI's (classic) cache drops every node output the next prompt does not use: run one
    that uses no model."""
    result = host.run(
        {
            "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
            "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "tests/e2e/evict"}},
        },
        timeout=60,
    )
    assert result.ok, result.error_text()
