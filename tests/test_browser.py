"""The live panel in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright)
opens the real ComfyUI frontend served by a real ComfyUI with the pack loaded, on two frontends
(``served_frontend``, tests/conftest.py): the host's pinned one, served by the session's server, and
the newest (``harness.browser.NEWEST_FRONTEND``) through ComfyUI's ``--front-end-root``. Each page
first proves it runs the frontend asked for.

The test loads the Wan example workflow into the canvas, opens the panel's bottom-panel tab, queues
the workflow's API twin through the server's API, and reads what the panel drew from data
attributes on its root (messages received, steps received, block calls drawn on the timeline, the
prompt and step shown) and from the timeline canvas's pixels. Then it closes the tab (the panel
leaves the page: no work while hidden), runs a second prompt, reopens the tab (the panel rebuilds
from GET /block_offload/report), and drops the websocket (the panel refetches on "reconnected").
A screenshot goes to the test's tmp dir; with BLOCK_OFFLOAD_SCREENSHOT=<path> also to that path
(docs/panel.png for the README). A server of its own, on which nothing has run, shows the empty state.
The nodes' input tooltips reach each frontend (its node definitions) and show when the mouse rests on a widget.

scripts/setup.sh installs Chromium (apt) and Playwright (pip); Playwright never downloads a browser
here, it drives /usr/bin/chromium (or $CHROMIUM).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness.browser import (
    ServedFrontend,
    browser_page,
    chromium_missing,
    frontend_root,
    hover_widget_tooltip,
    launch_browser,
    page_frontend_version,
)
from harness.comfy_host import CLASSIC_CACHE, REPO, ComfyHost
from harness.panel import BLOCKS, NODE_NAME, check_status, wan_prompt

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: run scripts/setup.sh")

UI_WORKFLOW = REPO / "example_workflows" / "async_block_offload_wan21_t2v.json"
TAB_COMMAND = "Workspace.ToggleBottomPanelTab.block-offload"
PANEL = "[data-testid=block-offload-panel]"
STEPS = 40
#: The pack's nodes (nodes/offload_nodes.py), whose inputs declare tooltips.
PACK_NODES = ("AsyncBlockOffload", "PartialGPUResidency", "SequentialOffloadWrapper")

pytestmark = [
    pytest.mark.usefixtures("tiny_models"),
    pytest.mark.skipif(chromium_missing() is not None, reason=str(chromium_missing())),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with launch_browser() as browser:
        yield browser


@pytest.fixture(scope="module")
def page(browser: Any, served_frontend: ServedFrontend) -> Iterator[Any]:
    """The frontend's server in the browser, the Wan example workflow on the canvas."""
    with browser_page(browser, served_frontend.host) as page:
        # Every test on this page runs on the frontend asked for, or none passes.
        assert page_frontend_version(page) == served_frontend.version
        page.evaluate("data => window.app.loadGraphData(data)", json.loads(UI_WORKFLOW.read_text()))
        yield page


def panel_data(page: Any) -> dict[str, str]:
    return page.evaluate(f"({{...document.querySelector('{PANEL}')?.dataset}})")


def toggle_tab(page: Any) -> None:
    page.evaluate(f"window.app.extensionManager.command.execute('{TAB_COMMAND}')")


def wait_for_panel(page: Any, condition: str) -> dict[str, str]:
    """Waits until the panel's data attributes (``d``) satisfy a JS ``condition``; returns them."""
    page.wait_for_function(f"(d => d && ({condition}))(document.querySelector('{PANEL}')?.dataset)", timeout=30_000)
    return panel_data(page)


def painted_pixels(page: Any) -> int:
    """Pixels the timeline canvas has drawn (not transparent)."""
    return page.evaluate(
        """() => {
            const canvas = document.querySelector('[data-testid=block-offload-timeline]');
            const pixels = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
            let painted = 0;
            for (let i = 3; i < pixels.length; i += 4) painted += pixels[i] > 0;
            return painted;
        }"""
    )


def test_the_page_runs_the_frontend_asked_for(page: Any, served_frontend: ServedFrontend) -> None:
    """The page reports the frontend's own version, and the server says it serves it from where it was told: a
    --front-end-root ComfyUI ignored would serve the pinned frontend and fail here."""
    assert page_frontend_version(page) == served_frontend.version
    assert f"web root: {frontend_root(served_frontend.name)}\n" in served_frontend.host.log_text()


def test_the_nodes_tooltips_reach_the_frontend(page: Any, served_frontend: ServedFrontend) -> None:
    """Every input tooltip the pack's nodes declare is in the frontend's definition of the node (what it shows on
    hover), and the canvas shows one when the mouse rests on its widget."""
    declared = {
        node: {
            name: spec[1]["tooltip"]
            for section in ("required", "optional")
            for name, spec in served_frontend.host.object_info(node)[node]["input"].get(section, {}).items()
            if len(spec) > 1 and "tooltip" in spec[1]
        }
        for node in PACK_NODES
    }
    assert all(declared.values()), f"a node of the pack declares no input tooltip: {declared}"
    received = page.evaluate(
        """nodes => Object.fromEntries(nodes.map((node) => {
            const input = window.LiteGraph.registered_node_types[node]?.nodeData?.input ?? {};
            const specs = {...input.required, ...input.optional};
            return [node, Object.fromEntries(Object.entries(specs).map(([name, spec]) => [name, spec[1]?.tooltip]))];
        }))""",
        list(PACK_NODES),
    )
    for node, tooltips in declared.items():
        assert {name: received[node].get(name) for name in tooltips} == tooltips, node

    shown = hover_widget_tooltip(page, "AsyncBlockOffload", "resident_blocks")
    assert shown.split() == declared["AsyncBlockOffload"]["resident_blocks"].split(), shown
    page.mouse.move(5, 5)  # off the canvas: the tooltip goes


def test_panel_draws_a_run_live(page: Any, served_frontend: ServedFrontend, tmp_path: Path) -> None:
    toggle_tab(page)
    wait_for_panel(page, "Number(d.reports) > 0 && (d.state === 'empty' || d.state === 'idle')")

    result = served_frontend.host.run(wan_prompt(STEPS), timeout=300)
    assert result.ok, result.error_text()
    data = wait_for_panel(page, f"d.prompt === '{result.prompt_id}' && d.state === 'idle'")
    assert int(data["messages"]) >= 2 and int(data["stepsReceived"]) >= 1, data
    assert int(data["lastStep"]) == STEPS - 1, data
    assert int(data["blocksDrawn"]) == BLOCKS, data
    assert float(data["drawMs"]) > 0, data  # what a draw costs is printed, not asserted: a time is no test's result
    print(f"\npanel: {data['messages']} messages, {data['draws']} draws, the last took {data['drawMs']} ms")
    assert painted_pixels(page) > 2000
    text = page.inner_text(PANEL)
    assert f"last run: {NODE_NAME}, {STEPS} steps" in text
    assert "1 of 5 blocks resident, 4 streamed" in text
    assert "No accelerator: process memory" in text  # the session's server runs on the CPU
    assert "overlap" in text and "host→device" in text and "GB/s" in text
    timeline = page.evaluate("fetch(document.querySelector('.bo-panel a[download]').href).then(r => r.json())")
    assert timeline["prompt_id"] == result.prompt_id and len(timeline["steps"]) == STEPS

    page.evaluate("window.app.extensionManager.command.execute('Comfy.Canvas.FitView')")  # the graph, above
    page.screenshot(path=tmp_path / "panel.png")
    target = os.environ.get("BLOCK_OFFLOAD_SCREENSHOT")
    if target:
        page.screenshot(path=target)
    assert not [e for e in page.errors if "block_offload" in e], page.errors


def test_panel_does_no_work_while_closed_and_survives_reopen_and_reconnect(
    page: Any, served_frontend: ServedFrontend
) -> None:
    if panel_data(page).get("state") is None:
        toggle_tab(page)
    before = wait_for_panel(page, "d.state === 'idle'")
    toggle_tab(page)  # close
    page.wait_for_function(f"!document.querySelector('{PANEL}')")

    result = served_frontend.host.run(wan_prompt(STEPS), timeout=300)
    assert result.ok, result.error_text()
    toggle_tab(page)  # reopen after the run: the report describes it
    data = wait_for_panel(page, f"d.prompt === '{result.prompt_id}' && d.state === 'idle' && d.blocksDrawn === '5'")
    assert int(data["messages"]) > int(before["messages"]), "messages stopped arriving while the tab was closed"
    # A fresh panel draws on mount, after the report, and for the run's last messages if they land after it
    # opened (a run's final message may wait out the rate limit): a handful, not one per step. Once the
    # messages have stopped, so must the drawing.
    page.wait_for_timeout(1000)
    settled = panel_data(page)
    assert int(settled["draws"]) <= 5, f"a fresh panel drew {settled['draws']} times"
    page.wait_for_timeout(1000)
    quiet = panel_data(page)
    assert quiet["messages"] == settled["messages"], "a message arrived long after the run ended"
    assert quiet["draws"] == settled["draws"], "the panel kept drawing while nothing changed"
    assert int(data["lastStep"]) == STEPS - 1

    reports = int(data["reports"])
    page.evaluate("window.comfyAPI.api.api.socket.close()")
    data = wait_for_panel(page, f"Number(d.reports) > {reports} && d.state === 'idle'")
    assert data["prompt"] == result.prompt_id and data["blocksDrawn"] == str(BLOCKS), data
    assert painted_pixels(page) > 2000
    # Under load the frontend may reconnect more than once, each time fetching the report; one fetched after
    # the status below would rightly clear what it says (the server's own report is the newer word), so the
    # reconnecting must be over first: connected, and no report fetched for a second.
    for _ in range(30):
        page.wait_for_timeout(1000)
        latest = panel_data(page)
        if latest["reports"] == data["reports"] and latest["state"] == "idle":
            break
        data = latest
    else:
        raise AssertionError(f"the panel kept reconnecting or fetching the report: {data}")

    # A status of a schema this panel does not read (the server's pack updated under an open page) is not
    # drawn: the panel keeps the last one it read and says to reload.
    page.evaluate(
        "window.comfyAPI.api.api.dispatchEvent(new CustomEvent('block_offload.status', {detail: {v: 99, seq: 1e9}}))"
    )
    page.wait_for_function(f"document.querySelector('{PANEL}').innerText.includes('status version 99')")
    assert panel_data(page)["prompt"] == result.prompt_id
    assert not [e for e in page.errors if "block_offload" in e], page.errors


def test_panel_empty_state_on_a_fresh_server(browser: Any, served_frontend: ServedFrontend) -> None:
    """Before anything streamed (a server of its own: the session's has run models by now) the routes
    answer an empty run and the panel says what it is for; this CPU-only server has no CUDA device."""
    env = {**os.environ, "BLOCK_OFFLOAD_ALLOW_CPU": "1"}
    with ComfyHost(env=env, extra_args=(*CLASSIC_CACHE, *served_frontend.server_args)) as fresh:
        report = fresh.get_json("/block_offload/report")
        check_status(report, "report")
        assert report["node"] is None and report["timeline"] is None and report["models"] == [], report
        assert not report["accelerator"] and report["memory"]["process_rss"] > 0
        assert fresh.get_json("/block_offload/timeline")["steps"] == []
        with browser_page(browser, fresh) as page:
            assert page_frontend_version(page) == served_frontend.version
            toggle_tab(page)
            data = wait_for_panel(page, "Number(d.reports) > 0")
            assert data["state"] == "empty" and data["blocksDrawn"] == "0", data
            text = page.inner_text(PANEL)
            assert "Nothing has streamed yet" in text and "No accelerator" in text, text
            assert not [e for e in page.errors if "block_offload" in e], page.errors
