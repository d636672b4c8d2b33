"""Quantized checkpoints stream as they are stored, through the real ComfyUI on the CPU.

The tiny Wan 2.1 in each format users run on small GPUs (``harness/tiny_models.py``): ComfyUI's per-layer
``comfy_quant`` fp8 and int8 (QuantizedTensor on 0.33), the same fp8 with its configs in the file's
metadata (QuantizedTensor on both hosts, 0.3.75's own class there), the older ``scaled_fp8`` (plain fp8
weights and a scale on 0.3.75, converted to QuantizedTensor by 0.33), and GGUF Q8_0 and Q4_K loaded by
city96's ComfyUI-GGUF (GGMLTensor). Each node's latent must equal the same quantized model's fully
resident one bit for bit, with a LoRA before or after the node too, and what the engine copies and plans
must be the bytes the file stores for the streamed blocks, not a dequantized copy.

Most cases run in-process (``harness/inprocess.py``), two through the server. The GGUF cases need
ComfyUI-GGUF linked into ``.host/custom_nodes`` (``scripts/setup.sh``) and skip, saying so, without it.
"""

from __future__ import annotations

import importlib.util
import json
import struct
import sys
import uuid
from collections.abc import Callable
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from conftest import HOST_VERSION
from test_nodes_e2e import full_prompt
from torch import nn

from harness import tiny_models as tm
from harness.comfy_host import HOST_DIR, ComfyHost
from harness.inprocess import offloaded, sample
from harness.prompts import ARCHS, ASYNC, NODES, PARTIAL, SEQUENTIAL, differs, plan_lines, run

from block_offload.offload import module_bytes
from block_offload.offload.layout import ALIGNMENT, BlockLayout

pytestmark = pytest.mark.usefixtures("allow_cpu_streaming")

ON_033 = not HOST_VERSION.startswith("0.3.")
GGUF_PACK = HOST_DIR / "custom_nodes" / "ComfyUI-GGUF"
GGUF_FORMATS = (tm.WAN21_Q8_0, tm.WAN21_Q4_K)
#: What ComfyUI holds a streamed block's Linear weight as, per format, on this host.
WEIGHT_KIND: dict[str, str] = {
    tm.WAN21_FP8: "QuantizedTensor",
    tm.WAN21_FP8_METADATA: "QuantizedTensor",
    tm.WAN21_INT8: "QuantizedTensor",
    tm.WAN21_FP8_E5M2: "QuantizedTensor",
    tm.WAN21_INT8_CONVROT: "QuantizedTensor",
    tm.WAN21_W4A4: "QuantizedTensor",
    tm.WAN21_W4A8: "QuantizedTensor",
    tm.WAN21_NVFP4: "QuantizedTensor",
    tm.WAN21_MXFP8: "QuantizedTensor",
    tm.WAN21_SCALED_FP8: "QuantizedTensor" if ON_033 else "Parameter",  # 0.3.75: a plain fp8 Parameter
    tm.WAN21_Q8_0: "GGMLTensor",
    tm.WAN21_Q4_K: "GGMLTensor",
}
#: A known gap, outside this file: a LoRA loaded after a node on a GGUF model samples right but unstreamed.
#: Formats this host cannot load as quantized, and why.
NOT_ON_HOST: dict[str, str] = (
    {}
    if ON_033
    else {
        tm.WAN21_FP8: "ComfyUI 0.3.75 reads no per-layer comfy_quant entries (only a file's _quantization_metadata)",
        tm.WAN21_INT8: "ComfyUI 0.3.75 has no int8_tensorwise format",
        **dict.fromkeys(
            (tm.WAN21_FP8_E5M2, tm.WAN21_INT8_CONVROT, tm.WAN21_W4A4, tm.WAN21_W4A8, tm.WAN21_NVFP4, tm.WAN21_MXFP8),
            "ComfyUI 0.3.75 reads no per-layer comfy_quant entries, nor has it this format",
        ),
    }
)


# -- loading ------------------------------------------------------------------------------------------------


def import_gguf_pack() -> ModuleType:
    """ComfyUI-GGUF's nodes, imported as ComfyUI imports a custom node pack (by its folder's name)."""
    if not (GGUF_PACK / "nodes.py").is_file():
        pytest.skip(f"ComfyUI-GGUF is not at {GGUF_PACK}: scripts/setup.sh links ../shared/ComfyUI-GGUF there")
    if importlib.util.find_spec("gguf") is None:
        pytest.skip("the gguf package is not installed (requirements-dev.txt; scripts/setup.sh installs it)")
    name = GGUF_PACK.name
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, GGUF_PACK / "__init__.py", submodule_search_locations=[str(GGUF_PACK)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[f"{name}.nodes"]


@pytest.fixture(scope="module")
def loader(comfy: SimpleNamespace) -> Callable[[str], object]:
    """Loads a tiny quantized checkpoint as its node would: UNETLoader's path, or ComfyUI-GGUF's UnetLoaderGGUF."""
    import folder_paths

    def load(name: str) -> object:
        if name in NOT_ON_HOST:
            pytest.skip(NOT_ON_HOST[name])
        if name not in GGUF_FORMATS:
            return comfy.sd.load_diffusion_model(str(comfy.models[name]))
        nodes = import_gguf_pack()
        folders = folder_paths.get_folder_paths("diffusion_models")
        if str(comfy.models[name].parent) not in folders:
            folder_paths.add_model_folder_path("diffusion_models", str(comfy.models[name].parent))
        return nodes.UnetLoaderGGUF().load_unet(tm.FILES[name])[0]

    return load


# -- what the files store -----------------------------------------------------------------------------------


def stored_in_file(path: Path) -> dict[str, int]:
    """The bytes each tensor of a checkpoint takes in the file, read from its header. A layer's
    ``comfy_quant`` entry (its JSON config) and the ``scaled_fp8`` marker are no weights: left out."""
    if path.suffix == ".gguf":
        import gguf

        sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    else:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        header.pop("__metadata__", None)
        sizes = {key: entry["data_offsets"][1] - entry["data_offsets"][0] for key, entry in header.items()}
    return {key: size for key, size in sizes.items() if not key.endswith(".comfy_quant") and key != "scaled_fp8"}


def held_bytes(module: nn.Module, name: str, stored: dict[str, int], recurse: bool = True) -> tuple[int, int]:
    """(bytes, tensors) ``module`` (``name`` in the model) holds its weights in: a plain tensor as ComfyUI
    holds it (0.3.75 loads even the biases of a scaled_fp8 model in fp8), a layer with a quantized weight as
    the file stores the rest of that layer (its quantized data and scales, whatever their keys)."""
    nbytes = count = 0
    for owner_name, owner in module.named_modules() if recurse else [("", module)]:
        layer = ".".join(part for part in (name, owner_name) if part)
        params = owner.named_parameters(recurse=False, remove_duplicate=False)
        buffers = owner.named_buffers(recurse=False, remove_duplicate=False)
        tensors = dict([*params, *buffers])  # what it holds itself, by each name; unset (None) ones are left out
        plain = {attr: t for attr, t in tensors.items() if type(t) in (torch.Tensor, nn.Parameter)}
        nbytes += sum(t.numel() * t.element_size() for t in plain.values())
        count += len(plain)
        if len(plain) < len(tensors):
            parts = [
                size for key, size in stored.items() if within(key, layer, False) and key[len(layer) + 1 :] not in plain
            ]
            nbytes, count = nbytes + sum(parts), count + len(parts)
    return nbytes, count


def within(key: str, name: str, recurse: bool) -> bool:
    """Whether the file's ``key`` is a tensor of module ``name`` (or of its submodules, with ``recurse``)."""
    return key.startswith(f"{name}.") if recurse else key.rsplit(".", 1)[0] == name


def assert_copies_are_the_stored_bytes(patched: object, node: str, path: Path, fp32: Path) -> None:
    """The last step copied each streamed unit it called once, as stored: its bytes plus at most the
    alignment of each tensor, and well under its fp32 (dequantized) size."""
    engine = patched.offload_engine
    step = engine.recorder.latest()
    stored, floats = stored_in_file(path), stored_in_file(fp32)
    diffusion_model = patched.model.diffusion_model
    if node == SEQUENTIAL:
        # Every module streams on its own, called or brought in with the parent whose code reads it (0.33's
        # Wan feed-forward runs an INT8 down-projection from its forward: comfy.ops.linear_input_act).
        names = {id(module): name for name, module in diffusion_model.named_modules()}
        called = {names[id(engine.runner.blocks[span.block])] for span in step.spans}
        units = [(name, diffusion_model.get_submodule(name)) for name in called]
        recurse = False
    else:
        copied = {span.block for span in step.spans if span.bytes_copied}
        assert copied == set(engine.plan.streamed), (copied, engine.plan.streamed)
        units = [(f"blocks.{i}", diffusion_model.blocks[i]) for i in copied]
        recurse = True
        # The plan (budgets, the log line, the panel, the planner) counts the same stored bytes.
        held = [held_bytes(block, f"blocks.{i}", stored)[0] for i, block in enumerate(diffusion_model.blocks)]
        assert engine.plan.block_bytes == tuple(held)
    sizes = [held_bytes(module, name, stored, recurse) for name, module in units]
    nbytes, count = sum(n for n, _ in sizes), sum(c for _, c in sizes)
    dequantized = sum(size for key, size in floats.items() if any(within(key, name, recurse) for name, _ in units))
    assert nbytes <= step.bytes_copied <= nbytes + ALIGNMENT * count, (step.bytes_copied, nbytes, count)
    assert step.bytes_copied < 0.4 * dequantized, (step.bytes_copied, dequantized)


# -- in-process -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(WEIGHT_KIND))
def test_every_node_streams_the_format_as_stored_bitwise(
    comfy: SimpleNamespace, loader: Callable[[str], object], name: str
) -> None:
    model = loader(name)
    blocks = model.model.diffusion_model.blocks
    weight = blocks[1].self_attn.q.weight
    assert type(weight).__name__ == WEIGHT_KIND[name], f"{name} loaded as {type(weight).__name__}, not quantized"
    if name == tm.WAN21_SCALED_FP8 and not ON_033:
        assert weight.dtype == torch.float8_e4m3fn
    path, fp32 = comfy.models[name], comfy.models[tm.WAN21]
    stored = stored_in_file(path)
    assert [module_bytes(b) for b in blocks] == [held_bytes(b, f"blocks.{i}", stored)[0] for i, b in enumerate(blocks)]
    reference = sample(comfy, model)
    for node in (ASYNC, PARTIAL, SEQUENTIAL):
        patched = offloaded(comfy, node, model)
        latent = sample(comfy, patched)
        assert torch.equal(latent, reference), f"{node}: {differs(latent, reference)}"
        assert_copies_are_the_stored_bytes(patched, node, path, fp32)
        comfy.mm.unload_all_models()
    assert type(blocks[1].self_attn.q.weight).__name__ == WEIGHT_KIND[name]
    assert torch.equal(sample(comfy, model), reference), "the loader's MODEL changed"
    comfy.mm.unload_all_models()


#: A QuantizedTensor (0.33's; 0.3.75's own class), GGUF, and on 0.3.75 the plain fp8 of scaled_fp8 (0.33
#: turns it into the same QuantizedTensor as the first).
LORA_FORMATS = [tm.WAN21_FP8_METADATA, tm.WAN21_Q4_K] + ([] if ON_033 else [tm.WAN21_SCALED_FP8])


@pytest.mark.parametrize("name", LORA_FORMATS)
def test_a_lora_before_or_after_each_node_on_quantized_weights(
    comfy: SimpleNamespace, loader: Callable[[str], object], name: str
) -> None:
    # As the server runs a prompt: 0.3.75 rounds a LoRA'd scaled_fp8 weight back to fp8 only in inference mode.
    with torch.inference_mode():
        model = loader(name)
        lora = comfy.utils.load_torch_file(str(comfy.models[tm.WAN21_LORA]))

        def with_lora(m: object) -> object:
            return comfy.sd.load_lora_for_models(m, None, lora, 1.0, 0)[0]

        reference = sample(comfy, with_lora(model))
        plain = sample(comfy, model)
        assert not torch.equal(reference, plain), "the LoRA changes nothing: the test would prove nothing"
        unstreamed = []

        def check(order: str, patched: object) -> None:
            latent = sample(comfy, patched)
            assert torch.equal(latent, reference), f"{order}: {differs(latent, reference)}"
            if getattr(patched, "offload_engine", None) is None:
                unstreamed.append(order)
            comfy.mm.unload_all_models()

        for node in (ASYNC, PARTIAL, SEQUENTIAL):
            check(f"LoRA, {node}", offloaded(comfy, node, with_lora(model)))
            check(f"{node}, LoRA", with_lora(offloaded(comfy, node, model)))
        assert torch.equal(sample(comfy, model), plain), "the LoRA stayed on the loader's MODEL"
        comfy.mm.unload_all_models()
    assert not unstreamed, f"these ran without streaming: {unstreamed}"


#: 0.3.75's own QuantizedTensor cannot dequantize to fp16 on the CPU (it ignores the cast, then multiplies
#: fp8 by its scale, which the CPU does not implement): its plain scaled_fp8 weights compute in fp16 there.
HALF_FORMATS = [tm.WAN21_FP8_METADATA if ON_033 else tm.WAN21_SCALED_FP8, tm.WAN21_Q8_0]


@pytest.mark.parametrize("name", HALF_FORMATS)
def test_half_precision_compute(
    comfy: SimpleNamespace, loader: Callable[[str], object], monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    """As on a GPU: the model computes in fp16 (on the CPU ComfyUI picks fp32, with manual casts)."""
    monkeypatch.setattr(comfy.mm, "unet_dtype", lambda *args, **kwargs: torch.float16)
    monkeypatch.setattr(comfy.mm, "unet_manual_cast", lambda *args, **kwargs: None)
    model = loader(name)
    assert model.model.get_dtype() == torch.float16 and model.model.manual_cast_dtype is None
    reference = sample(comfy, model)
    for node in (ASYNC, PARTIAL, SEQUENTIAL):
        latent = sample(comfy, offloaded(comfy, node, model))
        assert torch.equal(latent, reference), f"{node}: {differs(latent, reference)}"
        comfy.mm.unload_all_models()


#: ComfyUI's quantized layouts; NVFP4 and MXFP8 need a Blackwell GPU to compute, but comfy-kitchen's eager
#: backend quantizes and dequantizes them on the CPU, which is all a round trip needs.
LAYOUTS = (
    [
        "TensorCoreFP8E4M3Layout",
        "TensorCoreFP8E5M2Layout",
        "TensorWiseINT8Layout",
        "TensorCoreNVFP4Layout",
        "TensorCoreMXFP8Layout",
    ]
    if ON_033
    else ["TensorCoreFP8Layout"]
)


@pytest.mark.parametrize("layout_name", LAYOUTS)
def test_every_comfy_layout_is_packed_copied_and_rebuilt_around_the_copy(
    comfy: SimpleNamespace, layout_name: str
) -> None:
    """A QuantizedTensor weight packed into a host buffer, copied to a slot, rebuilt there: the same class,
    context and inner tensors, bit for bit, living in the slot, dequantizing to the same values."""
    from comfy.quant_ops import QuantizedTensor

    torch.manual_seed(0)
    original = QuantizedTensor.from_float(torch.randn(64, 128), layout_name)
    module = nn.Linear(128, 64)
    module.weight = nn.Parameter(original, requires_grad=False)
    layout = BlockLayout.of(module)
    host = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.pack_into(host)
    slot = torch.empty_like(host)
    slot.copy_(host)
    layout.point_at(layout.views(slot))

    rebuilt = module.weight
    assert type(rebuilt) is QuantizedTensor and isinstance(rebuilt, nn.Parameter)
    names, context = original.__tensor_flatten__()
    assert rebuilt.__tensor_flatten__() == (names, context)
    memory = range(slot.data_ptr(), slot.data_ptr() + slot.numel())
    stored = 0
    for name in names:
        before, after = getattr(original, name), getattr(rebuilt, name)
        assert after.dtype == before.dtype and after.shape == before.shape, name
        assert torch.equal(after.reshape(-1).view(torch.uint8), before.reshape(-1).view(torch.uint8)), name
        assert after.data_ptr() in memory, f"{name} does not live in the slot"
        stored += before.numel() * before.element_size()
    assert module_bytes(module) == stored + module.bias.nbytes  # the stored parts, not the dequantized size
    assert torch.equal(rebuilt.dequantize(), original.dequantize())


# -- through the server ---------------------------------------------------------------------------------------


#: Every format this host loads, through the server (about 10 s each on this machine, when idle).
SERVER_FORMATS = [name for name in WEIGHT_KIND if name not in NOT_ON_HOST]


@pytest.mark.usefixtures("tiny_models")
@pytest.mark.parametrize("name", SERVER_FORMATS)
def test_quantized_checkpoints_through_the_server(comfy_host: ComfyHost, name: str) -> None:
    """Every node, and a LoRA before and after each, on a prompt queued over HTTP: the GGUF file through
    ComfyUI-GGUF's Unet Loader (GGUF), the others through Load Diffusion Model; bitwise equal latents. The
    block nodes place automatically, as dragged in (the patch-cost probe runs: 0.3.75 failed the prompt there)."""
    arch = ARCHS[tm.WAN21]
    build = full_prompt(arch, f"tests/quantized/{uuid.uuid4().hex[:8]}/{name}")
    for node in build.prompt.values():
        if node["class_type"] in ("AsyncBlockOffload", "PartialGPUResidency"):
            node["inputs"]["policy"] = "auto"
    if name in GGUF_FORMATS:
        if "UnetLoaderGGUF" not in comfy_host.object_info():
            pytest.skip(f"the server has no UnetLoaderGGUF: ComfyUI-GGUF is not linked at {GGUF_PACK}")
        build.prompt[build.model[0]] = {"class_type": "UnetLoaderGGUF", "inputs": {"unet_name": tm.FILES[name]}}
    else:
        build.prompt[build.model[0]]["inputs"]["unet_name"] = tm.FILES[name]
    latents, log, _ = run(comfy_host, build)
    ref, lora_ref = latents["ref"], latents["lora_ref"]
    assert not torch.equal(ref, lora_ref), "the LoRA changes nothing: the LoRA branches prove nothing"
    mismatches = [
        f"{branch}: {differs(latent, lora_ref if 'lora' in branch else ref)}"
        for branch, latent in latents.items()
        if not torch.equal(latent, lora_ref if "lora" in branch else ref)
    ]
    assert not mismatches, "\n".join(mismatches)
    # Each node's three branches (node, LoRA then node, node then LoRA) loaded a streaming model.
    # (an automatic placement's measuring run also logs what it measured: not a plan line)
    lines = {node: sum("; weights from " in line for line in plan_lines(log, node)) for node in NODES}
    assert lines == dict.fromkeys(NODES, 3), log
