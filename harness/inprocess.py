"""ComfyUI in the test process, on the CPU: its real loader, ModelPatcher and sampler, and this pack's
nodes called as ComfyUI calls them. A tiny Wan 2.1 and a fixed conditioning make the runs comparable."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Hashable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from .prompts import ASYNC, PARTIAL

# Sampler steps of the in-process runs: enough for the engine to learn the call order and stream.
STEPS = 2


class Unstreamed:
    """What graphs sample without the nodes, by a name of the graph: each is sampled by the first case that asks,
    since it is the same in every node's case (and every order of node and patch)."""

    def __init__(self) -> None:
        self._runs: dict[Hashable, Any] = {}

    def once(self, graph: Hashable, run: Callable[[], Any]) -> Any:
        """``run()``'s result for ``graph``, run the first time it is asked for."""
        if graph not in self._runs:
            self._runs[graph] = run()
        return self._runs[graph]


def in_process_comfy(tiny_models: dict[str, Path], cpu: bool = True) -> SimpleNamespace:
    """ComfyUI's modules (its folder already on ``sys.path``; on the CPU unless ``cpu`` is False: then on the
    device ComfyUI picks) and this pack's, as ``block_offload`` (see ``pack.py``)."""
    from comfy.cli_args import args

    args.cpu = cpu
    mods = SimpleNamespace(
        mm=importlib.import_module("comfy.model_management"),
        sd=importlib.import_module("comfy.sd"),
        sample=importlib.import_module("comfy.sample"),
        utils=importlib.import_module("comfy.utils"),
        nodes=importlib.import_module("block_offload.nodes.offload_nodes"),
        patcher=importlib.import_module("block_offload.nodes.patcher"),
        placement=importlib.import_module("block_offload.nodes.placement"),
        pinned=importlib.import_module("block_offload.nodes.comfy_memory"),
        panel_feed=importlib.import_module("block_offload.nodes.panel"),
        models=tiny_models,
    )
    # The pack set up as ComfyUI sets it up (``comfy_entrypoint``), with no server: the panel its engines tell.
    mods.panel = mods.panel_feed.install_panel(None)
    return mods


def wan(comfy: SimpleNamespace):
    return comfy.sd.load_diffusion_model(str(comfy.models["wan21"]))


def sample(comfy: SimpleNamespace, model, seed: int = 5, steps: int = STEPS) -> torch.Tensor:
    """A few steps of the tiny Wan (a video latent); the zoo's models sample with ``harness.tiny_dit.sample``."""
    text_width = model.model.diffusion_model.text_embedding[0].in_features
    latent = torch.zeros(1, 16, 1, 8, 8)
    cond = [[torch.randn(1, 7, text_width, generator=torch.Generator().manual_seed(1)), {}]]
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(seed))
    return comfy.sample.sample(
        model, noise, steps, 1.0, "euler", "normal", cond, cond, latent, seed=seed, disable_pbar=True
    )


def async_offload(comfy: SimpleNamespace, model, resident: int = 1, prefetch: int = 1, policy: str = "leading"):
    """Async Block Offload on ``model``: the first ``resident`` blocks stay, unless ``policy`` says otherwise."""
    return comfy.nodes.AsyncBlockOffload.execute(
        model, resident_blocks=resident, prefetch_blocks=prefetch, pin_memory=True, policy=policy
    ).result[0]


def offloaded(comfy: SimpleNamespace, node: str, model):
    """``model`` through ``node`` ("async", "partial", "sequential") with the e2e tests' settings: 1 resident
    block, a budget that streams every block, every module streamed."""
    if node == ASYNC:
        return async_offload(comfy, model, resident=1)
    if node == PARTIAL:
        return comfy.nodes.PartialGPUResidency.execute(
            model, vram_budget_gb=0.001, policy="strided", prefetch_blocks=1, pin_memory=True
        ).result[0]
    return comfy.nodes.SequentialOffloadWrapper.execute(
        model, storage_dtype="as loaded", vram_limit_gb=0.0, prefetch_modules=1, pin_memory=True
    ).result[0]


def count_packs(monkeypatch) -> list[int]:
    """From now on, the bytes of every host buffer a block is packed into (``BlockLayout.pack_into``, before the
    first step or by the packing thread): empty while parked buffers are adopted and nothing is packed again."""
    from block_offload.offload.layout import BlockLayout

    packed: list[int] = []
    pack_into = BlockLayout.pack_into

    def counting(self, host, *args, **kwargs):
        packed.append(host.numel())
        return pack_into(self, host, *args, **kwargs)

    monkeypatch.setattr(BlockLayout, "pack_into", counting)
    return packed


def every_block_streamed(comfy: SimpleNamespace, node: str, model):
    """``model`` through ``node`` ("async", "partial", "sequential"), no block kept on the device: the tiny
    models' blocks are a few KiB."""
    if node == ASYNC:
        return async_offload(comfy, model, resident=0)
    if node == PARTIAL:
        run = comfy.nodes.PartialGPUResidency.execute
        return run(model, vram_budget_gb=1e-6, policy="strided", prefetch_blocks=1, pin_memory=True).result[0]
    return offloaded(comfy, node, model)
