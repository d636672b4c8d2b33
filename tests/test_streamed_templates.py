"""ComfyUI's official templates with the node in them (``example_workflows/streamed_*.json`` and their API twins),
as "Stream this workflow's models" writes them (harness/streamed_templates.py): the committed files are what the
action writes today, and the node is all they add, on every model path. That each streams bit for bit as the
template runs without it is checked beside the template's own reference run, in tests/test_templates.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from conftest import HOST_VERSION

from harness import streamed_templates
from harness.browser import browser_page, chromium_missing, launch_browser
from harness.comfy_host import ComfyHost
from harness.official_templates import TemplateMissingError, official_template
from harness.streamed_templates import OUR_NODE, api_twin, without_meta, without_our_nodes
from harness.workflows import GENERATED_FOR, OUT_DIR

pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: run scripts/setup.sh")

LOADERS = {"UNETLoader", "CheckpointLoaderSimple"}
# What samples with the model in the shipped templates: the samplers and the guiders (the scheduler of custom
# sampling only reads the model's sigmas: the action leaves it the model as it was).
SAMPLERS = {"KSampler", "KSamplerAdvanced", "BasicGuider", "CFGGuider"}


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
    stale = [name for name, text in expected.items() if (OUT_DIR / name).read_text() != text]
    assert not stale, f"out of date (run .venv-0.33.0/bin/python -m harness.streamed_templates): {stale}"


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
    assert without_meta(without_our_nodes(prompt)) == without_meta(template_prompts[template])
    ours = {node_id: node for node_id, node in prompt.items() if node["class_type"] == OUR_NODE}
    loaders = [node for node in prompt.values() if node["class_type"] in LOADERS]
    assert len(ours) == len(loaders) >= 1
    for node in ours.values():
        assert node["inputs"]["vram_budget_gb"] == 0 and node["inputs"]["policy"] == "auto"
    samplers = [node for node in prompt.values() if node["class_type"] in SAMPLERS]
    assert samplers and all(node["inputs"]["model"][0] in ours for node in samplers)
