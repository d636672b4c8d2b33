"""Benchmark support, loaded by a benchmark's server as a custom node: the smaller card of ``harness/card.py``,
held for the server's life where ``BLOCK_OFFLOAD_BENCH_CARD_BYTES`` names one."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: a server's path lacks it

from harness.card import install_from_env  # noqa: E402

HELD = install_from_env()  # the filler lives as long as this module: the server's life

NODE_CLASS_MAPPINGS: dict = {}
