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
