"""The frontend action "Stream this workflow's models" (``web/stream_workflow.js``) in the real ComfyUI frontend,
in headless Chromium: it puts a Partial GPU Residency node on every path from a diffusion model loader (or a merge
of loaders) to its sampler, inside the official templates' subgraphs and into a subgraph the model goes into,
after the LoRA toggle and ModelSampling patch and before the sampler; says what it did; is undone by one Ctrl+Z;
changes nothing the second time; follows a model out of the subgraphs it leaves; names apart the models in parts of
the workflow switched off (bypassed or muted), which get their node too; and leaves alone, naming them, the models it
cannot stream safely (a merge whose input also goes elsewhere, a node of ours already there, on or switched off, no
loader). And on every official template of the newest template package it streams what samples and nothing else,
damages no link, and puts its node over no other (``test_every_official_template_...``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import pytest
from conftest import HOST_VERSION, failed

from harness.browser import ServedFrontend, browser_page, chromium_missing, launch_browser, page_frontend_version
from harness.comfy_host import REPO, ComfyHost
from harness.model_paths import SAMPLER, ModelPaths, box, graphs_of, overlap
from harness.official_templates import TemplateMissingError, newest_templates, official_template
from harness.validate_only import failing_outputs, known_nodes, validate

pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: run scripts/setup.sh")

pytestmark = pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing()))

MODULE = "/extensions/block_offload/stream_workflow.js"
OUR_NODE = "PartialGPUResidency"
# A message as each frontend draws it: PrimeVue's toast up to 1.49, reka-ui's in 1.58.
TOAST = ".p-toast-message, [data-testid=toast]"
CLEAR_TOASTS_JS = """() => {
  const toast = window.app.extensionManager.toast;
  (toast.dismissAll ?? toast.removeAll).call(toast);
}"""
#: What each test starts from: a new workflow with nothing in it.
EMPTY_WORKFLOW = {"last_node_id": 0, "last_link_id": 0, "nodes": [], "links": [], "groups": [], "version": 0.4}
TAB_COMMAND = "Workspace.ToggleBottomPanelTab.block-offload"
COMMAND_LABEL = "Stream this workflow's models"

# Per graph (root, then each subgraph definition by name): our nodes with what feeds them and what they feed.
OUR_NODES_JS = """
async (ourType) => {
  const root = window.app.rootGraph ?? window.app.graph;
  const graphs = [["root", root], ...[...(root.subgraphs?.values() ?? [])].map(g => [g.name, g])];
  const link = (g, id) => g.links instanceof Map ? g.links.get(id) : g.links[id];
  return graphs.map(([name, g]) => [name, g.nodes.filter(n => n.type === ourType).map(n => ({
    from: g.getNodeById(link(g, n.inputs[0].link)?.origin_id)?.type ?? null,
    to: (n.outputs[0].links ?? []).map(id => g.getNodeById(link(g, id).target_id).type),
    budget: n.widgets.find(w => w.name === "vram_budget_gb").value,
    policy: n.widgets.find(w => w.name === "policy").value,
  }))]).filter(([, nodes]) => nodes.length);
}
"""


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launch_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def open_pages() -> Iterator[dict[str, tuple[ExitStack, Any]]]:
    """The page of each frontend, shared by the module's tests: starting the frontend was most of each test's time
    (4-7 s of 6-9 on this machine)."""
    pages: dict[str, tuple[ExitStack, Any]] = {}
    yield pages
    for stack, _ in pages.values():
        stack.close()


@pytest.fixture
def page(
    browser: Any,
    served_frontend: ServedFrontend,
    open_pages: dict[str, tuple[ExitStack, Any]],
    request: pytest.FixtureRequest,
) -> Iterator[Any]:
    """The page on each frontend (the host's pinned one and the newest, tests/conftest.py), an empty workflow on its
    canvas and no message shown. A test that fails, or raises in the page, leaves it closed: the next starts on a
    fresh one."""
    if served_frontend.version not in open_pages:
        stack = ExitStack()
        page = stack.enter_context(browser_page(browser, served_frontend.host))
        open_pages[served_frontend.version] = (stack, page)
        assert page_frontend_version(page) == served_frontend.version
        page.wait_for_function(f"import('{MODULE}').then(() => true)")
    stack, page = open_pages[served_frontend.version]
    load(page, EMPTY_WORKFLOW)
    clear_messages(page)
    seen = len(page.errors)
    yield page
    errors = page.errors[seen:]
    if errors or failed(request.node):
        del open_pages[served_frontend.version]
        stack.close()
    assert not [e for e in errors if "stream_workflow" in e], errors


def load(page: Any, workflow: dict[str, Any]) -> str:
    """Loads ``workflow`` on the canvas; returns the graph as the frontend serializes it."""
    page.evaluate("data => window.app.loadGraphData(data)", workflow)
    page.wait_for_timeout(300)  # the change tracker takes the loaded graph as its first state
    return serialized(page)


def serialized(page: Any) -> str:
    return page.evaluate("JSON.stringify((window.app.rootGraph ?? window.app.graph).serialize())")


def graph_of(text: str) -> dict[str, Any]:
    """The parts of a serialized graph an edit changes: nodes (id, type, links in and out) and links, per graph."""
    data = json.loads(text)

    def nodes_and_links(graph: dict[str, Any]) -> dict[str, Any]:
        nodes = sorted(
            (
                str(n["id"]),
                n["type"],
                [i.get("link") for i in n.get("inputs", [])],
                [o.get("links") for o in n.get("outputs", [])],
            )
            for n in graph["nodes"]
        )
        return {"nodes": nodes, "links": sorted(map(str, graph.get("links", [])))}

    subgraphs = data.get("definitions", {}).get("subgraphs", [])
    return {"root": nodes_and_links(data), **{s["name"]: nodes_and_links(s) for s in subgraphs}}


def clear_messages(page: Any) -> None:
    page.evaluate(CLEAR_TOASTS_JS)
    page.wait_for_function(f"!document.querySelector('{TOAST}')")


def run_action(page: Any) -> str:
    """Runs the command as the menus do; returns the message it showed."""
    page.evaluate(
        "document.querySelectorAll('.p-toast-message-close-button, .p-toast-close-button').forEach(b => b.click())"
    )
    page.wait_for_function(f"!document.querySelector('{TOAST}')")
    page.evaluate(f"import('{MODULE}').then(m => window.app.extensionManager.command.execute(m.COMMAND_ID))")
    page.wait_for_selector(TOAST)
    return page.inner_text(TOAST)


def our_nodes(page: Any) -> list[Any]:
    return page.evaluate(OUR_NODES_JS, OUR_NODE)


def undo(page: Any) -> None:
    page.keyboard.press("Control+z")
    page.wait_for_timeout(500)  # the change tracker undoes on the next animation frame


def test_both_wan22_experts_stream_after_their_lora_toggle_in_one_undo_step(page: Any) -> None:
    template = official_template("video_wan2_2_14B_t2v")
    before = load(page, template)
    text = run_action(page)
    assert (
        "2 models now stream through Partial GPU Residency: wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors, "
        "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors." in text
    ), text
    subgraph = template["definitions"]["subgraphs"][0]["name"]
    # After each expert's LoRA switch and ModelSamplingSD3, before its KSamplerAdvanced; automatic budget and policy.
    expected = {"from": "ModelSamplingSD3", "to": ["KSamplerAdvanced"], "budget": 0, "policy": "auto"}
    assert our_nodes(page) == [[subgraph, [expected, expected]]]
    after = serialized(page)

    again = run_action(page)
    assert "now stream" not in again and "Already streaming, left as they are" in again, again
    assert graph_of(serialized(page)) == graph_of(after), "the second run changed the workflow"

    undo(page)
    assert graph_of(serialized(page)) == graph_of(before), "one Ctrl+Z did not give back the template"
    assert our_nodes(page) == []


def test_a_single_model_template_streams_between_its_patch_and_its_sampler(page: Any) -> None:
    template = official_template("image_z_image_turbo")
    load(page, template)
    text = run_action(page)
    assert "1 model now streams through Partial GPU Residency: z_image_turbo_bf16.safetensors." in text, text
    subgraph = template["definitions"]["subgraphs"][0]["name"]
    assert our_nodes(page) == [
        [subgraph, [{"from": "ModelSamplingAuraFlow", "to": ["KSampler"], "budget": 0, "policy": "auto"}]]
    ]


def test_a_workflow_without_a_diffusion_model_is_left_unchanged(page: Any) -> None:
    page.evaluate("(window.app.rootGraph ?? window.app.graph).clear()")
    page.wait_for_timeout(300)
    before = serialized(page)
    text = run_action(page)
    assert "This workflow loads no diffusion model: nothing to stream, nothing changed." in text, text
    assert graph_of(serialized(page)) == graph_of(before)


def test_a_merge_streams_after_it_and_a_model_already_streaming_is_left_alone(page: Any) -> None:
    # The pack's own Wan example already streams its model through Async Block Offload.
    load(page, json.loads((REPO / "example_workflows" / "async_block_offload_wan21_t2v.json").read_text()))
    # Beside it, two loaders merged into one model before a sampler: the node goes after the merge, on the merged
    # model (streaming either input alone would leave the merge's other weights to ComfyUI).
    page.evaluate(MERGE_JS, False)
    page.wait_for_timeout(300)
    text = run_action(page)
    assert "Already streaming, left as they are: " in text and "(Async Block Offload (#" in text, text
    assert "1 model now streams through Partial GPU Residency: " in text and "(merged in merge (#" in text, text
    expected = {"from": "ModelMergeSimple", "to": ["KSampler"], "budget": 0, "policy": "auto"}
    assert our_nodes(page) == [["root", [expected]]]


def test_a_model_through_a_node_of_ours_switched_off_is_left_to_the_user(page: Any) -> None:
    """The pack's Wan example with its Async Block Offload bypassed (a user comparing): not "already streaming",
    and no second node: left as it is, saying so."""
    load(page, json.loads((REPO / "example_workflows" / "async_block_offload_wan21_t2v.json").read_text()))
    page.evaluate(
        "() => { const g = window.app.rootGraph ?? window.app.graph;"
        " g.nodes.find(n => n.type === 'AsyncBlockOffload').mode = 4; }"
    )
    before = serialized(page)
    text = run_action(page)
    assert "Already streaming" not in text and "now stream" not in text, text
    assert "Left as it is: " in text and "which is bypassed or muted: switch it on." in text, text
    assert graph_of(serialized(page)) == graph_of(before)


def test_a_merge_whose_input_also_feeds_another_sampler_is_left_alone_and_named(page: Any) -> None:
    page.evaluate("(window.app.rootGraph ?? window.app.graph).clear()")
    page.evaluate(MERGE_JS, True)
    page.wait_for_timeout(300)
    before = serialized(page)
    text = run_action(page)
    assert "now stream" not in text, text
    assert "meets another model in merge (#" in text, text
    assert graph_of(serialized(page)) == graph_of(before)


# Two loaders merged (ModelMergeSimple) before a sampler; ``branch``: the first also feeds a sampler of its own.
MERGE_JS = """
(branch) => {
  const g = window.app.rootGraph ?? window.app.graph;
  const add = (type, title) => { const n = LiteGraph.createNode(type); n.title = title; g.add(n); return n; };
  const a = add("UNETLoader", "expert A"), b = add("UNETLoader", "expert B");
  const merge = add("ModelMergeSimple", "merge"), sampler = add("KSampler", "sampler");
  a.connect(0, merge, 0); b.connect(0, merge, 1); merge.connect(0, sampler, 0);
  if (branch) a.connect(0, add("KSampler", "A alone"), 0);
}
"""


# A loader, its LoRA, ModelSamplingSD3 and a KSampler, part of them made into a subgraph (as "Convert to Subgraph"
# makes one), by ``shape``: "patched", the sampling patch and the sampler (the model goes in); "branches", two
# KSamplers fed by the subgraph's input itself (the paths part right inside it); "returns", the sampling patch alone
# (the model goes in and comes back out to the sampler); "loaded inside", all but the sampler (the model leaves).
SUBGRAPH_JS = """
(shape) => {
  const g = window.app.rootGraph ?? window.app.graph;
  g.clear();
  const add = (type) => { const n = LiteGraph.createNode(type); g.add(n); return n; };
  const loader = add("UNETLoader"), lora = add("LoraLoaderModelOnly");
  loader.connect(0, lora, 0);
  if (shape === "branches") {
    const first = add("KSampler"), second = add("KSampler");
    lora.connect(0, first, 0); lora.connect(0, second, 0);
    return g.convertToSubgraph(new Set([first, second])).node.type;
  }
  const sampling = add("ModelSamplingSD3"), sampler = add("KSampler");
  lora.connect(0, sampling, 0); sampling.connect(0, sampler, 0);
  const inside = {
    patched: [sampling, sampler], returns: [sampling], "loaded inside": [loader, lora, sampling],
  }[shape];
  return g.convertToSubgraph(new Set(inside)).node.type;
}
"""


def subgraph_workflow(page: Any, shape: str) -> str:
    """Builds the workflow of ``SUBGRAPH_JS`` on the canvas; returns the subgraph's name (its node's type)."""
    if not page.evaluate("typeof (window.app.rootGraph ?? window.app.graph).convertToSubgraph === 'function'"):
        pytest.skip("this frontend cannot make a subgraph")
    made = page.evaluate(SUBGRAPH_JS, shape)
    load(page, json.loads(serialized(page)))  # loaded as a file is: the change tracker's first state
    return made


def test_a_model_going_into_a_subgraph_streams_inside_it_before_its_sampler(page: Any) -> None:
    subgraph = subgraph_workflow(page, "patched")
    before = serialized(page)
    text = run_action(page)
    assert "1 model now streams through Partial GPU Residency" in text, text
    # Followed in through the subgraph's input: after the patch inside it, before its sampler.
    expected = {"from": "ModelSamplingSD3", "to": ["KSampler"], "budget": 0, "policy": "auto"}
    names = dict(
        page.evaluate(
            "() => [...(window.app.rootGraph ?? window.app.graph).subgraphs.values()].map(g => [g.id, g.name])"
        )
    )
    assert our_nodes(page) == [[names[subgraph], [expected]]]
    again = run_action(page)
    assert "now stream" not in again and "Already streaming, left as they are" in again, again
    undo(page)
    assert graph_of(serialized(page)) == graph_of(before), "one Ctrl+Z did not give back the workflow"


def test_a_model_parting_right_inside_a_subgraph_streams_before_it(page: Any) -> None:
    subgraph = subgraph_workflow(page, "branches")
    text = run_action(page)
    assert "1 model now streams through Partial GPU Residency" in text, text
    # The paths part at the subgraph's input: the node goes before the subgraph, outside, after the LoRA.
    expected = {"from": "LoraLoaderModelOnly", "to": [subgraph], "budget": 0, "policy": "auto"}
    assert our_nodes(page) == [["root", [expected]]]


@pytest.mark.parametrize("shape", ["returns", "loaded inside"])
def test_a_model_leaving_a_subgraph_is_followed_out_to_its_sampler(page: Any, shape: str) -> None:
    subgraph = subgraph_workflow(page, shape)
    before = serialized(page)
    text = run_action(page)
    assert "1 model now streams through Partial GPU Residency" in text, text
    # After the subgraph the model comes out of (its patches applied inside), right before the sampler.
    expected = {"from": subgraph, "to": ["KSampler"], "budget": 0, "policy": "auto"}
    assert our_nodes(page) == [["root", [expected]]]
    again = run_action(page)
    assert "now stream" not in again and "Already streaming, left as they are" in again, again
    undo(page)
    assert graph_of(serialized(page)) == graph_of(before), "one Ctrl+Z did not give back the workflow"


# Official templates whose model leaves a subgraph: USO's two pipelines (each model goes through patch subgraphs,
# one of them bypassed, and comes back to its KSampler) and the Qwen-Image edit one whose loader is a subgraph of its
# own, its model passed on by Reroutes typed "*" inside the next subgraph (which are no loaders). Per graph, our
# nodes with what feeds them and what they feed, a subgraph node by its subgraph's name.
LEAVING_TEMPLATES = {
    "flux1_dev_uso_reference_image_gen": {
        "USO Character Reference": [{"from": "USOStyleReference(Subgraph)", "to": ["KSampler"]}],
        "USO Style Reference": [{"from": "USOStyleReference", "to": ["KSampler"]}],
    },
    "templates-1_click_multiple_scene_angles-v1.0": {
        "root": [{"from": "Qwen Image Edit Model and Loras Loader", "to": ["Generate"]}],
    },
}


#: The models of those templates in a part switched off, as the message names them.
SWITCHED_OFF = {"flux1_dev_uso_reference_image_gen": ["flux1-dev-fp8.safetensors"]}
SWITCHED_OFF_LINE = "Switched off (bypassed or muted), given a node to stream once switched on: "


def switched_off(text: str) -> list[str]:
    """The files the message names as switched off."""
    lines = [line for line in text.splitlines() if line.startswith(SWITCHED_OFF_LINE)]
    return [name for line in lines for name in line.removeprefix(SWITCHED_OFF_LINE).rstrip(".").split(", ")]


@pytest.mark.parametrize("name", sorted(LEAVING_TEMPLATES))
def test_a_template_whose_model_leaves_a_subgraph_streams_once_before_each_sampler(page: Any, name: str) -> None:
    template = official_template(name)
    load(page, template)
    text = run_action(page)
    # USO's style pipeline is a bypassed subgraph: its model gets its node, and is named as switched off.
    streamed = sum(len(nodes) for nodes in LEAVING_TEMPLATES[name].values()) - len(SWITCHED_OFF.get(name, []))
    assert f"{streamed} model{'s' * (streamed > 1)} now stream" in text and "Left as it is" not in text, text
    assert switched_off(text) == SWITCHED_OFF.get(name, []), text
    named = {s["id"]: s["name"] for s in template["definitions"]["subgraphs"]}
    placed = {
        graph: [{"from": named.get(n["from"], n["from"]), "to": [named.get(t, t) for t in n["to"]]} for n in nodes]
        for graph, nodes in our_nodes(page)
    }
    assert placed == LEAVING_TEMPLATES[name]


def test_the_panel_button_and_the_canvas_menu_run_the_action(page: Any) -> None:
    template = official_template("image_qwen_image")
    subgraph = template["definitions"]["subgraphs"][0]["name"]
    load(page, template)
    page.evaluate(f"window.app.extensionManager.command.execute('{TAB_COMMAND}')")
    page.click("[data-testid=block-offload-stream]")
    page.wait_for_selector(TOAST)
    assert "1 model now streams through Partial GPU Residency: qwen_image_fp8_e4m3fn.safetensors." in page.inner_text(
        TOAST
    )
    assert [name for name, _ in our_nodes(page)] == [subgraph]

    load(page, template)
    page.evaluate(f"window.app.extensionManager.command.execute('{TAB_COMMAND}')")  # closed: the canvas is free
    clear_messages(page)
    box = page.locator("#graph-canvas").bounding_box()
    page.mouse.click(box["x"] + box["width"] - 60, box["y"] + box["height"] / 2, button="right")  # empty canvas
    page.locator(".litecontextmenu .litemenu-entry", has_text=COMMAND_LABEL).click()
    page.wait_for_selector(TOAST)
    assert "1 model now streams" in page.inner_text(TOAST)
    assert [name for name, _ in our_nodes(page)] == [subgraph]


# Two loaders, each to a KSampler of its own, the second muted.
TWO_LOADERS_ONE_MUTED_JS = """
() => {
  const g = window.app.rootGraph ?? window.app.graph;
  const add = (type) => { const n = LiteGraph.createNode(type); g.add(n); return n; };
  const on = add("UNETLoader"), muted = add("UNETLoader");
  on.connect(0, add("KSampler"), 0); muted.connect(0, add("KSampler"), 0);
  muted.mode = 2;
}
"""


def test_models_switched_off_get_their_node_and_are_named_apart(page: Any) -> None:
    """Wan 2.2's first-last-frame template ships its 4-step variant bypassed (two more loaders, with their LoRAs):
    every loader gets its node, the message counts only the two that run and names the bypassed two apart. A muted
    loader (mode "never") is switched off too."""
    load(page, official_template("video_wan2_2_14B_flf2v"))
    text = run_action(page)
    assert "2 models now stream through Partial GPU Residency" in text, text
    assert len(switched_off(text)) == 2, text
    assert sum(len(nodes) for _, nodes in our_nodes(page)) == 4

    load(page, EMPTY_WORKFLOW)
    page.evaluate(TWO_LOADERS_ONE_MUTED_JS)
    page.wait_for_timeout(300)
    text = run_action(page)
    assert "1 model now streams through Partial GPU Residency" in text and len(switched_off(text)) == 1, text
    assert sum(len(nodes) for _, nodes in our_nodes(page)) == 2


#: The tests on the newest templates: on 0.3.x they would test placeholders.
NEEDS_A_NEWER_HOST = pytest.mark.skipif(
    HOST_VERSION.startswith("0.3."),
    reason="the newest templates are made for a newer ComfyUI: most use nodes 0.3.75 lacks (ComfySwitchNode, "
    "ComfyMathExpression and more), which its frontend (1.32.9) loads as placeholders; the other tests here run on it",
)


@NEEDS_A_NEWER_HOST
def test_a_detector_loaded_as_a_model_is_left_alone_and_named(
    page: Any, templates_with_a_loader: dict[str, dict[str, Any]]
) -> None:
    """SAM3 loaded through Load Checkpoint feeds SAM3_Detect, which gives masks and boxes: no sampler, so no node,
    and the message names it."""
    before = load(page, templates_with_a_loader["utility_image_segment_sam3"])
    text = run_action(page)
    assert "now stream" not in text, text
    assert "Left as it is: sam3.1_multiplex_fp16.safetensors goes only to SAM3 Detect (#" in text, text
    assert "which does not sample." in text, text
    assert graph_of(serialized(page)) == graph_of(before)


# ------------------------------------------------------------------------------------------- every official template

# One template through the action as a user meets it: opened, the command the menus run, run a second time; the graph
# serialized at each step, and the prompt it queues before and after. The untouched prompt is taken first:
# graphToPrompt writes each node's execution order into the graph, which the change tracker takes into the action's
# undo step where the edit follows it. Undo is read from the change tracker: the action's one undo step must hold the
# template as opened. Ctrl+Z loads that state (a full graph load, as long again as opening the template; the tests
# above press it). The template comes as JSON text (a string crosses to the page at once, where an object took 50 ms
# and a route to this process as long) and loads without the missing-model scan, which only fills the
# missing-models list.
EVERY_TEMPLATE_JS = """
async ([modulePath, text]) => {
  const app = window.app;
  const graph = () => app.rootGraph ?? app.graph;
  const snapshot = () => JSON.stringify(graph().serialize());
  const prompt = async () => {
    try { return { output: (await app.graphToPrompt()).output }; } catch (e) { return { error: String(e) }; }
  };
  const { COMMAND_ID } = await import(modulePath);
  const command = (id) => app.extensionManager.command.execute(id);
  const run = async () => {
    await command(COMMAND_ID);
    const toast = app.extensionManager.toast;
    (toast.dismissAll ?? toast.removeAll).call(toast);
  };
  const workflow = JSON.parse(text);
  // Into the open tab, as opening a file there does: a new tab per template made each load 3 times slower.
  const tab = app.extensionManager.workflow.activeWorkflow;
  await app.loadGraphData(workflow, true, true, tab, { skipAssetScans: true });
  const result = { beforePrompt: await prompt(), before: snapshot() };
  // Emptied before the run, so its length counts the action's steps: the tracker keeps 50, and a full queue's length
  // would not grow.
  const undoQueue = tab.changeTracker.undoQueue;
  undoQueue.splice(0);
  await run();
  result.after = snapshot();
  const steps = undoQueue.length;
  result.undoState = steps ? JSON.stringify(undoQueue.at(-1)) : null;
  await run();
  result.again = snapshot();
  result.undoSteps = [steps, undoQueue.length - steps];
  result.afterPrompt = await prompt();
  return result;
}
"""
OUR_TYPES = {"PartialGPUResidency", "AsyncBlockOffload", "SequentialOffloadWrapper"}


def layout(text: str) -> dict[str, Any]:
    """``graph_of`` with each node's place: what a second run must not change and undo must give back."""
    data = json.loads(text)
    graphs = [data, *data.get("definitions", {}).get("subgraphs", [])]
    places = {g.get("name", "root"): sorted((str(n["id"]), list(n["pos"])) for n in g["nodes"]) for g in graphs}
    return {"graph": graph_of(text), "places": places}


def all_ids(workflow: dict[str, Any]) -> tuple[set[int], set[int]]:
    """Every node id and every link id in the workflow, subgraphs included."""
    graphs = graphs_of(workflow).values()
    return {i for g in graphs for i in g.nodes}, {i for g in graphs for i in g.links}


def template_problems(result: dict[str, Any], object_info: dict[str, Any]) -> list[str]:
    """What is wrong with the action's edit of one template (``EVERY_TEMPLATE_JS``'s result), read from the graph
    JSON alone (harness/model_paths.py)."""
    problems: list[str] = []
    before, after = json.loads(result["before"]), json.loads(result["after"])
    paths = ModelPaths(after, object_info)
    for loader in paths.loaders():
        for path in paths.paths(loader):
            names = [paths.node(s)["type"] for s in path]
            ours = [i for i, s in enumerate(path) if paths.node(s)["type"] in OUR_TYPES]
            if paths.kind(path[-1]) == SAMPLER:
                if len(ours) != 1:
                    problems.append(f"{len(ours)} of our nodes on the path {names}")
                    continue
                for step in path[ours[0] : -1]:
                    if paths.parts(step):
                        break
                    if step != path[ours[0]] and paths.node(step)["type"] not in OUR_TYPES:
                        problems.append(f"a patch after our node, before the path parts: {names}")
                        break
            elif ours:
                problems.append(f"our node on a path to no sampler: {names}")
    # Every old link still connects the same slots, or (the one our node was put on) now through our node.
    old, new = graphs_of(before), graphs_of(after)
    old_nodes, old_links = all_ids(before)
    for graph_id, graph in old.items():
        now = new[graph_id]
        if reused := (now.nodes.keys() - graph.nodes.keys()) & old_nodes:
            problems.append(f"new nodes in {graph_id} take ids other nodes have: {sorted(reused)}")
        if reused := (now.links.keys() - graph.links.keys()) & old_links:
            problems.append(f"new links in {graph_id} take ids other links have: {sorted(reused)}")
        for link in graph.links.values():
            if link.id in now.links:
                if now.links[link.id] != link:
                    problems.append(f"link {link.id} of {graph_id} now connects {now.links[link.id]}, not {link}")
                continue
            feeds = [n for n in now.links.values() if (n.target, n.target_slot) == (link.target, link.target_slot)]
            via = [now.nodes.get(n.origin, {}).get("type") in OUR_TYPES for n in feeds]
            fed = [n for n in now.links.values() if feeds and n.target == feeds[0].origin]
            if not (via == [True] and [(n.origin, n.origin_slot) for n in fed] == [(link.origin, link.origin_slot)]):
                problems.append(f"link {link.id} of {graph_id} ({link}) is lost")
        for node in now.nodes.values():
            for slot, i in enumerate(node.get("inputs") or []):
                link = now.links.get(i.get("link")) if i.get("link") is not None else None
                if i.get("link") is not None and (
                    link is None or (link.target, link.target_slot) != (node["id"], slot)
                ):
                    problems.append(f"input {slot} of node {node['id']} in {graph_id}: link {i['link']} ends elsewhere")
    if ("error" in result["afterPrompt"]) and "error" not in result["beforePrompt"]:
        problems.append(f"the edited workflow converts to no prompt: {result['afterPrompt']['error']}")
    # No node of ours over another.
    for graph in new.values():
        for node in graph.nodes.values():
            if node["type"] in OUR_TYPES and node["id"] not in graphs_of(before).get(graph.id, graph).nodes:
                covered = [o["id"] for o in graph.nodes.values() if o is not node and overlap(box(node), box(o))]
                if covered:
                    problems.append(f"our node {node['id']} in {graph.id} lies over nodes {covered}")
    if layout(result["again"]) != layout(result["after"]):
        problems.append("the second run changed the workflow")
    if result["after"] != result["before"]:
        if result["undoSteps"] != [1, 0]:
            problems.append(f"undo steps added by the first run and the second: {result['undoSteps']}, not [1, 0]")
        elif layout(result["undoState"]) != layout(result["before"]):
            problems.append("the action's undo step does not hold the template as opened")
    return problems


def validation_problems(host: ComfyHost, result: dict[str, Any], object_info: dict[str, Any]) -> list[str]:
    """Whether the edited prompt validates as the untouched one does (harness/validate_only.py: only outputs that
    cannot validate are asked for, so the server queues nothing): no error the untouched prompt lacks, none on our
    nodes."""
    if "error" in result["beforePrompt"] or "error" in result["afterPrompt"]:
        return []  # template_problems says so where only the edited one converts to no prompt
    before = known_nodes(result["beforePrompt"]["output"], object_info)
    after = known_nodes(result["afterPrompt"]["output"], object_info)
    targets = failing_outputs(before, object_info)
    if not targets:
        return []
    untouched, edited = validate(host, before, targets), validate(host, after, targets)
    ours = {i for i, node in after.items() if node["class_type"] in OUR_TYPES}
    problems = [f"our node {i} does not validate: {edited.node_errors[i]}" for i in ours & edited.node_errors.keys()]
    if edited.error != untouched.error:
        problems.append(f"the edited prompt fails with {edited.error}, the untouched one with {untouched.error}")
    others = {i: e for i, e in edited.node_errors.items() if i not in ours}
    if others != untouched.node_errors:
        problems.append(f"validation errors differ: {others} (edited) against {untouched.node_errors} (untouched)")
    return problems


@pytest.fixture(scope="module")
def templates_with_a_loader() -> dict[str, dict[str, Any]]:
    try:
        templates = newest_templates()
    except TemplateMissingError as exc:
        pytest.skip(str(exc))
    return templates


@NEEDS_A_NEWER_HOST
def test_every_official_template_streams_its_diffusion_models_and_nothing_else(
    page: Any, served_frontend: ServedFrontend, templates_with_a_loader: dict[str, dict[str, Any]]
) -> None:
    """Every template of the newest package (harness/official_templates.py) with a model loader, through the
    action: harness/model_paths.py reads each edited graph and finds exactly one node of ours on every path from a
    loader to a sampler and none on a path to anything else, no patch after it before the path parts, every old
    link in place (or, the one it was put on, through it), ids that were free, no node of ours over another; the
    run adds one undo step, which holds the template as opened, and a second run changes nothing and adds none.
    The edited prompt validates as the untouched one does, asked of the server with harness/validate_only.py, which
    names only outputs that cannot validate (their loader's model file is not on this machine), so the server
    answers 400 and queues nothing."""
    host = served_frontend.host
    object_info = host.get("/object_info").json()
    with_loader = [
        name
        for name, workflow in templates_with_a_loader.items()
        if "nodes" in workflow and ModelPaths(workflow, object_info).loaders()
    ]

    def check(result: dict[str, Any]) -> list[str]:
        return template_problems(result, object_info) + validation_problems(host, result, object_info)

    # The canvas draws nothing meanwhile (drawing changes no graph), and each template is checked on a thread while
    # the page goes on with the next.
    page.evaluate("window.app.canvas.pause_rendering = true")
    try:
        with ThreadPoolExecutor(max_workers=1) as checks:
            checked: dict[str, Future[list[str]]] = {}
            for name in with_loader:
                result = page.evaluate(EVERY_TEMPLATE_JS, [MODULE, json.dumps(templates_with_a_loader[name])])
                checked[name] = checks.submit(check, result)
    finally:
        page.evaluate("window.app.canvas.pause_rendering = false")
    problems = {name: future.result() for name, future in checked.items() if future.result()}
    report = "\n".join(f"{name}: {'; '.join(found)}" for name, found in sorted(problems.items()))
    assert not problems, f"{len(problems)} of {len(with_loader)} templates:\n{report}"
