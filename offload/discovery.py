"""A model's transformer blocks, found from its module tree alone with no table of architectures (``find_blocks``),
and the block methods it runs instead of calling the blocks (``entry_methods``).

Blocks are the entries of lists that hold blocks: a ``ModuleList``/``ModuleDict`` with an entry that has submodules, or
a ``Sequential`` whose entries repeat one structure; a list of bare layers is no block list. An entry that is a list
stands for its entries, as a UNet calls its ``TimestepEmbedSequential``'s layers one by one. Lists under
``MIN_LIST_SHARE`` of the weights stay with the model; if all lists hold under ``MIN_SHARE``, there are no blocks worth
streaming. The engine learns the call order.

A block streams around its calls, which its hooks see, but some models never call a block (Wan Animate 2 runs
``block.forward_pose(...)``). So the holder's code is read for methods called on the list's entries."""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

from torch import nn

from .layout import module_stored_bytes

#: Least share of the weights the block lists must hold together, and one list must hold.
MIN_SHARE = 0.5
MIN_LIST_SHARE = 0.01

_LISTS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class BlockList:
    """One list of blocks: its path (ending in ``.*`` where its entries are lists, taken entry by entry), its blocks,
    their shared class (or ``"mixed"``) and bytes."""

    path: str
    blocks: tuple[tuple[str, nn.Module], ...]
    kind: str
    nbytes: int

    def describe(self) -> str:
        return f"{self.path}: {len(self.blocks)} x {self.kind}"


@dataclass(frozen=True)
class FoundBlocks:
    """What ``find_blocks`` found: the class, the lists, every block in tree order, and their share of the weights."""

    model_class: str
    lists: tuple[BlockList, ...]
    blocks: tuple[tuple[str, nn.Module], ...]
    share: float

    @property
    def nbytes(self) -> int:
        return sum(found.nbytes for found in self.lists)

    def describe(self) -> str:
        """``Flux (double_blocks: 19 x DoubleStreamBlock, single_blocks: 38 x SingleStreamBlock; 21.98 GiB)``."""
        lists = ", ".join(found.describe() for found in self.lists)
        return f"{self.model_class} ({lists}; {self.nbytes / 2**30:.2f} GiB)"


class NoBlocksError(ValueError):
    """The model has no lists of repeated blocks holding most of its weights."""


def find_blocks(root: nn.Module) -> FoundBlocks:
    """``root``'s blocks, or ``NoBlocksError`` saying what was found instead."""
    total = module_stored_bytes(root) - _lookup_bytes(root)
    lists = [found for found in _block_lists(root, "") if total and found.nbytes >= MIN_LIST_SHARE * total]
    nbytes = sum(found.nbytes for found in lists)
    share = nbytes / total if total else 0.0
    if not lists or share < MIN_SHARE:
        seen = ", ".join(f"{found.describe()} ({found.nbytes / total:.0%})" for found in lists) if lists else "none"
        raise NoBlocksError(
            f"{type(root).__name__} has no lists of repeated blocks holding most of its weights "
            f"(block lists found: {seen}; they must hold {MIN_SHARE:.0%})"
        )
    blocks = tuple(block for found in lists for block in found.blocks)
    return FoundBlocks(type(root).__name__, tuple(lists), blocks, share)


def _lookup_bytes(root: nn.Module) -> int:
    """Embedding tables' bytes, counted in no share: a step reads a few rows, and a language model's vocabulary would
    outweigh a small DiT's layers."""
    return sum(module_stored_bytes(module) for module in root.modules() if isinstance(module, nn.Embedding))


def _block_lists(module: nn.Module, prefix: str) -> list[BlockList]:
    found: list[BlockList] = []
    for name, child in module.named_children():
        path = f"{prefix}{name}"
        block_list = _as_block_list(child, path) if isinstance(child, _LISTS) else None
        if block_list is not None:
            found.append(block_list)
        else:
            found += _block_lists(child, f"{path}.")
    return found


def _as_block_list(container: nn.Module, path: str) -> BlockList | None:
    entries: list[tuple[str, nn.Module]] = []
    flattened = False
    for name, entry in container.named_children():
        if isinstance(entry, _LISTS):
            flattened = True
            entries += [(f"{path}.{name}.{sub}", layer) for sub, layer in entry.named_children()]
        else:
            entries.append((f"{path}.{name}", entry))
    composite = Counter(type(entry) for _, entry in entries if any(True for _ in entry.children()))
    repeats = 1 if isinstance(container, (nn.ModuleList, nn.ModuleDict)) else 2
    if not composite or composite.most_common(1)[0][1] < repeats:
        return None
    sizes = {name: module_stored_bytes(entry) for name, entry in entries}
    entries = [(name, entry) for name, entry in entries if sizes[name]]
    kinds = {type(entry).__name__ for _, entry in entries}
    return BlockList(
        f"{path}.*" if flattened else path,
        tuple(entries),
        kinds.pop() if len(kinds) == 1 else "mixed",
        sum(sizes.values()),
    )


def entry_methods(root: nn.Module, found: FoundBlocks) -> dict[int, tuple[str, ...]]:
    """Per block index, its own methods the model's code runs it through; blocks only called as modules are left out."""
    index_of = {id(block): index for index, (_, block) in enumerate(found.blocks)}
    methods: dict[int, tuple[str, ...]] = {}
    for block_list in found.lists:
        if block_list.path.endswith(".*"):  # the model iterates the inner lists, not the blocks
            continue
        holder_path, _, attribute = block_list.path.rpartition(".")
        # mypy takes ``type[Module]`` for unhashable.
        holder_class: type = type(root.get_submodule(holder_path))
        called = methods_called_on(holder_class).get(attribute, ())
        for _, block in block_list.blocks:
            own = tuple(name for name in called if _own_method(type(block), name))
            if own:
                methods[index_of[id(block)]] = own
    return methods


@functools.cache
def methods_called_on(cls: type) -> dict[str, tuple[str, ...]]:
    """Per ``self`` attribute ``cls``'s code iterates or indexes, the methods called on its entries; {} where the
    code cannot be read."""
    called: dict[str, dict[str, None]] = {}
    for tree in class_code(cls):
        for attribute, method in _calls_on_entries(tree):
            called.setdefault(attribute, {})[method] = None
    return {attribute: tuple(methods) for attribute, methods in called.items()}


def _calls_on_entries(tree: ast.AST) -> Iterator[tuple[str, str]]:
    """(attribute, method) for each ``entry.method(...)`` inside a loop over ``self.attribute``, and each
    ``self.attribute[...].method(...)``."""
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
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return node.func.value, node.func.attr
    return None


def _iterated(expression: ast.expr) -> str | None:
    """The ``self`` attribute a loop runs over, directly or through ``enumerate``, ``zip`` or ``.items()``."""
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
    return not hasattr(nn.Module, name) and inspect.isfunction(getattr(cls, name, None))


def class_code(cls: type) -> Iterator[ast.Module]:
    """The parsed source of ``cls`` and its bases beyond torch's; none where it cannot be read."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        tree = _class_tree(klass)
        if tree is not None:
            yield tree


#: Each class definition's parsed source (None: unreadable), by where it is defined. ComfyUI builds its op classes
#: anew for every model it loads (``comfy.ops.mixed_precision_ops``), and ``inspect`` parses the whole module to
#: find each one; a definition's source is the same for every class it makes.
_trees: dict[tuple[str, str, int | None], ast.Module | None] = {}


def _class_tree(klass: type) -> ast.Module | None:
    where = (klass.__module__, klass.__qualname__, getattr(klass, "__firstlineno__", None))
    if where not in _trees:
        try:
            _trees[where] = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            _trees[where] = None
    return _trees[where]
