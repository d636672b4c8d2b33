"""Shared fixtures: one real ComfyUI server per test session, and the tiny models it loads.

* ``comfy_host``: a started :class:`comfy_host.ComfyHost` (CPU, free loopback port,
  base directory ``.host/``, this pack in custom_nodes), stopped after the session.
* ``tiny_models``: the tiny random-weight checkpoints, written into ``.host/models`` once.
* ``comfyui_path``: the ComfyUI folder, put on ``sys.path`` so a test can import
  ``comfy``/``nodes`` in-process. Nothing here imports comfy at module level.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

from comfy_host import HOST_DIR, ComfyHost, ComfyHostError, ensure_tiny_models, resolve_comfyui_path  # noqa: E402


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
    except ComfyHostError as exc:  # scripts/tiny_models.py not written yet
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def comfy_host() -> Iterator[ComfyHost]:
    """One ComfyUI server for the whole session, with the tiny models in place when they can be made."""
    try:
        ensure_tiny_models(HOST_DIR / "models")
    except ComfyHostError as exc:
        sys.stderr.write(f"conftest: {exc}\n")
    host = ComfyHost(env={**os.environ, "BLOCK_OFFLOAD_ALLOW_CPU": "1"})  # the nodes stream on the CPU too
    host.start()
    try:
        yield host
    finally:
        host.stop()
