"""The tiny checkpoints (harness/tiny_models.py) are real to ComfyUI: its own loaders detect
them as Wan 2.1 / Flux / SD3, the tiny CLIP-L conditions them, a 2-step KSampler-style run
gives finite latents, and each LoRA maps onto the blocks and changes the result.

Everything runs in-process on ComfyUI imported from its folder (on the CPU unless CUDA is
there), with the files generated into a temporary folder once per session.
"""

from __future__ import annotations

import fcntl
import gc
import logging
import re
import shutil
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from conftest import HOST_VERSION

from harness import tiny_models as tm
from harness import tiny_quantized, tiny_specs
from harness.big_model import TINY_FLUX
from harness.inprocess import sample

SEED = 42
STEPS = 2
PROMPT = "a lighthouse on a cliff at dusk"


@pytest.fixture(scope="session")
def comfy(comfyui_path: Path) -> SimpleNamespace:
    """ComfyUI's modules, imported as a library (its loaders, sampler and nodes.py); this module's own
    ``comfy``, in place of conftest's, which is about the pack.

    comfy.cli_args parses no argv when imported this way (comfy.options.args_parsing is off),
    so its defaults would make comfy.model_management look for CUDA at import time; without
    CUDA we set ``args.cpu`` first. If another test imported it already, we take it as it is.
    """
    path = comfyui_path
    # First on sys.path: this repo's own ``nodes`` package must not shadow ComfyUI's nodes.py.
    if str(path) in sys.path:
        sys.path.remove(str(path))
    sys.path.insert(0, str(path))
    from comfy.cli_args import args

    if "comfy.model_management" not in sys.modules and not torch.cuda.is_available():
        args.cpu = True
    import comfy.lora
    import comfy.model_management
    import comfy.sample
    import comfy.sd
    import comfy.utils
    import comfy_extras.nodes_hunyuan
    import comfy_extras.nodes_sd3

    import nodes  # ComfyUI's nodes.py (checked below), not this repo's nodes/ package

    assert Path(nodes.__file__).resolve() == (path / "nodes.py").resolve(), f"wrong nodes module: {nodes.__file__}"

    return SimpleNamespace(
        sd=comfy.sd,
        sample=comfy.sample,
        utils=comfy.utils,
        lora=comfy.lora,
        mm=comfy.model_management,
        nodes=nodes,
        latent_nodes={**vars(comfy_extras.nodes_hunyuan), **vars(comfy_extras.nodes_sd3)},
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """All tiny checkpoints, generated once into a temp folder, removed after this file's tests: 1.2 GB (Flux's
    detected width makes it 1 GB) that the rest of the suite, the other host's beside it, has no use for."""
    folder = tmp_path_factory.mktemp("tiny_models")
    yield tm.generate(folder)
    shutil.rmtree(folder)


@dataclass
class Encoded:
    """What CLIPTextEncode would output for the positive and the empty negative prompt."""

    positive: list[Any]
    negative: list[Any]


@pytest.fixture(scope="module")
def encode(comfy: SimpleNamespace, models: dict[str, Path]) -> Iterator[Any]:
    """encode(clip_type) -> Encoded, via comfy.sd.load_clip as CLIPLoader does (cached per type)."""
    cache: dict[str, Encoded] = {}

    def _encode(clip_type: str) -> Encoded:
        if clip_type not in cache:
            clip = comfy.sd.load_clip([str(models[tm.CLIP_L])], clip_type=getattr(comfy.sd.CLIPType, clip_type.upper()))
            pos, neg = (clip.encode_from_tokens_scheduled(clip.tokenize(text)) for text in (PROMPT, ""))
            cache[clip_type] = Encoded(pos, neg)
        return cache[clip_type]

    yield _encode
    cache.clear()


def _ksample(comfy: SimpleNamespace, model: Any, enc: Encoded, latent: torch.Tensor, cfg: float) -> torch.Tensor:
    """What KSampler does (nodes.common_ksampler): fix the empty latent, seeded noise, sample."""
    latent = comfy.sample.fix_empty_latent_channels(model, latent)
    noise = comfy.sample.prepare_noise(latent, SEED)
    out = comfy.sample.sample(
        model, noise, STEPS, cfg, "euler", "simple", enc.positive, enc.negative, latent, seed=SEED, disable_pbar=True
    )
    return out.float().cpu()


# --- generation ---------------------------------------------------------------------------


def test_generate_writes_every_file(models: dict[str, Path]) -> None:
    # All of them where the writers' packages are installed (ComfyUI 0.33's venv): 0.3.75's has no comfy_kitchen.
    assert set(models) == {name for name in tm.ARTIFACTS if tm.writable(name)}
    for name, path in models.items():
        assert path == path.parent.parent / tm.FOLDERS[name] / tm.FILES[name]
        assert path.is_file() and path.stat().st_size > 0
    assert not list(models[tm.WAN21].parent.parent.rglob("*.tmp")), "a temporary file was left behind"


def test_generate_is_idempotent(models: dict[str, Path]) -> None:
    before = {name: path.stat().st_mtime_ns for name, path in models.items()}
    t0 = time.monotonic()
    again = tm.generate(models[tm.WAN21].parent.parent)
    assert again == models
    assert {name: path.stat().st_mtime_ns for name, path in again.items()} == before
    assert time.monotonic() - t0 < 2.0, "an up-to-date folder should cost only header reads"


@pytest.mark.one_host(reason="the files' lock is the harness's, whatever the ComfyUI")
def test_a_file_another_process_is_writing_is_waited_for_and_not_written_twice(tmp_path: Path) -> None:
    """While another process holds a file's lock (the suites and workers start together), ``generate`` writes the
    other files, then waits for that one and takes it as written."""
    held, other = tm.WAN21_LORA, tm.SD3_LORA
    path = tmp_path / tm.ARTIFACTS[held].relpath
    path.parent.mkdir(parents=True)
    lines: list[str] = []
    with path.with_name(f".{path.name}.lock").open("a") as lock, ThreadPoolExecutor(1) as pool:
        fcntl.flock(lock, fcntl.LOCK_EX)
        generated = pool.submit(tm.generate, tmp_path, only=[held, other], log=lines.append)
        deadline = time.monotonic() + 60
        while not any(line.startswith(f"{other} ") for line in lines):
            assert time.monotonic() < deadline and not generated.done(), lines
            time.sleep(0.05)
        assert not path.exists() and not generated.done(), "the held file was written, or not waited for"
        tm.ARTIFACTS[held].write(path)  # the other process's copy
        written = path.stat().st_mtime_ns
        fcntl.flock(lock, fcntl.LOCK_UN)
        assert generated.result(timeout=60)[held] == path
    assert path.stat().st_mtime_ns == written
    assert [line.endswith(", up to date)") for line in lines if line.startswith(f"{held} ")] == [True], lines


def test_stale_or_broken_file_is_rewritten(tmp_path: Path) -> None:
    path = tmp_path / tm.FOLDERS[tm.SD3_LORA] / tm.FILES[tm.SD3_LORA]
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a safetensors file")
    tm.generate(tmp_path, only=[tm.SD3_LORA])
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        assert f.metadata()[tm.META_VERSION] == tm.GENERATOR_VERSION


def test_generation_is_deterministic(models: dict[str, Path], tmp_path: Path) -> None:
    """Bitwise identical across runs (the small files; Flux and CLIP-L use the same code)."""
    names = [tm.WAN21, tm.SD3, tm.WAN21_LORA, tm.FLUX_LORA, tm.SD3_LORA]
    assert tm.main(["--models-dir", str(tmp_path), "--only", *names]) == 0
    for name in names:
        fresh = tmp_path / tm.FOLDERS[name] / tm.FILES[name]
        assert fresh.read_bytes() == models[name].read_bytes(), name


@pytest.mark.parametrize("name", [tm.WAN21, tm.SD3_LORA])
def test_own_writer_reads_back_with_safetensors(models: dict[str, Path], name: str) -> None:
    from safetensors import safe_open
    from safetensors.torch import load_file

    expected = tm.build_state_dict(tm.ARTIFACTS[name])
    loaded = load_file(str(models[name]))
    assert loaded.keys() == expected.keys()
    for key, tensor in expected.items():
        assert loaded[key].dtype == tensor.dtype and torch.equal(loaded[key], tensor), key
    with safe_open(str(models[name]), framework="pt") as f:
        assert f.metadata() == {
            tm.META_VERSION: tm.GENERATOR_VERSION,
            tm.META_NAME: name,
            "seed": str(tm.ARTIFACTS[name].seed),
        }


# --- text encoder -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("clip_type", "context_dim", "pooled_dim"),
    [("stable_diffusion", 768, 768), ("sd3", 4096, 2048), ("wan", 768, 768)],
)
def test_clip_l_encodes(encode: Any, clip_type: str, context_dim: int, pooled_dim: int) -> None:
    """CLIPLoader + CLIPTextEncode on the tiny CLIP-L: finite [1, 77, C] cond and pooled output.

    With one CLIP-L file, type "sd3" zero-pads the 768-wide hidden states to 4096 (what the
    tiny Wan and SD3 take); every other type but "hidream" gives plain 768-wide CLIP-L output,
    "wan" included: it would not fit the tiny Wan, whose text_dim ComfyUI fixes at 4096.
    """
    enc = encode(clip_type)
    cond, extra = enc.positive[0]
    pooled = extra["pooled_output"]
    assert tuple(cond.shape) == (1, 77, context_dim)
    assert tuple(pooled.shape) == (1, pooled_dim)
    assert torch.isfinite(cond).all() and torch.isfinite(pooled).all()
    assert cond[..., :768].abs().mean() > 0.1, "CLIP-L output should not be near zero"
    assert not torch.equal(cond, enc.negative[0][0]), "prompt and empty prompt encode the same"


def test_clip_types_are_offered_by_cliploader(comfy: SimpleNamespace) -> None:
    offered = comfy.nodes.CLIPLoader.INPUT_TYPES()["required"]["type"][0]
    assert set(tm.CLIP_TYPE.values()) <= set(offered)


# --- diffusion models ---------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """What ComfyUI should make of one tiny diffusion model, and how to sample it."""

    config_class: str  # comfy.supported_models class
    base_class: str  # comfy.model_base class
    unet_class: str  # the diffusion_model module's class
    latent_shape: tuple[int, ...]  # what tm.EMPTY_LATENT_NODE gives for 64x64 (and 5 frames)
    cfg: float


ARCHS: dict[str, Arch] = {
    # EmptyHunyuanLatentVideo(64, 64, length=5): [B, 16, (length - 1) // 4 + 1, H/8, W/8]
    tm.WAN21: Arch("WAN21_T2V", "WAN21", "WanModel", (1, 16, 2, 8, 8), cfg=3.0),
    # EmptySD3LatentImage(64, 64): [B, 16, H/8, W/8]
    tm.FLUX: Arch("Flux", "Flux", "Flux", (1, 16, 8, 8), cfg=1.0),
    tm.SD3: Arch("SD3", "SD3", "OpenAISignatureMMDITWrapper", (1, 16, 8, 8), cfg=3.0),
}


#: A key of one of the diffusion model's blocks: its list (``double_``, ``joint_``, or none) and index.
BLOCK_KEY = re.compile(r"diffusion_model\.(\w+_)?blocks\.(\d+)\.")


def _identity_block(args: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """A "dit" block replacement that passes the streams through unchanged."""
    return {key: args[key] for key in ("img", "txt") if key in args}


def _relative_change(new: torch.Tensor, base: torch.Tensor) -> float:
    return float((new - base).abs().mean() / base.abs().mean())


def _lora_module_count(name: str) -> int:
    return sum(s.key.endswith((".lora_up.weight", ".lora_B.weight")) for s in tm.ARTIFACTS[name].specs())


@pytest.mark.parametrize("name", [pytest.param(n, marks=TINY_FLUX) if n == tm.FLUX else n for n in ARCHS])
def test_diffusion_model(
    comfy: SimpleNamespace, models: dict[str, Path], encode: Any, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    """UNETLoader's path detects the model, every weight is used, sampling is finite, and
    LoraLoaderModelOnly's path patches the blocks and changes the sampled latent."""
    arch = ARCHS[name]
    model = comfy.sd.load_diffusion_model(str(models[name]))
    try:
        assert type(model.model.model_config).__name__ == arch.config_class
        assert type(model.model).__name__ == arch.base_class
        unet = model.model.diffusion_model
        assert type(unet).__name__ == arch.unet_class
        from safetensors import safe_open

        with safe_open(str(models[name]), framework="pt") as f:
            # The names as the model takes them: ComfyUI 0.33's Flux renames the file's "*_norm.scale".
            file_keys = set(model.model.model_config.process_unet_state_dict(dict.fromkeys(f.keys())))
        assert set(unet.state_dict().keys()) == file_keys, "weights missing from or unused by the model"

        enc = encode(tm.CLIP_TYPE[name])
        assert tuple(enc.positive[0][0].shape[1:]) == (77, tm.CONDITIONING_DIMS[name][0])
        size = {"width": 64, "height": 64, "batch_size": 1} | ({"length": 5} if name == tm.WAN21 else {})
        latent = comfy.latent_nodes[tm.EMPTY_LATENT_NODE[name]].execute(**size).result[0]["samples"]
        assert tuple(latent.shape) == arch.latent_shape
        base = _ksample(comfy, model, enc, latent, arch.cfg)
        assert tuple(base.shape) == arch.latent_shape
        assert torch.isfinite(base).all(), "sampling produced NaN/inf"
        assert base.abs().mean() > 1e-3

        # Every block must count, or a block streamed wrongly would go unnoticed: replacing
        # the last block of the ("double_block") list with the identity moves the result.
        last = len(getattr(unet, {"wan21": "blocks", "flux": "double_blocks", "sd3": "joint_blocks"}[name])) - 1
        skipping = model.clone()
        skipping.set_model_patch_replace(_identity_block, "dit", "double_block", last)
        change = _relative_change(_ksample(comfy, skipping, enc, latent, arch.cfg), base)
        assert change > 0.03, f"skipping block {last} changed the latent by only {change:.2%}"

        lora = tm.LORA_FOR[name]
        lora_sd = comfy.utils.load_torch_file(str(models[lora]), safe_load=True)
        with caplog.at_level(logging.WARNING):
            patched, _ = comfy.sd.load_lora_for_models(model, None, lora_sd, 1.0, 0)
        assert "lora key not loaded" not in caplog.text, caplog.text
        # One patch per LoRA module; SD3's to_q/to_k/to_v land on slices of one fused qkv weight.
        assert sum(len(p) for p in patched.patches.values()) == _lora_module_count(lora)
        in_block = [BLOCK_KEY.match(key) for key in patched.patches]
        assert all(in_block), f"a LoRA patch outside the blocks: {sorted(patched.patches)}"
        blocks = {m.groups() for m in map(BLOCK_KEY.match, model.model.state_dict()) if m}
        assert {m.groups() for m in in_block if m} == blocks, "the LoRA should patch every block"
        with_lora = _ksample(comfy, patched, enc, latent, arch.cfg)
        assert torch.isfinite(with_lora).all()
        change = _relative_change(with_lora, base)
        assert change > 0.05, f"LoRA at strength 1.0 changed the latent by only {change:.2%}"
    finally:
        del model
        comfy.mm.unload_all_models()
        gc.collect()


# --- quantized checkpoints ----------------------------------------------------------------

#: ComfyUI 0.33's per-layer formats beyond fp8 e4m3 and plain int8 (tests/test_quantized.py has those): the
#: layout class its loader makes every quantized Linear weight (``QUANT_ALGOS[format]["comfy_tensor_layout"]``),
#: and the layout Params the layer's ``comfy_quant`` config must set.
QUANTIZED_LAYOUTS: dict[str, tuple[str, dict[str, object]]] = {
    tm.WAN21_FP8_E5M2: ("TensorCoreFP8E5M2Layout", {}),
    tm.WAN21_INT8_CONVROT: ("TensorWiseINT8Layout", {"convrot": True, "convrot_groupsize": 256}),
    tm.WAN21_W4A4: (
        "TensorCoreConvRotW4A4Layout",
        {"convrot_groupsize": 256, "quant_group_size": 64, "linear_dtype": "int4"},
    ),
    tm.WAN21_W4A8: ("AsymW4A8Int8Layout", {"group_size": 16, "convrot_groupsize": 256}),
    tm.WAN21_NVFP4: ("TensorCoreNVFP4Layout", {}),
    tm.WAN21_MXFP8: ("TensorCoreMXFP8Layout", {}),
}
NOT_ON_HOST: dict[str, str] = (
    {}
    if not HOST_VERSION.startswith("0.3.")
    else dict.fromkeys(
        QUANTIZED_LAYOUTS,
        "ComfyUI 0.3.75 reads no per-layer comfy_quant entries and has none of these formats "
        "(nor comfy_kitchen, which writes all but fp8 e5m2)",
    )
)


def _stored(weight: Any) -> tuple[dict[str, tuple[torch.dtype, tuple[int, ...], bytes]], dict[str, Any]]:
    """A QuantizedTensor as PyTorch's ``__tensor_flatten__`` sees it: each inner tensor's dtype, shape and
    bytes, and the Params' other fields but ``orig_dtype`` (the model's compute dtype, not stored)."""
    names, context = weight.__tensor_flatten__()
    inner = {}
    for name in names:
        tensor = getattr(weight, name)
        inner[name] = (tensor.dtype, tuple(tensor.shape), tensor.reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
    return inner, {k: v for k, v in context["non_tensor_fields"].items() if k != "orig_dtype"}


@pytest.mark.parametrize("name", list(QUANTIZED_LAYOUTS))
def test_quantized_wan_is_what_comfyui_makes(comfy: SimpleNamespace, models: dict[str, Path], name: str) -> None:
    """ComfyUI 0.33's loader detects the tiny Wan in each of its other per-layer formats and makes every
    Linear weight of the blocks a QuantizedTensor of the format's layout, with the config's options; what it
    holds is bitwise what ComfyUI's own quantizer makes of the fp32 weight; and the model samples finitely,
    close to the fp32 model."""
    if name in NOT_ON_HOST:
        pytest.skip(NOT_ON_HOST[name])
    from comfy.quant_ops import QuantizedTensor

    layout, options = QUANTIZED_LAYOUTS[name]
    source = tm.build_state_dict(tm.ARTIFACTS[tm.WAN21])
    quantized = [
        key for key, tensor in source.items() if key.startswith("blocks.") and tiny_quantized.quantized(key, tensor)
    ]
    assert len(quantized) == 10 * tiny_specs.WAN21_LAYERS  # q, k, v, o of both attentions and the two FFN layers
    model = comfy.sd.load_diffusion_model(str(models[name]))
    try:
        assert type(model.model.model_config).__name__ == ARCHS[tm.WAN21].config_class
        unet = model.model.diffusion_model
        for key in quantized:
            weight = unet.get_submodule(key.removesuffix(".weight")).weight
            assert isinstance(weight, QuantizedTensor), f"{key}: {type(weight).__name__}"
            layout_name = weight.__tensor_flatten__()[1]["layout_cls"]  # the name its layout is registered under
            assert layout_name == layout, f"{key}: {layout_name}"
            assert {field: getattr(weight.params, field) for field in options} == options, key
        # Rounded to nearest, the scales recomputed from the weight, the layout's options taken from the loaded
        # Params: the first block (both FFN shapes) and the 64-row head, whose NVFP4/MXFP8 block scales are padded.
        for key in [*(key for key in quantized if key.startswith("blocks.0.")), "head.head.weight"]:
            weight = unet.get_submodule(key.removesuffix(".weight")).weight
            expected = weight.requantize_from_float(source[key], scale="recalculate")
            assert _stored(weight) == _stored(expected), f"{key}: not what ComfyUI's quantizer makes"

        latent = sample(comfy, model)
        assert torch.isfinite(latent).all(), "sampling produced NaN/inf"
        reference = comfy.sd.load_diffusion_model(str(models[tm.WAN21]))
        change = _relative_change(latent, sample(comfy, reference))
        assert change < 0.2, f"{name} moved the latent {change:.1%} from the fp32 model's"
    finally:
        del model
        comfy.mm.unload_all_models()
        gc.collect()
