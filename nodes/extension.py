"""The one object the extension keeps for the life of the process: its panel (``nodes/panel.py``'s ``Panel``).

ComfyUI hands a node pack no object of its own that the pack's model patchers and engines could reach, so the
panel is kept in the process's registry (``offload/device.py``), set once where ComfyUI sets the pack up
(``comfy_entrypoint``, where the routes are registered; the in-process tests set it up the same way, with no
server): importing the pack sets up nothing. This module imports no other of the nodes, so the engine
(``nodes/engine.py``) reaches the panel through it as an ``EngineWatcher`` without importing the panel (data
flows engine -> panel only); the entry holds ``object``, and each reader checks what it gets.
"""

from __future__ import annotations

from collections.abc import Callable

from ..offload import PROCESS_STATE

_PANEL = "panel"


def install_once(make: Callable[[], object]) -> object:
    """The installed object: the one ``make`` returns on the first call, the same one on every later call
    (ComfyUI sets the pack up once; the in-process tests set it up as they start, perhaps more than once)."""
    return PROCESS_STATE.entry(
        _PANEL, make, "ComfyUI gives a pack no object of its own that its patchers and engines could reach"
    )


def installed() -> object | None:
    """The panel once set up; None before, and in a process that never sets the pack up as ComfyUI does."""
    return PROCESS_STATE.made(_PANEL)
