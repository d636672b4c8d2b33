"""What the tests, the benchmarks and the scripts share: a real ComfyUI server to start (``comfy_host``) and
talk to (``comfy_client``), the tiny checkpoints (``tiny_models``), the example workflows (``workflows``), a small
transformer stack (``transformer_stack``), ComfyUI in-process (``inprocess``), prompts for the server
(``prompts``) and a smaller simulated device (``device_limit``).

Importing it makes the pack importable under its one name, ``block_offload`` (``pack.py``).
"""

from .pack import import_pack

import_pack()
