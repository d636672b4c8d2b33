"""Prompts for a real ComfyUI server, built in the API format around the tiny models: a loader, the
tiny CLIP's conditioning, an empty latent, and any number of branches (plain, through one of the
pack's nodes, through a LoRA) each sampled and saved; and running them, with their latents back."""

from __future__ import annotations

import itertools
import os
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load_file

from . import tiny_models as tm
from . import tiny_specs
from .comfy_client import RunResult, WsEvent
from .comfy_host import ComfyHost
from .workflows import SAMPLER, SCHEDULER, SEED, STEPS

ASYNC, PARTIAL, SEQUENTIAL = "async", "partial", "sequential"


#: node key -> (class_type, widget inputs, the node name its log line carries)
NODES: dict[str, tuple[str, dict[str, Any], str]] = {
    ASYNC: (
        "AsyncBlockOffload",
        {"resident_blocks": 1, "prefetch_blocks": 1, "pin_memory": True, "policy": "leading"},
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
    tm.WAN21: Arch(tm.WAN21, {"width": 32, "height": 32, "length": 5, "batch_size": 1}, 6.0, tiny_specs.WAN21_LAYERS),
    tm.FLUX: Arch(
        tm.FLUX,
        {"width": 32, "height": 32, "batch_size": 1},
        1.0,
        tiny_specs.FLUX_DOUBLE_BLOCKS + tiny_specs.FLUX_SINGLE_BLOCKS,
    ),
    tm.SD3: Arch(tm.SD3, {"width": 64, "height": 64, "batch_size": 1}, 4.0, tiny_specs.SD3_DEPTH),
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

    def lora(self, model: list[Any], strength: float = 1.0) -> list[Any]:
        lora = tm.FILES[tm.LORA_FOR[self.arch.name]]
        return self.add("LoraLoaderModelOnly", model=model, lora_name=lora, strength_model=strength)

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


def run(
    host: ComfyHost, builder: PromptBuilder, timeout: float = 300
) -> tuple[dict[str, torch.Tensor], str, RunResult]:
    """Runs the prompt; returns each branch's latent, what the server logged meanwhile, and the result."""
    log_start = len(host.log_text())
    result = host.run(builder.prompt, timeout=timeout)
    log = host.log_text()[log_start:]
    assert result.ok, result.error_text() + "\n" + host.log_tail(60)
    sampled = executed_nodes(result)
    latents = {}
    for branch, save_id in builder.saves.items():
        (item,) = result.outputs()[save_id]["latents"]
        path = result.output_dir / item["subfolder"] / item["filename"]
        latents[branch] = load_file(str(path))["latent_tensor"]
        ksampler = builder.prompt[save_id]["inputs"]["samples"][0]
        assert ksampler in sampled, f"{branch}: KSampler {ksampler} was answered from the cache, not sampled"
    return latents, log, result


def executed_nodes(result: RunResult) -> list[str]:
    return [e.data["node"] for e in result.events_of("executing") if e.data.get("node") is not None]


def cached_nodes(result: RunResult) -> list[str]:
    return [node for e in result.events_of("execution_cached") for node in e.data.get("nodes", [])]


#: ``nodes/engine.py``'s ``PACKING_DONE``: a line of the node's that is not its plan line (the server's log is read
#: in a process that need not import the pack's nodes).
PACKING_DONE = "background packing done:"


def plan_lines(log: str, node: str) -> list[str]:
    """The node's plan lines in a server's log (one per engine start; not the line that its packing in the
    background is over)."""
    start = f"Block Offload ({NODES[node][2]}): "
    return [line for line in log.splitlines() if line.startswith(start) and not line.startswith(start + PACKING_DONE)]


def differs(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}"
    diff = (a.double() - b.double()).abs()
    return f"max |diff| {diff.max().item():.3g}, {int((diff > 0).sum())}/{diff.numel()} elements differ"


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


FRESH_SEEDS = itertools.count(10_000)


def server_env(**extra: str) -> dict[str, str]:
    """A test server's environment: the nodes stream on the CPU too, and on a GPU under Dynamic VRAM they
    stream the tiny models, which always fit (stepping aside is tested in process, test_dynamic_vram.py)."""
    return {**os.environ, "BLOCK_OFFLOAD_ALLOW_CPU": "1", "BLOCK_OFFLOAD_STEP_ASIDE": "0", **extra}


def prefix(name: str) -> str:
    return f"tests/reliability/{uuid.uuid4().hex[:8]}/{name}"


def sampler_of(builder: PromptBuilder, branch: str) -> dict[str, Any]:
    """The inputs of the KSampler whose latent ``branch`` saves."""
    save = builder.prompt[builder.saves[branch]]
    return builder.prompt[save["inputs"]["samples"][0]]["inputs"]


def offload_prompt(
    arch: Any = None,
    node: str = "AsyncBlockOffload",
    seed: int | None = None,
    steps: int = STEPS,
    lora: float = 0.0,
    name: str = "p",
    plain: bool = True,
    **widgets: Any,
) -> PromptBuilder:
    """The loader's MODEL (through a LoRA if ``lora``) sampled as it is (``plain``) and through ``node``
    with ``widgets`` over the e2e test's defaults (``offload``), same seed, steps and conditioning.
    ``plain=False`` leaves the first branch out (ComfyUI would run it even when the other fails).
    Without a ``seed``, one no other prompt used: ComfyUI would answer a repeated sampler from its cache."""
    seed = next(FRESH_SEEDS) if seed is None else seed
    arch = arch or ARCHS[tm.WAN21]
    b = PromptBuilder(arch, prefix(name))
    model = b.lora(b.model, lora) if lora else b.model
    if plain:
        b.sample("plain", model)
    b.sample("offload", b.add(node, model=model, **{**defaults(node), **widgets}))
    for branch in b.saves:
        sampler_of(b, branch).update(seed=seed, steps=steps)
    return b


def defaults(node: str) -> dict[str, Any]:
    """The e2e test's widget values for ``node``."""
    return next(widgets for class_type, widgets, _ in NODES.values() if class_type == node)


def run_offload(host: ComfyHost, builder: PromptBuilder) -> tuple[torch.Tensor, str]:
    """Runs an ``offload_prompt``; asserts both branches equal; returns the latent and the log."""
    latents, log, _ = run(host, builder)
    assert torch.equal(latents["offload"], latents["plain"]), differs(latents["offload"], latents["plain"])
    return latents["plain"], log


def interrupted_run(host: ComfyHost, builder: PromptBuilder, at_step: int, branch: str = "offload") -> None:
    """Runs ``builder`` and interrupts it once sampling reported ``at_step`` steps done."""
    sent = []

    def interrupt(event: WsEvent) -> None:
        if event.type == "progress" and event.data["value"] >= at_step and not sent:
            host.interrupt()
            sent.append(event.data["value"])

    result = host.run(builder.prompt, timeout=300, on_event=interrupt)
    assert sent, f"sampling ended before step {at_step}: {result.summary()}"
    assert result.status == "interrupted", result.summary()
    progress = [e.data["value"] for e in result.events_of("progress")]
    assert progress[-1] < sampler_of(builder, branch)["steps"], "the prompt finished: nothing was interrupted"
