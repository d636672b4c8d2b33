"""Modules whose weights ComfyUI reads from their parent's code, without calling them.

ComfyUI's ops read a layer's weights through ``comfy.ops.cast_bias_weight(layer, ...)``, which a layer's own
forward calls. Some models call it, or ``comfy.ops.linear_input_act(layer, ...)`` (0.33's fused activation
and INT8 down-projection), on a child layer from the parent's code: Wan's and LTX's feed-forward read their
down-projection so, Lumina's, Cosmos', Ernie's, JoyImage's and Ideogram's attention their q/k norms. A
streaming engine that brings each module in as it is called would never see those children called: they
would compute from wherever their weights rest. Their parent's call must bring them in.

Found from the code of each module's class (its methods, and its bases' within the model): the first argument
of each such call, when it is ``self`` followed by attributes and constant indices (``self.norm_q``,
``self[2]``, ``self.net[2]``), resolved on the module itself.
"""

from __future__ import annotations

import ast
import functools
from typing import Protocol, runtime_checkable

from torch import nn

from ..offload import streamed_modules
from ..offload.discovery import class_code

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
