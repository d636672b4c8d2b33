"""Dynamic VRAM (ComfyUI 0.33 and later): the nodes stream a classic twin of the model.

On a ``ModelPatcherDynamic`` MODEL the nodes call ``clone(disable_dynamic=True)`` (ComfyUI's own way to
get a classic patcher of the same checkpoint, used by its TorchCompileModel) and stream that;
docs/comfyui-integration.md says why and what it costs.

Without CUDA, ComfyUI cannot build a ``ModelPatcherDynamic`` (comfy-aimdo's host buffers need the CUDA
driver, and on a CPU load device the class hands back a plain ModelPatcher). The in-process tests
therefore give a real ModelPatcher, loaded by ComfyUI's own loader, the one property the nodes look at:
``is_dynamic()`` answers True. Everything after that, ComfyUI's ``clone(disable_dynamic=True)``
reloading the checkpoint, loading, sampling and streaming, is ComfyUI's and the pack's real code.
The CUDA tests run the real thing through a server, Dynamic VRAM on (0.33's default) and off.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION

from harness import tiny_models as tm
from harness.comfy_host import CLASSIC_CACHE, ComfyHost
from harness.inprocess import async_offload, sample, wan
from harness.prompts import ARCHS, NODES, PromptBuilder, differs, evict_cached_models, offload_prompt, run, server_env

pytestmark = [
    pytest.mark.skipif(
        HOST_VERSION.startswith("0.3."), reason=f"ComfyUI {HOST_VERSION} has no Dynamic VRAM (it came in 0.4)"
    ),
    pytest.mark.usefixtures("allow_cpu_streaming"),
]


def dynamic(comfy: SimpleNamespace):
    """A Wan model from ComfyUI's loader whose patcher says it is managed by Dynamic VRAM."""
    from comfy.model_patcher import ModelPatcher

    class DynamicOnCPU(ModelPatcher):
        def is_dynamic(self) -> bool:
            return True

    model = wan(comfy)
    model.__class__ = DynamicOnCPU
    return model


def weights(model) -> dict[str, torch.Tensor]:
    return {key: value.clone() for key, value in model.model.state_dict().items()}


def test_a_dynamic_model_streams_as_a_classic_twin_and_stays_untouched(comfy: SimpleNamespace) -> None:
    reference = sample(comfy, wan(comfy))  # the same checkpoint, classic and fully loaded
    comfy.mm.unload_all_models()
    model = dynamic(comfy)
    before = weights(model)

    streaming = async_offload(comfy, model, resident=1)
    assert not streaming.is_dynamic() and isinstance(streaming, comfy.patcher.BlockOffloadPatcher)
    assert streaming.model is not model.model, "the twin must be its own module, not the dynamic one"
    assert torch.equal(sample(comfy, streaming), reference)
    step = streaming.offload_engine.recorder.latest()
    assert [span.block for span in step.spans] == list(range(5))
    assert sum(span.bytes_copied for span in step.spans) == streaming.offload_engine.plan.streamed_bytes > 0

    # A second node on the same dynamic model streams the same twin: the checkpoint is not read again.
    again = comfy.nodes.PartialGPUResidency.execute(
        model, vram_budget_gb=0.001, policy="strided", prefetch_blocks=2, pin_memory=True
    ).result[0]
    assert again.model is streaming.model
    assert torch.equal(sample(comfy, again), reference)

    comfy.mm.unload_all_models()
    assert model.is_dynamic() and model.get_attachment(comfy.patcher.ATTACHMENT) is None
    for key, value in model.model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_lora_before_or_after_the_node_on_a_dynamic_model(comfy: SimpleNamespace) -> None:
    lora = comfy.utils.load_torch_file(str(comfy.models["wan21_lora"]))

    def with_lora(m):
        return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0)[0]

    reference = sample(comfy, with_lora(wan(comfy)))
    model = dynamic(comfy)
    lora_then_offload = async_offload(comfy, with_lora(model), resident=1)
    assert lora_then_offload.patches, "the LoRA's patches were not carried to the twin"
    assert torch.equal(sample(comfy, lora_then_offload), reference)
    offload_then_lora = with_lora(async_offload(comfy, model, resident=1))
    assert torch.equal(sample(comfy, offload_then_lora), reference)
    assert offload_then_lora.model is lora_then_offload.model  # one twin per dynamic model
    comfy.mm.unload_all_models()


def test_a_dynamic_model_without_a_reload_recipe_is_refused_with_what_to_do(comfy: SimpleNamespace) -> None:
    model = dynamic(comfy)
    model.cached_patcher_init = None  # what a custom loader (e.g. GGUF) leaves
    with pytest.raises(ValueError, match=r"Dynamic VRAM.*core loader.*--disable-dynamic-vram"):
        async_offload(comfy, model)


# -- on a GPU, the real Dynamic VRAM ------------------------------------------------------------------

CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: 0.33's default on NVIDIA, and the classic loader it keeps behind --disable-dynamic-vram.
MODES = {"dynamic-vram": (), "classic": ("--disable-dynamic-vram",)}
#: VRAM torch may still hold after /free: the allocator's workspace, cuBLAS handles (not weights).
FREED_SLACK = 64 * 2**20


@pytest.fixture(scope="module", params=list(MODES))
def gpu_host(request: pytest.FixtureRequest) -> Iterator[ComfyHost]:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    with ComfyHost(cpu=False, extra_args=(*MODES[request.param], *CLASSIC_CACHE), env=server_env()) as host:
        yield host


def vram_allocated(host: ComfyHost) -> int:
    device = host.system_stats()["devices"][0]
    return device["torch_vram_total"] - device["torch_vram_free"]


@CUDA_ONLY
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


@CUDA_ONLY
def test_on_a_gpu_the_parking_hand_over_works_under_dynamic_vram(gpu_host: ComfyHost) -> None:
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
