"""Reliability through a real ComfyUI server: bad input, interrupts, out of memory, long queues, unloading.

* Bad input (CPU): each node's ``validate_inputs`` turns a bad widget value into ComfyUI's 400 answer
  to POST /prompt, with a message that says what to do; what only the model can tell (too many
  resident blocks, a model without a block list) fails at execution, and the message reaches the
  websocket's ``execution_error`` and /history. The next prompt runs. Without
  BLOCK_OFFLOAD_ALLOW_CPU a ``--cpu`` server passes the model through with a warning.
* Interrupts: POST /interrupt while a prompt samples (ComfyUI checks before every op, so it lands
  inside a block); the same model then samples what a clean run does.
* Out of memory: a server whose device is limited (harness/device_limit.py, loaded as a custom node
  from tests/support) to what 1 resident block and the stream buffers need; a node asking for 4 falls
  back and says so.
* Long queue: 24 prompts through the API, alternating Wan and SD3, LoRA strengths, node settings
  and seeds, each with the same loader output sampled with and without offload. Every result equals
  its clean reference (the plain branch, and the first result of that model, LoRA and seed); the
  server's RSS (and allocated VRAM on CUDA) after the last prompts is within ``MEMORY_BOUND`` of
  after the first ones (medians of six: one prompt's figure moves by tens of MiB with what it loaded).
* Unloading: POST /free and dropping the workflow's model, round after round, leave no growth.

Items 2-4 and the unloading test run on the CPU server and, with CUDA, on a second server on the GPU.
"""

from __future__ import annotations

import os
import re
import statistics
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
from conftest import DEVICES, GPU_MODES

from harness import tiny_models as tm
from harness.comfy_client import PromptValidationError
from harness.comfy_host import CLASSIC_CACHE, HOST_DIR, REPO, ComfyHost
from harness.device_limit import LIMIT_ENV
from harness.prompts import (
    ARCHS,
    NODES,
    PromptBuilder,
    differs,
    evict_cached_models,
    interrupted_run,
    offload_prompt,
    run_offload,
    sampler_of,
    server_env,
)

pytestmark = pytest.mark.usefixtures("tiny_models")

#: How far memory after the last prompts may be from after the first ones (about 5 % of the CPU server's RSS).
LIMIT_NODE = "block_offload_device_limit"  # tests/support: the simulated device limit, as a custom node
MEMORY_BOUND = 64 * 2**20
WAN = ARCHS[tm.WAN21]
ASYNC = "AsyncBlockOffload"
COSMOS_FILE = "block_offload_test_cosmos_predict2_3_blocks.safetensors"


@pytest.fixture(params=DEVICES)
def host(request: pytest.FixtureRequest, comfy_host: ComfyHost, gpu_hosts: Callable[[str], ComfyHost]) -> ComfyHost:
    """The session's CPU server, or one on the GPU in each of ComfyUI's loading modes there."""
    return comfy_host if request.param == "cpu" else gpu_hosts(request.param)


# -- prompts --------------------------------------------------------------------------------------


def settle(host: ComfyHost) -> None:
    """ComfyUI reads /free's flags after the prompt it is running, or when idle: after two more prompts
    that load no model, they have surely been acted on."""
    for _ in range(2):
        evict_cached_models(host)


def memory(host: ComfyHost) -> tuple[int, int | None]:
    """The server's RSS, and the bytes torch has allocated on its GPU (None on the CPU)."""
    rss = psutil.Process(host.pid).memory_info().rss
    device = host.system_stats()["devices"][0]
    if device["type"] == "cpu":
        return rss, None
    return rss, device["torch_vram_total"] - device["torch_vram_free"]


def assert_no_growth(first: list[tuple[int, int | None]], last: list[tuple[int, int | None]], what: str) -> None:
    """The median of ``last`` (RSS, VRAM) is within MEMORY_BOUND of the median of ``first``: medians, because
    one prompt's figure moves by tens of MiB with the model and the activations it happened to leave."""
    for column, name in enumerate(("RSS", "allocated VRAM")):
        if first[0][column] is None:
            continue
        before = statistics.median(m[column] for m in first)
        after = statistics.median(m[column] for m in last)
        print(f"{what}: {name} {before / 2**20:.0f} MiB -> {after / 2**20:.0f} MiB")  # the figures for the docs
        assert after - before <= MEMORY_BOUND, f"{what}: {name} grew by {(after - before) / 2**20:.1f} MiB"


# -- 1. bad input ---------------------------------------------------------------------------------

RAM_GIB = psutil.virtual_memory().total / 2**30
BAD_WIDGETS = [
    pytest.param(
        ASYNC,
        {"resident_blocks": -1},
        "resident_blocks is -1; use 0 (every block streams) up to the model's number of blocks.",
        id="negative-resident",
    ),
    pytest.param(ASYNC, {"prefetch_blocks": 9}, "prefetch_blocks is 9; use 0 (copy on demand) to 8.", id="prefetch"),
    pytest.param(
        "PartialGPUResidency",
        {"vram_budget_gb": -1.0},
        "vram_budget_gb is -1.0; use 0 (automatic) or a positive number of GiB up to 1024.",
        id="negative-budget",
    ),
    pytest.param(
        "PartialGPUResidency",
        {"vram_budget_gb": 1024.0},
        f"vram_budget_gb is 1024.0 GiB but the device (cpu) has {RAM_GIB:.1f} GiB; use less, or 0 (automatic).",
        id="budget-over-device",
        marks=pytest.mark.skipif(RAM_GIB >= 1024, reason="this host has 1 TiB of RAM or more"),
    ),
    pytest.param(
        "SequentialOffloadWrapper",
        {"storage_dtype": "fp4"},
        "storage_dtype is 'fp4'; use one of: as loaded, bf16, fp16, fp8_e4m3fn, fp8_e5m2.",
        id="storage-dtype",
    ),
    pytest.param(
        "SequentialOffloadWrapper",
        {"vram_limit_gb": -0.5, "prefetch_modules": -1},
        "vram_limit_gb is -0.5; use 0 (keep no module on the device) or a positive number of GiB up to 1024. "
        "prefetch_modules is -1; use 0 (copy on demand) to 8.",
        id="negative-limit-and-prefetch",
    ),
]


@pytest.mark.parametrize(("node", "widgets", "message"), BAD_WIDGETS)
def test_bad_widget_values_are_refused_before_any_work(
    comfy_host: ComfyHost, node: str, widgets: dict[str, Any], message: str
) -> None:
    # Only the node's branch: a prompt with some valid output would run that and answer 200.
    bad = offload_prompt(node=node, name="bad", plain=False, **widgets)
    node_id = sampler_of(bad, "offload")["model"][0]
    with pytest.raises(PromptValidationError) as refused:
        comfy_host.queue(bad.prompt)
    assert list(refused.value.node_errors) == [node_id]
    details = [error["details"] for error in refused.value.node_errors[node_id]["errors"]]
    assert details and all(detail.endswith(f" - {message}") for detail in details), details
    run_offload(comfy_host, offload_prompt(node=node, name="after-bad"))  # the next prompt runs


LINKED_WIDGETS = [
    pytest.param(ASYNC, {"resident_blocks": ("PrimitiveInt", 2), "prefetch_blocks": ("PrimitiveInt", 2)}, id="async"),
    pytest.param(
        "PartialGPUResidency",
        {"vram_budget_gb": ("PrimitiveFloat", 0.001), "prefetch_blocks": ("PrimitiveInt", 0)},
        id="partial",
    ),
    pytest.param(
        "SequentialOffloadWrapper",
        {"vram_limit_gb": ("PrimitiveFloat", 0.0), "prefetch_modules": ("PrimitiveInt", 2)},
        id="sequential",
    ),
]


@pytest.mark.parametrize(("node", "links"), LINKED_WIDGETS)
def test_widgets_fed_by_other_nodes_are_checked_when_the_node_runs(
    comfy_host: ComfyHost, node: str, links: dict[str, tuple[str, Any]]
) -> None:
    """A widget converted to an input has no value when the prompt is validated: the prompt must be
    accepted (ComfyUI passes no value for a link to ``validate_inputs``), stream as with widgets, and
    a bad value must still be refused, when the node runs."""
    builder = offload_prompt(node=node, name="linked")
    offload = builder.prompt[sampler_of(builder, "offload")["model"][0]]["inputs"]
    for name, (primitive, value) in links.items():
        offload[name] = builder.add(primitive, value=value)
    run_offload(comfy_host, builder)

    # A bad value through a link fails when the node runs, with the message a widget would get.
    name = next(name for name in links if name.startswith("prefetch_"))
    offload[name] = builder.add("PrimitiveInt", value=-1)
    assert execution_error(comfy_host, builder) == f"{name} is -1; use 0 (copy on demand) to 8."
    run_offload(comfy_host, offload_prompt(node=node, name="after-linked"))


@pytest.fixture(scope="module")
def cosmos_predict2(comfy: SimpleNamespace) -> str:
    """A tiny Cosmos Predict2 (MiniTrainDIT) checkpoint of 3 blocks, a model the block nodes' old table refused.
    ComfyUI's own detection sizes it from its tensors; its other sizes are MiniTrainDIT's defaults."""
    path = HOST_DIR / "models" / "diffusion_models" / COSMOS_FILE
    if not path.exists():
        import comfy.ops
        from comfy.ldm.cosmos.predict2 import MiniTrainDIT
        from comfy.model_detection import detect_unet_config
        from safetensors.torch import save_file

        channels, in_channels = 64, 16
        probe = {
            "x_embedder.proj.1.weight": torch.zeros(channels, (in_channels + 1) * 4),
            **{f"blocks.{index}.mlp.layer1.weight": torch.zeros(1) for index in range(3)},
        }
        config = detect_unet_config(probe, "")
        config.pop("image_model")
        model = MiniTrainDIT(**config, operations=comfy.ops.disable_weight_init)
        generator = torch.Generator().manual_seed(0)
        tensors = {k: torch.randn(v.shape, generator=generator) * 0.02 for k, v in model.state_dict().items()}
        written = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # whole, then renamed: suites run side by side
        save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(written))
        os.replace(written, path)
    return COSMOS_FILE


def execution_error(host: ComfyHost, builder: PromptBuilder) -> str:
    """Runs a prompt that must fail at execution; the message as the websocket and /history carry it."""
    result = host.run(builder.prompt, timeout=120)
    assert result.status == "error", result.summary()
    message = result.error()["exception_message"]
    history = dict(result.history["status"]["messages"])
    assert history["execution_error"]["exception_message"] == message
    assert result.error()["node_type"] == history["execution_error"]["node_type"]
    return message.strip()  # ComfyUI appends a line of tips (empty here)


def test_execution_time_errors_reach_the_websocket_and_history(comfy_host: ComfyHost, cosmos_predict2: str) -> None:
    too_many = offload_prompt(name="too-many", plain=False, resident_blocks=9)
    assert execution_error(comfy_host, too_many) == "resident_blocks is 9 but this model has 5 blocks; use 0 to 5."
    run_offload(comfy_host, offload_prompt(name="after-too-many"))

    # A model the old block table refused, loaded by ComfyUI's detection: the node finds its blocks and streams
    # them (the plan line; the one-block Wan of test_every_dit.py has none, and streams module by module). The
    # tiny text encoder's 4096-wide conditioning then fails the sampler in the model's own cross-attention
    # (Cosmos takes 1024), where ComfyUI fails it without the node too.
    log_start = len(comfy_host.log_text())
    cosmos = offload_prompt(name="cosmos", plain=False)
    cosmos.prompt[cosmos.model[0]]["inputs"]["unet_name"] = cosmos_predict2
    message = execution_error(comfy_host, cosmos)
    assert "shapes cannot be multiplied" in message, message
    lines = [line for line in comfy_host.log_text()[log_start:].splitlines() if "Block Offload (" in line]
    # 0.33's detection counts the blocks in the file; 0.3.75's reads only the widths, and builds MiniTrainDIT's
    # default count (its missing weights left as created).
    found = r"Block Offload \(Async Block Offload\): MiniTrainDIT \(blocks: (\d+) x Block; [\d.]+ GiB\): 1/\1 blocks"
    assert any(re.match(found, line) for line in lines), lines
    run_offload(comfy_host, offload_prompt(name="after-cosmos"))


@pytest.fixture(scope="module")
def cpu_only_host() -> Iterator[ComfyHost]:
    """ComfyUI with --cpu and without BLOCK_OFFLOAD_ALLOW_CPU, as a user without a GPU runs it."""
    env = {k: v for k, v in os.environ.items() if k != "BLOCK_OFFLOAD_ALLOW_CPU"}
    with ComfyHost(env=env, extra_args=CLASSIC_CACHE) as host:
        yield host


@pytest.mark.parametrize("node", [class_type for class_type, _, _ in NODES.values()])
def test_on_a_cpu_only_comfyui_the_nodes_pass_the_model_through(cpu_only_host: ComfyHost, node: str) -> None:
    _, log = run_offload(cpu_only_host, offload_prompt(node=node, name="cpu-only"))
    warnings = [line for line in log.splitlines() if "passing the model through unchanged" in line]
    assert len(warnings) == 1 and "ComfyUI runs this model on the CPU, so there is no GPU memory to save" in warnings[0]
    assert "blocks resident (" not in log and "every module streamed" not in log


# -- 2. interrupts --------------------------------------------------------------------------------


def test_interrupt_mid_sampling_then_the_same_model_samples_as_a_clean_run(host: ComfyHost) -> None:
    """Three interrupts of a 10 000-step prompt, at different steps and prefetch depths, on the loader's
    cached MODEL; then the clean prompt again, which must give the first clean result bit for bit."""
    clean = offload_prompt(name="clean", resident_blocks=1, prefetch_blocks=2, seed=7)
    reference, _ = run_offload(host, clean)
    before = [memory(host)]
    for at_step, prefetch in ((2, 2), (5, 1), (9, 0)):
        long = offload_prompt(name="long", resident_blocks=1, prefetch_blocks=prefetch, seed=at_step, steps=10_000)
        interrupted_run(host, long, at_step)
    again = offload_prompt(name="again", resident_blocks=1, prefetch_blocks=2, seed=7)
    latent, _ = run_offload(host, again)
    assert torch.equal(latent, reference), differs(latent, reference)
    assert_no_growth(before, [memory(host)], "three interrupts")


# -- 3. out of memory -----------------------------------------------------------------------------


@pytest.fixture(scope="module", params=DEVICES)
def limited_host(
    request: pytest.FixtureRequest,
    comfy_host: ComfyHost,
    gpu_hosts: Callable[[str], ComfyHost],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[ComfyHost]:
    """A server whose device holds what Wan with 1 resident block and the 2 buffers of prefetch 1 need,
    and half a block more; measured on the unlimited server of the same device."""
    cpu = request.param == "cpu"
    base = comfy_host if cpu else gpu_hosts(request.param)
    loaded = {}
    for resident in (1, 2):
        # Unloaded first: an earlier prompt with the same settings left its resident blocks loaded (parked), and
        # ComfyUI logs no load for a model that is already loaded.
        base.free(unload_models=True, free_memory=False)
        _, log = run_offload(base, offload_prompt(name="measure", resident_blocks=resident, seed=1000 + resident))
        # What ComfyUI loaded of the streaming model, from its own log line of that load (the only partial load
        # of the prompt; to 0.01 MB, well inside the half block of slack below).
        (megabytes,) = re.findall(r"([\d.]+) MB loaded, full load: False", log)
        loaded[resident] = int(float(megabytes) * 2**20)
    block = loaded[2] - loaded[1]
    limit = loaded[1] + 2 * block + block // 2
    # Its own base directory: the pack and the device limit as custom nodes, the shared models.
    base_dir = tmp_path_factory.mktemp("limited")
    (base_dir / "custom_nodes").mkdir()
    (base_dir / "custom_nodes" / "block_offload").symlink_to(REPO)
    (base_dir / "custom_nodes" / LIMIT_NODE).symlink_to(REPO / "tests" / "support" / LIMIT_NODE)
    (base_dir / "models").symlink_to(HOST_DIR / "models")
    env = server_env(**{LIMIT_ENV: str(limit)})
    mode = () if cpu else GPU_MODES[request.param.removeprefix("cuda-")]
    with ComfyHost(base_dir=base_dir, cpu=cpu, env=env, extra_args=(*mode, *CLASSIC_CACHE)) as host:
        yield host


def test_out_of_memory_falls_back_to_more_streaming_and_says_so(limited_host: ComfyHost) -> None:
    notice = "Out of memory placing 4 resident blocks with prefetch 1; fell back to 1 with prefetch 1."
    _, log = run_offload(limited_host, offload_prompt(name="oom", resident_blocks=4, prefetch_blocks=1))
    assert f"Block Offload (Async Block Offload): {notice}" in log.splitlines()
    found = "WanModel (blocks: 5 x WanAttentionBlock; 0.01 GiB)"
    assert f"Block Offload (Async Block Offload): {found}: 1/5 blocks resident (0, leading), 4 streamed" in log
    assert notice in limited_host.get_json("/block_offload/report")["notices"]
    # Later prompts on the same model start from the placement that fit, and say so only in the panel.
    for seed, lora in ((2, 0.0), (3, 1.0)):
        _, log = run_offload(limited_host, offload_prompt(name="oom-again", resident_blocks=4, seed=seed, lora=lora))
        assert "1/5 blocks resident" in log and "Out of memory" not in log
        assert notice in limited_host.get_json("/block_offload/report")["notices"]


# -- 4. a long queue ------------------------------------------------------------------------------

SETTINGS = [
    (ASYNC, {"resident_blocks": 0, "prefetch_blocks": 1, "pin_memory": True}),
    (ASYNC, {"resident_blocks": 2, "prefetch_blocks": 2, "pin_memory": False}),
    ("PartialGPUResidency", {"vram_budget_gb": 0.001, "policy": "strided", "prefetch_blocks": 0}),
    ("PartialGPUResidency", {"vram_budget_gb": 0.001, "policy": "trailing", "prefetch_blocks": 1}),
    ("SequentialOffloadWrapper", {"vram_limit_gb": 0.001, "prefetch_modules": 2}),
    (ASYNC, {"resident_blocks": 3, "prefetch_blocks": 0, "pin_memory": True}),
]
QUEUE = [
    # (arch, LoRA strength, node and its settings, seed): each key (arch, strength, seed) comes up twice or more
    (ARCHS[(tm.WAN21, tm.SD3)[i % 2]], (0.0, 0.5, 1.0)[i // 2 % 3], SETTINGS[i // 3 % len(SETTINGS)], 1 + i // 6 % 2)
    for i in range(24)
]


def test_a_long_queue_gives_clean_results_without_memory_growth(host: ComfyHost) -> None:
    references: dict[tuple[str, float, int], torch.Tensor] = {}
    after: list[tuple[int, int | None]] = []
    started = time.monotonic()
    for arch, lora, (node, widgets), seed in QUEUE:
        latent, _ = run_offload(host, offload_prompt(arch, node, seed=seed, lora=lora, name="queue", **widgets))
        reference = references.setdefault((arch.name, lora, seed), latent)
        assert torch.equal(latent, reference), f"{arch.name} LoRA {lora} seed {seed}: " + differs(latent, reference)
        after.append(memory(host))
    assert len(references) == 12 and len(after) == len(QUEUE)
    # Six prompts each (three of each model) after the first, and the last six.
    assert_no_growth(after[1:7], after[-6:], f"{len(QUEUE)} prompts in {time.monotonic() - started:.0f} s")


# -- 6. unloading ---------------------------------------------------------------------------------


def test_free_and_dropping_the_model_leave_nothing_behind(host: ComfyHost) -> None:
    """Round after round: a streaming prompt, then POST /free (unload_models) or a prompt without the
    model (ComfyUI's cache drops the loader's output); memory after the last round equals after the first."""
    after = []
    for round_ in range(12):
        run_offload(host, offload_prompt(name="unload", resident_blocks=1, seed=round_))
        if round_ % 2:
            host.free(unload_models=True, free_memory=False)
        settle(host)  # runs prompts without the model: the cache drops it
        after.append(memory(host))
    assert_no_growth(after[1:5], after[-4:], f"{len(after)} rounds of /free and dropped models")
