"""Host memory through a real ComfyUI server: what the pack holds on the host, measured at its peak.

* Unloading (``POST /free``, or ComfyUI evicting a model for the next one) gives each streamed block its
  memory back as the block's host buffer goes: two 24-block fp32 Wan experts in one prompt, as Wan 2.2
  runs them, then ``/free``; the peak resident set during the unload (the kernel's high-water mark, reset
  just before) stays within ``UNLOAD_GROWTH`` of one expert's streamed bytes above the RSS before it.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from harness import tiny_models as tm
from harness.comfy_host import HOST_DIR, ComfyHost
from harness.host_memory import peak_during, wait_until
from harness.prompts import ARCHS, PromptBuilder, evict_cached_models, prefix, run

from bench.checkpoints import resized

pytestmark = pytest.mark.usefixtures("tiny_models")

#: Wan 2.2's two experts, small: 24 blocks of 12.6 MB (dim 512) each, stored and computed in fp32 on the CPU.
EXPERT_SIZES = {"WAN21_DIM": 512, "WAN21_FFN_DIM": 1024, "WAN21_LAYERS": 24}
EXPERTS = ("wan22_high_noise", "wan22_low_noise")
#: How far above the RSS before it an unload may go, as a share of one model's streamed bytes.
UNLOAD_GROWTH = 0.10
MIB = 2**20


def expert_file(name: str) -> str:
    """Writes the expert checkpoint once (ComfyUI's loader detects it as Wan 2.1/2.2); returns its file name."""
    artifact = tm.Artifact(name, resized(tm.wan21_specs, **EXPERT_SIZES), torch.float32)
    path = Path(HOST_DIR, "models", "diffusion_models", f"block_offload_tiny_{name}.safetensors")
    if not artifact.is_current(path):
        artifact.write(path)
    return path.name


def streamed_bytes() -> int:
    """An expert's block bytes: all of them stream with ``resident_blocks`` 0."""
    specs = resized(tm.wan21_specs, **EXPERT_SIZES)()
    return sum(4 * torch.Size(spec.shape).numel() for spec in specs if spec.key.startswith("blocks."))


def streaming_models(host: ComfyHost) -> list:
    return host.get_json("/block_offload/report")["models"]


def test_unloading_two_streamed_experts_holds_no_second_copy(comfy_host: ComfyHost) -> None:
    files = [expert_file(name) for name in EXPERTS]
    comfy_host.free(unload_models=True, free_memory=True)  # what earlier tests left loaded is not measured
    evict_cached_models(comfy_host)
    builder = PromptBuilder(ARCHS[tm.WAN21], prefix("experts"))
    for name, file in zip(EXPERTS, files, strict=True):
        model = builder.add("UNETLoader", unet_name=file, weight_dtype="default")
        offloaded = builder.add(
            "AsyncBlockOffload", model=model, resident_blocks=0, prefetch_blocks=1, pin_memory=True, policy="leading"
        )
        builder.sample(name, offloaded)
    run(comfy_host, builder)
    assert len(streaming_models(comfy_host)) == 2
    streamed = streamed_bytes()
    with peak_during(comfy_host.pid) as peak:
        comfy_host.free(unload_models=True, free_memory=False)
        wait_until(lambda: streaming_models(comfy_host) == [], 60, "the experts' engines to stop")
        time.sleep(1.0)  # the rest of ComfyUI's unload (its own unpatch) and its garbage collection
    print(
        f"/free of two experts ({streamed / MIB:.0f} MiB streamed each): RSS {peak.rss_before / MIB:.0f} MiB, "
        f"peak +{peak.rss_growth / MIB:.1f} MiB; anonymous peak +{peak.anon_growth / MIB:.1f} MiB"
    )
    bound = UNLOAD_GROWTH * streamed
    assert peak.rss_growth <= bound, f"the peak is {peak.rss_growth / streamed:.2f}x an expert's streamed bytes"
    assert peak.anon_growth <= bound
