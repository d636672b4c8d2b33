"""Blocks a model runs through methods of their own instead of calling them (Wan Animate 2's ``forward_pose`` and
``forward_gen``): found from the model's code (``offload/discovery.py``) and streamed around those calls.
ComfyUI's Wan Animate 2 itself is in ``test_every_dit.py``."""

from __future__ import annotations

import inspect

import pytest
import torch
from torch import nn

from block_offload.offload import BlockStreamer, CallOptions, RingOptions, StreamSpec, TimelineRecorder, stream_blocks
from block_offload.offload.discovery import entry_methods, find_blocks, methods_called_on

CPU = torch.device("cpu")
WIDTH = 16


class TwoPassBlock(nn.Module):
    """A pose pass and a generation pass, as Wan Animate 2's blocks: the second runs the first again inside it
    (a method of the block called from another), and can be told to raise part-way, as an interrupt does."""

    def __init__(self, reads: list[bool], holds: list) -> None:
        super().__init__()
        self.pose = nn.Linear(WIDTH, WIDTH)
        self.gen = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
        self.reads, self.holds = reads, holds
        self.interrupt = False

    def forward_pose(self, y: torch.Tensor) -> torch.Tensor:
        self._read()
        return torch.tanh(self.pose(y))

    def forward_gen(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        again = self.forward_pose(y)
        if self.interrupt:
            raise KeyboardInterrupt("interrupted inside the generation pass")
        self._read()
        return x + self.gen(x * again)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.forward_gen(x, y)

    def _read(self) -> None:
        if self.holds:
            self.reads.append(all(self.holds[-1](weight) for weight in self.parameters()))


class TwoPassModel(nn.Module):
    """Runs each block's pose pass, then its generation pass: through the method, or (``called``) by calling the
    block, whose forward runs it."""

    def __init__(self, blocks: int = 5, called: bool = False) -> None:
        super().__init__()
        self.called = called
        self.reads: list[bool] = []
        self.holds: list = []  # the engine's ``holds`` while one streams
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(TwoPassBlock(self.reads, self.holds) for _ in range(blocks))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        y = x.flip(-1)
        for block in self.blocks:
            y = block.forward_pose(y)
            x = block(x, y) if self.called else block.forward_gen(x, y)
        return x


def test_the_methods_a_model_runs_its_blocks_through_are_read_from_its_code() -> None:
    model = TwoPassModel()
    found = find_blocks(model)
    assert entry_methods(model, found) == {index: ("forward_pose", "forward_gen") for index in range(5)}

    class Indexed(nn.Module):
        """A dict of blocks iterated by its items, and a list looked up by index; ``to`` and ``forward`` are
        nn.Module's, which the blocks' hooks see already; ``i.bit_length`` is no block's."""

        def __init__(self) -> None:
            super().__init__()
            self.named = nn.ModuleDict({"a": TwoPassBlock([], []), "b": TwoPassBlock([], [])})
            self.listed = nn.ModuleList(TwoPassBlock([], []) for _ in range(2))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _, block in self.named.items():
                block.to(x.device)
                x = block.forward_pose(x) if block.training else block.forward(x)
            for i in range(len(self.listed)):
                x = self.listed[i].forward_gen(x, x) + i.bit_length()
            return x

    assert methods_called_on(Indexed) == {"named": ("to", "forward_pose", "forward"), "listed": ("forward_gen",)}
    indexed = Indexed()
    assert entry_methods(indexed, find_blocks(indexed)) == {0: ("forward_pose",), 1: ("forward_pose",),
                                                            2: ("forward_gen",), 3: ("forward_gen",)}  # fmt: skip

    class Called(nn.Module):
        """Blocks only ever called as modules."""

        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(TwoPassBlock([], []) for _ in range(3))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    called = Called()
    assert methods_called_on(Called) == {} and entry_methods(called, find_blocks(called)) == {}


def test_classes_made_anew_from_one_definition_are_read_from_the_source_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """ComfyUI makes its op classes anew for every model it loads (``comfy.ops.mixed_precision_ops``), and reading a
    class's source parses its whole module: the classes one definition makes are read once, and read alike."""

    def make() -> type[nn.Module]:
        class Posed(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.blocks = nn.ModuleList(TwoPassBlock([], []) for _ in range(2))

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                for block in self.blocks:
                    x = block.forward_pose(x)
                return x

        return Posed

    read: list[object] = []
    getsource = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda thing: read.append(thing) or getsource(thing))
    first, second = make(), make()
    assert first is not second
    assert methods_called_on(first) == methods_called_on(second) == {"blocks": ("forward_pose",)}
    assert read == [first]


def streamed(model: TwoPassModel, methods: bool, prefetch: int = 1) -> tuple[BlockStreamer, TimelineRecorder]:
    recorder = TimelineRecorder(CPU)
    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(len(model.blocks)),
        StreamSpec(
            ring=RingOptions(prefetch=prefetch),
            calls=CallOptions(root=model, entry_methods=entry_methods(model, find_blocks(model)) if methods else {}),
            recorder=recorder,
        ),
    )
    streamer.enable()
    model.holds.append(streamer.ring.holds)
    return streamer, recorder


@pytest.mark.parametrize("called", [False, True], ids=["methods", "a method and the call"])
def test_blocks_run_through_their_methods_stream_bitwise_from_the_engines_buffers(called: bool) -> None:
    """Each run of a method the model runs a block through is a call of the block, unless the block's call is open
    already: a method run inside another (the pose pass inside the generation pass), or inside the block's own
    forward, is part of that call, whose end alone lets the block go."""
    torch.manual_seed(0)
    model = TwoPassModel(called=called)
    x = torch.randn(2, 3, WIDTH)
    reference = model(x)
    streamer, recorder = streamed(model, methods=True)
    for _ in range(3):
        assert torch.equal(model(x), reference)
    # Each block is one call per method the model runs it through (the pose pass inside the generation pass is
    # part of the outer call), and is read from the ring at every pass.
    assert [span.block for span in recorder.latest().spans] == [i for i in range(5) for _ in range(2)]
    assert model.reads and all(model.reads)
    assert all(span.bytes_copied for span in recorder.latest().spans[::2])  # 5 blocks through a ring of 2
    streamer.disable()
    assert all("forward_pose" not in block.__dict__ for block in model.blocks)  # the class's methods again
    assert torch.equal(model(x), reference)

    # Without the methods, the engine sees no run of them: those read the weights where they rest.
    model.reads.clear()
    model.holds.clear()
    streamer, _ = streamed(model, methods=False)
    assert torch.equal(model(x), reference)
    assert model.reads and (not all(model.reads) if called else not any(model.reads))
    streamer.disable()


def test_an_interrupt_inside_a_method_leaves_the_block_on_the_host_and_the_model_usable() -> None:
    torch.manual_seed(1)
    model = TwoPassModel()
    x = torch.randn(1, 4, WIDTH)
    reference = model(x)
    streamer, recorder = streamed(model, methods=True, prefetch=2)
    model.blocks[2].interrupt = True
    with pytest.raises(KeyboardInterrupt):
        model(x)
    model.blocks[2].interrupt = False
    # The interrupt (a BaseException, as ComfyUI 0.33's) ended the call: block 2 points at its host buffer.
    host = streamer.host.blocks[2].host
    inside = range(host.data_ptr(), host.data_ptr() + host.numel() * host.element_size())
    assert not streamer.calls.open and all(weight.data_ptr() in inside for weight in model.blocks[2].parameters())
    model.reads.clear()
    assert torch.equal(model(x), reference) and all(model.reads)
    assert [span.block for span in recorder.latest().spans] == [i for i in range(5) for _ in range(2)]
    streamer.disable()


def test_a_call_through_a_method_whose_start_raises_is_closed_all_the_same() -> None:
    """The start of a block's call through one of its methods raises once the call is open (a host's transform of
    it failing, out of memory): the call is closed there, as a module's always-called post-hook closes it, so the
    block is not left held and pointing at the ring until the step's end; the next calls are bitwise."""
    torch.manual_seed(2)
    model = TwoPassModel()
    x, y = torch.randn(1, 4, WIDTH), torch.randn(1, 4, WIDTH)
    block = model.blocks[1]
    reference, expected = block.forward_pose(y), model(x)
    failing = [True]

    def transform(copied: bool) -> None:
        if failing[0]:
            raise torch.OutOfMemoryError("patching block 1")

    streamer = stream_blocks(
        model.blocks,
        CPU,
        range(len(model.blocks)),
        StreamSpec(
            ring=RingOptions(prefetch=1),
            calls=CallOptions(root=model, entry_methods=entry_methods(model, find_blocks(model))),
            transforms={1: transform},
        ),
    )
    streamer.enable()
    with pytest.raises(torch.OutOfMemoryError, match="patching block 1"):
        block.forward_pose(y)  # outside a step of the model: nothing else closes the call
    host = streamer.host.blocks[1].host
    inside = range(host.data_ptr(), host.data_ptr() + host.numel())
    assert not streamer.calls.open and all(weight.data_ptr() in inside for weight in block.parameters())
    failing[0] = False
    assert torch.equal(block.forward_pose(y), reference)
    streamer.close_open_step()
    assert torch.equal(model(x), expected)
    streamer.disable()
