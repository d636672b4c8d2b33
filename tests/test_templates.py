"""ComfyUI's official templates run through a real server on tiny models, without any node of ours: the reference
runs that the templates with our streaming node inserted are compared with, bit for bit (the shipped
``example_workflows/streamed_*.json``, here; a node of each kind on each tiny architecture, tests/test_every_dit.py).

Each template's API prompt is what the real frontend (headless Chromium) queues for it; ``for_tiny_models`` changes
only what feeds the diffusion models (``harness/templates.py``); the files it loads are tiny stand-ins under the
template's own names (``harness/template_models.py``). A template a host cannot run is skipped, saying why.
"""

from __future__ import annotations

import copy
import re
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
import torch

from harness import streamed_templates
from harness.browser import browser_page, chromium_missing, launch_browser
from harness.comfy_host import ComfyHost
from harness.official_templates import official_template
from harness.template_models import TinyFile, template_files, write_template_models
from harness.template_prompts import (
    CLIP_TYPE_FOR_TINY,
    LATENT_TAP,
    PIXEL_TAP,
    SIZE_NODES,
    SWITCH,
    TEXT_GENERATORS,
    TINY_FRAMES,
    TINY_SIDE,
    Prompt,
    constant,
    fold_switches,
    for_host,
    for_tiny_models,
    is_link,
    missing_nodes,
    switch_primitives,
    with_lora,
)
from harness.templates import (
    TEMPLATE_BY_NAME,
    TEMPLATES,
    TemplateRun,
    api_prompt,
    comfyui_version,
    has_model_class,
    load_problems,
    reference_prompt,
    run_template,
    same_outputs,
    why_not_runnable,
)

pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: run scripts/setup.sh")

pytestmark = pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))

NAMES = tuple(t.name for t in TEMPLATES)
#: The loaders whose files must be ours: their models folder and the input naming the file.
MODEL_LOADERS = MappingProxyType(
    {
        "UNETLoader": ("diffusion_models", "unet_name"),
        "CheckpointLoaderSimple": ("checkpoints", "ckpt_name"),
    }
)
#: Samplers, whose re-execution a determinism check must see.
SAMPLERS = frozenset({"KSampler", "KSamplerAdvanced", "SamplerCustomAdvanced"})


@pytest.fixture(scope="module")
def page(comfy_host: ComfyHost) -> Iterator[Any]:
    """The host's own frontend in headless Chromium, shared by the module's tests."""
    with launch_browser() as browser, browser_page(browser, comfy_host) as page:
        yield page


@pytest.fixture(scope="module")
def object_info(comfy_host: ComfyHost) -> dict[str, Any]:
    return comfy_host.object_info()


@pytest.fixture(scope="module")
def version(comfy_host: ComfyHost) -> str:
    return comfyui_version(comfy_host.comfyui_path)


def runnable(name: str, comfy_host: ComfyHost) -> None:
    """Skips the test, saying why, where ``name`` cannot run on this host's ComfyUI."""
    why = why_not_runnable(name, comfy_host.comfyui_path)
    if why is not None:
        pytest.skip(why)


@pytest.fixture(scope="module")
def prepared(page: Any, comfy_host: ComfyHost, object_info: dict[str, Any], version: str) -> Callable[[str], Prompt]:
    """The reference prompt of a template this host runs (its tiny files written), or a skip naming what the host
    lacks. The frontend makes each template's prompt once per module."""
    prompts: dict[str, Prompt] = {}

    def prepare(name: str) -> Prompt:
        runnable(name, comfy_host)
        if name not in prompts:
            prompts[name] = reference_prompt(page, name, object_info)
        prompt = copy.deepcopy(prompts[name])
        missing = missing_nodes(prompt, object_info)
        if missing:
            pytest.skip(f"ComfyUI {version} lacks the node classes {missing}")
        write_template_models(name, comfy_host.base_dir / "models")
        return prompt

    return prepare


@pytest.fixture(scope="module")
def references(comfy_host: ComfyHost, prepared: Callable[[str], Prompt]) -> Callable[[str], TemplateRun]:
    """The reference run of a template, run once per module."""
    runs: dict[str, TemplateRun] = {}

    def reference(name: str) -> TemplateRun:
        if name not in runs:
            runs[name] = run_template(comfy_host, prepared(name), f"tests/templates/{uuid.uuid4().hex[:8]}/{name}")
        return runs[name]

    return reference


def ours(name: str, path: Path) -> bool:
    """Whether ``path`` is the tiny stand-in of template ``name`` for its file name (its metadata says so)."""
    return any(isinstance(f, TinyFile) and f.name == path.name and f.is_current(path) for f in template_files(name))


@pytest.mark.parametrize("name", NAMES)
def test_template_runs_on_tiny_models(
    name: str, comfy_host: ComfyHost, version: str, references: Callable[[str], TemplateRun]
) -> None:
    """The template's graph runs to its end on the tiny files: its image or video comes out at the tiny size,
    the latents it decodes are finite, and every loader loaded a tiny file that fits the model ComfyUI built."""
    run = references(name)
    assert run.result.ok, run.result.error_text() + "\n" + comfy_host.log_tail(60)
    latents = {key: value for key, value in run.outputs.items() if key.startswith(f"{LATENT_TAP}:")}
    frames = {key: value for key, value in run.outputs.items() if key.startswith(f"{PIXEL_TAP}:")}
    made = {key: value for key, value in run.outputs.items() if key not in latents and key not in frames}
    assert latents and frames and made, f"outputs: {sorted(run.outputs)}"
    for key, latent in latents.items():
        assert latent.is_floating_point() and bool(latent.isfinite().all()), key
    for key, image in made.items():
        assert image.dtype == torch.uint8 and image.shape[-3:] == (TINY_SIDE, TINY_SIDE, 3), (key, image.shape)
        if image.dim() == 4:
            assert image.shape[0] == TINY_FRAMES, (key, image.shape)
        assert image.float().std() > 1.0, f"{key}: a flat image"
    prompt = run.result.history["prompt"][2]
    for node in prompt.values():
        if node["class_type"] in MODEL_LOADERS:
            folder, file_input = MODEL_LOADERS[node["class_type"]]
            file = comfy_host.base_dir / "models" / folder / node["inputs"][file_input]
            assert ours(name, file), f"{node['class_type']} loaded {file}, which is not a tiny file of ours"
    assert not load_problems(run.log, TEMPLATE_BY_NAME[name].unused_on(version)), run.log
    print(f"{name} on ComfyUI {version}: {run.result.wall_s:.1f} s")


@pytest.mark.parametrize("name", NAMES)
def test_api_prompt_is_the_workflows_own(name: str, page: Any, comfy_host: ComfyHost, version: str) -> None:
    """The frontend gives the same prompt for the template every time (its seeds are the workflow's until a prompt
    is queued), and, where the template runs, it names the template's own model files: those we stand in for. (The
    0.3.75 host's older frontend misreads the widgets of some newer templates, all of which it cannot run.)"""
    template = official_template(name)
    first, second = api_prompt(page, template), api_prompt(page, template)
    assert first == second
    if TEMPLATE_BY_NAME[name].limit_on(version) is None and has_model_class(
        comfy_host.comfyui_path, TEMPLATE_BY_NAME[name].model_class
    ):
        loaded = {
            node["inputs"][MODEL_LOADERS[node["class_type"]][1]]
            for node in first.values()
            if node["class_type"] in MODEL_LOADERS
        }
        folders = {folder for folder, _ in MODEL_LOADERS.values()}
        assert loaded == {f.name for f in template_files(name) if f.folder in folders}


def other_prompt() -> Prompt:
    """A prompt of one tiny latent: run between two runs of a template, it leaves nothing of the first cached."""
    return {
        "1": {"class_type": "EmptyLatentImage", "inputs": {"width": 16, "height": 16, "batch_size": 1}},
        "2": {"class_type": "SaveLatent", "inputs": {"samples": ["1", 0], "filename_prefix": "tests/templates/other"}},
    }


# A model's plan line: some of its blocks streamed, or (a model whose block lists hold under half its weights, as
# the tiny Flux 2's do) every module streamed.
PLAN_LINE = re.compile(
    r"^Block Offload \(Partial GPU Residency\): .*?(?:(\d+)/(\d+) blocks resident|(every module streamed))",
    re.MULTILINE,
)
# Below every tiny template model (the smallest, Wan, holds 5.5 MB), so that some of its blocks stream.
STREAMING_BUDGET_GB = 0.002


@pytest.mark.parametrize("name", NAMES)
def test_the_streamed_template_is_bitwise_the_template_and_streams_every_model(
    name: str,
    comfy_host: ComfyHost,
    object_info: dict[str, Any],
    prepared: Callable[[str], Prompt],
    references: Callable[[str], TemplateRun],
) -> None:
    """The template as the action streams it (its committed API twin), on the same tiny files, gives bit for bit
    the reference run's outputs, and each of its models streamed (a plan line per model, blocks streamed). Without
    its nodes, the twin is the prompt of the reference run.

    It runs from scratch (another prompt in between: the server keeps only the last prompt's results) and samples
    again (no sampler answered from the cache), so it also shows that the template reproduces bit for bit, which
    comparing runs relies on (the LoRA test's too).

    The node's budget is automatic; on this CPU-only server that would keep every block "resident" in RAM, so
    the test gives it a budget below the model's size: the streaming, not the placement, is what is checked."""
    reference = references(name)
    assert reference.result.ok, reference.result.error_text()
    streamed = for_host(for_tiny_models(streamed_templates.api_twin(name)), object_info)
    own = streamed_templates.without_meta(prepared(name))
    # The twin is 0.33.0's frontend's prompt, which also sets a few widgets an older host's frontend does not write
    # (a video's bit depth and codec) and its ComfyUI does not read: every input this host's prompt has is the same.
    plain = {
        node_id: {**node, "inputs": {k: v for k, v in node["inputs"].items() if k in own.get(node_id, node)["inputs"]}}
        for node_id, node in streamed_templates.without_meta(streamed_templates.without_our_nodes(streamed)).items()
    }
    assert plain == own
    ours = [node for node in streamed.values() if node["class_type"] == streamed_templates.OUR_NODE]
    for node in ours:
        node["inputs"]["vram_budget_gb"] = STREAMING_BUDGET_GB
    assert comfy_host.run(other_prompt(), timeout=60).ok
    run = run_template(comfy_host, streamed, f"tests/templates/{uuid.uuid4().hex[:8]}/{name}/streamed")
    assert run.result.ok, run.result.error_text() + "\n" + comfy_host.log_tail(60)
    cached = {n for e in run.result.events_of("execution_cached") for n in e.data.get("nodes", [])}
    prompt = run.result.history["prompt"][2]
    assert not {nid for nid, node in prompt.items() if node["class_type"] in SAMPLERS} & cached
    assert reference.outputs and not same_outputs(reference.outputs, run.outputs)
    plans = PLAN_LINE.findall(run.log)
    assert len(plans) >= len(ours), f"{len(plans)} plan lines for {len(ours)} models:\n{run.log}"
    assert all(every or int(resident) < int(blocks) for resident, blocks, every in plans), plans


@pytest.mark.parametrize("name", NAMES)
def test_template_lora_changes_the_output(
    name: str,
    comfy_host: ComfyHost,
    page: Any,
    object_info: dict[str, Any],
    version: str,
    prepared: Callable[[str], Prompt],
) -> None:
    """With the template's LoRA toggle on (its own 4-step/turbo setting), its LoRA at the template's strength gives
    another output than at strength 0: the tiny LoRA's keys are the tiny model's, and it is applied."""
    prepared(name)  # skips where the template cannot run here
    base = for_tiny_models(api_prompt(page, official_template(name)))
    if not switch_primitives(base, "LoraLoaderModelOnly"):
        pytest.skip("the template has no LoRA toggle")
    prefix = f"tests/templates/{uuid.uuid4().hex[:8]}/{name}"
    on = run_template(comfy_host, for_host(with_lora(base), object_info), f"{prefix}/lora")
    off = run_template(comfy_host, for_host(with_lora(base, strength=0.0), object_info), f"{prefix}/no-lora")
    assert on.result.ok and off.result.ok, on.result.error_text() + off.result.error_text()
    assert not load_problems(on.log, TEMPLATE_BY_NAME[name].unused_on(version)), on.log
    differ = same_outputs(on.outputs, off.outputs)
    assert any(key.startswith(f"{LATENT_TAP}:") for key in differ), "the LoRA changed nothing"


@pytest.mark.parametrize("name", NAMES)
def test_tiny_changes_leave_the_diffusion_part_alone(name: str, page: Any) -> None:
    """``for_tiny_models`` changes only a CLIPLoader's type, the latent sizes and a prompt enhancer's switch: every
    loader, LoRA, model patch and sampler keeps the template's inputs."""
    before = api_prompt(page, official_template(name))
    after = for_tiny_models(before)
    assert set(before) == set(after)
    for node_id, node in before.items():
        old, new = node["inputs"], after[node_id]["inputs"]
        changed = {key for key in old.keys() | new.keys() if old.get(key) != new.get(key)}
        if not changed:
            continue
        if node["class_type"] == "CLIPLoader":
            assert changed == {"type"} and new["type"] == CLIP_TYPE_FOR_TINY[old["type"]], node_id
        elif node["class_type"] in SIZE_NODES:
            assert changed <= {"width", "height", "length"}, node_id
        else:
            assert node["class_type"] == SWITCH and changed == {"switch"}, (node_id, node["class_type"], changed)
            branches = [old[b] for b in ("on_true", "on_false") if is_link(old.get(b))]
            assert any(before[b[0]]["class_type"] in TEXT_GENERATORS for b in branches), node_id


def model_chain(prompt: Prompt, node_id: str) -> list[str]:
    """The classes a sampler's model passes through, from the sampler's input back to its loader."""
    chain, source = [], prompt[node_id]["inputs"]["model"]
    while is_link(source):
        chain.append(prompt[source[0]]["class_type"])
        source = prompt[source[0]]["inputs"].get("model")
    return chain


def test_folding_the_switches_keeps_what_they_select(page: Any) -> None:
    """What ComfyUI 0.3.75 runs of the Wan 2.2 template: with its switches folded into the prompt, each sampler gets
    the model, steps and cfg the template's toggle selects, as it would through the switches."""
    prompt = for_tiny_models(api_prompt(page, official_template("video_wan2_2_14B_t2v")))
    for lora, steps, cfg in ((False, 20, 3.5), (True, 4, 1.0)):
        folded = fold_switches(with_lora(prompt) if lora else prompt)
        assert SWITCH not in {node["class_type"] for node in folded.values()}
        samplers = [nid for nid, node in folded.items() if node["class_type"] == "KSamplerAdvanced"]
        assert len(samplers) == 2
        for sampler in samplers:
            inputs = folded[sampler]["inputs"]
            patched = ["ModelSamplingSD3", "LoraLoaderModelOnly", "UNETLoader"]
            assert model_chain(folded, sampler) == (patched if lora else [patched[0], patched[2]])
            assert (constant(folded, inputs["steps"]), constant(folded, inputs["cfg"])) == (steps, cfg)
