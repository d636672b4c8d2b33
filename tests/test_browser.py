"""The live panel in a real browser: headless Chromium (Debian's ``chromium``, driven by Playwright)
opens the real ComfyUI frontend served by the session's server, with the pack loaded.

The test loads the Wan example workflow into the canvas, opens the panel's bottom-panel tab, queues
the workflow's API twin through the server's API, and reads what the panel drew from data
attributes on its root (messages received, steps received, block calls drawn on the timeline, the
prompt and step shown) and from the timeline canvas's pixels. Then it closes the tab (the panel
leaves the page: no work while hidden), runs a second prompt, reopens the tab (the panel rebuilds
from GET /block_offload/report), and drops the websocket (the panel refetches on "reconnected").
A screenshot goes to the test's tmp dir; with BLOCK_OFFLOAD_SCREENSHOT=<path> also to that path
(docs/panel.png for the README). A server of its own, on which nothing has run, shows the empty state.

scripts/setup.sh installs Chromium (apt) and Playwright (pip); Playwright never downloads a browser
here, it drives /usr/bin/chromium (or $CHROMIUM).
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harness.comfy_host import CLASSIC_CACHE, REPO, ComfyHost
from harness.panel import BLOCKS, NODE_NAME, check_status, wan_prompt

playwright = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed: run scripts/setup.sh")

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
UI_WORKFLOW = REPO / "example_workflows" / "async_block_offload_wan21_t2v.json"
TAB_COMMAND = "Workspace.ToggleBottomPanelTab.block-offload"
PANEL = "[data-testid=block-offload-panel]"
STEPS = 40
TIMEOUT_MS = 120_000

pytestmark = [
    pytest.mark.usefixtures("tiny_models"),
    pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason=f"no Chromium at {CHROMIUM}: run scripts/setup.sh"),
]


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def browser_page(browser: Any, host: ComfyHost) -> Iterator[Any]:
    """ComfyUI's frontend from ``host`` in a fresh browser context, first-run dialogs and banners settled."""
    # A user who has seen the tutorial gets no template browser on load (ComfyUI's own setting).
    host.post("/api/settings/Comfy.TutorialCompleted", True).raise_for_status()
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        context.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
        page = context.new_page()
        page.errors = []  # type: ignore[attr-defined]
        page.on("pageerror", lambda error: page.errors.append(f"{error}\n{error.stack}"))
        page.goto(host.url)
        page.wait_for_function("window.app?.extensionManager && window.app.graph", timeout=TIMEOUT_MS)
        page.keyboard.press("Escape")  # any dialog the frontend opened on its own
        yield page
    finally:
        context.close()


@pytest.fixture(scope="module")
def page(browser: Any, comfy_host: ComfyHost) -> Iterator[Any]:
    """The session's server in the browser, the Wan example workflow on the canvas."""
    with browser_page(browser, comfy_host) as page:
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


def test_panel_draws_a_run_live(page: Any, comfy_host: ComfyHost, tmp_path: Path) -> None:
    toggle_tab(page)
    wait_for_panel(page, "Number(d.reports) > 0 && (d.state === 'empty' || d.state === 'idle')")

    result = comfy_host.run(wan_prompt(STEPS), timeout=300)
    assert result.ok, result.error_text()
    data = wait_for_panel(page, f"d.prompt === '{result.prompt_id}' && d.state === 'idle'")
    assert int(data["messages"]) >= 2 and int(data["stepsReceived"]) >= 1, data
    assert int(data["lastStep"]) == STEPS - 1, data
    assert int(data["blocksDrawn"]) == BLOCKS, data
    assert float(data["drawMs"]) < 50, f"one draw took {data['drawMs']} ms of the page's main thread"
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


def test_panel_does_no_work_while_closed_and_survives_reopen_and_reconnect(page: Any, comfy_host: ComfyHost) -> None:
    if panel_data(page).get("state") is None:
        toggle_tab(page)
    before = wait_for_panel(page, "d.state === 'idle'")
    toggle_tab(page)  # close
    page.wait_for_function(f"!document.querySelector('{PANEL}')")

    result = comfy_host.run(wan_prompt(STEPS), timeout=300)
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


def test_panel_empty_state_on_a_fresh_server(browser: Any) -> None:
    """Before anything streamed (a server of its own: the session's has run models by now) the routes
    answer an empty run and the panel says what it is for; this CPU-only server has no CUDA device."""
    with ComfyHost(env={**os.environ, "BLOCK_OFFLOAD_ALLOW_CPU": "1"}, extra_args=CLASSIC_CACHE) as fresh:
        report = fresh.get_json("/block_offload/report")
        check_status(report, "report")
        assert report["node"] is None and report["timeline"] is None and report["models"] == [], report
        assert not report["accelerator"] and report["memory"]["process_rss"] > 0
        assert fresh.get_json("/block_offload/timeline")["steps"] == []
        with browser_page(browser, fresh) as page:
            toggle_tab(page)
            data = wait_for_panel(page, "Number(d.reports) > 0")
            assert data["state"] == "empty" and data["blocksDrawn"] == "0", data
            text = page.inner_text(PANEL)
            assert "Nothing has streamed yet" in text and "No accelerator" in text, text
            assert not [e for e in page.errors if "block_offload" in e], page.errors
