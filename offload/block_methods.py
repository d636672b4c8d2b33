"""The methods through which a model runs its blocks, where it does not call them as modules, read from its code.

A block streams around its calls, which its module hooks see. Some models never call a block: Wan Animate 2
runs each of its blocks through ``block.forward_pose(...)`` (or ``block.kv_from_input(...)``) and then
``block.forward_gen(...)``, which no module hook sees. What code calls on a block is found by reading, in the
class (and bases) of the module that holds a block list, the loops over that list (``for i, block in
enumerate(self.blocks)``, ``self.blocks.items()``) and the lookups into it (``self.blocks[i]``), and taking
the methods called on what they yield. Only the block class's own methods count: ``nn.Module``'s (``to``,
``forward``, ...) move or call the block as a module, which its hooks see already.
"""

from __future__ import annotations

import ast
import functools
import inspect
from collections.abc import Iterator

from torch import nn

from .discovery import FoundBlocks
from .model_code import class_code


def entry_methods(root: nn.Module, found: FoundBlocks) -> dict[int, tuple[str, ...]]:
    """Per block (its index in ``found.blocks``), the methods of its own the model's code runs it through; blocks
    only ever called as modules are left out."""
    index_of = {id(block): index for index, (_, block) in enumerate(found.blocks)}
    methods: dict[int, tuple[str, ...]] = {}
    for block_list in found.lists:
        if block_list.path.endswith(".*"):  # entries that are lists: the model iterates those, not the blocks
            continue
        holder_path, _, attribute = block_list.path.rpartition(".")
        # Widened to ``type``: mypy takes the ``type[Module]`` of ``type(holder)`` for unhashable.
        holder_class: type = type(root.get_submodule(holder_path))
        called = methods_called_on(holder_class).get(attribute, ())
        for _, block in block_list.blocks:
            own = tuple(name for name in called if _own_method(type(block), name))
            if own:
                methods[index_of[id(block)]] = own
    return methods


@functools.cache
def methods_called_on(cls: type) -> dict[str, tuple[str, ...]]:
    """Per attribute of ``self`` that ``cls``'s code iterates or indexes, the methods it calls on the entries;
    {} where the code cannot be read (built in, compiled)."""
    called: dict[str, dict[str, None]] = {}
    for tree in class_code(cls):
        for attribute, method in _calls_on_entries(tree):
            called.setdefault(attribute, {})[method] = None
    return {attribute: tuple(methods) for attribute, methods in called.items()}


def _calls_on_entries(tree: ast.AST) -> Iterator[tuple[str, str]]:
    """(attribute, method) for each ``entry.method(...)`` where ``entry`` is a loop variable over ``self.attribute``
    (inside that loop, nested functions included), and each ``self.attribute[...].method(...)``."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.comprehension)):
            attribute = _iterated(node.iter)
            if attribute is None:
                continue
            names = {name.id for name in ast.walk(node.target) if isinstance(name, ast.Name)}
            scope = node.body if isinstance(node, ast.For) else [node]
            for statement in scope:
                for call in ast.walk(statement):
                    method = _method_called(call)
                    if method is not None and isinstance(method[0], ast.Name) and method[0].id in names:
                        yield attribute, method[1]
        method = _method_called(node)
        if method is not None and isinstance(method[0], ast.Subscript):
            attribute = _self_attribute(method[0].value)
            if attribute is not None:
                yield attribute, method[1]


def _method_called(node: ast.AST) -> tuple[ast.expr, str] | None:
    """(what, name) for a call ``what.name(...)``."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value, node.func.attr
    return None


def _iterated(expression: ast.expr) -> str | None:
    """The attribute of ``self`` a loop runs over: ``self.blocks``, ``enumerate(self.blocks)``, ``zip(self.blocks,
    ...)``, ``self.blocks.items()``."""
    attribute = _self_attribute(expression)
    if attribute is not None or not isinstance(expression, ast.Call):
        return attribute
    if isinstance(expression.func, ast.Attribute) and expression.func.attr in ("items", "values"):
        return _self_attribute(expression.func.value)
    return next(filter(None, map(_self_attribute, expression.args)), None)


def _self_attribute(expression: ast.expr) -> str | None:
    if isinstance(expression, ast.Attribute) and isinstance(expression.value, ast.Name):
        return expression.attr if expression.value.id == "self" else None
    return None


def _own_method(cls: type, name: str) -> bool:
    """Whether ``name`` is a method ``cls`` defines beyond ``nn.Module``'s."""
    return not hasattr(nn.Module, name) and inspect.isfunction(getattr(cls, name, None))
