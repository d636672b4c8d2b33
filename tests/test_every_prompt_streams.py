"""A prompt whose graph has an offload node streams every time it samples, whatever the server ran before
with the same checkpoint; once the node is out of the graph nothing streams.

Through a real ComfyUI server with its own default flags, caching included (0.33: the RAM-pressure cache,
which keeps a node's output across prompts that do not use it; 0.3.75: the classic cache), plus the LRU
cache, which keeps outputs on both; with CUDA, the same on the GPU in each of the host's loading modes (0.33:
Dynamic VRAM and classic). Between two prompts with the node, each sequence runs something else
on the same checkpoint: the plain model, a LoRA, another strength, another offload node, the node on a
LoRA, ``/free``, another model, an interrupted prompt. Every prompt gets a seed of its own, so ComfyUI
samples again while it answers the loader, the LoRA and the node from its cache. Each sampled latent is
bitwise equal to the plain workflow's (or the plain LoRA workflow's) with the same seed; each prompt with
the node recorded a run of its own in ``/block_offload/timeline``, with copies in every step; each
plain prompt leaves no engine streaming.

The first sequence, plain then the cached node, is what 0.33 got wrong: ``ModelPatcher.__del__`` detaches
an old clone of the node's output after the plain model had loaded the weights, and that detach passed
the plain load off as the one the engine had parked, so the next clone sampled without streaming.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch
from conftest import GPU_MODES, HOST_VERSION, NEEDS_CUDA

from harness import tiny_models as tm
from harness.comfy_host import ComfyHost
from harness.prompts import (
    ARCHS,
    ASYNC,
    NODES,
    PARTIAL,
    SEQUENTIAL,
    PromptBuilder,
    differs,
    interrupted_run,
    prefix,
    run,
    sampler_of,
    server_env,
)
from harness.workflows import STEPS

pytestmark = pytest.mark.usefixtures("tiny_models")

WAN = ARCHS[tm.WAN21]
HALF = 0.5
# The other node each node's sequence runs in between (on the same loader output).
OTHER_NODE = {ASYNC: PARTIAL, PARTIAL: SEQUENTIAL, SEQUENTIAL: ASYNC}
CACHES = {"default": (), "lru": ("--cache-lru", "64")}
# One seed per sampled prompt on a server: ComfyUI would answer a repeated sampler from its cache.
SEEDS = itertools.count(20_000)
DYNAMIC_VRAM_HOST = not HOST_VERSION.startswith("0.3.")


# Where the servers run: the CPU, and with CUDA each of the host's GPU loading modes (0.33: Dynamic VRAM, its
# default, and classic), each with ComfyUI's default caching and the LRU cache.
SERVERS = [pytest.param(("cpu", cache), id=f"cpu-{cache}") for cache in CACHES] + [
    pytest.param((f"cuda-{mode}", cache), marks=NEEDS_CUDA, id=f"cuda-{mode}-{cache}")
    for mode in GPU_MODES
    for cache in CACHES
]


@pytest.fixture(scope="module", params=SERVERS)
def host(request: pytest.FixtureRequest) -> Iterator[ComfyHost]:
    """A server as users start one (no caching flag), and one with the LRU cache."""
    device, cache = request.param
    mode = () if device == "cpu" else GPU_MODES[device.removeprefix("cuda-")]
    server = ComfyHost(cpu=device == "cpu", env=server_env(), extra_args=(*mode, *CACHES[cache])).start()
    try:
        yield server
    finally:
        server.stop()


@dataclass(frozen=True)
class Graph:
    """The checkpoint's MODEL through ``chain`` (("lora", strength) or ("node", key)), sampled."""

    chain: tuple[tuple[str, float | str], ...] = ()
    arch: str = tm.WAN21

    @property
    def node(self) -> str | None:
        """The last offload node in the chain: the one whose engine must stream."""
        return next((str(value) for kind, value in reversed(self.chain) if kind == "node"), None)

    @property
    def lora(self) -> float:
        return next((float(value) for kind, value in self.chain if kind == "lora"), 0.0)

    def prompt(self, seed: int, steps: int = STEPS) -> PromptBuilder:
        builder = PromptBuilder(ARCHS[self.arch], prefix("every-prompt"))
        model = builder.model
        for kind, value in self.chain:
            model = builder.lora(model, float(value)) if kind == "lora" else builder.offload(model, str(value))
        builder.sample("x", model)
        sampler_of(builder, "x").update(seed=seed, steps=steps)
        return builder


def plain(lora: float = 0.0) -> Graph:
    return Graph((("lora", lora),) if lora else ())


def through(node: str, lora: float = 0.0) -> Graph:
    return Graph((*plain(lora).chain, ("node", node)))


@dataclass
class Sequence:
    """Runs graphs on one server, a fresh seed each; checks at once that each streamed (or did not), and at
    the end that each streamed latent equals the plain workflow's with its LoRA and seed. The references are sampled
    last, in one prompt: sampled in between, they would put a plain prompt after every step."""

    host: ComfyHost
    sampled: list[tuple[str, Graph, int, torch.Tensor]] = field(default_factory=list)

    @property
    def node_makes_a_twin(self) -> bool:
        """On a GPU server with Dynamic VRAM (0.33's default) the node streams a twin: a model of its own."""
        return not self.host.cpu and "--disable-dynamic-vram" not in self.host.extra_args and DYNAMIC_VRAM_HOST

    def sample(self, graph: Graph, after: str) -> None:
        seed = next(SEEDS)
        latents, _, result = run(self.host, graph.prompt(seed))
        if graph.arch != tm.WAN21:
            return
        timeline = self.host.get_json("/block_offload/timeline")
        if graph.node is None:
            assert timeline["prompt_id"] != result.prompt_id, f"{graph} (no node) streamed, after {after}"
            live = self.host.get_json("/block_offload/report")["models"]
            assert not any(model["running"] for model in live), f"{graph} (no node) ran an engine after {after}"
            if self.node_makes_a_twin:
                # The twin of a node output still cached (``--cache-lru``) is another model than the plain one:
                # ComfyUI keeps it loaded, idle, while it has room (test_dynamic_vram.py, the twin kept loaded).
                nodes_before = {NODES[g.node][2] for _, g, _, _ in self.sampled if g.node is not None}
                assert {model["node"] for model in live} <= nodes_before, f"after {after}: {live}"
            else:
                assert live == [], f"{graph} (no node) left engines streaming after {after}: {live}"
            return
        self.sampled.append((after, graph, seed, latents["x"]))
        assert timeline["prompt_id"] == result.prompt_id, (
            f"after {after}: {graph} sampled without streaming: the last run the pack recorded is prompt "
            f"{timeline['prompt_id']} ({timeline['node']}), not {result.prompt_id}"
        )
        assert timeline["node"] == NODES[graph.node][2]
        copied = [step["bytes_copied"] for step in timeline["steps"]]
        assert len(copied) == STEPS and all(copied), f"after {after}: {graph}: bytes copied per step {copied}"

    def interrupt(self, node: str) -> None:
        builder = through(node).prompt(next(SEEDS), steps=10_000)
        interrupted_run(self.host, builder, at_step=2, branch="x")

    def check_against_plain(self) -> None:
        builder = PromptBuilder(WAN, prefix("every-prompt-references"))
        models: dict[float, list] = {0.0: builder.model}
        for _, graph, seed, _ in self.sampled:
            if graph.lora not in models:
                models[graph.lora] = builder.lora(builder.model, graph.lora)
            builder.sample(f"{graph.lora}-{seed}", models[graph.lora])
            sampler_of(builder, f"{graph.lora}-{seed}").update(seed=seed)
        references, _, _ = run(self.host, builder)
        for after, graph, seed, latent in self.sampled:
            reference = references[f"{graph.lora}-{seed}"]
            assert torch.equal(latent, reference), f"after {after}: {graph}: " + differs(latent, reference)


def interludes(node: str) -> dict[str, list]:
    """What runs between two prompts with ``node``: graphs to sample, or a name the sequence acts on."""
    return {
        "plain": [plain()],
        "plain-twice": [plain(), plain()],
        "lora": [plain(lora=1.0)],
        "lora-strength": [plain(lora=1.0), plain(lora=HALF)],
        "other-node": [through(OTHER_NODE[node])],
        "node-on-lora": [through(node, lora=1.0)],
        "lora-after-node": [Graph((("node", node), ("lora", 1.0)))],
        "node-on-lora-then-plain": [through(node, lora=1.0), plain()],
        "free": ["free"],
        "plain-then-free": [plain(), "free"],
        "free-models-and-cache": ["free-all"],
        "other-model": [Graph(arch=tm.SD3)],
        "plain-then-other-model": [plain(), Graph(arch=tm.SD3)],
        "interrupted": ["interrupt"],
        "interrupted-then-plain": ["interrupt", plain()],
    }


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_the_node_streams_every_time_it_samples_whatever_ran_before(host: ComfyHost, node: str) -> None:
    sequence = Sequence(host)
    sequence.sample(through(node), after="nothing")
    sequence.sample(through(node), after="the same prompt")  # the node's cached output, still loaded
    for name, steps in interludes(node).items():
        for step in steps:
            if step in ("free", "free-all"):
                # ComfyUI's worker wakes on the flag when idle; a prompt queued at once could still come first.
                host.free(unload_models=True, free_memory=step == "free-all")
                time.sleep(1.0)
            elif step == "interrupt":
                sequence.interrupt(node)
            else:
                sequence.sample(step, after=f"{name} (its own step)")
        sequence.sample(through(node), after=name)
    sequence.check_against_plain()


def test_plain_then_the_cached_node_streams(host: ComfyHost) -> None:
    """The report's sequence alone: the node, the plain model, the node's cached output again."""
    sequence = Sequence(host)
    for after, graph in (("nothing", through(ASYNC)), ("the node", plain()), ("plain", through(ASYNC))):
        sequence.sample(graph, after=after)
    sequence.check_against_plain()
