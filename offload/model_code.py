"""A model's own code, read where its module tree alone does not tell how it runs: which methods it runs its
blocks through (``block_methods.py``), which layers' weights it reads without calling them (the nodes'
``fused_reads.py``)."""

from __future__ import annotations

import ast
import inspect
import textwrap
from collections.abc import Iterator

from torch import nn


def class_code(cls: type) -> Iterator[ast.Module]:
    """The parsed source of ``cls`` and of each of its bases beyond torch's; none for a class whose code cannot
    be read (built in, compiled)."""
    for klass in cls.__mro__:
        if klass in (nn.Module, object) or klass.__module__.startswith("torch."):
            continue
        try:
            yield ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
