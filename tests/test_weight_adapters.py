"""The other weight adapters ComfyUI's LoRA loader reads (``comfy/weight_adapter``): DoRA (a LoRA with
``dora_scale``), LoHa, LoKr and OFT, whose patches hold other tensors than a LoRA's up and down, stream through
every node exactly as ComfyUI computes them without one: on the plain tiny Wan before and after each node (the
classic load, and Dynamic VRAM's, whose twin the node streams), and
on each stored format this host loads (GGUF through ComfyUI-GGUF) with the adapter after Async Block Offload.
Bitwise the latent of the same model without the node, every streamed weight read from the engine's buffers.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import HOST_VERSION
from test_quantized import loader  # noqa: F401 - the fixture
from test_quantized_lora import assert_samples_from_the_engine

from harness import tiny_models as tm
from harness.inprocess import Unstreamed, every_block_streamed, sample, wan
from harness.prompts import ASYNC, NODES

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

KINDS = ["dora", "loha", "lokr", "oft"]
RANK = 4
OFT_BLOCK = 4


def adapter(model: Any, kind: str) -> dict[str, torch.Tensor]:
    """A ``kind`` adapter on every block's self-attention query and first MLP layer, as a LoRA file's tensors."""
    generator = torch.Generator().manual_seed(3)

    def small(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.1

    tensors = {}
    for name, weight in model.model.diffusion_model.state_dict().items():
        shape = tuple(getattr(weight, "tensor_shape", weight.shape))  # a GGUF tensor's logical shape
        if not (name.startswith("blocks.") and name.endswith((".self_attn.q.weight", ".ffn.0.weight"))):
            continue
        key, (rows, columns) = f"diffusion_model.{name.removesuffix('.weight')}", shape
        if kind == "dora":
            tensors |= {f"{key}.lora_up.weight": small(rows, RANK), f"{key}.lora_down.weight": small(RANK, columns)}
            tensors[f"{key}.dora_scale"] = 1 + small(rows, 1)
        elif kind == "loha":
            tensors |= {f"{key}.hada_w1_a": small(rows, RANK), f"{key}.hada_w1_b": small(RANK, columns)}
            tensors |= {f"{key}.hada_w2_a": small(rows, RANK), f"{key}.hada_w2_b": small(RANK, columns)}
            tensors[f"{key}.alpha"] = torch.tensor(2.0)
        elif kind == "lokr":
            tensors |= {f"{key}.lokr_w1": small(2, 2), f"{key}.lokr_w2": small(rows // 2, columns // 2)}
        else:
            tensors[f"{key}.oft_blocks"] = small(rows // OFT_BLOCK, OFT_BLOCK, OFT_BLOCK)
    assert tensors, "no layer to adapt"
    return tensors


def with_adapter(comfy: SimpleNamespace, model: Any, tensors: dict[str, torch.Tensor]) -> Any:
    patched = comfy.sd.load_lora_for_models(model, None, tensors, 1.0, 0)[0]
    assert len(patched.patches) > len(model.patches), "ComfyUI read none of the adapter's keys"
    return patched


@pytest.mark.parametrize("adapter_first", [True, False], ids=["adapter-before-node", "node-before-adapter"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("node", NODES)
@pytest.mark.parametrize("loading", ["classic", "dynamic_vram"])
def test_an_adapter_streams_as_comfyui_computes_it(
    comfy: SimpleNamespace,
    request: pytest.FixtureRequest,
    unstreamed: Unstreamed,
    loading: str,
    node: str,
    kind: str,
    adapter_first: bool,
) -> None:
    if loading == "classic":
        model = wan(comfy)
        load_reference = lambda: model  # noqa: E731
    elif HOST_VERSION.startswith("0.3."):
        pytest.skip(f"ComfyUI {HOST_VERSION} has no Dynamic VRAM")
    else:  # the node streams a twin of the dynamic MODEL; ComfyUI's classic load of the file is the reference
        dynamic_vram = request.getfixturevalue("dynamic_vram")
        model = dynamic_vram.load(comfy.models["wan21"], torch.float32)
        load_reference = lambda: dynamic_vram.load_classic(comfy.models["wan21"], torch.float32)  # noqa: E731
    tensors = adapter(model, kind)
    reference = unstreamed.once((loading, kind), lambda: sample(comfy, with_adapter(comfy, load_reference(), tensors)))
    plain = unstreamed.once(loading, lambda: sample(comfy, load_reference()))
    assert not torch.equal(reference, plain), "the adapter changes nothing"
    comfy.mm.unload_all_models()
    if adapter_first:
        streamed = every_block_streamed(comfy, node, with_adapter(comfy, model, tensors))
    else:
        streamed = with_adapter(comfy, every_block_streamed(comfy, node, model), tensors)
    assert_samples_from_the_engine(comfy, streamed, lambda m: sample(comfy, m), reference)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("stored", [artifact.name for artifact in tm.QUANTIZED_ARTIFACTS])
def test_an_adapter_on_a_quantized_checkpoint_streams_as_comfyui_computes_it(
    comfy: SimpleNamespace,
    loader: Callable[[str], object],  # noqa: F811 - the fixture
    stored: str,
    kind: str,
) -> None:
    with torch.inference_mode():  # as the server samples
        model = loader(stored)
        tensors = adapter(model, kind)
        reference = sample(comfy, with_adapter(comfy, model, tensors))
        comfy.mm.unload_all_models()
        streamed = with_adapter(comfy, every_block_streamed(comfy, ASYNC, model), tensors)
        assert_samples_from_the_engine(comfy, streamed, lambda m: sample(comfy, m), reference)
