"""A process's host memory as Linux counts it (``/proc/PID/status``), at its peak rather than after.

``peak_during`` resets the kernel's high-water mark (``VmHWM``, by writing 5 to ``clear_refs``) and reads
it when the watched work is over: the exact peak of the resident set, however briefly it lasted. A thread
sampling ``RssAnon`` (anonymous memory: what the process allocated, not the checkpoint pages it maps) runs
beside it, for the growth that file pages would hide.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

SAMPLE_INTERVAL_S = 0.002


def status_bytes(pid: int, field: str) -> int:
    """A ``/proc/PID/status`` memory field (``VmRSS``, ``VmHWM``, ``RssAnon``...) in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", line
            return int(value) * 1024
    raise KeyError(f"{field} is not in /proc/{pid}/status")


@dataclass
class Peak:
    """What ``peak_during`` measured: the resident set before and at its peak, the anonymous memory before
    and the highest sample of it."""

    rss_before: int = 0
    rss_peak: int = 0
    anon_before: int = 0
    anon_peak: int = 0

    @property
    def rss_growth(self) -> int:
        return self.rss_peak - self.rss_before

    @property
    def anon_growth(self) -> int:
        return self.anon_peak - self.anon_before


@contextmanager
def peak_during(pid: int, interval_s: float = SAMPLE_INTERVAL_S) -> Iterator[Peak]:
    """Measures process ``pid``'s memory peak over the ``with`` block (filled in when it exits), ``RssAnon``
    sampled every ``interval_s``."""
    peak = Peak()
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # VmHWM := VmRSS now
    peak.rss_before = status_bytes(pid, "VmRSS")
    peak.anon_before = peak.anon_peak = status_bytes(pid, "RssAnon")
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak.anon_peak = max(peak.anon_peak, status_bytes(pid, "RssAnon"))
            time.sleep(interval_s)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        yield peak
    finally:
        stop.set()
        sampler.join()
        peak.rss_peak = status_bytes(pid, "VmHWM")


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout:.0f} s")
        time.sleep(0.05)
