"""Which ComfyUI the pack runs on, said once in the log when ComfyUI loads it: a version the whole test suite
passes on, or one line saying this one is not tested (it streams as usual)."""

from __future__ import annotations

import logging

#: The ComfyUI versions the test suite runs on, every commit (README, "Supported models and ComfyUI versions").
TESTED = ("0.3.75", "0.33.0")


def running_version() -> str | None:
    """The version of the ComfyUI this process runs (its ``comfyui_version`` module), None if it has none."""
    try:
        from comfyui_version import __version__
    except ImportError:
        return None
    return str(__version__)


def version_notice(version: str | None) -> tuple[int, str]:
    """The log level and line for ``version``."""
    if version in TESTED:
        return logging.INFO, f"Block Offload: ComfyUI {version}, a version this pack is tested on"
    which = f"ComfyUI {version}" if version else "this ComfyUI (it has no comfyui_version module)"
    return logging.WARNING, (
        f"Block Offload: {which} is not a version this pack is tested on ({' and '.join(TESTED)}); "
        "the nodes stream as usual. If one misbehaves, say which ComfyUI version you run when you report it"
    )


def log_version_notice() -> None:
    logging.log(*version_notice(running_version()))
