"""Shared fixtures: one real ComfyUI server per test session, and the tiny models it loads.

* ``comfy_host``: a started :class:`comfy_host.ComfyHost` (CPU, free loopback port,
  base directory ``.host/``, this pack in custom_nodes), stopped after the session.
* ``tiny_models``: the tiny random-weight checkpoints, written into ``.host/models`` once.
* ``comfyui_path``: the ComfyUI folder, put on ``sys.path`` so a test can import
  ``comfy``/``nodes`` in-process. Nothing here imports comfy at module level.
* ``comfy``: ComfyUI and this pack in the test process (``harness/inprocess.py``);
  ``allow_cpu_streaming``: the nodes stream on the CPU too.

The helpers the tests share live in ``harness/``, which the tests import like any package (the
repository root is on ``sys.path``, pyproject's ``pythonpath``); importing it makes the pack
importable as ``block_offload``, the one name the tests use for it.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.comfy_host import (
    CLASSIC_CACHE,
    HOST_DIR,
    REPO,
    ComfyHost,
    ComfyHostError,
    ensure_tiny_models,
    resolve_comfyui_path,
)
from harness.inprocess import in_process_comfy


def comfyui_version() -> str:
    """The version of the ComfyUI the suite runs on (its ``comfyui_version.py``)."""
    try:
        text = (resolve_comfyui_path() / "comfyui_version.py").read_text()
    except (ComfyHostError, OSError):  # no host set up: the fixtures that need one say so
        return "unknown"
    return text.split("__version__ = ")[1].split()[0].strip("\"'")


HOST_VERSION = comfyui_version()


def pytest_report_header(config: pytest.Config) -> str:
    return f"ComfyUI host: {HOST_VERSION} ({os.environ.get('COMFYUI_PATH') or 'the set-up default'})"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test id names the ComfyUI it ran on (``[comfyui-0.33.0]``): the suite runs once per host."""
    if "comfyui_host" in metafunc.fixturenames:
        metafunc.parametrize("comfyui_host", [HOST_VERSION], ids=[f"comfyui-{HOST_VERSION}"], scope="session")


@pytest.fixture(autouse=True)
def _host_in_test_id(comfyui_host: str) -> None:
    """Pulls ``comfyui_host`` into every test, so ``pytest_generate_tests`` puts the host in its id."""


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """The repo root is the pack: its __init__.py (which needs ComfyUI's comfy_api) makes pytest
    collect the root as a Package, whose setup imports that __init__.py looking for setup_module.
    ComfyUI imports the pack, never pytest: skip that setup for the root node only."""
    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Package) and node.path == REPO:
                node.setup = lambda: None  # type: ignore[method-assign]


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    """The ComfyUI folder ($COMFYUI_PATH or the one scripts/setup.sh installed), on sys.path."""
    path = resolve_comfyui_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """The tiny checkpoints in .host/models (generated once per session)."""
    try:
        return ensure_tiny_models(HOST_DIR / "models")
    except ComfyHostError as exc:  # harness/tiny_models.py cannot write them
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def comfy_host() -> Iterator[ComfyHost]:
    """One ComfyUI server for the whole session, with the tiny models in place when they can be made."""
    try:
        ensure_tiny_models(HOST_DIR / "models")
    except ComfyHostError as exc:
        sys.stderr.write(f"conftest: {exc}\n")
    # BLOCK_OFFLOAD_ALLOW_CPU: the nodes stream on the CPU too.
    host = ComfyHost(env={**os.environ, "BLOCK_OFFLOAD_ALLOW_CPU": "1"}, extra_args=CLASSIC_CACHE)
    host.start()
    try:
        yield host
    finally:
        host.stop()


@pytest.fixture(scope="session")
def comfy(comfyui_path: Path, tiny_models: dict[str, Path]) -> SimpleNamespace:
    """ComfyUI and this pack in the test process, on the CPU (``harness/inprocess.py``)."""
    return in_process_comfy(tiny_models)


@pytest.fixture
def allow_cpu_streaming(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes stream on the CPU (without it they pass the model through: no GPU memory to save)."""
    monkeypatch.setenv("BLOCK_OFFLOAD_ALLOW_CPU", "1")
