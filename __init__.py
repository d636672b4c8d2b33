"""Block Offload: stream diffusion-model blocks between pinned CPU memory and the GPU.

ComfyUI imports this file when the pack sits in ``custom_nodes/``. The nodes are
V3 definitions, handed to ComfyUI through ``comfy_entrypoint``. They (and the
ComfyUI modules they use) are imported when ComfyUI asks for them, so the engine,
``block_offload.offload``, imports with nothing but torch.
"""

WEB_DIRECTORY = "./web"


async def comfy_entrypoint():
    from .nodes import comfy_entrypoint as nodes_entrypoint

    return await nodes_entrypoint()


__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
