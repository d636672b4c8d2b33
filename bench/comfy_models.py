"""ComfyUI in the benchmark's process (``import_comfy``, Dynamic VRAM turned on as its ``main.py`` does), and the
models the benchmark runs, each written as a checkpoint file and loaded from it as users load it: bf16 and fp8
(ComfyUI's per-layer format) safetensors by ComfyUI's own Load Diffusion Model, classic and with Dynamic VRAM,
GGUF Q8_0 by ComfyUI-GGUF; with their inputs (``bench/comfy_bench.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from harness import safetensors_writer, tiny_quantized
from harness.comfy_host import HOST_DIR, resolve_comfyui_path
from harness.pack import PACK

from bench.checkpoints import Checkpoint

GGUF_PACK = "ComfyUI-GGUF"


@dataclass
class Comfy:
    """ComfyUI's modules and this pack, imported once."""

    mm: ModuleType
    detection: ModuleType
    sd: ModuleType
    nodes: ModuleType  # this pack's nodes
    offload: ModuleType  # this pack's engine, as the nodes see it
    find_blocks: Callable[[torch.nn.Module], Any]
    no_dynamic_vram: str | None  # why the Dynamic VRAM rows cannot run here; None: they can


def enable_dynamic_vram() -> str | None:
    """Turns on ComfyUI's Dynamic VRAM as its ``main.py`` does (comfy-aimdo first, before ComfyUI's patcher
    is imported); returns why it cannot be, or None."""
    if not torch.cuda.is_available():
        return "Dynamic VRAM needs CUDA (comfy-aimdo manages device memory through the CUDA driver)"
    if "comfy.memory_management" in sys.modules:
        # Its comfy_aimdo.host_buffer took comfy-aimdo's library when imported: None before init().
        return "ComfyUI's memory management was imported before comfy-aimdo was initialised"
    try:
        import comfy_aimdo.control
    except ImportError as error:
        return f"this ComfyUI has no Dynamic VRAM ({error.name} is missing)"
    comfy_aimdo.control.init()
    try:
        import comfy.memory_management  # ComfyUI 0.33 and later
    except ImportError as error:
        return f"this ComfyUI has no Dynamic VRAM ({error.name} is missing)"
    import comfy.model_management
    import comfy.model_patcher

    if not comfy_aimdo.control.init_devices(d.index for d in comfy.model_management.get_all_torch_devices()):
        return "comfy-aimdo found no device it can manage"
    comfy.model_patcher.CoreModelPatcher = comfy.model_patcher.ModelPatcherDynamic
    comfy.memory_management.aimdo_enabled = True
    return None


def import_comfy(smoke: bool, user_dir: Path) -> Comfy:
    """ComfyUI from $COMFYUI_PATH or the set-up one, and this pack's nodes (``harness/pack.py``)."""
    sys.path.insert(0, str(resolve_comfyui_path()))
    from comfy.cli_args import args

    if smoke:
        args.cpu = True
        os.environ["BLOCK_OFFLOAD_ALLOW_CPU"] = "1"
    no_dynamic_vram = "smoke runs on the CPU" if smoke else enable_dynamic_vram()
    import comfy.model_detection
    import comfy.model_management
    import comfy.sd
    import folder_paths

    # A fresh measurement cache: the automatic placement must measure, as on a first run.
    folder_paths.set_user_directory(str(user_dir))
    nodes = importlib.import_module(f"{PACK}.nodes.offload_nodes")
    offload = importlib.import_module(f"{PACK}.offload")
    return Comfy(
        comfy.model_management,
        comfy.model_detection,
        comfy.sd,
        nodes,
        offload,
        importlib.import_module(f"{PACK}.nodes.blocks").find_blocks,
        no_dynamic_vram,
    )


def write_checkpoint(checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], device: torch.device,
                     dtype: torch.dtype, folder: Path) -> Path:  # fmt: skip
    """The checkpoint as a safetensors file in ``folder``, as users download one (``quantized_weights``: random,
    its Linear weights in ``checkpoint.quant`` where that names one of ComfyUI's per-layer formats), written one
    layer at a time: no copy of the model in host memory."""
    path = folder / f"{checkpoint.name}.safetensors"
    quantize = None
    if checkpoint.quant is not None:
        quant = tiny_quantized.SAFETENSORS_QUANT[checkpoint.quant]
        if quant.config_in_metadata or quant.markers:
            raise ValueError(f"{checkpoint.quant}: the benchmark writes ComfyUI's per-layer formats only")
        quantize = layer_quantizer(quant, checkpoint.quantized_under)
    # What each key is written as (a quantized layer: its data, scale and config), shapes from the meta device.
    written_from, layout = {}, []
    for key, meta in shapes.items():
        for name, tensor in as_written(key, torch.empty(meta.shape, dtype=dtype, device="meta"), quantize).items():
            written_from[name] = key
            layout.append((name, tensor.dtype, tuple(tensor.shape)))
    drawn: dict[str, torch.Tensor] = {}

    def tensor_for(name: str) -> torch.Tensor:
        if name not in drawn:
            key = written_from[name]
            drawn.update(quantized_weights({key: shapes[key]}, device, dtype, quantize))
        return drawn.pop(name)

    safetensors_writer.save_safetensors(path, layout, tensor_for, dict(checkpoint.metadata))
    return path


def layer_quantizer(
    quant: tiny_quantized.SafetensorsQuant, under: tuple[str, ...] = ()
) -> Callable[[str, torch.Tensor], dict]:
    """``quantized_weights``' ``quantize`` for a per-layer format: a weight's key to its layer's tensors; only keys
    starting with one of ``under`` where it names some, the others kept as they are."""

    def quantize(key: str, weight: torch.Tensor) -> dict:
        if under and not key.startswith(under):
            return {key: weight}
        return quant.layer(key.removesuffix(".weight"), weight)

    return quantize


@contextlib.contextmanager
def dynamic_vram_off() -> Iterator[None]:
    """ComfyUI as started with ``--disable-dynamic-vram`` while the block lasts, in a process where the benchmark
    turned Dynamic VRAM on: the file read into memory of the process, layers built with their weights."""
    memory = sys.modules.get("comfy.memory_management")
    enabled = getattr(memory, "aimdo_enabled", False)
    if enabled:
        memory.aimdo_enabled = False
    try:
        yield
    finally:
        if enabled:
            memory.aimdo_enabled = True


def load_file(comfy: Comfy, path: Path, device: torch.device, dtype: torch.dtype, dynamic: bool):
    """ComfyUI's Load Diffusion Model on ``path``: with ``dynamic``, as ComfyUI 0.33 runs by default on NVIDIA
    (a ``ModelPatcherDynamic`` whose weights are views of the file's mapping, read as they are needed); else as
    with ``--disable-dynamic-vram`` (the classic ``ModelPatcher``, every weight copied into host memory).
    Offloading is to host memory, whatever ComfyUI's VRAM state would pick for a model this size."""
    options = {"dtype": dtype, "load_device": device, "offload_device": torch.device("cpu")}
    if dynamic:
        model = comfy.sd.load_diffusion_model(str(path), model_options=options)
    else:
        loader = comfy.sd.load_diffusion_model
        classic = {"disable_dynamic": True} if "disable_dynamic" in inspect.signature(loader).parameters else {}
        with dynamic_vram_off():
            model = loader(str(path), model_options=options, **classic)
    model.model.eval()
    return model


def check_built(comfy: Comfy, model, shapes: dict[str, torch.Tensor]) -> None:
    """Raises if the host built a model other than the checkpoint's: ComfyUI's loader only logs the keys it
    found missing or unexpected, and would run on uninitialised weights."""
    config = comfy.detection.model_config_from_unet(shapes, "")
    built = {key: tuple(value.shape) for key, value in model.model.diffusion_model.state_dict().items()}
    # The keys as ComfyUI's loader hands them to the model (load_model_weights: Flux's norm "scale" -> "weight").
    wanted = {key: tuple(value.shape) for key, value in config.process_unet_state_dict(dict(shapes)).items()}
    if built != wanted:
        differ = sorted(key for key in built.keys() | wanted.keys() if built.get(key) != wanted.get(key))
        raise RuntimeError(f"the host built a model unlike the checkpoint: {differ[:5]} ({len(differ)} keys)")


def random_weight(
    shape: Sequence[int], generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """N(0, 0.02), drawn on ``device``."""
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype).mul_(0.02)


def quantized_weights(
    shapes: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    quantize: Callable[[str, torch.Tensor], dict] | None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, random, in host memory one at a time: each drawn in ``dtype`` on ``device``
    (seeded by its key: the same tensor in any order) and, where ``tiny_models``' rule quantizes it, replaced by
    what ``quantize(key, weight)`` makes of it there (quantized data, scales, configs by key)."""
    for key, meta in shapes.items():
        generator = torch.Generator(device=device).manual_seed(zlib.crc32(key.encode()))
        weight = random_weight(meta.shape, generator, device, dtype)
        yield from ((name, tensor.cpu()) for name, tensor in as_written(key, weight, quantize).items())


def as_written(key: str, weight: torch.Tensor, quantize: Callable[[str, torch.Tensor], dict] | None) -> dict:
    """``weight`` as the checkpoint holds it: what ``quantize`` makes of it where ``tiny_models``' rule
    quantizes it, else itself."""
    if quantize is not None and tiny_quantized.quantized(key, weight):
        return quantize(key, weight)
    return {key: weight}


def q8_0(weight: torch.Tensor) -> torch.Tensor:
    """GGML Q8_0 blocks of ``weight`` (rows a multiple of 32 long) as the bytes GGUF stores, on its device:
    per 32 values an fp16 scale ``d`` (their largest magnitude / 127) and 32 int8 rounded away from zero,
    as the ``gguf`` package quantizes (on the CPU, minutes for 12B values; here, seconds on a GPU)."""
    blocks = weight.float().reshape(-1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    scaled = blocks * torch.where(d == 0, 0, 1 / d)
    quants = (scaled.sign() * (scaled.abs() + 0.5).floor()).to(torch.int8)
    packed = torch.cat([d.half().view(torch.uint8), quants.view(torch.uint8)], dim=1)
    return packed.reshape(weight.shape[0], -1)


def import_gguf_loader() -> type:
    """ComfyUI-GGUF's ``UnetLoaderGGUF``, its pack loaded as ComfyUI loads a custom node
    (``nodes.load_custom_node``) from the host's ``custom_nodes`` or this repo's test host's; raises
    LookupError saying why it cannot be."""
    import folder_paths

    import nodes as comfy_nodes  # ComfyUI's

    if importlib.util.find_spec("gguf") is None:
        raise LookupError("the gguf package is not installed (requirements-dev.txt)")
    folders = [*folder_paths.get_folder_paths("custom_nodes"), str(HOST_DIR / "custom_nodes")]
    found = next((Path(f) / GGUF_PACK for f in folders if (Path(f) / GGUF_PACK / "nodes.py").is_file()), None)
    if found is None:
        raise LookupError(f"{GGUF_PACK} is in none of {folders}")
    if "UnetLoaderGGUF" not in comfy_nodes.NODE_CLASS_MAPPINGS:
        asyncio.run(comfy_nodes.load_custom_node(str(found)))
    if "UnetLoaderGGUF" not in comfy_nodes.NODE_CLASS_MAPPINGS:
        raise LookupError(f"ComfyUI did not load {found} (its log says why)")
    return comfy_nodes.NODE_CLASS_MAPPINGS["UnetLoaderGGUF"]


def load_gguf(checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], device: torch.device, folder: Path):
    """The file, and ComfyUI-GGUF's Unet Loader (GGUF) on the checkpoint written as GGUF into ``folder`` (its
    architecture, the Linear weights in Q8_0, the one GGML type written here, the rest in F32, as its
    convert.py writes them)."""
    import folder_paths
    import gguf

    loader = import_gguf_loader()
    qtype = gguf.GGMLQuantizationType.Q8_0
    path = folder / f"{checkpoint.name}.gguf"
    writer = gguf.GGUFWriter(path, arch=checkpoint.gguf_arch)
    for key, tensor in quantized_weights(shapes, device, torch.float32, lambda key, w: {key: q8_0(w)}):
        writer.add_tensor(key, tensor.numpy(), raw_dtype=qtype if tensor.dtype == torch.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    folder_paths.add_model_folder_path("diffusion_models", str(folder))
    return path, loader().load_unet(path.name)[0]


def load_model(comfy: Comfy, checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], device: torch.device,
               dtype: torch.dtype, folder: Path) -> tuple[Path, Any]:  # fmt: skip
    """The checkpoint written as its file into ``folder``, and the classic ModelPatcher the benchmark measures:
    the host's Load Diffusion Model (with ``--disable-dynamic-vram``) on it, or ComfyUI-GGUF's."""
    if checkpoint.is_gguf:
        return load_gguf(checkpoint, shapes, device, folder)
    path = write_checkpoint(checkpoint, shapes, device, dtype, folder)
    classic = load_file(comfy, path, device, dtype, dynamic=False)
    if checkpoint.quant is None:
        check_built(comfy, classic, shapes)
    return path, classic


def cannot_load(checkpoint: Checkpoint) -> str | None:
    """Why this host cannot load ``checkpoint`` as its format's tensors, or None."""
    import comfy.utils

    if checkpoint.is_gguf:
        try:
            import_gguf_loader()
        except LookupError as error:
            return f"ComfyUI-GGUF cannot be loaded: {error}"
    elif checkpoint.quant is not None and not hasattr(comfy.utils, "detect_layer_quantization"):
        return "this ComfyUI reads no per-layer comfy_quant entries (0.3.75 reads only a file's _quantization_metadata)"
    return None


def make_inputs(checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], device: torch.device, seed: int = 1):
    """One denoising step's keyword arguments for ``BaseModel.apply_model``."""
    generator = torch.Generator(device=device).manual_seed(seed)
    inputs = {
        name: torch.randn(shape, generator=generator, device=device)
        for name, shape in checkpoint.input_shapes(shapes).items()
    }
    inputs["t"] = torch.full((1,), 0.5, device=device)
    if checkpoint.guidance:
        inputs["guidance"] = torch.full((1,), 3.5, device=device)
    if checkpoint.latent_shapes:
        inputs["latent_shapes"] = [torch.Size(shape) for shape in checkpoint.latent_shapes]
    return inputs


def forward(patcher, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return patcher.model.apply_model(**inputs)
