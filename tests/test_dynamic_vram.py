"""Dynamic VRAM (ComfyUI 0.33 and later): the nodes stream a classic twin of the model.

On a ``ModelPatcherDynamic`` MODEL the nodes call ``clone(disable_dynamic=True)`` (ComfyUI's own way to
get a classic patcher of the same checkpoint, used by its TorchCompileModel) and stream that, cast to the
dtypes ComfyUI recorded (``nodes/dynamic_vram.py``; docs/comfyui-integration.md says why).

Without CUDA ComfyUI cannot build a ``ModelPatcherDynamic``, but what breaks a twin on a GPU is not the
patcher: it is the process-wide flag Dynamic VRAM sets and the half-precision compute a GPU runs.
``DynamicVram`` below recreates exactly those on the CPU; everything after that, ComfyUI's loader and
``clone(disable_dynamic=True)``, loading, sampling and streaming, is ComfyUI's and the pack's real code.
Each case is compared bitwise with the same file loaded the classic way in the same compute dtype.
The CUDA tests run the real thing through a server, Dynamic VRAM on (0.33's default) and off.
"""

from __future__ import annotations

import itertools
import logging
import re
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import DEVICES, HOST_VERSION
from safetensors.torch import load_file

from harness import tiny_models as tm
from harness.comfy_host import ComfyHost
from harness.dynamic_vram import COMPUTE, STORED, DynamicVram
from harness.inprocess import Unstreamed, async_offload, sample
from harness.prompts import (
    ARCHS,
    ASYNC,
    NODES,
    PARTIAL,
    SEQUENTIAL,
    PromptBuilder,
    differs,
    evict_cached_models,
    offload_prompt,
    run,
)

pytestmark = [
    pytest.mark.skipif(
        HOST_VERSION.startswith("0.3."), reason=f"ComfyUI {HOST_VERSION} has no Dynamic VRAM (it came in 0.4)"
    ),
    pytest.mark.usefixtures("allow_cpu_streaming"),
]


def weights(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.model.state_dict().items()}


def assert_recorded_dtypes(model) -> None:
    """Every parameter and buffer has the dtype ComfyUI recorded for it (``*_comfy_model_dtype``)."""
    for name, module in model.model.named_modules():
        tensors = itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
        for key, tensor in tensors:
            recorded = getattr(module, f"{key}_comfy_model_dtype", None)
            assert recorded in (None, tensor.dtype), f"{name}.{key} is {tensor.dtype}, ComfyUI recorded {recorded}"


def run_node(comfy: SimpleNamespace, node: str, model, budget_gb: float = 0.001):
    """``node`` on ``model``; Partial GPU Residency with ``budget_gb`` (0: automatic)."""
    if node == ASYNC:
        return async_offload(comfy, model, resident=1)
    if node == PARTIAL:
        return comfy.nodes.PartialGPUResidency.execute(
            model, vram_budget_gb=budget_gb, policy="strided", prefetch_blocks=2, pin_memory=True
        ).result[0]
    return comfy.nodes.SequentialOffloadWrapper.execute(
        model, storage_dtype="as loaded", vram_limit_gb=0.0, prefetch_modules=1, pin_memory=True
    ).result[0]


@pytest.mark.parametrize("compute", list(COMPUTE))
@pytest.mark.parametrize("stored", list(STORED))
@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_every_node_streams_a_dynamic_model_exactly_as_its_classic_load(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    stored_wan: dict[str, Path],
    unstreamed: Unstreamed,
    node: str,
    stored: str,
    compute: str,
) -> None:
    path, dtype = stored_wan[stored], COMPUTE[compute]

    def classic_run() -> tuple[torch.Tensor, int]:  # the file loaded the classic way: its latent and its size
        classic = dynamic_vram.load_classic(path, dtype)
        return sample(comfy, classic), classic.model_size()

    reference, classic_size = unstreamed.once((stored, compute), classic_run)
    comfy.mm.unload_all_models()
    model = dynamic_vram.load(path, dtype)
    before = weights(model)

    streaming = run_node(comfy, node, model)
    assert not streaming.is_dynamic() and isinstance(streaming, comfy.patcher.BlockOffloadPatcher)
    assert streaming.model is not model.model, "the twin must be its own module, not the dynamic one"
    latent = sample(comfy, streaming)
    assert torch.equal(latent, reference), differs(latent, reference)
    assert_recorded_dtypes(streaming)
    # ComfyUI's books count the twin's weights as they are, not the dynamic parent's stored bytes.
    assert streaming.model_size() == classic_size == comfy.mm.module_size(streaming.model)
    engine = streaming.offload_engine
    assert engine.recorder.latest().spans, "nothing streamed"
    assert engine.placement.summary.endswith("weights from a Dynamic VRAM model, streamed from its checkpoint file")

    comfy.mm.unload_all_models()
    assert model.is_dynamic() and model.get_attachment(comfy.patcher.ATTACHMENT) is None
    for key, value in model.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_a_second_node_on_a_dynamic_model_streams_the_same_twin(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path]
) -> None:
    path, dtype = stored_wan["fp32"], torch.float16
    reference = sample(comfy, dynamic_vram.load_classic(path, dtype))
    model = dynamic_vram.load(path, dtype)
    first = async_offload(comfy, model, resident=1)
    assert torch.equal(sample(comfy, first), reference)
    again = run_node(comfy, PARTIAL, model)
    assert again.model is first.model, "the checkpoint was read a second time"
    assert again.model_size() == first.model_size() == comfy.mm.module_size(first.model)
    assert torch.equal(sample(comfy, again), reference)
    comfy.mm.unload_all_models()


def test_lora_before_or_after_the_node_on_a_dynamic_model(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path]
) -> None:
    lora = load_file(comfy.models["wan21_lora"])

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0)[0]

    # On a GPU Dynamic VRAM patches a layer in the compute dtype as it casts it (a classic load: in fp32 or
    # fp16, then rounded): the node computes what the Dynamic VRAM MODEL does, not the classic load.
    path, dtype = stored_wan["bf16"], torch.bfloat16
    reference = sample(comfy, dynamic_vram.load_patched_as_cast(path, dtype, lora))
    assert not torch.equal(reference, sample(comfy, with_lora(dynamic_vram.load_classic(path, dtype))))
    model = dynamic_vram.load(path, dtype)
    lora_then_offload = async_offload(comfy, with_lora(model), resident=1)
    assert lora_then_offload.patches, "the LoRA's patches were not carried to the twin"
    assert torch.equal(sample(comfy, lora_then_offload), reference)
    offload_then_lora = with_lora(async_offload(comfy, model, resident=1))
    assert torch.equal(sample(comfy, offload_then_lora), reference)
    assert offload_then_lora.model is lora_then_offload.model  # one twin per dynamic model
    assert_recorded_dtypes(offload_then_lora)
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_the_twin_kept_loaded_across_a_plain_prompt_streams_again(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path], node: str
) -> None:
    """What a server with ``--cache-lru`` does on a GPU (H100, 2026-11-26): the node's output stays cached
    while a prompt samples the plain Dynamic VRAM model. The twin is a model of its own, so ComfyUI keeps it
    loaded, idle, as it keeps any model it has room for (a smaller card unloads it through ComfyUI's
    ``free_memory``); the plain model runs without it, and the cached twin streams again the next time."""
    path, dtype = stored_wan["bf16"], torch.bfloat16
    reference = sample(comfy, dynamic_vram.load_classic(path, dtype))
    comfy.mm.unload_all_models()
    model = dynamic_vram.load(path, dtype)
    twin = run_node(comfy, node, model)
    assert torch.equal(sample(comfy, twin), reference)
    first_run = twin.offload_engine.recorder.latest()
    books = twin.loaded_size()

    # The plain prompt's load, as its sampler asks ComfyUI (on the CPU the stand-in for Dynamic VRAM's patcher
    # cannot compute: its casts are comfy-aimdo's, on the device).
    comfy.mm.load_models_gpu([model])
    loaded = [loaded.model for loaded in comfy.mm.current_loaded_models]
    assert twin in loaded and model in loaded, "ComfyUI keeps both: two models, room for each"
    assert twin.offload_engine.recorder.latest() is first_run, "the plain model ran through the twin's engine"
    assert twin.loaded_size() == books, "the twin's books moved"

    latent = sample(comfy, twin)
    assert torch.equal(latent, reference), differs(latent, reference)
    assert twin.offload_engine.recorder.latest() is not first_run, "the cached twin sampled without streaming"
    assert twin.offload_engine.recorder.latest().spans, "nothing streamed"
    comfy.mm.unload_all_models()


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_dynamic_patcher_class_with_its_own_classic_path_streams_that_path(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path], node: str
) -> None:
    """A loader's own Dynamic VRAM patcher class that makes its classic clone itself, as ComfyUI-GGUF's
    ``GGUFModelPatcherDynamic`` (2026) does: its Dynamic VRAM weights are only patched right by its Dynamic VRAM
    patcher, so the node streams the model its ``clone(disable_dynamic=True)`` gives (what ComfyUI's hooks and
    TorchCompileModel run), LoRA included, rather than a twin of its Dynamic VRAM build."""
    path, dtype = stored_wan["bf16"], torch.bfloat16
    lora = load_file(comfy.models["wan21_lora"])

    class OwnClassicPath(dynamic_vram.patcher_class):
        def clone(self, disable_dynamic=False, model_override=None, **kwargs):
            if disable_dynamic and model_override is None:  # its classic reload, its own way
                model_override = dynamic_vram.load_classic(path, dtype).get_clone_model_override()
            return super().clone(disable_dynamic=disable_dynamic, model_override=model_override, **kwargs)

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0)[0]

    model = dynamic_vram.load(path, dtype)
    model.__class__ = OwnClassicPath
    reference = sample(comfy, with_lora(model.clone(disable_dynamic=True)))
    # A twin of the Dynamic VRAM build computes the LoRA as ComfyUI's Dynamic VRAM patches it, which differs.
    assert not torch.equal(reference, sample(comfy, dynamic_vram.load_patched_as_cast(path, dtype, lora)))
    comfy.mm.unload_all_models()
    streaming = run_node(comfy, node, with_lora(model))
    latent = sample(comfy, streaming)
    assert torch.equal(latent, reference), differs(latent, reference)
    engine = streaming.offload_engine
    assert engine.recorder.latest().spans, "nothing streamed"
    assert engine.placement.summary.endswith(
        "weights from the classic reload that the Dynamic VRAM model's OwnClassicPath makes of it"
    ), engine.placement.summary
    comfy.mm.unload_all_models()
    assert model.is_dynamic() and model.get_attachment(comfy.patcher.ATTACHMENT) is None


def test_a_dynamic_patcher_class_whose_clone_only_passes_arguments_on_keeps_the_file_backed_twin(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path]
) -> None:
    path, dtype = stored_wan["fp32"], torch.float16
    reference = sample(comfy, dynamic_vram.load_classic(path, dtype))

    class OwnAttributes(dynamic_vram.patcher_class):
        def clone(self, *args, **kwargs):
            cloned = super().clone(*args, **kwargs)
            cloned.own_setting = getattr(self, "own_setting", None)
            return cloned

    model = dynamic_vram.load(path, dtype)
    model.__class__ = OwnAttributes
    model.own_setting = "kept"
    streaming = async_offload(comfy, model, resident=1)
    assert streaming.own_setting == "kept"
    latent = sample(comfy, streaming)
    assert torch.equal(latent, reference), differs(latent, reference)
    summary = streaming.offload_engine.placement.summary
    assert summary.endswith("weights from a Dynamic VRAM model, streamed from its checkpoint file"), summary
    comfy.mm.unload_all_models()


def test_a_dynamic_model_without_a_reload_recipe_is_refused_with_what_to_do(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path]
) -> None:
    model = dynamic_vram.load(stored_wan["fp16"], torch.float16)
    model.cached_patcher_init = None  # what a custom loader (e.g. GGUF) leaves
    with pytest.raises(ValueError, match=r"Dynamic VRAM.*core loader.*--disable-dynamic-vram"):
        async_offload(comfy, model)


@pytest.mark.parametrize("node", [ASYNC, PARTIAL, SEQUENTIAL])
def test_a_node_steps_aside_where_dynamic_vram_keeps_the_model_resident(
    comfy: SimpleNamespace,
    dynamic_vram: DynamicVram,
    stored_wan: dict[str, Path],
    node: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a device with room for the whole model, Dynamic VRAM runs it resident, which no streamed placement
    beats: every node returns the MODEL it was given, and says why in the log and the panel."""
    model = dynamic_vram.load(stored_wan["fp32"], torch.float16)
    fp16_bytes = comfy.mm.module_size(dynamic_vram.load_classic(stored_wan["fp32"], torch.float16).model)
    dynamic_vram.room_for_weights = fp16_bytes  # fits in fp16, though the file is twice as large
    with caplog.at_level(logging.INFO):
        assert run_node(comfy, node, model, budget_gb=0.0) is model
    aside = [r.getMessage() for r in caplog.records if "steps aside" in r.getMessage()]
    assert len(aside) == 1 and f"whole model ({fp16_bytes / 2**30:.2f} GiB) fits" in aside[0], aside
    notices = comfy.panel.snapshot()["notices"]
    assert len(notices) == 1 and "stepped aside" in notices[0], notices

    from block_offload.nodes.request import STEP_ASIDE_ENV  # ComfyUI is importable once `comfy` is set up

    monkeypatch.setenv(STEP_ASIDE_ENV, "0")  # the user asks to stream anyway
    assert isinstance(run_node(comfy, node, model, budget_gb=0.0), comfy.patcher.BlockOffloadPatcher)
    monkeypatch.delenv(STEP_ASIDE_ENV)
    dynamic_vram.room_for_weights = fp16_bytes - 1
    assert isinstance(run_node(comfy, node, model, budget_gb=0.0), comfy.patcher.BlockOffloadPatcher)


def test_settings_that_stream_nothing_step_aside_and_a_budget_below_the_model_streams(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path]
) -> None:
    model = dynamic_vram.load(stored_wan["bf16"], torch.bfloat16)
    every_block = len(model.model.diffusion_model.blocks)
    assert async_offload(comfy, model, resident=every_block) is model
    assert "settings stream no block" in comfy.panel.snapshot()["notices"][0]
    dynamic_vram.room_for_weights = 2**40  # the device has room, the node's budget does not
    budget = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.001, policy="strided", prefetch_blocks=1, pin_memory=True
    ).result[0]
    assert isinstance(budget, comfy.patcher.BlockOffloadPatcher)
    reference = sample(comfy, dynamic_vram.load_classic(stored_wan["bf16"], torch.bfloat16))
    assert torch.equal(sample(comfy, budget), reference)
    comfy.mm.unload_all_models()


# -- on a GPU, the real Dynamic VRAM ------------------------------------------------------------------

#: VRAM torch may still hold after /free: the allocator's workspace, cuBLAS handles (not weights).
FREED_SLACK = 64 * 2**20
GPU_DEVICES = [device for device in DEVICES if device != "cpu"]  # Dynamic VRAM on (0.33's default) and off


@pytest.fixture(scope="module", params=GPU_DEVICES)
def gpu_host(request: pytest.FixtureRequest, gpu_hosts: Callable[[str], ComfyHost]) -> ComfyHost:
    return gpu_hosts(request.param)


def vram_allocated(host: ComfyHost) -> int:
    device = host.system_stats()["devices"][0]
    return device["torch_vram_total"] - device["torch_vram_free"]


@pytest.mark.parametrize("node", [class_type for class_type, _, _ in NODES.values()])
def test_on_a_gpu_every_node_streams_and_comfyui_keeps_true_books(gpu_host: ComfyHost, node: str) -> None:
    evict_cached_models(gpu_host)
    gpu_host.free()
    evict_cached_models(gpu_host)
    idle = vram_allocated(gpu_host)
    log_start = len(gpu_host.log_text())
    builder = offload_prompt(node=node)
    latents, log, result = run(gpu_host, builder)
    assert torch.equal(latents["offload"], latents["plain"]), differs(latents["offload"], latents["plain"])

    report = gpu_host.get_json("/block_offload/report")
    assert report["prompt_id"] == result.prompt_id and report["accelerator"], report
    last = report["last_step"]
    assert last["bytes_copied"] > 0 and "S" in report["placement"], report
    # What ComfyUI says it loaded of the streaming model is what the pack planned resident. The prompt loads the
    # text encoder and, classic, the plain model too (its whole size): one of the figures is the streaming model's.
    loaded = [float(mb) for mb in re.findall(r"([\d.]+) MB loaded", gpu_host.log_text()[log_start:])]
    resident_mb = report["memory"]["resident_weights"] / 2**20
    assert any(abs(mb - resident_mb) < 0.01 for mb in loaded), (loaded, report)
    assert report["memory"]["allocated"] >= report["memory"]["resident_weights"]

    gpu_host.free()
    evict_cached_models(gpu_host)
    evict_cached_models(gpu_host)
    assert vram_allocated(gpu_host) - idle <= FREED_SLACK, "weights stayed on the GPU after /free"


def test_on_a_gpu_the_parking_hand_over_works_in_each_mode(gpu_host: ComfyHost) -> None:
    """Two prompts on the same offload node: the second adopts the parked host buffers, same latent."""
    first, _ = _latent_of(gpu_host, seed=7)
    second, log = _latent_of(gpu_host, seed=7, no_ops=1)
    assert torch.equal(first, second), differs(first, second)


def _latent_of(host: ComfyHost, seed: int, no_ops: int = 0) -> tuple[torch.Tensor, str]:
    builder = PromptBuilder(ARCHS[tm.WAN21], f"tests/dynamic/{seed}-{no_ops}")
    latent = builder.latent
    for _ in range(no_ops):
        latent = builder.add("LatentMultiply", samples=latent, multiplier=1.0)
    builder.sample("offload", builder.offload(builder.model, "async"), latent)
    latents, log, _ = run(host, builder)
    return latents["offload"], log
