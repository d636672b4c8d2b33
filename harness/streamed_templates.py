"""ComfyUI's official templates with the pack's node in them, made by the pack's own action.

Each shipped template is loaded into the real frontend (headless Chromium, harness/browser.py), the "Stream this
workflow's models" command (web/stream_workflow.js) inserts Partial GPU Residency (auto) on every model path,
and the result is written in both formats: ``example_workflows/<name>.json`` (the UI graph, what ComfyUI's
template browser offers) and ``example_workflows/api/<name>.json`` (``app.graphToPrompt()``'s output, what
``POST /prompt`` takes). Nothing else of the template changes: its models, sizes, steps and LoRAs are what users
download and run. Running ::

    .venv-0.33.0/bin/python -m harness.streamed_templates   # starts ComfyUI 0.33.0 with this pack and its frontend

rewrites them; tests/test_streamed_templates.py checks on that host, with its pinned frontend, that the committed
files are what the action writes today, and tests/test_templates.py runs each through a server on tiny models.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .browser import browser_page, launch_browser
from .comfy_host import ComfyHost
from .official_templates import official_template
from .template_prompts import Prompt, is_link
from .templates import api_prompt
from .workflows import OUT_DIR, REPO, dump

#: The templates shipped with the node in them, by the official template's name.
SHIPPED = (
    "video_wan2_2_14B_t2v",
    "image_z_image_turbo",
    "image_qwen_image",
    "image_flux2_text_to_image",
    "image_krea2_turbo_t2i_int8",
    "video_ltx2_3_t2v",
    "video_minimax_h3_t2v",
)
PREFIX = "streamed_"
#: The node the action inserts.
OUR_NODE = "PartialGPUResidency"
MODULE = "/extensions/block_offload/stream_workflow.js"

# Loads the template, runs the command the menus run, and returns the graph, its API prompt and the message.
STREAM_JS = """
async ([modulePath, workflow]) => {
  await window.app.loadGraphData(workflow);
  const module = await import(modulePath);
  const report = module.runStreamCommand();
  const prompt = await window.app.graphToPrompt();
  return {
    ui: JSON.parse(JSON.stringify((window.app.rootGraph ?? window.app.graph).serialize())),
    api: prompt.output,
    streamed: report.streamed,
    switchedOff: report.switchedOff,
    leftAlone: report.leftAlone,
  };
}
"""


def template_prompt(page: Any, template: str) -> Prompt:
    """The API prompt of the official template ``template`` itself, without the node."""
    return api_prompt(page, official_template(template))


def example_name(template: str) -> str:
    return PREFIX + template


def api_twin(template: str) -> Prompt:
    """The committed API prompt of ``template`` with the node in it."""
    return json.loads((OUT_DIR / "api" / f"{example_name(template)}.json").read_text())


def without_meta(prompt: Prompt) -> Prompt:
    """``prompt`` without its titles (``_meta``): the host's display names, which differ between hosts, while the
    graph is what runs."""
    return {node_id: {k: v for k, v in node.items() if k != "_meta"} for node_id, node in prompt.items()}


def without_our_nodes(prompt: Prompt) -> Prompt:
    """``prompt`` with each of our nodes dropped and whatever it fed linked to what fed it."""
    ours = {node_id: node["inputs"]["model"] for node_id, node in prompt.items() if node["class_type"] == OUR_NODE}
    return {
        node_id: {
            **node,
            "inputs": {
                name: ours[value[0]] if is_link(value) and value[0] in ours else value
                for name, value in node["inputs"].items()
            },
        }
        for node_id, node in prompt.items()
        if node_id not in ours
    }


def stream_template(page: Any, template: str) -> dict[str, Any]:
    """The action's result on ``template`` in ``page``: ``ui``, ``api``, ``streamed`` (files),
    ``switchedOff`` (files in a part switched off, given their node too), ``leftAlone``."""
    return dict(page.evaluate(STREAM_JS, [MODULE, official_template(template)]))


def render(page: Any) -> dict[str, str]:
    """File name -> file text, for every shipped template in both formats."""
    files: dict[str, str] = {}
    for template in SHIPPED:
        result = stream_template(page, template)
        if not result["streamed"] or result["leftAlone"]:
            raise RuntimeError(f"the action did not stream every model of {template}: {result['leftAlone']}")
        files[f"{example_name(template)}.json"] = dump(result["ui"])
        files[f"api/{example_name(template)}.json"] = dump(result["api"])
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.parse_args(argv)
    with ComfyHost() as host, launch_browser() as browser, browser_page(browser, host) as page:
        files = render(page)
    for filename, text in files.items():
        path = OUT_DIR / filename
        path.write_text(text)
        print(path.relative_to(REPO))
    return 0


if __name__ == "__main__":
    sys.exit(main())
