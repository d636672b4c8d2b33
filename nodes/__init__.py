"""ComfyUI adapters over the offload engine."""

from comfy_api.latest import ComfyExtension, io


class BlockOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return []


async def comfy_entrypoint() -> BlockOffloadExtension:
    return BlockOffloadExtension()
