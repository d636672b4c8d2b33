"""The blocks of a ComfyUI diffusion model are those ``offload.discovery.find_blocks`` finds in its module tree,
for every model ComfyUI loads, with no table of architectures to keep up with its releases. They are found
again at each load, from the model as ComfyUI patched it for that load: an object patch that swaps a block
(or a whole list) streams as it is, never from a list found before. This file holds what the nodes say of
them, and how they name what streams.
"""

from __future__ import annotations

from ..offload.discovery import NoBlocksError


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
