"""The real ComfyUI frontend in headless Chromium (Debian's ``chromium``, driven by Playwright), for the tests
that work in the page: the panel (``tests/test_browser.py``) and the "Stream this workflow's models" action.

scripts/setup.sh installs Chromium (apt) and Playwright (pip); Playwright never downloads a browser here, it
drives /usr/bin/chromium (or $CHROMIUM).

The tests run on two frontends (:class:`ServedFrontend`): the one the host pins (its ``comfyui-frontend-package``,
what ComfyUI serves by default) and the newest (``NEWEST_FRONTEND``, which scripts/setup.sh unpacks into
``.host/frontends/``), served through ComfyUI's own ``--front-end-root``. The page says which one it runs
(:func:`page_frontend_version`), so a flag ComfyUI ignored fails rather than testing the pinned one twice.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata, util
from pathlib import Path
from typing import Any

from .comfy_host import SERVER_ARGS_ENV, SETUP_DIR, ComfyHost

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = (
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
TIMEOUT_MS = 120_000
#: The newest ComfyUI frontend the browser tests also run on (beside each host's pinned one). The one place its
#: version is named: scripts/setup.sh reads this line and unpacks the wheel's static/ into FRONTENDS_DIR/VERSION.
NEWEST_FRONTEND = "1.58.1"
FRONTENDS_DIR = SETUP_DIR / "frontends"
PINNED = "pinned"


@dataclass(frozen=True)
class ServedFrontend:
    """A ComfyUI frontend the browser tests run on, and the server that serves it.

    name: ``PINNED`` (the host's own) or a version under ``FRONTENDS_DIR``; version: what the page must report;
    server_args: the flags that make a ComfyUI serve it (a test's server of its own passes them too)."""

    name: str
    version: str
    server_args: tuple[str, ...]
    host: ComfyHost


def pinned_frontend_version() -> str:
    """The frontend the host pins: the ``comfyui-frontend-package`` installed beside its ComfyUI (the tests run
    in the host's environment, and ComfyUI serves that package's static/ unless told otherwise)."""
    try:
        return metadata.version("comfyui-frontend-package")
    except metadata.PackageNotFoundError:
        return "unknown"


def frontend_root(name: str) -> Path:
    """The folder frontend ``name`` is served from: the pinned package's static/, or its folder under
    ``FRONTENDS_DIR``."""
    if name != PINNED:
        return FRONTENDS_DIR / name
    spec = util.find_spec("comfyui_frontend_package")
    if spec is None or spec.origin is None:
        raise FileNotFoundError("comfyui-frontend-package is not installed in this environment")
    return Path(spec.origin).parent / "static"


def frontend_args(name: str) -> tuple[str, ...]:
    """The ComfyUI flags that serve frontend ``name``: none for the pinned one."""
    return () if name == PINNED else ("--front-end-root", str(frontend_root(name)))


def frontend_missing(name: str) -> str | None:
    """Why frontend ``name`` cannot be served here, or None."""
    # The flags every server gets come after a test's own, so their --front-end-root would win over ours
    # (the bare GPU machine points it at an empty folder: no frontend at all).
    if "--front-end-root" in os.environ.get(SERVER_ARGS_ENV, ""):
        return f"${SERVER_ARGS_ENV} sets every server's --front-end-root, so no test can choose the frontend"
    if name == PINNED or (FRONTENDS_DIR / name / "index.html").is_file():
        return None
    return (
        f"the ComfyUI frontend {name} is not unpacked at {FRONTENDS_DIR / name}: scripts/setup.sh could not "
        "download comfyui-frontend-package (offline?); run it again online"
    )


def page_frontend_version(page: Any) -> str:
    """The version of the frontend the page runs, as the frontend itself says (it sets this global when it
    mounts; every frontend from the hosts' pinned 1.32.9 to 1.58.1 does)."""
    return str(page.evaluate("window.__COMFYUI_FRONTEND_VERSION__"))


def chromium_missing() -> str | None:
    """Why no browser test can run here, or None."""
    if shutil.which(CHROMIUM) is None:
        return f"no Chromium at {CHROMIUM}: run scripts/setup.sh"
    return None


@contextmanager
def launch_browser() -> Iterator[Any]:
    """Headless Chromium under Playwright (imported here: only the browser tests need it)."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as driver:
        browser = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=list(CHROMIUM_ARGS))
        try:
            yield browser
        finally:
            browser.close()


@contextmanager
def browser_page(browser: Any, host: ComfyHost) -> Iterator[Any]:
    """ComfyUI's frontend from ``host`` in a fresh browser context, first-run dialogs and banners settled.

    ``page.errors`` collects the page's uncaught errors (message and stack)."""
    # A user who has seen the tutorial gets no template browser on load (ComfyUI's own setting).
    host.post("/api/settings/Comfy.TutorialCompleted", True).raise_for_status()
    # Workflows naming models (or, on 0.3.75, nodes) this server lacks open a dialog over the canvas at each load,
    # which takes the pointer's hover and clicks meant for the graph.
    for warning in ("Comfy.Workflow.ShowMissingModelsWarning", "Comfy.Workflow.ShowMissingNodesWarning"):
        host.post(f"/api/settings/{warning}", False).raise_for_status()
    context = browser.new_context(viewport={"width": 1400, "height": 900})
    try:
        # 1.32's "try the new Vue nodes" banner (0.3.75's pin); later frontends show none.
        context.add_init_script("localStorage.setItem('vueNodesBannerDismissed', 'true')")
        page = context.new_page()
        page.errors = []
        page.on("pageerror", lambda error: page.errors.append(f"{error}\n{error.stack}"))
        page.goto(host.url)
        page.wait_for_function("window.app?.extensionManager && window.app.graph", timeout=TIMEOUT_MS)
        # ``window.app`` exists before the frontend opens its first workflow (the default graph, for a browser
        # with no saved tabs): a graph loaded before that is replaced by it, on a busy machine.
        page.wait_for_function("(window.app.rootGraph ?? window.app.graph).nodes.length > 0", timeout=TIMEOUT_MS)
        page.keyboard.press("Escape")  # any dialog the frontend opened on its own
        yield page
    finally:
        context.close()


def hover_widget_tooltip(page: Any, node_type: str, widget: str) -> str:
    """The tooltip the canvas shows when the mouse rests on ``widget`` of the first ``node_type`` node in the
    graph (ComfyUI's tooltip element, ``.node-tooltip``), or "" when none shows.

    The node is first moved into view at the canvas's scale 1, so the widget's place on the screen is the node's
    position plus the widget's own offset (``widget.y``, below the title)."""
    point = page.evaluate(
        """([type, name]) => {
            const canvas = window.app.canvas;
            const node = window.app.graph.nodes.find((n) => n.type === type);
            const widget = node?.widgets?.find((w) => w.name === name);
            if (!widget) return null;
            canvas.ds.scale = 1;
            canvas.ds.offset = [300 - node.pos[0], 300 - node.pos[1]];
            canvas.setDirty(true, true);
            const rect = canvas.canvas.getBoundingClientRect();
            return [rect.left + 300 + node.size[0] / 2, rect.top + 300 + (widget.y ?? widget.last_y) + 10];
        }""",
        [node_type, widget],
    )
    if point is None:
        raise AssertionError(f"no {node_type} node with a widget {widget!r} in the graph")
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    x, y = point
    # The frontend shows a tooltip once the pointer has rested (LiteGraph.Node.TooltipDelay, 500 ms): move onto
    # the widget from beside it, so the canvas sees a move, then wait for the tooltip.
    page.mouse.move(x - 20, y)
    page.mouse.move(x, y)
    try:
        page.wait_for_function(
            "[...document.querySelectorAll('.node-tooltip')].some((e) => e.innerText.trim())", timeout=10_000
        )
    except PlaywrightTimeout:  # no tooltip showed: the caller's assertion says so
        return ""
    return str(page.evaluate("[...document.querySelectorAll('.node-tooltip')].map((e) => e.innerText).join('')"))
