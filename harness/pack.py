"""The one way this repo's own code imports the pack: as ComfyUI does, as the package ``block_offload``.

The repository root is the pack. Importing its engine under a second name (``offload`` from the root on
``sys.path``) would give two copies of every class and two registries of parked blocks; the tests, the
benchmarks and the test support all go through here instead.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pytest

PACK = "block_offload"  # the name ComfyUI imports it under: its folder in custom_nodes
REPO = Path(__file__).resolve().parents[1]


def import_pack() -> ModuleType:
    """The pack, imported once per process. Its ``offload`` engine needs only torch; its ``nodes`` need
    ComfyUI's modules importable (on ``sys.path``) when they are first imported."""
    module = sys.modules.get(PACK)
    if module is None:
        root = str(REPO)
        spec = importlib.util.spec_from_file_location(PACK, REPO / "__init__.py", submodule_search_locations=[root])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACK] = module
        spec.loader.exec_module(module)
    return module


def skip_pack_setup(items: list[pytest.Item]) -> None:
    """The repo root is the pack: its __init__.py (which needs ComfyUI's comfy_api) makes pytest collect the root
    as a Package, whose setup imports that __init__.py looking for setup_module. ComfyUI imports the pack, never
    pytest: skip that setup for the root node only."""
    import pytest  # the tests' conftests call this; the benchmarks import this module without pytest

    for item in items:
        for node in item.listchain():
            if isinstance(node, pytest.Package) and node.path == REPO:
                node.setup = lambda: None  # type: ignore[method-assign]
