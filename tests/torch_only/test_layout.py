"""The engine streams every kind of tensor as the bytes it is stored in (``offload/layout.py``), on the CPU.

No ComfyUI here: a wrapper subclass implementing PyTorch's ``__tensor_flatten__``/``__tensor_unflatten__``
protocol (as ComfyUI's QuantizedTensor does) and a subclass with memory of its own and attributes that say
how to read it (as ComfyUI-GGUF's GGMLTensor) stand for the kinds; ``test_quantized.py`` runs the real ones
through ComfyUI.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from harness.parking import lot_of
from harness.private_views import plain_torch_function, wrapper_subclass
from harness.transformer_stack import Stack, forward_steps, transformer_stack

from block_offload.offload import (
    CallOptions,
    HostOptions,
    RingOptions,
    SequentialOptions,
    StreamSpec,
    layout,
    module_bytes,
    stream_blocks,
    stream_modules,
)
from block_offload.offload.layout import ALIGNMENT, BlockLayout

CPU = torch.device("cpu")
DIM = 32


class RowScaled(torch.Tensor):
    """int8 rows and their fp32 scales inside a wrapper that presents the dequantized dtype, its parts
    named by ``__tensor_flatten__``: how ComfyUI's QuantizedTensor is made."""

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> RowScaled:
        return wrapper_subclass(cls, qdata.shape, dtype, qdata.device)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        self.qdata, self.scale = qdata, scale

    def __tensor_flatten__(self) -> tuple[list[str], torch.dtype]:
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner: dict, dtype: torch.dtype, size: torch.Size, stride: tuple) -> RowScaled:
        return RowScaled(inner["qdata"], inner["scale"], dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        if func is torch.ops.aten.detach.default:  # what nn.Parameter asks of it
            return RowScaled(args[0].qdata, args[0].scale, args[0].dtype)
        raise NotImplementedError(func)

    def dequantize(self) -> torch.Tensor:
        return self.qdata.to(self.dtype) * self.scale


class ScaledBytes(torch.Tensor):
    """int8 values whose scale is a Python attribute, read at compute time: a subclass with memory of its
    own and no dispatch of its own, as ComfyUI-GGUF's GGMLTensor (raw bytes plus ``tensor_type``)."""

    __torch_function__ = plain_torch_function  # ops on it give plain tensors

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: float) -> ScaledBytes:
        return data.as_subclass(cls)

    def __init__(self, data: torch.Tensor, scale: float) -> None:
        self.scale = scale

    def detach(self) -> ScaledBytes:
        return self  # as GGMLTensor's: what lets nn.Parameter keep the subclass (and its attributes)

    def dequantize(self) -> torch.Tensor:
        return self.float() * self.scale


class DispatchOnly(torch.Tensor):
    """A wrapper with a dispatch of its own but no flatten protocol: nothing says what it is made of."""

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> DispatchOnly:
        return wrapper_subclass(cls, inner.shape, inner.dtype)

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
        raise NotImplementedError


class MixedBlock(nn.Module):
    """A plain Linear, a wrapper weight, a storage-subclass weight and a buffer in one block."""

    def __init__(self) -> None:
        super().__init__()
        self.plain = nn.Linear(DIM, DIM)
        rows = torch.randint(-127, 128, (DIM, DIM), dtype=torch.int8), torch.rand(DIM, 1) * 0.002
        self.rows = nn.Parameter(RowScaled(*rows, torch.float32), requires_grad=False)
        self.scaled = nn.Parameter(ScaledBytes(torch.randint(-127, 128, (DIM, DIM), dtype=torch.int8), 0.002), False)
        self.register_buffer("shift", torch.randn(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Reads the wrapper's inner tensors and the subclass's attribute, as their owners' ops do.
        rows, scaled = self.rows.dequantize(), self.scaled.dequantize()
        return x + self.plain(x) + F.linear(x, rows) + F.linear(x, scaled) + self.shift


def mixed_stack(blocks: int = 4) -> Stack:
    torch.manual_seed(0)
    return Stack([MixedBlock() for _ in range(blocks)], DIM).eval()


def contents(model: nn.Module) -> dict[str, tuple[type, list[torch.Tensor], object]]:
    """Each tensor's kind, its parts (copied) and the subclass's attribute: what must survive streaming."""
    out = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        parts = [tensor.qdata, tensor.scale] if isinstance(tensor, RowScaled) else [tensor]
        scale = tensor.scale if isinstance(tensor, ScaledBytes) else None
        out[name] = (type(tensor), [p.detach().clone() for p in parts], scale)
    return out


def assert_same_contents(model: nn.Module, expected: dict[str, tuple[type, list[torch.Tensor], object]]) -> None:
    actual = contents(model)
    assert actual.keys() == expected.keys()
    for name, (kind, parts, scale) in actual.items():
        assert kind is expected[name][0] and scale == expected[name][2], name
        assert all(p.dtype == q.dtype and torch.equal(p, q) for p, q in zip(parts, expected[name][1], strict=True))


def test_every_kind_is_packed_as_its_parts_and_streams_bitwise() -> None:
    model = mixed_stack()
    x = torch.randn(2, 5, DIM)
    (reference,) = forward_steps(model, x, steps=1)
    before = contents(model)
    block = model.blocks[1]
    plain_weight, scaled_weight = block.plain.weight, block.scaled
    streamer = stream_blocks(
        model.blocks, CPU, range(4), StreamSpec(ring=RingOptions(prefetch=1), calls=CallOptions(root=model))
    )
    streamer.enable()

    # The host buffer holds each tensor as stored: the wrapper's inner int8 rows and scales, the int8 bytes.
    parts = (block.plain.weight, block.plain.bias, block.rows.qdata, block.rows.scale, block.scaled, block.shift)
    stored = sum(t.numel() * t.element_size() for t in parts)
    assert module_bytes(block) == stored
    host = streamer.host.blocks[1].host
    assert stored <= host.numel() <= stored + 6 * ALIGNMENT  # six parts, each aligned
    inside = range(host.data_ptr(), host.data_ptr() + host.numel())
    assert block.rows.qdata.data_ptr() in inside and block.rows.scale.data_ptr() in inside
    assert block.scaled.data_ptr() in inside and block.scaled.dtype == torch.int8

    seen: list[bool] = []

    def in_the_slot(module: nn.Module, args: tuple) -> None:
        start, end = streamer.ring.region_of(1)
        memory = range(streamer.ring.memory.data_ptr() + start, streamer.ring.memory.data_ptr() + end)
        rows, scaled = module.rows, module.scaled
        seen.append(rows.qdata.data_ptr() in memory and rows.scale.data_ptr() in memory)
        seen.append(scaled.data_ptr() in memory and scaled.scale == 0.002)
        seen.append(isinstance(rows, nn.Parameter) and isinstance(rows, RowScaled))

    handle = block.register_forward_pre_hook(in_the_slot)
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=3))
    handle.remove()
    assert seen and all(seen), "the block ran on something else than its slot's memory"
    # Plain tensors and the storage subclass stay the very Parameter objects (their attributes with them).
    assert block.plain.weight is plain_weight and block.scaled is scaled_weight
    streamer.disable()
    assert_same_contents(model, before)
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=1))


def test_the_sequential_wrapper_streams_every_kind_and_casts_only_plain_weights() -> None:
    model = mixed_stack(blocks=2)
    x = torch.randn(1, 3, DIM)
    (reference,) = forward_steps(model, x, steps=1)
    before = contents(model)
    layout = BlockLayout.of(model.blocks[0], torch.bfloat16, recurse=False)
    dtypes = {slot.name: [part.dtype for part in slot.parts] for slot in layout.slots}
    # A storage dtype is for plain weights: a subclass's parts mean something only in their own dtypes.
    assert dtypes == {"rows": [torch.int8, torch.float32], "scaled": [torch.int8], "shift": [torch.float32]}
    wrapper = stream_modules(model, CPU, StreamSpec(ring=RingOptions(prefetch=2)), SequentialOptions())
    wrapper.enable()
    assert all(torch.equal(out, reference) for out in forward_steps(model, x, steps=3))
    wrapper.disable()
    assert_same_contents(model, before)


def test_parked_subclasses_are_adopted_then_given_memory_of_their_own() -> None:
    model = mixed_stack(blocks=3)
    x = torch.randn(2, 4, DIM)
    (reference,) = forward_steps(model, x, steps=1)
    first = stream_blocks(
        model.blocks, CPU, [0, 2], StreamSpec(host=HostOptions(parking=lot_of(model)), calls=CallOptions(root=model))
    )
    first.enable()
    hosts = {i: first.host.blocks[i].host.data_ptr() for i in (0, 2)}
    last = range(hosts[2], hosts[2] + first.host.blocks[2].host.numel())
    first.disable(park=True)
    assert forward_steps(model, x, steps=1)[0].equal(reference)
    second = stream_blocks(
        model.blocks, CPU, [0, 2], StreamSpec(host=HostOptions(parking=lot_of(model)), calls=CallOptions(root=model))
    )
    second.enable()
    assert {i: second.host.blocks[i].host.data_ptr() for i in (0, 2)} == hosts  # adopted, not packed again
    assert all(torch.equal(out, reference) for out in forward_steps(model, x))
    second.disable(park=True)
    block = model.blocks[2]
    assert all(t.data_ptr() in last for t in (block.rows.qdata, block.rows.scale, block.scaled, block.plain.weight))
    lot_of(model).unpark(model.blocks)
    assert not any(t.data_ptr() in last for t in (block.rows.qdata, block.rows.scale, block.scaled, block.plain.weight))
    assert isinstance(block.rows, RowScaled) and block.scaled.scale == 0.002
    assert forward_steps(model, x, steps=1)[0].equal(reference)


def test_a_subclass_of_unknown_make_is_refused_naming_the_kinds_streamed() -> None:
    block = nn.Module()
    block.register_buffer("weight", DispatchOnly(torch.randn(4, 4)))
    with pytest.raises(TypeError) as refused:
        BlockLayout.of(block)
    message = str(refused.value)
    assert "Module.weight is a DispatchOnly" in message
    assert "__tensor_flatten__/__tensor_unflatten__ (ComfyUI's QuantizedTensor)" in message
    assert "ComfyUI-GGUF's GGMLTensor" in message and "plain tensors of any dtype" in message


def made_in_inference_mode(model: Stack) -> Stack:
    """``model`` with every Parameter made again inside ``torch.inference_mode``, as ComfyUI 0.33 makes them."""
    with torch.inference_mode():
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                module.register_parameter(name, nn.Parameter(param.detach().clone(), requires_grad=False))
    assert all(p.is_inference() for p in model.parameters())
    return model


def test_a_streamed_call_makes_its_inference_aliases_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Parameter made in inference mode takes a normal tensor's memory (its host buffer, a ring region) as an
    inference alias of it (see the test below). Each streamed call made one per tensor as it pointed the block
    back at its host buffer, half of the call's host work on a 2-core CPU: they are made once per kept view, then
    kept. So from the second step on, a step makes none, and the output stays the resident model's."""
    model = made_in_inference_mode(transformer_stack())
    x = torch.randn(1, 5, 32)
    reference = forward_steps(model, x, steps=1)[0]
    made: list[torch.Tensor] = []
    inference_alias = layout._inference_alias

    def counted(tensor: torch.Tensor) -> torch.Tensor:
        made.append(tensor)
        return inference_alias(tensor)

    monkeypatch.setattr(layout, "_inference_alias", counted)
    streamer = stream_blocks(model.blocks, CPU, [0, 1, 2, 3], StreamSpec(calls=CallOptions(root=model)))
    streamer.enable()  # host buffers made outside inference mode, as by a packing thread (the mode is per thread)
    per_step = []
    for _ in range(4):
        assert torch.equal(forward_steps(model, x, steps=1)[0], reference)
        per_step.append(len(made) - sum(per_step))
    tensors = sum(len(list(block.parameters())) + len(list(block.buffers())) for block in model.blocks)
    assert per_step[0] >= tensors, "enabling and a first step place every streamed tensor as an alias"
    assert per_step[1:] == [0, 0, 0]
    assert all(p.is_inference() for p in model.parameters())
    streamer.disable()
    assert torch.equal(forward_steps(model, x, steps=1)[0], reference)


def test_parameters_made_in_inference_mode_stay_usable_after_streaming_stops_outside_it() -> None:
    """ComfyUI 0.33 builds and moves its Parameters inside ``torch.inference_mode`` (the prompt's execution;
    ``comfy.ops`` re-creates them as it moves them), but unloads models outside it (``POST /free`` runs
    ``unload_all_models`` in the prompt worker). A Parameter made in inference mode that takes a normal
    tensor's memory through ``.data`` loses its version counter: the next prompt's first view of it failed
    with "Inference tensors do not track version counter"."""
    model = made_in_inference_mode(transformer_stack())
    x = torch.randn(1, 5, 32)
    (reference,) = forward_steps(model, x, steps=1)
    for park in (True, False):
        streamer = stream_blocks(
            model.blocks,
            CPU,
            [1, 2, 3],
            StreamSpec(host=HostOptions(parking=lot_of(model)), calls=CallOptions(root=model)),
        )
        with torch.inference_mode():
            streamer.enable()
        assert all(torch.equal(out, reference) for out in forward_steps(model, x))
        streamer.disable(park=park)  # outside inference mode, as ComfyUI unloads
        lot_of(model).unpark(model.blocks)
        assert all(torch.equal(out, reference) for out in forward_steps(model, x))
