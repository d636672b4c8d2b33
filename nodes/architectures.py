"""Where the transformer blocks of each of ComfyUI's diffusion models live.

One table, matched against the diffusion model's class and its base classes, so a
subclass (Flux 2 and Kontext use ``Flux``; Wan 2.2 uses ``WanModel``) is found too.
Lists are named in the order the model calls them; the engine learns the real
call order anyway (VACE interleaves its blocks with the main ones). A name stands
for its children; ``name.*`` for the children of each child.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Architecture:
    name: str
    block_lists: tuple[str, ...]


ARCHITECTURES: dict[str, Architecture] = {
    "VaceWanModel": Architecture("Wan 2.1/2.2 VACE", ("blocks", "vace_blocks")),
    "WanModel": Architecture("Wan 2.1/2.2", ("blocks",)),
    "Flux": Architecture("Flux / Flux 2 / Kontext", ("double_blocks", "single_blocks")),
    "Chroma": Architecture("Chroma", ("double_blocks", "single_blocks")),
    "HunyuanVideo": Architecture("HunyuanVideo / HunyuanImage 2.1", ("double_blocks", "single_blocks")),
    "OpenAISignatureMMDITWrapper": Architecture("SD3 / SD3.5", ("joint_blocks",)),
    "QwenImageTransformer2DModel": Architecture("Qwen-Image", ("transformer_blocks",)),
    "NextDiT": Architecture("Lumina 2 / Z-Image", ("layers",)),
    "LTXVModel": Architecture("LTX-Video", ("transformer_blocks",)),
    "HiDreamImageTransformer2DModel": Architecture("HiDream", ("double_stream_blocks", "single_stream_blocks")),
    # SD1.x/SDXL: the UNet calls the layers inside each TimestepEmbedSequential one by one.
    "UNetModel": Architecture("SD1.5 / SDXL UNet", ("input_blocks.*", "middle_block", "output_blocks.*")),
}


def supported_names() -> str:
    return ", ".join(arch.name for arch in ARCHITECTURES.values())


class UnsupportedModelError(ValueError):
    pass


def find_architecture(diffusion_model: nn.Module) -> Architecture:
    for cls in type(diffusion_model).__mro__:
        if cls.__name__ in ARCHITECTURES:
            return ARCHITECTURES[cls.__name__]
    raise UnsupportedModelError(
        f"Block offloading does not know where the blocks of {type(diffusion_model).__name__} are. "
        f"Supported: {supported_names()}. For any other model use the Sequential Offload Wrapper node, "
        "which streams module by module and needs no block list."
    )


def find_blocks(diffusion_model: nn.Module) -> tuple[Architecture, list[tuple[str, nn.Module]]]:
    """The architecture and its blocks as (name relative to the diffusion model, module)."""
    arch = find_architecture(diffusion_model)
    blocks: list[tuple[str, nn.Module]] = []
    for path in arch.block_lists:
        flatten = path.endswith(".*")
        name = path.removesuffix(".*")
        container = getattr(diffusion_model, name, None)
        if container is None:
            continue  # e.g. a Wan model without VACE blocks
        for index, child in enumerate(container.children()):
            if flatten:
                blocks += [(f"{name}.{index}.{sub}", layer) for sub, layer in child.named_children()]
            else:
                blocks.append((f"{name}.{index}", child))
    if not blocks:
        raise UnsupportedModelError(
            f"{type(diffusion_model).__name__} has no blocks in {', '.join(arch.block_lists)}; "
            "use the Sequential Offload Wrapper node for it."
        )
    return arch, blocks


def inside(name: str, prefixes: frozenset[str]) -> bool:
    """Whether the module or weight ``name`` is one of ``prefixes`` or lies inside one."""
    return any(name == p or name.startswith(p + ".") for p in prefixes)
