"""The state that belongs to the process, not to any engine or model: one registry of named entries, each with
why it cannot live on an object of its own (in the style of diffusers' ``HookRegistry``).

Everything else lives on the objects it describes (an engine, a streamer, a model's patcher). What is here is
shared by all of them by nature: the driver's page locks, one copy stream per device, a host's pin budget. The
engine's entries are made in ``offload/``; a host adapter (``nodes/``) adds its own the same way, so one object
lists all of it: ``PROCESS_STATE.reasons()``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar, cast

T = TypeVar("T")


@dataclass(frozen=True)
class _Entry:
    value: object
    why: str


class ProcessState:
    """Named process-wide values, each made once on first use, with why it is process-wide."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        # Entries are first used from the streamer's thread, the packing thread and the server's threads.
        self._lock = threading.Lock()

    def entry(self, name: str, make: Callable[[], T], why: str) -> T:
        """The value named ``name``: the one ``make`` returns on the first call, the same one after."""
        found = self._entries.get(name)
        if found is None:
            with self._lock:
                found = self._entries.get(name)
                if found is None:
                    found = self._entries[name] = _Entry(make(), why)
        return cast(T, found.value)

    def made(self, name: str) -> object | None:
        """The value named ``name`` if it was made; None before its first ``entry``."""
        found = self._entries.get(name)
        return found.value if found is not None else None

    def reasons(self) -> dict[str, str]:
        """Every entry made so far, by name: why it is process-wide."""
        return {name: entry.why for name, entry in self._entries.items()}


PROCESS_STATE = ProcessState()
