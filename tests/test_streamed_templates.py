"""ComfyUI's official templates with the node in them (``example_workflows/streamed_*.json`` and their API twins),
as "Stream this workflow's models" writes them (harness/streamed_templates.py): the committed files are what the
action writes today, and every one streams each of its diffusion models where the action put the node.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import HOST_VERSION

from harness import streamed_templates
from harness.browser import browser_page, chromium_missing, launch_browser
from harness.comfy_host import REPO, ComfyHost
from harness.official_templates import TemplateMissingError, official_template
from harness.template_models import write_template_models
from harness.template_prompts import for_host, for_tiny_models, missing_nodes
from harness.templates import RUNNABLE, run_template, same_outputs, why_not_runnable
from harness.workflows import GENERATED_FOR

pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: run scripts/setup.sh")

EXAMPLES = REPO / "example_workflows"
OUR_NODE = "PartialGPUResidency"
# Below every tiny template model (the smallest, Wan, holds 5.5 MB), so that some of its blocks stream.
STREAMING_BUDGET_GB = 0.002
LOADERS = {"UNETLoader", "CheckpointLoaderSimple"}
# What samples with the model in the shipped templates: the samplers and the guiders (the scheduler of custom
# sampling only reads the model's sigmas: the action leaves it the model as it was).
SAMPLERS = {"KSampler", "KSamplerAdvanced", "BasicGuider", "CFGGuider"}


def api_twin(template: str) -> dict[str, Any]:
    return json.loads((EXAMPLES / "api" / f"{streamed_templates.example_name(template)}.json").read_text())


@pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))
@pytest.mark.skipif(
    HOST_VERSION != GENERATED_FOR,
    reason=f"the committed templates are written on ComfyUI {GENERATED_FOR} with its pinned frontend",
)
def test_committed_files_are_what_the_action_writes(comfy_host: ComfyHost) -> None:
    """Run ``.venv-0.33.0/bin/python -m harness.streamed_templates`` after changing the action or the list."""
    try:
        for template in streamed_templates.SHIPPED:
            official_template(template)
    except TemplateMissingError as exc:
        pytest.skip(str(exc))
    with launch_browser() as browser, browser_page(browser, comfy_host) as page:
        expected = streamed_templates.render(page)
    assert len(expected) == 2 * len(streamed_templates.SHIPPED)
    stale = [name for name, text in expected.items() if (EXAMPLES / name).read_text() != text]
    assert not stale, f"out of date (run .venv-0.33.0/bin/python -m harness.streamed_templates): {stale}"


def without_meta(prompt: dict[str, Any]) -> dict[str, Any]:
    return {node_id: {k: v for k, v in node.items() if k != "_meta"} for node_id, node in prompt.items()}


def without_our_nodes(prompt: dict[str, Any]) -> dict[str, Any]:
    """``prompt`` with each of our nodes dropped and whatever it fed linked to what fed it."""
    ours = {node_id: node["inputs"]["model"] for node_id, node in prompt.items() if node["class_type"] == OUR_NODE}
    return {
        node_id: {
            **node,
            "inputs": {
                name: ours[value[0]] if isinstance(value, list) and value and value[0] in ours else value
                for name, value in node["inputs"].items()
            },
        }
        for node_id, node in prompt.items()
        if node_id not in ours
    }


@pytest.fixture(scope="module")
def template_prompts(comfy_host: ComfyHost) -> Iterator[dict[str, dict[str, Any]]]:
    """Each shipped template's own API prompt, as the host's pinned frontend makes it (``graphToPrompt``)."""
    missing = chromium_missing()
    if missing is not None:
        pytest.skip(missing)
    prompts = {}
    with launch_browser() as browser, browser_page(browser, comfy_host) as page:
        for template in streamed_templates.SHIPPED:
            try:
                prompts[template] = streamed_templates.template_prompt(page, template)
            except TemplateMissingError as exc:
                pytest.skip(str(exc))
    yield prompts


def skip_without_nodes(prompt: dict[str, Any], comfy_host: ComfyHost) -> None:
    missing = sorted({node["class_type"] for node in prompt.values()} - set(comfy_host.object_info()))
    if missing:
        pytest.skip(f"ComfyUI {HOST_VERSION} has no {', '.join(missing)}")


@pytest.mark.parametrize("template", streamed_templates.SHIPPED)
def test_the_node_is_all_that_differs_and_every_model_passes_through_it(
    template: str, template_prompts: dict[str, dict[str, Any]], comfy_host: ComfyHost
) -> None:
    """Dropping the node from the API twin (its consumers linked back to what fed it) gives the template's own
    prompt; each loader has its own node, set to automatic, and every sampler takes its model from one."""
    prompt = api_twin(template)
    skip_without_nodes(prompt, comfy_host)
    # Titles (``_meta``) are the host's display names, which differ between hosts; the graph is what runs.
    assert without_meta(without_our_nodes(prompt)) == without_meta(template_prompts[template])
    ours = {node_id: node for node_id, node in prompt.items() if node["class_type"] == OUR_NODE}
    loaders = [node for node in prompt.values() if node["class_type"] in LOADERS]
    assert len(ours) == len(loaders) >= 1
    for node in ours.values():
        assert node["inputs"]["vram_budget_gb"] == 0 and node["inputs"]["policy"] == "auto"
    samplers = [node for node in prompt.values() if node["class_type"] in SAMPLERS]
    assert samplers and all(node["inputs"]["model"][0] in ours for node in samplers)


# ------------------------------------------------------------------------------------------ running them
# A model's plan line: some of its blocks streamed, or (a model whose block lists hold under half its weights, as
# the tiny Flux 2's do) every module streamed.
PLAN_LINE = re.compile(
    r"^Block Offload \(Partial GPU Residency\): .*?(?:(\d+)/(\d+) blocks resident|(every module streamed))",
    re.MULTILINE,
)


@pytest.mark.usefixtures("tiny_models")
@pytest.mark.parametrize("template", [t for t in streamed_templates.SHIPPED if t in RUNNABLE])
def test_the_streamed_template_is_bitwise_the_template_and_streams_every_model(
    template: str, comfy_host: ComfyHost
) -> None:
    """The API twin, on tiny models under the template's own file names (``harness/template_models.py``, changed
    for them only by ``for_tiny_models``), gives bit for bit what the same prompt without the node gives, and each
    of its models streamed (a plan line per model, blocks streamed).

    The node's budget is automatic; on this CPU-only server that would keep every block "resident" in RAM, so
    the test gives it a budget below the model's size: the streaming, not the placement, is what is checked."""
    why = why_not_runnable(template, comfy_host.comfyui_path)
    if why is not None:
        pytest.skip(why)
    object_info = comfy_host.object_info()
    streamed = for_host(for_tiny_models(api_twin(template)), object_info)
    for node in streamed.values():
        if node["class_type"] == OUR_NODE:
            node["inputs"]["vram_budget_gb"] = STREAMING_BUDGET_GB
    missing = missing_nodes(streamed, object_info)
    if missing:
        pytest.skip(f"ComfyUI {HOST_VERSION} lacks the node classes {missing}")
    write_template_models(template, comfy_host.base_dir / "models")
    prefix = f"tests/streamed_templates/{uuid.uuid4().hex[:8]}/{template}"
    plain = run_template(comfy_host, without_our_nodes(streamed), f"{prefix}/plain")
    assert plain.result.ok, plain.result.error_text() + "\n" + comfy_host.log_tail(60)
    ours = run_template(comfy_host, streamed, f"{prefix}/streamed")
    assert ours.result.ok, ours.result.error_text() + "\n" + comfy_host.log_tail(60)
    assert plain.outputs and not same_outputs(plain.outputs, ours.outputs)
    plans = PLAN_LINE.findall(ours.log)
    models = sum(1 for node in streamed.values() if node["class_type"] == OUR_NODE)
    assert len(plans) >= models, f"{len(plans)} plan lines for {models} models:\n{ours.log}"
    assert all(every or int(resident) < int(blocks) for resident, blocks, every in plans), plans
