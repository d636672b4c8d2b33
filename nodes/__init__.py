"""ComfyUI adapters over the offload engine: the nodes, the ModelPatcher integration, the panel's routes, and the
pack's entry point, which logs once whether this ComfyUI version is one the suite is tested on."""

from __future__ import annotations

import logging

from comfy_api.latest import ComfyExtension, io

from . import panel
from .offload_nodes import NODES

#: The ComfyUI versions the test suite runs on.
TESTED = ("0.3.75", "0.33.0")


def running_version() -> str | None:
    """This ComfyUI's version (its ``comfyui_version`` module), None if it has none."""
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    return str(__version__)


def version_notice(version: str | None) -> tuple[int, str]:
    if version in TESTED:
        return logging.INFO, f"Block Offload: ComfyUI {version}, a version this pack is tested on"
    which = f"ComfyUI {version}" if version else "this ComfyUI (it has no comfyui_version module)"
    return logging.WARNING, (
        f"Block Offload: {which} is not a version this pack is tested on ({' and '.join(TESTED)}); "
        "the nodes stream as usual. If one misbehaves, say which ComfyUI version you run when you report it"
    )


def log_version_notice() -> None:
    logging.log(*version_notice(running_version()))


class BlockOffloadExtension(ComfyExtension):
    async def get_node_list(self) -> list[type[io.ComfyNode]]:
        return list(NODES)


async def comfy_entrypoint() -> BlockOffloadExtension:
    # Imported here so that importing the pack needs no server (the in-process tests).
    from server import PromptServer

    panel.install_panel(PromptServer.instance).register_routes()
    log_version_notice()  # ComfyUI calls the entry point once
    return BlockOffloadExtension()
