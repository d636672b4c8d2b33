"""Block Offload: stream diffusion-model blocks between pinned CPU memory and the GPU.

ComfyUI imports this file when the pack sits in ``custom_nodes/``. The nodes are
V3 definitions, handed to ComfyUI through ``comfy_entrypoint``.
"""

from .nodes import comfy_entrypoint

WEB_DIRECTORY = "./web"

__all__ = ["WEB_DIRECTORY", "comfy_entrypoint"]
