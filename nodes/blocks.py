"""The blocks of a ComfyUI diffusion model are those ``offload.discovery.find_blocks`` finds in its module tree,
for every model ComfyUI loads, with no table of architectures to keep up with its releases. They are found
again at each load, from the model as ComfyUI patched it for that load: an object patch that swaps a block
(or a whole list) streams as it is, never from a list found before. This file holds what the nodes say of
them, the models whose blocks must not stream as blocks (``MODULE_BY_MODULE``, each with its reason), and the
one answer to which units an engine streams (``Units``), which the placement and the engine both ask.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..offload import OffloadPlan, streamed_modules
from ..offload.discovery import FoundBlocks, NoBlocksError
from ..offload.discovery import find_blocks as discover

#: Diffusion models (by class, subclasses included) whose blocks must not stream as blocks, and why: the engine
#: streams a block around its calls as a module, which these models never make.
MODULE_BY_MODULE: dict[str, str] = {
    "WanAnimate2Model": "the model never calls its blocks as modules, only their forward_pose and forward_gen "
    "methods, which a block's hooks do not see",
}


def find_blocks(diffusion_model: nn.Module) -> FoundBlocks:
    """The blocks of a ComfyUI diffusion model (``offload.discovery``); ``NoBlocksError`` for one without block
    lists or one of ``MODULE_BY_MODULE``, which the nodes then stream module by module."""
    for cls in type(diffusion_model).__mro__:
        reason = MODULE_BY_MODULE.get(cls.__name__)
        if reason is not None:
            raise NoBlocksError(f"{type(diffusion_model).__name__}'s blocks cannot stream as blocks: {reason}")
    return discover(diffusion_model)


def module_by_module_notice(error: NoBlocksError) -> str:
    """What the block nodes say when they stream a model module by module, as the Sequential Offload Wrapper
    does, because it has no blocks."""
    return (
        f"{error}. Streaming it module by module instead, as the Sequential Offload Wrapper does (every module "
        "copied as loaded, none kept on the device): the same output, with more, smaller copies."
    )


def inside(name: str, prefixes: frozenset[str]) -> bool:
    """Whether the module or weight ``name`` is one of ``prefixes`` or lies inside one."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)


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
