"""The units an engine streams in a ComfyUI diffusion model: its blocks and their names (``Units``, ``inside``), and
the modules whose weights their parent's code reads (``read_by_parents``).

Blocks are found from the module tree at each load, as patched for that load, so an object patch that swaps a block
streams as it is. Some models read a child layer's weights from the parent's code
(``comfy.ops.cast_bias_weight(self.norm_q, ...)``), so the child is never called and must be brought in with its parent;
such children are found by reading the class's code."""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from torch import nn

from ..offload import OffloadPlan, streamed_modules
from ..offload.discovery import FoundBlocks, NoBlocksError, class_code
from ..offload.discovery import find_blocks as discover

#: Keyed by ``id``; the model is kept alive beside its blocks so no other takes its ``id`` within the scope.
_FOUND_IN_THIS_LOAD: ContextVar[dict[int, tuple[nn.Module, FoundBlocks]] | None] = ContextVar(
    "block_offload_found", default=None
)


def find_blocks(diffusion_model: nn.Module) -> FoundBlocks:
    """The blocks of a ComfyUI diffusion model; ``NoBlocksError`` for one without block lists, which the nodes then
    stream module by module."""
    found_so_far = _FOUND_IN_THIS_LOAD.get()
    if found_so_far is None:
        return discover(diffusion_model)
    kept = found_so_far.get(id(diffusion_model))
    if kept is None:
        kept = found_so_far[id(diffusion_model)] = (diffusion_model, discover(diffusion_model))
    return kept[1]


@contextmanager
def one_tree_per_load() -> Iterator[None]:
    """Within: each diffusion model's blocks are found once, since one load asks several times and each search walks
    the whole tree. The tree is fixed within a load: object patches go on before ``load``, and the loader moves
    weights, not modules. Nested scopes share the outermost."""
    if _FOUND_IN_THIS_LOAD.get() is not None:
        yield
        return
    token = _FOUND_IN_THIS_LOAD.set({})
    try:
        yield
    finally:
        _FOUND_IN_THIS_LOAD.reset(token)


def module_by_module_notice(error: NoBlocksError) -> str:
    return (
        f"{error}. Streaming it module by module instead, as the Sequential Offload Wrapper does (every module "
        "copied as loaded, none kept on the device): the same output, with more, smaller copies."
    )


def inside(name: str, prefixes: frozenset[str]) -> bool:
    """Whether ``name`` is one of ``prefixes`` or lies inside one. Looks up ``name``'s own prefixes, since checking
    each of ``prefixes`` for every weight would be quadratic."""
    if name in prefixes:
        return True
    dot = name.find(".")
    while dot != -1:
        if name[:dot] in prefixes:
            return True
        dot = name.find(".", dot + 1)
    return False


@dataclass(frozen=True)
class Units:
    """Units of a diffusion model an engine streams, by the engine's index, with their names: modules owning tensors
    (``recurse`` False, the sequential wrapper's) or blocks with their submodules."""

    modules: dict[int, nn.Module]
    names: dict[int, str]
    recurse: bool

    @classmethod
    def every(cls, diffusion_model: nn.Module, sequential: bool) -> Units:
        found = streamed_modules(diffusion_model) if sequential else find_blocks(diffusion_model).blocks
        return cls(
            {i: module for i, (_, module) in enumerate(found)},
            {i: name for i, (name, _) in enumerate(found)},
            not sequential,
        )

    @classmethod
    def streamed(cls, diffusion_model: nn.Module, plan: OffloadPlan | None) -> Units:
        """The units an engine streams: every tensor-owning module without a block ``plan``, else the plan's streamed
        blocks."""
        every = cls.every(diffusion_model, sequential=plan is None)
        if plan is None:
            return every
        return cls(
            {i: every.modules[i] for i in sorted(plan.streamed)},
            {i: every.names[i] for i in sorted(plan.streamed)},
            True,
        )

    @property
    def qualified(self) -> frozenset[str]:
        """The units' names as ComfyUI's patcher knows them (under ``diffusion_model``)."""
        return frozenset(f"diffusion_model.{name}" if name else "diffusion_model" for name in self.names.values())


# -- modules whose weights ComfyUI reads from their parent's code, without calling them


#: ComfyUI's functions that read their first argument's weights for the caller.
WEIGHT_READERS = ("cast_bias_weight", "linear_input_act")


def read_by_parents(root: nn.Module) -> dict[int, nn.Module]:
    """Per streamed module (by index) whose weights another module's code reads without calling it, that module,
    whose call must bring them in."""
    index_of = {id(module): index for index, (_, module) in enumerate(streamed_modules(root))}
    holders: dict[int, nn.Module] = {}
    for parent in root.modules():
        # mypy takes ``type[Module]`` for unhashable.
        parent_class: type = type(parent)
        for path in read_paths(parent_class):
            child = _resolve(parent, path)
            if child is not None and child is not parent and id(child) in index_of:
                holders.setdefault(index_of[id(child)], parent)
    return holders


@functools.cache
def read_paths(cls: type) -> tuple[tuple[str | int, ...], ...]:
    """The ``self`` paths of the layers ``cls``'s methods pass to a weight reader; () where the code cannot be read."""
    paths: list[tuple[str | int, ...]] = []
    for tree in class_code(cls):
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and _called_name(node.func) in WEIGHT_READERS and node.args:
                path = _self_path(node.args[0])
                if path:
                    paths.append(path)
    return tuple(dict.fromkeys(paths))


def _called_name(func: ast.expr) -> str | None:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else None


def _self_path(expression: ast.expr) -> tuple[str | int, ...] | None:
    """``self.a[2].b`` as ("a", 2, "b"); None for anything else."""
    steps: list[str | int] = []
    while True:
        if isinstance(expression, ast.Attribute):
            steps.append(expression.attr)
            expression = expression.value
        elif isinstance(expression, ast.Subscript) and isinstance(expression.slice, ast.Constant):
            if not isinstance(expression.slice.value, int):
                return None
            steps.append(expression.slice.value)
            expression = expression.value
        elif isinstance(expression, ast.Name) and expression.id == "self":
            return tuple(reversed(steps)) if steps else None
        else:
            return None


@runtime_checkable
class _Indexed(Protocol):
    def __getitem__(self, index: int, /) -> object: ...


def _resolve(module: nn.Module, path: tuple[str | int, ...]) -> nn.Module | None:
    """The submodule ``path`` names on ``module``, or None (another class's attribute)."""
    current = module
    for step in path:
        try:
            if isinstance(step, str):
                found = getattr(current, step, None)
            elif isinstance(current, _Indexed):
                found = current[step]
            else:
                return None
        except (IndexError, KeyError, TypeError):
            return None
        if not isinstance(found, nn.Module):
            return None
        current = found
    return current
