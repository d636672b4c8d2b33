"""A model's transformer blocks, found from its module tree alone: no table of architectures.

Blocks are the entries of the lists that hold blocks: a ``ModuleList`` or ``ModuleDict`` (containers a model
only iterates) with an entry that has submodules of its own, or a ``Sequential`` whose entries repeat one
structure (two of one class with submodules). A list of bare layers, as an embedder's ``Sequential(Linear,
SiLU, Linear)``, is no block list; a ``ModuleList`` of one block is (a model configured with one block in a
list, as a Flux of one double and one single block). An entry that is itself a list
stands for its entries: a UNet's ``input_blocks`` holds ``TimestepEmbedSequential``s whose layers it calls
one by one, never the sequential itself. The search descends through every other module, so lists
nested anywhere are found (an approximator's layers, a text refiner's blocks), but never into a list it
took. Lists holding under ``MIN_LIST_SHARE`` of the weights stay with the rest of the model; if the lists
taken hold under ``MIN_SHARE`` of them, the model has no blocks worth streaming and the caller streams it
module by module instead. Embedding tables count in neither share (``_lookup_bytes``).

Blocks come in module-tree order; the engine learns the order the model calls them in.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import nn

from .layout import module_stored_bytes

#: The least share of a model's weights its block lists must hold together.
MIN_SHARE = 0.5
#: The least share of a model's weights one block list must hold to be streamed.
MIN_LIST_SHARE = 0.01

_LISTS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class BlockList:
    """One list of blocks: its path in the model (ending in ``.*`` where its entries are lists themselves,
    taken entry by entry), its blocks as (name, module), the class they share (or ``"mixed"``) and their bytes."""

    path: str
    blocks: tuple[tuple[str, nn.Module], ...]
    kind: str
    nbytes: int

    def describe(self) -> str:
        return f"{self.path}: {len(self.blocks)} x {self.kind}"


@dataclass(frozen=True)
class FoundBlocks:
    """What ``find_blocks`` found in a model: its class, its block lists, every block as (name, module) in
    tree order, and the share of the model's weights the blocks hold."""

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
    """``root``'s blocks (module docstring), or ``NoBlocksError`` saying what was found instead."""
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
    """The bytes of ``root``'s embedding tables: a step reads a few of their rows, not all of them as it reads a
    layer's weights, so they count in no share (a language-model DiT's vocabulary would outweigh its layers in a
    small one)."""
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
    """``container`` as a block list, if it holds blocks (module docstring)."""
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
    entries = [(name, entry) for name, entry in entries if sizes[name]]  # no weights, nothing to stream
    kinds = {type(entry).__name__ for _, entry in entries}
    return BlockList(
        f"{path}.*" if flattened else path,
        tuple(entries),
        kinds.pop() if len(kinds) == 1 else "mixed",
        sum(sizes.values()),
    )
