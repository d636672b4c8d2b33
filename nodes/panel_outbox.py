"""The panel's one way out: every status message goes through one ``Outbox``, at most once per ``MIN_INTERVAL_S``.

The panel (``nodes/report.py``) keeps the one outbox; its publishers send through it from the sampling thread.
``send_sync`` hands a message to ComfyUI's event loop, which serialises and sends it off the sampling thread.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from .status_schema import STATUS_EVENT

MIN_INTERVAL_S = 0.25  # at most four messages a second


class Outbox:
    """The one rate limit every message obeys: the panel sees a single stream.

    A message that must go (a run's first and last) but comes inside the interval waits for its end;
    statuses are snapshots, so a newer one waiting replaces an older one instead of queueing behind
    it, and a burst of short runs never builds a backlog that would hold back the next run's updates.
    """

    def __init__(self, server: Any | None) -> None:
        self._server = server  # ComfyUI's PromptServer; None in-process (tests, benchmarks): nobody to tell
        self.next_at = 0.0  # perf_counter time from which a message may go
        self.seq = 0
        self._waiting: dict[str, Any] | None = None
        self._lock = threading.Lock()  # the sampling thread sends, the server's loop sends what waited

    def send(self, status: dict[str, Any], force: bool = False) -> bool:
        """Sends ``status`` if one is due; ``force`` sends it anyway, when the interval ends."""
        with self._lock:
            delay = self.next_at - time.perf_counter()
            if delay <= 0:
                # A status waiting for its turn is older than this one: sent after it, it would go back in time.
                self._waiting = None
                self._emit(status)
                return True
            if not force:
                return False
            first_to_wait = self._waiting is None
            self._waiting = status
        if first_to_wait and self._server is not None:
            self._server.loop.call_soon_threadsafe(self._server.loop.call_later, delay, self._send_waiting)
        return True

    def _send_waiting(self) -> None:
        """On the server's loop, when a waiting status's interval has ended (a message sent directly since
        may have started another: then it waits for that one's end)."""
        with self._lock:
            if self._waiting is None:
                return
            delay = self.next_at - time.perf_counter()
            if delay <= 0:
                status, self._waiting = self._waiting, None
                self._emit(status)
                return
        if self._server is not None:
            self._server.loop.call_later(delay, self._send_waiting)

    def _emit(self, status: dict[str, Any]) -> None:
        self.next_at = time.perf_counter() + MIN_INTERVAL_S
        self.seq += 1
        status.update(seq=self.seq, time=time.time())
        if self._server is not None:
            self._server.send_sync(STATUS_EVENT, status)
