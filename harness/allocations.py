"""What allocates memory while a model samples, step by step: the CPU stand-in for the allocation counts of a
GPU's caching allocator, which ComfyUI's compiler (0.35+) records per block and replays.

``AllocationLog`` is a ``TorchDispatchMode``: every operator the sampling runs on the main thread passes
through it, and each output that is not a view of one of the operator's inputs is an allocation, logged as
(operator, shape, dtype) under the step it happened in: ``steps[0]`` is what ran before the diffusion model's
first call (the load, the placement), ``steps[n]`` its ``n``-th call and what follows it. Logged apart:

* ``format_patch``: inside ComfyUI's own patch of a streamed weight (``loaded_patch.as_loaded``), which the
  pack runs where it cannot patch in its scratch (``nodes/loaded_patch.py``): a weight in a quantized format,
  dequantized, patched and re-quantized by the format's code, as ComfyUI's load does it;
* ``paused``: under ``paused()``, what ``comfy.model_prefetch.pause_malloc_graph`` keeps out of the compiler's
  recording (``nodes/comfy_memory.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

Allocation = tuple[str, tuple[int, ...], torch.dtype]


@dataclass
class Step:
    """The allocations of one call of the diffusion model: the pack's and the model's, and those logged apart."""

    own: list[Allocation] = field(default_factory=list)
    format_patch: list[Allocation] = field(default_factory=list)
    paused: list[Allocation] = field(default_factory=list)


def _storage(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except RuntimeError:  # a wrapper subclass (a quantized format's tensor) has no storage of its own
        return None


class AllocationLog(TorchDispatchMode):
    """Logs every allocation into ``steps[-1]``; ``step`` starts the next."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[Step] = [Step()]
        self._scopes: list[str] = []  # the innermost decides where an allocation is logged

    def step(self) -> None:
        self.steps.append(Step())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {_storage(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        logged = getattr(self.steps[-1], self._scopes[-1] if self._scopes else "own")
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and _storage(tensor) not in inputs:
                logged.append((str(func), tuple(tensor.shape), tensor.dtype))
        return out

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Allocations in this context are logged under ``name`` ("format_patch", "paused")."""
        self._scopes.append(name)
        try:
            yield
        finally:
            self._scopes.pop()


def logged_steps(model, run: Callable[[], object], log: AllocationLog | None = None) -> list[Step]:
    """``run()`` (sampling ``model``, a ModelPatcher) with its allocations logged per call of its diffusion model,
    into ``log`` if given (its ``scope`` may be used while it runs)."""
    from block_offload.nodes import loaded_patch

    log = log if log is not None else AllocationLog()
    as_loaded = loaded_patch.as_loaded

    def logged_apart(*args, **kwargs):
        with log.scope("format_patch"):
            return as_loaded(*args, **kwargs)

    loaded_patch.as_loaded = logged_apart
    handle = model.model.diffusion_model.register_forward_pre_hook(lambda *_: log.step())
    try:
        with log:
            run()
    finally:
        handle.remove()
        loaded_patch.as_loaded = as_loaded
    return log.steps
