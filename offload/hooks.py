"""The module hooks through which an engine sees the model run: a pair per module called (a block, or the
holder that brings blocks in), and a pair around the root's forward, which brackets one step."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar, cast

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

Hook = TypeVar("Hook", bound=Callable[..., object])


def eager(hook: Hook) -> Hook:
    """``hook``, run as plain Python under ``torch.compile``: the engine's hooks issue copies, record events
    and repoint parameters, which a traced graph would bake in once; the compiler breaks the graph around
    them instead, and compiles the blocks' own code between them."""
    disable: Callable[..., object] = torch.compiler.disable
    return cast(Hook, disable(hook, recursive=True))


def hook_calls(
    blocks: Sequence[nn.Module],
    holders: Mapping[int, nn.Module],
    begins: Callable[[int], None],
    ends: Callable[[int], None],
    after: Callable[[], None],
) -> list[RemovableHandle]:
    """Calls ``begins(i)`` before block ``i`` runs and ``ends(i)`` once it has (even when it raised), then
    ``after()``. ``holders[i]``: the module whose call brings block ``i`` in, where that is not the block
    itself. One pair of hooks per module called: a holder brings in every block it holds and lets them go in
    the reverse order, so a call ending never releases a call around it."""
    callers: dict[int, tuple[nn.Module, list[int]]] = {}
    for index, block in enumerate(blocks):
        caller = holders.get(index, block)
        callers.setdefault(id(caller), (caller, []))[1].append(index)
    handles = []
    for caller, indices in callers.values():
        handles.append(caller.register_forward_pre_hook(eager(_each(begins, tuple(indices)))))
        handles.append(
            caller.register_forward_hook(eager(_each(ends, tuple(reversed(indices)), after)), always_call=True)
        )
    return handles


def hook_step(root: nn.Module, begin: Callable[[], None], end: Callable[[], None]) -> list[RemovableHandle]:
    """Calls ``begin()`` before ``root``'s forward, every other hook of it included (the root may be a block
    too), and ``end()`` after it, even when it raised."""
    return [
        root.register_forward_pre_hook(eager(lambda *_: begin()), prepend=True),
        root.register_forward_hook(eager(lambda *_: end()), always_call=True),
    ]


def _each(
    call: Callable[[int], None], indices: tuple[int, ...], then: Callable[[], None] | None = None
) -> Callable[..., None]:
    """A hook calling ``call`` for each of ``indices`` in turn, then ``then``."""

    def hook(module: nn.Module, *_: object) -> None:
        for index in indices:
            call(index)
        if then is not None:
            then()

    return hook
