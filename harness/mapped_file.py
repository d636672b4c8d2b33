"""A module whose weights are views of a safetensors file's mapping, as ComfyUI's Dynamic VRAM loader holds
them, for the engine's file-tier tests (which import no ComfyUI): the file is written, mapped read-only,
and every tensor of the module replaced by its view, with the ``FileSlice`` the engine reads it by."""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from pathlib import Path

import torch
from torch import nn

from block_offload.offload import FileSlice

from .safetensors_writer import save_safetensors

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}


class MappedFile:
    """``module``'s tensors saved to ``path`` (cast to ``dtype`` when given), then mapped back into it."""

    def __init__(self, module: nn.Module, path: Path, dtype: torch.dtype | None = None) -> None:
        state = {
            name: tensor.detach().to(dtype or tensor.dtype).contiguous() for name, tensor in module.state_dict().items()
        }
        save_safetensors(path, [(name, t.dtype, tuple(t.shape)) for name, t in state.items()], state.__getitem__, {})
        self.path = path
        self.handle = os.open(path, os.O_RDONLY)
        self.mapping = mmap.mmap(self.handle, 0, access=mmap.ACCESS_READ)
        (header_size,) = struct.unpack("<Q", self.mapping[:8])
        header = json.loads(self.mapping[8 : 8 + header_size])
        base = 8 + header_size
        self.slices: dict[int, FileSlice] = {}  # by the mapped tensor's address
        tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            dtype_ = _DTYPES[info["dtype"]]
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="The given buffer is not writable")
                flat = torch.frombuffer(self.mapping, dtype=torch.uint8, count=end - start, offset=base + start)
            tensor = flat.view(dtype_).view(info["shape"])
            tensors[name] = tensor
            self.slices[tensor.data_ptr()] = FileSlice(self.handle, base + start, end - start, tensor)
        module.load_state_dict(tensors, assign=True)
        self.module = module

    @property
    def file_bytes(self) -> int:
        return sum(source.nbytes for source in self.slices.values())

    def file_slice(self, part: torch.Tensor) -> FileSlice | None:
        """The engine's ``file_slice``: the file bytes a tensor views, when it views exactly one tensor's."""
        source = self.slices.get(part.data_ptr())
        if source is None or part.numel() * part.element_size() != source.nbytes:
            return None
        return source

    def mapped(self, part: torch.Tensor) -> bool:
        start = torch.frombuffer(self.mapping, dtype=torch.uint8, count=1).data_ptr()
        return start <= part.data_ptr() < start + len(self.mapping)

    def close(self) -> None:
        os.close(self.handle)
