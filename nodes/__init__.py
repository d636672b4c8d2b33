"""ComfyUI adapters over the offload engine: the nodes, the ModelPatcher integration, the report route."""

from comfy_api.latest import ComfyExtension, io

from . import report
from .offload_nodes import NODES
from .versions import log_version_notice


class BlockOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return NODES


async def comfy_entrypoint() -> BlockOffloadExtension:
    report.register_routes()
    log_version_notice()  # once: ComfyUI calls the entry point once, as it loads the pack
    return BlockOffloadExtension()
