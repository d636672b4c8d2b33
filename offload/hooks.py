"""The module hooks through which an engine sees the model run: a pair per module called (a block, or the
holder that brings blocks in), a wrapper around each method of its own a model runs a block through instead
of calling it (``block_methods.py``), and a pair around the root's forward, which brackets one step."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, TypeVar, cast

import torch
from torch import nn

Hook = TypeVar("Hook", bound=Callable[..., object])


class Removable(Protocol):
    def remove(self) -> None: ...


def eager(hook: Hook) -> Hook:
    """``hook``, run as plain Python under ``torch.compile``: the engine's hooks issue copies, record events
    and repoint parameters, which a traced graph would bake in once; the compiler breaks the graph around
    them instead, and compiles the blocks' own code between them."""
    disable: Callable[..., object] = torch.compiler.disable
    return cast(Hook, disable(hook, recursive=True))


def hook_calls(
    blocks: Sequence[nn.Module],
    holders: Mapping[int, nn.Module],
    methods: Mapping[int, Sequence[str]],
    begins: Callable[[int], None],
    ends: Callable[[int], None],
    after: Callable[[], None],
    running: Callable[[int], bool],
) -> list[Removable]:
    """Calls ``begins(i)`` before block ``i`` runs and ``ends(i)`` once it has (even when it raised), then
    ``after()``. ``holders[i]``: the module whose call brings block ``i`` in, where that is not the block
    itself. One pair of hooks per module called: a holder brings in every block it holds and lets them go in
    the reverse order, so a call ending never releases a call around it. ``methods[i]``: block ``i``'s own
    methods the model runs it through besides its call, each run a call of the block unless the block is
    ``running`` already (the method runs inside its call or another of its methods: ending there would release
    the block under the outer call)."""
    callers: dict[int, tuple[nn.Module, list[int]]] = {}
    for index, block in enumerate(blocks):
        caller = holders.get(index, block)
        callers.setdefault(id(caller), (caller, []))[1].append(index)
    handles: list[Removable] = []
    for caller, indices in callers.values():
        handles.append(caller.register_forward_pre_hook(eager(_each(begins, tuple(indices)))))
        handles.append(
            caller.register_forward_hook(eager(_each(ends, tuple(reversed(indices)), after)), always_call=True)
        )
    for index, names in methods.items():
        handles += [_MethodCalls(blocks[index], name, index, begins, ends, after, running) for name in names]
    return handles


class _MethodCalls:
    """Block ``index``'s method ``name``, replaced on the block (an instance attribute before its class's) by
    one that brackets it with ``begins(index)`` and ``ends(index)``, then ``after()``, unless the block is
    ``running`` already. The end runs whatever the method raised: an interrupt (a ``BaseException``) leaves no
    call open either."""

    def __init__(
        self,
        block: nn.Module,
        name: str,
        index: int,
        begins: Callable[[int], None],
        ends: Callable[[int], None],
        after: Callable[[], None],
        running: Callable[[int], bool],
    ) -> None:
        method: Callable[..., object] = getattr(block, name)

        @eager
        def begin() -> bool:
            if running(index):
                return False
            try:
                begins(index)
            except BaseException:  # the call may be open already: closed, as a module's post-hook closes it
                ends(index)
                raise
            return True

        @eager
        def end() -> None:
            ends(index)
            after()

        @functools.wraps(method)
        def called(*args: object, **kwargs: object) -> object:
            began = begin()
            try:
                return method(*args, **kwargs)
            finally:
                if began:
                    end()

        self.block, self.name, self.called = block, name, called
        block.__dict__[name] = called

    def remove(self) -> None:
        if self.block.__dict__.get(self.name) is self.called:
            del self.block.__dict__[self.name]


def hook_step(root: nn.Module, begin: Callable[[], None], end: Callable[[bool], None]) -> list[Removable]:
    """Calls ``begin()`` before ``root``'s forward, every other hook of it included (the root may be a block
    too), and ``end(returned)`` after it, even when it raised: ``returned`` False then (PyTorch hands a hook
    run for a forward that raised no output)."""
    return [
        root.register_forward_pre_hook(eager(lambda *_: begin()), prepend=True),
        root.register_forward_hook(eager(lambda _root, _args, output: end(output is not None)), always_call=True),
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
