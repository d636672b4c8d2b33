"""The pack's import structure, read from its source: data flows node -> plan -> engine -> recorder ->
panel, so no module of ``nodes/`` imports back along that line, and the engine (``offload/``) stands on
torch alone, importing neither ComfyUI nor the ComfyUI side of the pack.

Imports are read with ``ast``, type-checking-only ones included: a cycle that only the type checker
walks is still two modules that each need the other to be understood.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.comfy_host import REPO, resolve_comfyui_path

pytestmark = pytest.mark.one_host(
    reason="reads this repository's imports; ComfyUI's top-level names are the same on every host"
)


def imports(path: Path) -> Iterator[tuple[int, str]]:
    """Every module ``path`` imports, as (relative level, dotted name); ``from . import x`` gives (1, "x")."""
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            yield from ((0, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.module is None:
                yield from ((node.level, alias.name) for alias in node.names)
            else:
                yield node.level, node.module


def sibling_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports (``from .x`` / ``from . import x``)."""
    modules = {path.stem: path for path in package.glob("*.py")}
    graph = {}
    for name, path in modules.items():
        targets = {target.split(".")[0] for level, target in imports(path) if level == 1}
        graph[name] = targets & modules.keys()
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph`` (first module repeated at the end), or None when it is acyclic."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return path[path.index(node) :] + [node]
        if node in done:
            return None
        for target in sorted(graph[node]):
            cycle = visit(target, [*path, node])
            if cycle is not None:
                return cycle
        done.add(node)
        return None

    for start in sorted(graph):
        cycle = visit(start, [])
        if cycle is not None:
            return cycle
    return None


def test_find_cycle_sees_a_cycle_and_an_acyclic_graph() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_nodes_modules_import_no_cycle() -> None:
    graph = sibling_graph(REPO / "nodes")
    assert {"engine", "panel", "patcher"} <= graph.keys()
    assert find_cycle(graph) is None, f"import cycle in nodes/: {' -> '.join(find_cycle(graph))}"


def test_the_harness_imports_no_cycle() -> None:
    """The tiny models' specs (``dits_*.py``) are data the builder (``tiny_dit.py``) reads: none imports it back."""
    graph = sibling_graph(REPO / "harness")
    assert {"tiny_dit", "dit_spec", "dits_video"} <= graph.keys() and "tiny_dit" not in graph["dits_video"]
    assert find_cycle(graph) is None, f"import cycle in harness/: {' -> '.join(find_cycle(graph))}"


def test_the_engine_never_imports_the_panel() -> None:
    """The engine tells the panel the extension set up (``nodes/extension.py``, which imports none of the
    nodes) as it starts and stops; it calls, never imports it."""
    graph = sibling_graph(REPO / "nodes")
    assert "panel" not in graph["engine"]
    assert "engine" in graph["panel"]
    assert not graph["extension"]


def test_offload_imports_neither_comfyui_nor_the_nodes() -> None:
    """Only relative imports inside ``offload/`` (level 1) and no top-level module that ComfyUI's own
    folder provides (``comfy``, ``comfy_api``, ``folder_paths``, ``nodes``, ``server``, ...)."""
    comfyui = resolve_comfyui_path()
    comfy_modules = {path.stem for path in comfyui.iterdir() if path.suffix == ".py" or path.is_dir()}
    assert {"comfy", "folder_paths", "nodes", "server"} <= comfy_modules
    offenders = [
        f"{path.name}: {'.' * level}{target}"
        for path in sorted((REPO / "offload").glob("*.py"))
        for level, target in imports(path)
        if level > 1 or (level == 0 and target.split(".")[0] in comfy_modules | {"block_offload"})
    ]
    assert not offenders, offenders
