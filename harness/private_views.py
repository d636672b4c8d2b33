"""The private parts of ComfyUI and PyTorch that tests must reach, each behind one name that says why.

Tests read public views. Where none exists (the list ComfyUI's loader walks, a GPU kernel that only takes
time, the constructors of tensor subclasses), they call here instead, so every reach into another
project's private parts is in this one place, named and explained, and a change there breaks it here.
Nothing here imports comfy (tests/conftest.py): ComfyUI's objects come in as arguments.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

#: ``__torch_function__`` for a tensor subclass whose ops give plain tensors (PyTorch's default wraps each
#: result in the subclass). PyTorch keeps this switch private (``torch._C``), though its docs on extending
#: torch name it; a builtin, so it stays unbound as a class attribute, as ``__torch_function__`` must.
plain_torch_function: Callable[..., Any] = torch._C._disabled_torch_function_impl


def load_list(patcher: Any) -> list[Any]:
    """The entries ``ModelPatcher.load`` walks to place a model's weights on the device (ComfyUI's private
    ``ModelPatcher._load_list``), what the pack's patcher hides streamed modules from. No public view lists
    them; the tests add up the bytes they offer to check what ComfyUI was told against what it loaded."""
    return patcher._load_list()


def wrapper_subclass(
    cls: type[torch.Tensor], shape: Sequence[int], dtype: torch.dtype, device: torch.device | None = None
) -> torch.Tensor:
    """A ``cls`` tensor of ``shape``, ``dtype`` and ``device`` with no memory of its own: its data is in the
    inner tensors that ``__tensor_flatten__`` names, as in ComfyUI's QuantizedTensor. PyTorch makes such a
    wrapper only through the private ``torch.Tensor._make_wrapper_subclass`` (QuantizedTensor calls it too)."""
    return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device)


def gpu_sleep(cycles: int) -> None:
    """Queues ``cycles`` GPU clock cycles of work on the current CUDA stream that touch no memory: a stream kept
    busy for a known time, so a test can show a copy on another stream waiting for it. PyTorch has no public
    kernel that only takes time; ``torch.cuda._sleep`` is the one its own stream tests use."""
    torch.cuda._sleep(cycles)
