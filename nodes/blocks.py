"""The blocks of a ComfyUI diffusion model are those ``offload.discovery.find_blocks`` finds in its module tree,
for every model ComfyUI loads, with no table of architectures to keep up with its releases. They are found
again at each load, from the model as ComfyUI patched it for that load: an object patch that swaps a block
(or a whole list) streams as it is, never from a list found before. This file holds what the nodes say of
them, and the one answer to which units an engine streams (``Units``), which the placement and the engine
both ask.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass

from torch import nn

from ..offload import OffloadPlan, streamed_modules
from ..offload.discovery import FoundBlocks, NoBlocksError
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
    start) asks for them about seven times, 16 ms each for a Wan 2.1 of 40 blocks on a 2-core CPU; its module tree
    is fixed within it (object patches go on before ``load``, and ComfyUI's loader moves weights, not modules).
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
