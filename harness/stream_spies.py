"""A device's copy stream and events for a test on the CPU, where the engine has none: each notes what the
engine asks of it and what held then, so a test can check the order a CUDA device depends on (which copies an
event covers, what the copy stream waits for) without a device.

They order nothing themselves: on the CPU every copy is done when it returns.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class EventSpy:
    """A block's ``ready`` event: notes at each ``record`` whether ``lock`` (the hand-over lock) was held, and at
    each ``synchronize`` what ``seen()`` says then."""

    def __init__(self, lock: threading.Lock, seen: Callable[[], object] = lambda: None) -> None:
        self.lock = lock
        self.records: list[bool] = []
        self.seen = seen
        self.synchronized: list[object] = []

    def record(self, stream: Any = None) -> None:
        self.records.append(self.lock.locked())

    def synchronize(self) -> None:
        """Nothing is queued on the CPU: only noted."""
        self.synchronized.append(self.seen())


class StreamSpy:
    """A copy stream: notes each ``wait_stream`` with what ``seen()`` said then."""

    def __init__(self, seen: Callable[[], object]) -> None:
        self.seen = seen
        self.waits: list[object] = []

    def __enter__(self) -> StreamSpy:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        self.waits.append(self.seen())

    def wait_event(self, event: object) -> None:
        """Copies over a region wait for its last reader: nothing to wait for on the CPU."""
