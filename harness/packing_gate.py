"""A gate in front of the engine's packing thread (``offload/background_packing.py``), so a test decides how far
packing in the background has got when the model steps: it holds the thread before each block until ``let``
lets it pack more, and a streamer that stops its packing meanwhile stops it there, as between two copies."""

from __future__ import annotations

import threading

import pytest

from block_offload.offload.background_packing import BackgroundPacking, PackingStopped


class PackingGate:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.permits = threading.Semaphore(0)
        pack = BackgroundPacking.pack_waiting

        def gated(packing: BackgroundPacking, index: int, stopping: threading.Event) -> None:
            while not self.permits.acquire(timeout=0.005):
                if stopping.is_set():
                    raise PackingStopped
            pack(packing, index, stopping)

        monkeypatch.setattr(BackgroundPacking, "pack_waiting", gated)

    def let(self, blocks: int) -> None:
        """Lets the thread pack ``blocks`` more blocks."""
        for _ in range(blocks):
            self.permits.release()
