"""ComfyUI adapters over the offload engine: the nodes, the ModelPatcher integration, the panel's routes."""

from comfy_api.latest import ComfyExtension, io

from . import panel
from .offload_nodes import NODES
from .versions import log_version_notice


class BlockOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> BlockOffloadExtension:
    # ComfyUI's server runs by now; imported here, so that importing the pack needs none (the in-process tests).
    from server import PromptServer

    panel.install_panel(PromptServer.instance).register_routes()  # the panel's one creation
    log_version_notice()  # once: ComfyUI calls the entry point once, as it loads the pack
    return BlockOffloadExtension()
