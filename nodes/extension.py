"""The one object the extension keeps for the process: its panel.

ComfyUI gives a pack no object its patchers and engines could reach, so the panel lives in the process registry, set
once in ``comfy_entrypoint``; importing the pack sets up nothing. This module imports no other node module, so the
engine reaches the panel as an ``EngineWatcher`` without importing it (data flows engine -> panel only)."""

from __future__ import annotations

from collections.abc import Callable

from ..offload import PROCESS_STATE

_PANEL = "panel"


def install_once(make: Callable[[], object]) -> object:
    """The object ``make`` returns on the first call, the same one after (in-process tests may set up more than
    once)."""
    return PROCESS_STATE.entry(
        _PANEL, make, "ComfyUI gives a pack no object of its own that its patchers and engines could reach"
    )


def installed() -> object | None:
    """The panel once set up; None before, and in a process that never sets the pack up."""
    return PROCESS_STATE.made(_PANEL)
