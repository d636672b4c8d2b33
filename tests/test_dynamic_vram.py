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

import contextlib
import gc
import itertools
import logging
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from conftest import DEVICES, HOST_VERSION
from safetensors.torch import load_file, save_file

from harness import tiny_models as tm
from harness.comfy_host import ComfyHost
from harness.inprocess import async_offload, sample
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


# -- Dynamic VRAM as ComfyUI 0.33 runs it on a GPU, reproduced on the CPU ---------------------------------

#: Checkpoints as users store them, and the dtypes ComfyUI computes in on a GPU (fp16 for Wan on recent
#: NVIDIA cards, bf16 elsewhere).
STORED = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
COMPUTE = {"fp16": torch.float16, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def stored_wan(comfy: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Wan 2.1 checkpoint (fp32) saved again in each stored dtype."""
    folder = tmp_path_factory.mktemp("stored_wan")
    state_dict = load_file(comfy.models["wan21"])
    paths = {}
    for name, dtype in STORED.items():
        paths[name] = folder / f"wan21-{name}.safetensors"
        save_file({key: value.to(dtype) for key, value in state_dict.items()}, paths[name])
    return paths


class DynamicVram:
    """ComfyUI 0.33 started with Dynamic VRAM, as ``main.py`` sets it up on an NVIDIA GPU, on the CPU.

    * The process-wide ``comfy.memory_management.aimdo_enabled`` is on, so ``comfy.ops`` Linear and
      Embedding take checkpoint tensors as stored (no cast to the model's dtype) for every model loaded
      from then on, the classic twins the nodes make included.
    * The model computes natively in half precision, as on a GPU: no manual cast (on the CPU ComfyUI
      would cast every weight to fp32 per layer, which hides a dtype mix).
    * Files are read the classic way: aimdo's safetensors reader maps them through the CUDA driver, and
      gives the same tensors.
    * The device has ``room_for_weights`` bytes for weights (``maximum_vram_for_weights``), 1 MiB unless
      a test says otherwise.
    * The dynamic MODEL is ComfyUI's own load of the file, whose patcher answers ``is_dynamic()``: on a
      CPU load device ComfyUI hands back a plain ModelPatcher (``ModelPatcherDynamic.__new__``).
    """

    def __init__(self, comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
        from comfy import memory_management
        from comfy.model_patcher import ModelPatcher

        self.comfy = comfy
        self.flag = memory_management
        read = comfy.utils.load_torch_file

        def read_classically(*args, **kwargs):
            with self.aimdo(False):
                return read(*args, **kwargs)

        monkeypatch.setattr(comfy.utils, "load_torch_file", read_classically)
        monkeypatch.setattr(comfy.mm, "unet_manual_cast", lambda *args, **kwargs: None)
        monkeypatch.setattr(self.flag, "aimdo_enabled", True)
        # A GPU smaller than the tiny models, so the nodes stream them (a model that fits is left to
        # Dynamic VRAM, see test_a_node_steps_aside_where_dynamic_vram_keeps_the_model_resident).
        self.room_for_weights = 2**20
        monkeypatch.setattr(comfy.mm, "maximum_vram_for_weights", lambda device=None: self.room_for_weights)

        class DynamicOnCPU(ModelPatcher):
            def is_dynamic(self) -> bool:
                return True

        self.patcher_class = DynamicOnCPU

    @contextlib.contextmanager
    def aimdo(self, enabled: bool) -> Iterator[None]:
        before, self.flag.aimdo_enabled = self.flag.aimdo_enabled, enabled
        try:
            yield
        finally:
            self.flag.aimdo_enabled = before

    def load(self, path: Path, dtype: torch.dtype):
        """The dynamic MODEL: ComfyUI's Load Diffusion Model with the flag on."""
        model = self.comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype})
        model.__class__ = self.patcher_class
        return model

    def load_classic(self, path: Path, dtype: torch.dtype):
        """The same file loaded as with --disable-dynamic-vram: the reference."""
        with self.aimdo(False):
            return self.comfy.sd.load_diffusion_model(str(path), model_options={"dtype": dtype})


@pytest.fixture
def dynamic_vram(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> DynamicVram:
    return DynamicVram(comfy, monkeypatch)


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
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, stored_wan: dict[str, Path], node: str, stored: str, compute: str
) -> None:
    path, dtype = stored_wan[stored], COMPUTE[compute]
    classic = dynamic_vram.load_classic(path, dtype)
    reference = sample(comfy, classic)
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
    assert streaming.model_size() == classic.model_size() == comfy.mm.module_size(streaming.model)
    engine = streaming.offload_engine
    assert engine.recorder.latest().spans, "nothing streamed"
    assert engine.placement.summary.endswith("weights from a Dynamic VRAM model streamed as a classic twin")

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

    path, dtype = stored_wan["bf16"], torch.float16
    reference = sample(comfy, with_lora(dynamic_vram.load_classic(path, dtype)))
    model = dynamic_vram.load(path, dtype)
    lora_then_offload = async_offload(comfy, with_lora(model), resident=1)
    assert lora_then_offload.patches, "the LoRA's patches were not carried to the twin"
    assert torch.equal(sample(comfy, lora_then_offload), reference)
    offload_then_lora = with_lora(async_offload(comfy, model, resident=1))
    assert torch.equal(sample(comfy, offload_then_lora), reference)
    assert offload_then_lora.model is lora_then_offload.model  # one twin per dynamic model
    assert_recorded_dtypes(offload_then_lora)
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
    notices = comfy.report.snapshot()["notices"]
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
    assert "settings stream no block" in comfy.report.snapshot()["notices"][0]
    dynamic_vram.room_for_weights = 2**40  # the device has room, the node's budget does not
    budget = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.001, policy="strided", prefetch_blocks=1, pin_memory=True
    ).result[0]
    assert isinstance(budget, comfy.patcher.BlockOffloadPatcher)
    reference = sample(comfy, dynamic_vram.load_classic(stored_wan["bf16"], torch.bfloat16))
    assert torch.equal(sample(comfy, budget), reference)
    comfy.mm.unload_all_models()


#: Blocks of the deep tiny Wan the memory test streams: enough that the stream buffers (two blocks on
#: the CPU "device") and the run's own allocations are small beside the weights.
DEEP_WAN_BLOCKS = 40


@pytest.fixture(scope="module")
def deep_wan(comfy: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Wan 2.1 (fp32) with its blocks repeated to ``DEEP_WAN_BLOCKS``; ComfyUI counts the depth."""
    state_dict = load_file(comfy.models["wan21"])
    for index in range(tm.WAN21_LAYERS, DEEP_WAN_BLOCKS):
        source = f"blocks.{index % tm.WAN21_LAYERS}."
        for key in [key for key in state_dict if key.startswith(source)]:
            state_dict[f"blocks.{index}.{key.removeprefix(source)}"] = state_dict[key].clone()
    path = tmp_path_factory.mktemp("deep_wan") / "wan21-deep.safetensors"
    save_file(state_dict, path)
    return path


def test_the_twin_adds_at_most_its_own_weights_to_host_ram(
    comfy: SimpleNamespace, dynamic_vram: DynamicVram, deep_wan: Path, capsys: pytest.CaptureFixture
) -> None:
    """Host RAM beyond what ComfyUI alone holds (the loaded dynamic MODEL) when the pack streams its twin:
    at most 1.1x the twin's weights, which is what streaming them from RAM needs. Stored fp32, computed
    in fp16: the twin is read in the stored dtype and cast, the worst case for a transient copy."""
    process = psutil.Process()
    # ComfyUI alone has run a prompt: the first run's own allocations (kernels, thread pools) are its.
    sample(comfy, dynamic_vram.load_classic(comfy.models["wan21"], torch.float16))
    comfy.mm.unload_all_models()
    model = dynamic_vram.load(deep_wan, torch.float16)
    gc.collect()
    alone = process.memory_info().rss

    streaming = async_offload(comfy, model, resident=0)
    sample(comfy, streaming)
    gc.collect()
    added = process.memory_info().rss - alone
    engine = streaming.offload_engine
    # On the CPU the "device" is RAM too: what ComfyUI loaded and the stream buffers would be VRAM on a GPU.
    device_side = streaming.loaded_size() + engine.runner.device_buffer_bytes
    twin_bytes = streaming.model_size()
    host_added = added - device_side
    with capsys.disabled():
        print(
            f"\ntwin of a {len(engine.plan.block_bytes)}-block Wan, {twin_bytes / 2**20:.1f} MiB in fp16 "
            f"(stored fp32): host RAM +{host_added / 2**20:.1f} MiB ({host_added / twin_bytes:.2f}x), of which "
            f"{engine.runner.host_bytes / 2**20:.1f} MiB the streamed blocks' host buffers; "
            f"RSS +{added / 2**20:.1f} MiB with the {device_side / 2**20:.1f} MiB a GPU would hold"
        )
    assert engine.runner.host_bytes == engine.plan.streamed_bytes
    assert host_added <= 1.1 * twin_bytes, (host_added, twin_bytes)
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
    # What ComfyUI says it loaded of the streaming model is what the pack planned resident.
    loaded = [float(mb) for mb in re.findall(r"([\d.]+) MB loaded", gpu_host.log_text()[log_start:])]
    assert loaded and abs(loaded[-1] - report["memory"]["resident_weights"] / 2**20) < 0.01, (loaded, report)
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
