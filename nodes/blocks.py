"""The units an engine streams in a ComfyUI diffusion model: its blocks, found from its module tree, their names
(``Units``, ``inside``), and the modules whose weights their parent's code reads (``read_by_parents``).

The blocks are those ``offload.discovery.find_blocks`` finds, for every model ComfyUI loads, with no table of
architectures to keep up with its releases. They are found again at each load, from the model as ComfyUI
patched it for that load: an object patch that swaps a block (or a whole list) streams as it is, never from a
list found before. ``Units`` is the one answer to which units an engine streams, which the placement and the
engine both ask.

ComfyUI's ops read a layer's weights through ``comfy.ops.cast_bias_weight(layer, ...)``, which a layer's own
forward calls. Some models call it, or ``comfy.ops.linear_input_act(layer, ...)``, on a child layer from the
parent's code: Wan's and LTX's feed-forward read their down-projection so, Lumina's, Cosmos', Ernie's,
JoyImage's and Ideogram's attention their q/k norms. An engine that brings each module in as it is called
would never see those children called, so their parent's call must bring them in. They are found from the code
of each module's class (its methods, and its bases' within the model): the first argument of each such call,
when it is ``self`` followed by attributes and constant indices (``self.norm_q``, ``self[2]``,
``self.net[2]``), resolved on the module itself.
"""

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

#: Within ``one_tree_per_load``: the blocks found so far, per diffusion model (by ``id``: each kept beside its
#: blocks, alive, so that no other model takes its ``id`` within the scope).
_FOUND_IN_THIS_LOAD: ContextVar[dict[int, tuple[nn.Module, FoundBlocks]] | None] = ContextVar(
    "block_offload_found", default=None
)


def find_blocks(diffusion_model: nn.Module) -> FoundBlocks:
    """The blocks of a ComfyUI diffusion model (``offload.discovery``); ``NoBlocksError`` for one without block
    lists, which the nodes then stream module by module."""
    found_so_far = _FOUND_IN_THIS_LOAD.get()
    if found_so_far is None:
        return discover(diffusion_model)
    kept = found_so_far.get(id(diffusion_model))
    if kept is None:
        kept = found_so_far[id(diffusion_model)] = (diffusion_model, discover(diffusion_model))
    return kept[1]


@contextmanager
def one_tree_per_load() -> Iterator[None]:
    """Within: each diffusion model's blocks are found once. One load (the placement, its fallbacks, the engine's
    start) asks for them several times, and each search walks the whole module tree; the tree is fixed within it
    (object patches go on before ``load``, and ComfyUI's loader moves weights, not modules).
    Nested scopes share the outermost one's."""
    if _FOUND_IN_THIS_LOAD.get() is not None:
        yield
        return
    token = _FOUND_IN_THIS_LOAD.set({})
    try:
        yield
    finally:
        _FOUND_IN_THIS_LOAD.reset(token)


def module_by_module_notice(error: NoBlocksError) -> str:
    """What the block nodes say when they stream a model module by module, as the Sequential Offload Wrapper
    does, because it has no blocks."""
    return (
        f"{error}. Streaming it module by module instead, as the Sequential Offload Wrapper does (every module "
        "copied as loaded, none kept on the device): the same output, with more, smaller copies."
    )


def inside(name: str, prefixes: frozenset[str]) -> bool:
    """Whether the module or weight ``name`` is one of ``prefixes`` or lies inside one. Looks up ``name``'s own
    prefixes (as many as it has dots), not every one of ``prefixes``: asked for each module and weight of a model
    against each of its streamed blocks, the other way is quadratic."""
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
    """Units of a diffusion model an engine streams, by index, with their module names under it: modules that own
    tensors (the sequential wrapper's; ``recurse`` False: each unit is its own tensors only) or blocks (``recurse``
    True: each with its submodules). Indices are the engine's: into ``streamed_modules`` or the block list."""

    modules: dict[int, nn.Module]
    names: dict[int, str]
    recurse: bool

    @classmethod
    def every(cls, diffusion_model: nn.Module, sequential: bool) -> Units:
        """Every unit the sequential wrapper (``sequential``) or a block engine could stream."""
        found = streamed_modules(diffusion_model) if sequential else find_blocks(diffusion_model).blocks
        return cls(
            {i: module for i, (_, module) in enumerate(found)},
            {i: name for i, (name, _) in enumerate(found)},
            not sequential,
        )

    @classmethod
    def streamed(cls, diffusion_model: nn.Module, plan: OffloadPlan | None) -> Units:
        """The units an engine streams: every module that owns tensors without a block ``plan``, else the plan's
        streamed blocks."""
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


#: The names of ComfyUI's functions that read a layer's weights (their first argument) for whoever calls them.
WEIGHT_READERS = ("cast_bias_weight", "linear_input_act")


def read_by_parents(root: nn.Module) -> dict[int, nn.Module]:
    """Per module the sequential wrapper streams (an index of ``streamed_modules(root)``) whose weights another
    module's code reads without calling it: that module, whose call must bring them in."""
    index_of = {id(module): index for index, (_, module) in enumerate(streamed_modules(root))}
    holders: dict[int, nn.Module] = {}
    for parent in root.modules():
        # Widened to ``type``: mypy takes the ``type[Module]`` of ``type(parent)`` for unhashable.
        parent_class: type = type(parent)
        for path in read_paths(parent_class):
            child = _resolve(parent, path)
            if child is not None and child is not parent and id(child) in index_of:
                holders.setdefault(index_of[id(child)], parent)
    return holders


@functools.cache
def read_paths(cls: type) -> tuple[tuple[str | int, ...], ...]:
    """The paths from ``self`` (attribute names, constant indices) of the layers ``cls``'s methods pass to a
    weight reader; () where the code cannot be read (built in, compiled)."""
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
    """A module the model's code indexes (``nn.Sequential``, ``nn.ModuleList``, a model's own container)."""

    def __getitem__(self, index: int, /) -> object: ...


def _resolve(module: nn.Module, path: tuple[str | int, ...]) -> nn.Module | None:
    """The submodule ``path`` names on ``module``, or None where it names none (another class's attribute)."""
    current = module
    for step in path:
        try:
            if isinstance(step, str):
                found = getattr(current, step, None)
            elif isinstance(current, _Indexed):
                found = current[step]
            else:  # a module without ``__getitem__``: indexing it would raise TypeError
                return None
        except (IndexError, KeyError, TypeError):
            return None
        if not isinstance(found, nn.Module):
            return None
        current = found
    return current
