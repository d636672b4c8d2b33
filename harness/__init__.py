"""What the tests, the benchmarks and the scripts share: a real ComfyUI server to start (``comfy_host``) and
talk to (``comfy_client``), the tiny checkpoints (``tiny_models``), the example workflows (``workflows``), a small
transformer stack (``transformer_stack``), ComfyUI in-process (``inprocess``), prompts for the server
(``prompts``) and a smaller simulated device (``device_limit``).

Importing it makes the pack importable under its one name, ``block_offload`` (``pack.py``), and makes the CPU's
matrix products give the same bits wherever their operands lie in memory, in this process and the ComfyUI servers
it starts.
"""

import os

from .pack import import_pack

# MKL (torch's CPU BLAS) rounds a matrix-vector product differently for a weight at another alignment on some CPUs
# (AMD's, with AVX2), and a streamed weight lives in other buffers than the loader's: the bitwise checks would compare
# two kernels. Its conditional numerical reproducibility picks one (read at MKL's first call, so still in time here).
os.environ.setdefault("MKL_CBWR", "AUTO")
import_pack()
