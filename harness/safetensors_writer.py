"""A safetensors writer whose files are byte-stable, one tensor in memory at a time (the tiny checkpoints and
the benchmark's real-size ones are written with it)."""

from __future__ import annotations

import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

_ST_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int8: "I8",
    torch.uint8: "U8",
}


def save_safetensors(
    path: Path,
    layout: Iterable[tuple[str, torch.dtype, tuple[int, ...]]],
    tensor_for: Callable[[str], torch.Tensor],
    metadata: dict[str, str],
) -> None:
    """Write a safetensors file with a byte-stable header, one tensor in memory at a time.

    safetensors' own writer keeps ``__metadata__`` in a Rust HashMap, whose order changes from
    one process to the next, so its files are not bitwise reproducible; it also wants every
    tensor in memory at once. The format is simple (little-endian u64 header size, JSON
    header padded to 8 bytes, raw data), so we write it ourselves: the header from ``layout``
    (key, dtype, shape), keys sorted, then ``tensor_for(key)`` for each key in that order.
    """
    if sys.byteorder != "little":
        raise RuntimeError("safetensors data is little-endian; this writer copies raw memory")
    entries = sorted(layout)
    header: dict[str, object] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for key, dtype, shape in entries:
        size = math.prod(shape) * dtype.itemsize
        header[key] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for key, dtype, shape in entries:
            t = tensor_for(key)
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise ValueError(f"{key}: got {t.dtype} {tuple(t.shape)}, header says {dtype} {tuple(shape)}")
            f.write(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        # Flush to disk before the rename: a crash then leaves the old file or the complete new
        # one, never an empty one under the final name. It also keeps gigabytes of dirty pages
        # from being written back while the caller goes on to load and run the models.
        f.flush()
        os.fsync(f.fileno())
