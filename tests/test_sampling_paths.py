"""Ways ComfyUI's official templates run the model other than one call per step, each through the three nodes
against the same graph without them, bit for bit, in-process on the CPU: context windows (the Wan Animate 2
templates' ContextWindowsManual: several calls per step on parts of the latent), Ideogram 4's Dual Model CFG
Guider (a second model for the negative pass, run with the first one's options), the autoregressive video sampler
of Causal Forcing (calls per chunk of frames, a KV cache kept in the blocks' arguments), and a model patch that
makes room on the device in the middle of the forward and loads the models again (what the DiffSynth, Z-Image
and Uni3C control patches do when they encode their image with the VAE during sampling: ComfyUI unloads the
streaming model, wholly or in part, between two of its blocks; classic, and the Dynamic VRAM twin), and the
patches that change which blocks a step calls (Skip Layer Guidance's extra pass without some blocks, EasyCache and
LazyCache answering whole model calls from their cache).
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import HOST_VERSION
from safetensors.torch import load_file, save_file
from test_quantized_lora import assert_samples_from_the_engine

from harness import tiny_dit
from harness.inprocess import Unstreamed, async_offload, every_block_streamed, wan
from harness.prompts import ASYNC, NODES, differs

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

LATENT_FRAMES = 9  # enough for context windows of 4 frames overlapping by 2


def comfy_node(module: str, name: str) -> Any:
    """A node class of ComfyUI's ``comfy_extras.<module>``, or a skip where this ComfyUI lacks it."""
    found = getattr(importlib.import_module(f"comfy_extras.{module}"), name, None)
    if found is None:
        pytest.skip(f"ComfyUI {HOST_VERSION} has no {name}")
    return found


def wan_conds(model: Any) -> tuple[list, list]:
    """A positive and a different negative text conditioning for the tiny Wan."""
    generator = torch.Generator().manual_seed(1)
    width = model.model.diffusion_model.text_embedding[0].in_features
    return [[torch.randn(1, 7, width, generator=generator), {}]], [[torch.randn(1, 7, width, generator=generator), {}]]


def sample_video(comfy: SimpleNamespace, model: Any, steps: int = 2) -> torch.Tensor:
    """``steps`` euler steps of a 9-frame tiny Wan latent at cfg 3 (both passes batched in one call)."""
    positive, negative = wan_conds(model)
    latent = torch.zeros(1, 16, LATENT_FRAMES, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    return comfy.sample.sample(
        model, noise, steps, 3.0, "euler", "normal", positive, negative, latent, seed=5, disable_pbar=True
    )


def assert_streams_as_comfyui(
    comfy: SimpleNamespace,
    patch: Callable[[Any], Any],
    node: str,
    before_node: bool,
    streamed_by: Callable[[Any], Any] | None = None,
    models: tuple[Any, Any] | None = None,
    reference: torch.Tensor | None = None,
) -> None:
    """``patch`` applied before or after ``node`` samples what it samples without the node (``reference``, when
    the caller has it), every streamed weight read from the engine's buffers. ``models``: the model and the one
    sampled without the node (the tiny Wan)."""
    stream = streamed_by or (lambda model: every_block_streamed(comfy, node, model))
    model, reference_model = models or (wan(comfy),) * 2
    if reference is None:
        reference = sample_video(comfy, patch(reference_model))
    comfy.mm.unload_all_models()
    streamed = stream(patch(model)) if before_node else patch(stream(model))
    assert_samples_from_the_engine(comfy, streamed, lambda m: sample_video(comfy, m), reference)


def context_windows(schedule: str, freenoise: bool) -> Callable[[Any], Any]:
    def apply(model: Any) -> Any:
        node = comfy_node("nodes_context_windows", "ContextWindowsManualNode")
        options = inspect.signature(node.execute).parameters
        if freenoise and "freenoise" not in options:
            pytest.skip(f"ComfyUI {HOST_VERSION}'s context windows have no FreeNoise")
        # Windows of 4 frames overlapping by 2 on the latent's frames (dim 2); what 0.33 added left as default.
        settings = dict(context_length=4, context_overlap=2, context_schedule=schedule, context_stride=1)
        settings |= dict(closed_loop=False, fuse_method="pyramid", dim=2)
        defaults = dict(freenoise=freenoise, cond_retain_index_list="", split_conds_to_windows=False)
        defaults |= dict(latent_retain_index_list="", causal_window_fix=True)
        settings |= {key: value for key, value in defaults.items() if key in options}
        return node.execute(model=model, **settings).result[0]

    return apply


@pytest.mark.parametrize("before_node", [True, False], ids=["windows-before-node", "node-before-windows"])
@pytest.mark.parametrize(
    ("schedule", "freenoise"), [("standard_static", False), ("looped_uniform", False), ("standard_static", True)]
)
@pytest.mark.parametrize("node", NODES)
def test_context_windows_stream_as_comfyui_computes_them(
    comfy: SimpleNamespace, unstreamed: Unstreamed, node: str, schedule: str, freenoise: bool, before_node: bool
) -> None:
    windowed = context_windows(schedule, freenoise)
    plain = unstreamed.once("plain", lambda: sample_video(comfy, wan(comfy)))
    reference = unstreamed.once((schedule, freenoise), lambda: sample_video(comfy, windowed(wan(comfy))))
    assert not torch.equal(reference, plain), "the windows change nothing"
    assert_streams_as_comfyui(comfy, windowed, node, before_node, reference=reference)


def dual_model_guided(comfy: SimpleNamespace, model: Any, negative_model: Any) -> torch.Tensor:
    """Dual Model CFG Guider at cfg 4: ``model`` for the positive pass, ``negative_model`` for the negative."""
    samplers = importlib.import_module("comfy.samplers")
    guider_node = comfy_node("nodes_custom_sampler", "DualModelGuider")
    positive, negative = wan_conds(model)
    guider = guider_node.execute(model, positive, 4.0, negative_model, negative).result[0]
    latent = torch.zeros(1, 16, 1, 8, 8)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(5))
    sigmas = samplers.calculate_sigmas(model.get_model_object("model_sampling"), "normal", 3)
    return guider.sample(noise, latent, samplers.sampler_object("euler"), sigmas, seed=5, disable_pbar=True)


@pytest.mark.parametrize("streamed", ["both", "positive", "negative"])
@pytest.mark.parametrize("node", NODES)
def test_a_dual_model_guider_streams_each_model_as_comfyui_computes_it(
    comfy: SimpleNamespace, tmp_path: Path, unstreamed: Unstreamed, node: str, streamed: str
) -> None:
    positive = wan(comfy)
    other = tmp_path / "negative_wan.safetensors"  # another model of the same shape: the tiny Wan's weights x 1.25
    save_file({key: weight * 1.25 for key, weight in load_file(comfy.models["wan21"]).items()}, str(other))
    negative = comfy.sd.load_diffusion_model(str(other))
    reference = unstreamed.once("dual", lambda: dual_model_guided(comfy, positive, negative))
    one_model = unstreamed.once("dual, one model", lambda: dual_model_guided(comfy, positive, positive))
    assert not torch.equal(reference, one_model), "the second model changes nothing"
    through = {
        "positive": every_block_streamed(comfy, node, positive) if streamed != "negative" else positive,
        "negative": every_block_streamed(comfy, node, negative) if streamed != "positive" else negative,
    }
    latent = dual_model_guided(comfy, through["positive"], through["negative"])
    engines = [m.offload_engine for m in through.values() if m not in (positive, negative)]
    assert engines and all(engine is not None and engine.recorder.steps_ended > 0 for engine in engines)
    comfy.mm.unload_all_models()
    assert torch.equal(latent, reference), differs(latent, reference)


@pytest.mark.parametrize("node", NODES)
def test_the_autoregressive_video_sampler_streams_as_comfyui_computes_it(
    comfy: SimpleNamespace, unstreamed: Unstreamed, node: str
) -> None:
    samplers = importlib.import_module("comfy.samplers")
    spec = next((s for s in tiny_dit.zoo() if s.config == "WAN21_CausalAR_T2V"), None)
    ar_video = hasattr(importlib.import_module("comfy.k_diffusion.sampling"), "sample_ar_video")
    if spec is None or not spec.available() or not ar_video:
        pytest.skip(f"ComfyUI {HOST_VERSION} has no Causal Forcing model or ar_video sampler")
    model = tiny_dit.build(spec)

    def sample_chunks(m: Any) -> torch.Tensor:
        cond = tiny_dit.conditioning(spec, torch.Generator().manual_seed(1))
        shape = (*spec.latent[:2], 4, *spec.latent[3:])  # 4 frames: 2 chunks of 2
        noise = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        sampler = samplers.ksampler("ar_video", {"num_frame_per_block": 2})
        sigmas = samplers.calculate_sigmas(m.get_model_object("model_sampling"), "normal", 3)
        latent = torch.zeros(shape)
        return comfy.sample.sample_custom(m, noise, 1.0, sampler, sigmas, cond, cond, latent, seed=5, disable_pbar=True)

    reference = unstreamed.once("autoregressive", lambda: sample_chunks(model))
    assert_samples_from_the_engine(comfy, every_block_streamed(comfy, node, model), sample_chunks, reference)


#: Steps of the skipping patches' runs: enough for the caches to answer some of them and for a later step to
#: follow a skipped one.
SKIPPING_STEPS = 8
#: Model patches of ComfyUI's that change which blocks a step calls: Skip Layer Guidance adds a pass without blocks
#: 1 and 2 at every step; EasyCache and LazyCache answer whole model calls from their cache (no block called).
SKIPPING_PATCHES = {
    "skip-layer-guidance": (
        "nodes_slg",
        "SkipLayerGuidanceDiT",
        dict(double_layers="1, 2", single_layers="", scale=3.0, rescaling_scale=0.0),
    ),
    "easycache": ("nodes_easycache", "EasyCacheNode", dict(reuse_threshold=3.0, verbose=False)),
    "lazycache": ("nodes_easycache", "LazyCacheNode", dict(reuse_threshold=3.0, verbose=False)),
}
#: Settings every skipping patch above takes alike: acting from the first step to the last.
SKIPPING_RANGE = dict(start_percent=0.0, end_percent=1.0)


def skipping_patch(name: str) -> Callable[[Any], Any]:
    module, node_class, settings = SKIPPING_PATCHES[name]
    settings = {**settings, **SKIPPING_RANGE}
    return lambda model: comfy_node(module, node_class).execute(model=model, **settings).result[0]


@pytest.mark.parametrize("before_node", [True, False], ids=["patch-before-node", "node-before-patch"])
@pytest.mark.parametrize("patch", list(SKIPPING_PATCHES))
@pytest.mark.parametrize("node", NODES)
def test_patches_that_skip_blocks_or_whole_model_calls_stream_as_comfyui_computes_them(
    comfy: SimpleNamespace, unstreamed: Unstreamed, node: str, patch: str, before_node: bool
) -> None:
    """The engine learns each step's call order from the last: an extra pass calling some blocks only (Skip Layer
    Guidance), or model calls answered from a cache (EasyCache, LazyCache) between steps that call every block,
    stream bit for bit as ComfyUI computes them, the patch before or after the node."""
    apply = skipping_patch(patch)
    passes: list[int] = []  # the calls of the first block (never skipped) in each run

    def run(model: Any) -> torch.Tensor:
        first_block = model.model.diffusion_model.blocks[0]
        calls = [0]
        counting = first_block.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        try:
            return sample_video(comfy, model, steps=SKIPPING_STEPS)
        finally:
            counting.remove()
            passes.append(calls[0])

    def counted(model: Any) -> tuple[torch.Tensor, int]:
        return run(model), passes.pop()

    plain, _ = unstreamed.once(("plain", SKIPPING_STEPS), lambda: counted(wan(comfy)))
    reference, reference_passes = unstreamed.once(patch, lambda: counted(apply(wan(comfy))))
    comfy.mm.unload_all_models()
    assert not torch.equal(reference, plain), f"{patch} changes nothing: the test would prove nothing"
    model = wan(comfy)
    streamed = (
        every_block_streamed(comfy, node, apply(model))
        if before_node
        else apply(every_block_streamed(comfy, node, model))
    )
    assert_samples_from_the_engine(comfy, streamed, run, reference)
    # The passes through the blocks: two a step with Skip Layer Guidance's, fewer than the steps where a cache
    # answered; the same streamed as in the reference.
    expected = 2 * SKIPPING_STEPS if patch == "skip-layer-guidance" else reference_passes
    assert passes == [reference_passes] and reference_passes == expected, (passes, reference_passes)
    assert patch == "skip-layer-guidance" or expected < SKIPPING_STEPS, reference_passes


def making_room_mid_forward(share: float | None) -> Callable[[Any], Any]:
    """A patch after block 1 that, as the control patches encoding with the VAE during sampling, takes the models
    loaded, makes room on the device (all of it, or ``share`` of each model ComfyUI loaded) and loads them again.
    The patched model counts the unloads in ``room_made``."""

    def apply(model: Any) -> Any:
        import comfy.model_management as mm

        patched = model.clone()
        patched.room_made = []

        def replace(args: dict, extra: dict) -> Any:
            out = extra["original_block"](args)
            loaded = mm.loaded_models(only_currently_used=True)
            if share is None:
                patched.room_made += mm.free_memory(1e30, mm.get_torch_device())
            else:
                for entry in list(mm.current_loaded_models):
                    size = entry.model.loaded_size()
                    if entry.model_unload(memory_to_free=int(size * share)):  # wholly, as free_memory drops it
                        mm.current_loaded_models.remove(entry)
                    patched.room_made.append(size - entry.model.loaded_size())
            mm.load_models_gpu(loaded)
            return out

        patched.set_model_patch_replace(replace, "dit", "double_block", 1)
        return patched

    return apply


@pytest.mark.parametrize("before_node", [True, False], ids=["patch-before-node", "node-before-patch"])
@pytest.mark.parametrize("node", NODES)
def test_a_model_unloaded_between_two_blocks_and_loaded_again_streams_on(
    comfy: SimpleNamespace, unstreamed: Unstreamed, node: str, before_node: bool
) -> None:
    room = making_room_mid_forward(None)
    reference = unstreamed.once("room made", lambda: sample_video(comfy, room(wan(comfy))))
    assert_streams_as_comfyui(comfy, room, node, before_node, reference=reference)


@pytest.mark.parametrize("resident", [1, 3])
def test_a_model_partly_unloaded_between_two_blocks_streams_on(comfy: SimpleNamespace, resident: int) -> None:
    """ComfyUI unloads half of what it loaded of the streaming model (resident blocks) mid-forward, then loads it
    again; the blocks it moved compute as ComfyUI's own cast, the streamed ones from the engine's buffers."""
    room = making_room_mid_forward(0.5)
    model = async_offload(comfy, wan(comfy), resident=resident)
    probe = room(model)
    sample_video(comfy, probe, steps=1)
    assert probe.room_made and all(freed > 0 for freed in probe.room_made), probe.room_made
    comfy.mm.unload_all_models()
    assert_streams_as_comfyui(
        comfy, room, ASYNC, True, streamed_by=lambda m: async_offload(comfy, m, resident=resident)
    )


@pytest.mark.parametrize("share", [None, 0.5], ids=["wholly", "half"])
@pytest.mark.parametrize("node", NODES)
def test_a_dynamic_vram_twin_unloaded_between_two_blocks_streams_on(
    comfy: SimpleNamespace, request: pytest.FixtureRequest, node: str, share: float | None
) -> None:
    """The same on 0.33's default: the node streams a twin of the Dynamic VRAM MODEL, read from the file."""
    if HOST_VERSION.startswith("0.3."):
        pytest.skip(f"ComfyUI {HOST_VERSION} has no Dynamic VRAM")
    dynamic_vram = request.getfixturevalue("dynamic_vram")
    models = (
        dynamic_vram.load(comfy.models["wan21"], torch.float32),
        dynamic_vram.load_classic(comfy.models["wan21"], torch.float32),
    )
    assert_streams_as_comfyui(comfy, making_room_mid_forward(share), node, True, models=models)
