"""Test support, loaded by a test server as a custom node: the device limit of ``harness/device_limit.py``.
Importing the harness imports the pack under the name ComfyUI gives it, whichever of the two ComfyUI
loads first, so the limit applies to the modules ComfyUI runs."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository: a server's path lacks it

from harness.device_limit import install_from_env  # noqa: E402

install_from_env()

NODE_CLASS_MAPPINGS: dict = {}
