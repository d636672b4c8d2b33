"""The example workflows: committed files match harness/workflows.py, the UI-format files are
graphs the frontend can load, and the API twins run on a real ComfyUI.

The frontend checks follow how ComfyUI's frontend reads a graph against ``/object_info``: an
input is a widget when its type is INT, FLOAT, STRING, BOOLEAN or a combo (unless
``forceInput``), a socket otherwise; widget values come in ``input_order`` (required, then
optional), and an input marked ``control_after_generate`` is followed by that widget's value.
"""

from __future__ import annotations

import json
import re
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from conftest import HOST_VERSION
from safetensors.torch import load_file

from harness import tiny_models as tm
from harness import workflows
from harness.big_model import TINY_FLUX
from harness.comfy_host import REPO, ComfyHost

EXAMPLES = REPO / "example_workflows"
# The workflows harness/workflows.py writes; the official templates streamed by the action have their own tests
# (tests/test_streamed_templates.py, tests/test_templates.py): they keep their pipeline in a subgraph, which the
# checks below do not read.
UI_FILES = [EXAMPLES / f"{name}.json" for name in workflows.WORKFLOWS]
API_DIR = EXAMPLES / "api"
#: The workflows that load the tiny Flux (``big_model``: they take turns with the other suites' such tests).
FLUX_WORKFLOWS = frozenset(
    name for name in workflows.WORKFLOWS if tm.FLUX_FILE in (API_DIR / f"{name}.json").read_text()
)
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
PACK_NODES = {
    "AsyncBlockOffload": "Async Block Offload",
    "PartialGPUResidency": "Partial GPU Residency",
    "SequentialOffloadWrapper": "Sequential Offload Wrapper",
}


@pytest.fixture(scope="module")
def object_info(comfy_host: ComfyHost) -> dict[str, Any]:
    return comfy_host.object_info()


def skip_without_their_packs(class_types: set[str], object_info: dict[str, Any]) -> None:
    """Skips, saying why, when a workflow's nodes come from a pack the server lacks: the GGUF example's
    Unet Loader (GGUF) is ComfyUI-GGUF's, which scripts/setup.sh links where ../shared/ComfyUI-GGUF exists."""
    missing = sorted(class_types - set(object_info))
    if missing:
        pytest.skip(f"the server has no {', '.join(missing)} (ComfyUI-GGUF not in .host/custom_nodes?)")


# ------------------------------------------------------------------ generator vs files
@pytest.mark.skipif(
    HOST_VERSION != workflows.GENERATED_FOR,
    reason=f"the committed workflows follow ComfyUI {workflows.GENERATED_FOR}'s node definitions "
    f"(harness/workflows.py GENERATED_FOR); this host's are checked by the frontend tests below",
)
def test_committed_files_are_what_the_generator_writes(object_info: dict[str, Any]) -> None:
    """Run ``.venv-0.33.0/bin/python -m harness.workflows`` after changing a workflow (or when ComfyUI's
    nodes change)."""
    skip_without_their_packs({n["class_type"] for f in workflows.WORKFLOWS.values() for n in f().values()}, object_info)
    expected = workflows.render(object_info)
    assert len(expected) == 2 * len(workflows.WORKFLOWS)
    stale = []
    for filename, text in expected.items():
        path = EXAMPLES / filename
        if not path.is_file() or path.read_text() != text:
            stale.append(filename)
    assert not stale, f"out of date (run .venv-0.33.0/bin/python -m harness.workflows): {stale}"


def test_every_workflow_has_both_files() -> None:
    names = {p.stem for p in EXAMPLES.glob("*.json")}
    assert set(workflows.WORKFLOWS) <= names
    for name in names:
        assert (API_DIR / f"{name}.json").is_file(), f"{name}.json has no API twin"


# -------------------------------------------------------------------- frontend validity
def _inputs(info: dict[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    out = []
    for section in ("required", "optional"):
        for name in info["input_order"].get(section, []):
            spec = info["input"][section][name]
            out.append((name, spec[0], spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}))
    return out


def _widget(input_type: Any, options: dict[str, Any]) -> bool:
    return (isinstance(input_type, list) or input_type in WIDGET_TYPES) and not options.get("forceInput")


def _widget_count(info: dict[str, Any]) -> int:
    return sum(1 + bool(o.get("control_after_generate")) for _, t, o in _inputs(info) if _widget(t, o))


def _check_value(where: str, input_type: Any, options: dict[str, Any], value: Any) -> list[str]:
    choices = input_type if isinstance(input_type, list) else options.get("options")
    if input_type == "COMBO" or isinstance(input_type, list):
        return [] if value in choices else [f"{where}: {value!r} is not one of {choices}"]
    if input_type == "BOOLEAN":
        return [] if isinstance(value, bool) else [f"{where}: {value!r} is not a boolean"]
    if input_type == "STRING":
        return [] if isinstance(value, str) else [f"{where}: {value!r} is not a string"]
    kinds = (int,) if input_type == "INT" else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        return [f"{where}: {value!r} is not {input_type}"]
    low, high = options.get("min", float("-inf")), options.get("max", float("inf"))
    return [] if low <= value <= high else [f"{where}: {value!r} is outside [{low}, {high}]"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def frontend_problems(graph: dict[str, Any], object_info: dict[str, Any]) -> list[str]:
    """Everything that would keep the frontend from loading ``graph`` as drawn (empty: fine).

    The shapes follow the frontend's own schema of version 0.4 (zComfyWorkflow in
    src/platform/workflow/validation/schemas/workflowSchema.ts); the rest is consistency
    between nodes, links and the node definitions, which that schema does not check."""
    problems: list[str] = []
    for key in ("last_node_id", "last_link_id", "nodes", "links", "groups", "config", "extra", "version"):
        if key not in graph:
            problems.append(f"no top-level {key!r}")
    if problems:
        return problems
    if graph["version"] != 0.4:
        problems.append(f"version {graph['version']} (expected 0.4)")
    node_ids = [n["id"] for n in graph["nodes"]]
    link_ids = [link[0] for link in graph["links"]]
    problems += [f"node id {i} used twice" for i, c in Counter(node_ids).items() if c > 1]
    problems += [f"link id {i} used twice" for i, c in Counter(link_ids).items() if c > 1]
    if node_ids and graph["last_node_id"] < max(node_ids):
        problems.append(f"last_node_id {graph['last_node_id']} < node id {max(node_ids)}")
    if link_ids and graph["last_link_id"] < max(link_ids):
        problems.append(f"last_link_id {graph['last_link_id']} < link id {max(link_ids)}")
    nodes = {n["id"]: n for n in graph["nodes"]}
    if sorted(n["order"] for n in graph["nodes"]) != list(range(len(nodes))):
        problems.append("node 'order' values are not 0..n-1")

    for node in graph["nodes"]:
        where = f"node {node['id']} ({node['type']})"
        info = object_info.get(node["type"])
        if info is None:
            problems.append(f"{where}: /object_info has no such node type")
            continue
        for key in ("pos", "size", "flags", "mode", "properties", "inputs", "outputs", "widgets_values"):
            if key not in node:
                problems.append(f"{where}: no {key!r}")
        for key in ("pos", "size"):
            vector = node.get(key)
            if not (isinstance(vector, list) and len(vector) == 2 and all(_number(v) for v in vector)):
                problems.append(f"{where}: {key} {vector!r} is not [x, y]")
        if not (_number(node.get("order")) and _number(node.get("mode")) and isinstance(node.get("flags"), dict)):
            problems.append(f"{where}: order, mode or flags malformed")
        if node.get("properties", {}).get("Node name for S&R") != node["type"]:
            problems.append(f"{where}: properties['Node name for S&R'] is not the node type")
        specs = _inputs(info)
        sockets = [(name, t) for name, t, o in specs if not _widget(t, o)]
        drawn = [(i["name"], i["type"]) for i in node["inputs"] if "widget" not in i]
        if drawn != sockets:
            problems.append(f"{where}: input sockets {drawn}, /object_info says {sockets}")
        required = set(info["input_order"].get("required", []))
        for slot in node["inputs"]:
            if slot["name"] in required and slot.get("link") is None and "widget" not in slot:
                problems.append(f"{where}: required input {slot['name']!r} is not connected")
        outputs = [(o["name"], o["type"]) for o in node["outputs"]]
        expected_outputs = list(zip(info["output_name"], info["output"], strict=True))
        # An output a newer ComfyUI added (0.33's SaveLatent returns its latent) is drawn by an older
        # frontend as an extra, unconnected slot: the graph loads and queues the same.
        added = node["outputs"][len(expected_outputs) :]
        newer_only = outputs[: len(expected_outputs)] == expected_outputs and not any(o.get("links") for o in added)
        if outputs != expected_outputs and not newer_only:
            problems.append(f"{where}: outputs {outputs}, /object_info says {expected_outputs}")
        values = list(node["widgets_values"])
        if len(values) != _widget_count(info):
            problems.append(f"{where}: {len(values)} widgets_values, the node has {_widget_count(info)} widgets")
            continue
        for name, input_type, options in specs:
            if not _widget(input_type, options):
                continue
            problems += _check_value(f"{where} widget {name!r}", input_type, options, values.pop(0))
            if options.get("control_after_generate"):
                control = values.pop(0)
                if control not in CONTROL_VALUES:
                    problems.append(f"{where}: control_after_generate value {control!r} after {name!r}")

    for link in graph["links"]:
        if len(link) != 6:
            problems.append(f"link {link}: not [id, origin_id, origin_slot, target_id, target_slot, type]")
            continue
        link_id, origin, origin_slot, target, target_slot, link_type = link
        where = f"link {link_id}"
        if origin not in nodes or target not in nodes:
            problems.append(f"{where}: origin {origin} or target {target} is no node")
            continue
        outs, ins = nodes[origin]["outputs"], nodes[target]["inputs"]
        if not 0 <= origin_slot < len(outs) or not 0 <= target_slot < len(ins):
            problems.append(f"{where}: slot {origin_slot} of node {origin} or slot {target_slot} of {target} missing")
            continue
        out, inp = outs[origin_slot], ins[target_slot]
        if not out["type"] == inp["type"] == link_type:
            problems.append(f"{where}: types {out['type']} -> {inp['type']} as {link_type}")
        if link_id not in (out.get("links") or []):
            problems.append(f"{where}: not listed in node {origin}'s output {out['name']!r} links")
        if inp.get("link") != link_id:
            problems.append(f"{where}: node {target}'s input {inp['name']!r} has link {inp.get('link')}")
    by_id = {link[0]: link for link in graph["links"] if len(link) == 6}
    for node in graph["nodes"]:
        for slot_index, slot in enumerate(node["inputs"]):
            link = by_id.get(slot["link"]) if slot.get("link") is not None else None
            if slot.get("link") is not None and (link is None or link[3:5] != [node["id"], slot_index]):
                problems.append(f"node {node['id']} input {slot['name']!r}: link {slot['link']} does not end here")
        for slot_index, slot in enumerate(node["outputs"]):
            if slot.get("slot_index", slot_index) != slot_index:
                problems.append(f"node {node['id']} output {slot['name']!r}: slot_index {slot['slot_index']}")
            for link_id in slot.get("links") or []:
                link = by_id.get(link_id)
                if link is None or link[1:3] != [node["id"], slot_index]:
                    problems.append(f"node {node['id']} output {slot['name']!r}: link {link_id} does not start here")
    return problems


def ui_to_api(graph: dict[str, Any], object_info: dict[str, Any]) -> dict[str, Any]:
    """What the frontend queues for ``graph`` (its graphToPrompt), without titles."""
    links = {link[0]: link for link in graph["links"]}
    prompt = {}
    for node in graph["nodes"]:
        inputs: dict[str, Any] = {}
        values = list(node["widgets_values"])
        for name, input_type, options in _inputs(object_info[node["type"]]):
            if _widget(input_type, options):
                inputs[name] = values.pop(0)
                if options.get("control_after_generate"):
                    values.pop(0)
        for slot in node["inputs"]:
            if slot.get("link") is not None:
                link = links[slot["link"]]
                inputs[slot["name"]] = [str(link[1]), link[2]]
        prompt[str(node["id"])] = {"class_type": node["type"], "inputs": inputs}
    return prompt


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_ui_workflow_loads_in_the_frontend(path: Path, object_info: dict[str, Any]) -> None:
    graph = json.loads(path.read_text())
    skip_without_their_packs({node["type"] for node in graph["nodes"]}, object_info)
    problems = frontend_problems(graph, object_info)
    assert not problems, f"{path.name}:\n" + "\n".join(problems)


@pytest.mark.parametrize("path", UI_FILES, ids=[p.stem for p in UI_FILES])
def test_ui_workflow_queues_its_api_twin(path: Path, object_info: dict[str, Any]) -> None:
    """The two files describe one workflow: queuing the UI graph sends what the API file says."""
    api = json.loads((API_DIR / path.name).read_text())
    skip_without_their_packs({node["class_type"] for node in api.values()}, object_info)
    without_meta = {nid: {"class_type": n["class_type"], "inputs": n["inputs"]} for nid, n in api.items()}
    assert ui_to_api(json.loads(path.read_text()), object_info) == without_meta


def test_frontend_checks_catch_a_broken_graph(object_info: dict[str, Any]) -> None:
    """The checks above can fail: each kind of damage is reported."""
    graph = workflows.to_ui(workflows.sequential_offload_wrapper_sd3_t2i(), object_info)
    assert frontend_problems(graph, object_info) == []

    def damaged(edit: Any) -> list[str]:
        copy = json.loads(json.dumps(graph))
        edit(copy)
        return frontend_problems(copy, object_info)

    ksampler = next(i for i, n in enumerate(graph["nodes"]) if n["type"] == "KSampler")
    assert damaged(lambda g: g["nodes"][ksampler]["widgets_values"].pop(1))  # no control_after_generate
    assert damaged(lambda g: g["links"][0].__setitem__(5, "CLIP"))
    assert damaged(lambda g: g["links"][0].__setitem__(3, 99))
    assert damaged(lambda g: g["nodes"][ksampler]["inputs"][0].__setitem__("link", None))
    assert damaged(lambda g: g["nodes"][0].__setitem__("type", "NoSuchNode"))
    assert damaged(lambda g: g["nodes"][1].__setitem__("id", 1))
    assert damaged(lambda g: g["nodes"][ksampler]["widgets_values"].__setitem__(4, "no_such_sampler"))
    assert damaged(lambda g: g["nodes"][ksampler]["outputs"].clear())  # an output the node has is missing
    extra = {"name": "extra", "type": "LATENT", "links": [graph["last_link_id"]]}
    assert damaged(lambda g: g["nodes"][ksampler]["outputs"].append(extra))  # a connected output it lacks


# ------------------------------------------------------------------------ running them
@pytest.mark.usefixtures("tiny_models")
@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=TINY_FLUX) if n in FLUX_WORKFLOWS else n for n in workflows.WORKFLOWS]
)
def test_api_workflow_runs_and_streams(comfy_host: ComfyHost, object_info: dict[str, Any], name: str) -> None:
    prompt = json.loads((API_DIR / f"{name}.json").read_text())
    skip_without_their_packs({node["class_type"] for node in prompt.values()}, object_info)
    prefix = f"tests/workflows/{uuid.uuid4().hex[:8]}/{name}"
    for node in prompt.values():
        if node["class_type"] == "SaveLatent":
            node["inputs"]["filename_prefix"] = prefix
    log_start = len(comfy_host.log_text())
    result = comfy_host.run(prompt, timeout=300)
    log = comfy_host.log_text()[log_start:]
    assert result.ok, result.error_text() + "\n" + comfy_host.log_tail(60)
    (latent_path,) = result.latent_files()
    latent = load_file(str(latent_path))["latent_tensor"]
    assert latent.numel() > 0 and bool(latent.isfinite().all()), f"{latent_path}: empty or not finite"
    (pack_node,) = [n["class_type"] for n in prompt.values() if n["class_type"] in PACK_NODES]
    plan = [line for line in log.splitlines() if line.startswith(f"Block Offload ({PACK_NODES[pack_node]}): ")]
    assert plan, f"{pack_node} did not stream (is BLOCK_OFFLOAD_ALLOW_CPU=1 set for the server?)\n{log}"
    if pack_node != "SequentialOffloadWrapper":
        match = re.search(r"(\d+)/(\d+) blocks resident", plan[0])
        assert match and int(match[1]) < int(match[2]), plan[0]
