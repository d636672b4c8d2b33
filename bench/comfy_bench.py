"""This pack against ComfyUI's own offloading, side by side in one process, on real-shaped models.

    .venv/bin/python -m bench.comfy_bench [--models wan14b flux12b qwen20b] [--budgets 0.25 0.5 0.75]
                                         [--cards 8 12 16 24] [--rounds 2] [--steps 20] [--out docs/results]

Each model is built the way ComfyUI builds one from a checkpoint: ``bench/checkpoints.py`` gives every key
and shape of the real file (Wan 2.1 T2V 14B, Flux.1-dev 12B, Qwen-Image 20B) as meta tensors, the host's
own ``comfy.model_detection.model_config_from_unet`` picks the config and classes from them, and the
model it builds gets random bf16 weights N(0, 0.02) in host memory (nothing is downloaded), wrapped in
ComfyUI's ``ModelPatcher``.

``flux12b_fp8`` and ``flux12b_q8_0`` are the same Flux with every Linear weight quantized (the rule of
``harness/tiny_models.py``), each tensor drawn on the device and quantized there: fp8 e4m3 in ComfyUI's
per-layer ``comfy_quant`` format (its scale and config entries beside each weight), handed as a state dict
to the host's ``comfy.sd.load_diffusion_model_state_dict`` (ComfyUI 0.33 loads it as ``QuantizedTensor``);
and GGUF Q8_0, written to a temporary file (the non-quantized tensors in F32) and loaded by city96's
ComfyUI-GGUF's ``Unet Loader (GGUF)`` (``GGMLTensor``), the pack loaded as ComfyUI loads a custom node
(from the host's ``custom_nodes`` or this repo's test host's). A host that cannot load one (0.3.75 has no
per-layer ``comfy_quant``; no ComfyUI-GGUF) skips it and writes why. Budgets, bytes streamed and the lower
bound count the weights as stored (``offload.module_bytes``): quantized data and scales.

Every configuration is loaded, then runs the diffusion model's forward (``apply_model``) on fixed inputs
for ``--steps`` steps, as one generation would; that is a round. Rows of one budget take their rounds in
turn (A B C A B C ...), so a drift of the machine touches them alike, and the group's first row is
measured a second time at the end of each round, as a control. Per row: load plus the first step, the
median of every later step with its min and max, the wall time of a round, peak VRAM, process RSS and
the bytes the pack pinned. Two rows that placed the same blocks the same way must agree within 2 %, or
the run says it is too noisy (``too_noisy`` in the JSON, a line above the table).

Budgets: ``--budgets``, shares of the model's bytes handed to ComfyUI's loader
(``partially_load(device, budget)``, as ``load_models_gpu`` passes its ``lowvram_model_memory``); and
``--cards``, VRAM sizes users own (GiB): a filler allocation leaves exactly that much device memory free
and ComfyUI's own ``load_models_gpu`` decides what to load, as on such a card (CUDA only).

Configurations: fully resident (the reference); every block streamed (Async Block Offload, prefetch 1
and 2); per budget, ComfyUI's partial loading with its async offload on (2 streams, its NVIDIA default)
and off, the pack's nodes (Async Block Offload with the leading blocks that fit, Partial GPU Residency
trailing / strided / auto, the Sequential Offload Wrapper). On ComfyUI 0.33 with CUDA and comfy-aimdo,
each card also gets ComfyUI's Dynamic VRAM and each node on a Dynamic VRAM model (elsewhere those rows
are skipped, and the run's notes say why). The lower bound is max(resident step, bytes that do not fit /
pinned host-to-device bandwidth).

Writes ``<model>.json``, ``<model>.md`` (the table and the issue's targets) and ``<model>.png`` (step
time against the share budgets, one line per method) to ``--out``.

Needs a CUDA device and exits with status 2 without one. ``--smoke`` runs the same code on the CPU with
tiny shapes (the times mean nothing), so the test suite can check the script itself.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import gc
import importlib
import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, TypeVar

import psutil
import torch

from harness import tiny_quantized
from harness.comfy_host import HOST_DIR, REPO, resolve_comfyui_path
from harness.pack import PACK

from bench.checkpoints import CHECKPOINTS, SMOKE_CHECKPOINTS, Checkpoint
from bench.plot import line_chart
from bench.results import (
    AGAIN,
    ALL_STREAMED,
    AUTO,
    CARD,
    COMFYUI,
    GIB,
    RESIDENT,
    SHARE,
    Budget,
    Measurement,
    ModelRun,
    Round,
    markdown,
    series,
    write,
    write_skipped,
)
from bench.timing import h2d_bandwidth_gbps, ms_of_each_call
from block_offload.offload.device import synchronize

NO_CUDA_EXIT = 2
COMMIT_ENV = "BLOCK_OFFLOAD_COMMIT"  # the commit a copy of the checkout was made from, where its .git is not
GGUF_PACK = "ComfyUI-GGUF"
DYNAMIC = "on a Dynamic VRAM model"
COMFYUI_DYNAMIC = f"{COMFYUI}, Dynamic VRAM"


@dataclass
class Comfy:
    """ComfyUI's modules and this pack, imported once."""

    mm: ModuleType
    detection: ModuleType
    patcher: ModuleType
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
    import comfy.model_patcher
    import comfy.sd
    import folder_paths

    # A fresh measurement cache: the automatic placement must measure, as on a first run.
    folder_paths.set_user_directory(str(user_dir))
    nodes = importlib.import_module(f"{PACK}.nodes.offload_nodes")
    offload = importlib.import_module(f"{PACK}.offload")
    return Comfy(
        comfy.model_management,
        comfy.model_detection,
        comfy.model_patcher,
        comfy.sd,
        nodes,
        offload,
        importlib.import_module(f"{PACK}.nodes.blocks").find_blocks,
        no_dynamic_vram,
    )


# -- the model and its inputs -------------------------------------------------------------------


def build_model(comfy: Comfy, shapes: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype, seed: int = 0):
    """A ModelPatcher over the model the host's detection makes of ``shapes``, weights random N(0, 0.02) in
    host memory.

    The model is created with uninitialised weights (ComfyUI's ops skip initialisation) and each weight is
    drawn on ``device``, where random numbers are fast, then copied into place: no second host copy.
    """
    config = comfy.detection.model_config_from_unet(shapes, "")
    if config is None:
        raise RuntimeError("this ComfyUI does not recognise the checkpoint's keys")
    config.set_inference_dtype(dtype, None)
    with layers_with_weights():
        model = config.get_model(shapes, "")
    built = {key: tuple(value.shape) for key, value in model.diffusion_model.state_dict().items()}
    # The keys as ComfyUI's loader hands them to the model (load_model_weights: Flux's norm "scale" -> "weight").
    wanted = {key: tuple(value.shape) for key, value in config.process_unet_state_dict(dict(shapes)).items()}
    if built != wanted:
        # What load_state_dict would report as missing, unexpected or mis-shaped: the host built another model.
        differ = sorted(key for key in built.keys() | wanted.keys() if built.get(key) != wanted.get(key))
        raise RuntimeError(f"the host built a model unlike the checkpoint: {differ[:5]} ({len(differ)} keys)")
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(random_weight(param.shape, generator, device, param.dtype))
    model.eval()
    # Offloading is to host memory, whatever ComfyUI's VRAM state would pick for a model this size.
    return comfy.patcher.ModelPatcher(model, load_device=device, offload_device=torch.device("cpu"))


@contextlib.contextmanager
def layers_with_weights() -> Iterator[None]:
    """With Dynamic VRAM on, ComfyUI 0.33's layers are built without weights until a state dict is loaded (so
    Windows does not commit their memory twice); the classic model here is built with its weights, to draw into."""
    memory = sys.modules.get("comfy.memory_management")
    enabled = getattr(memory, "aimdo_enabled", False)
    if enabled:
        memory.aimdo_enabled = False
    try:
        yield
    finally:
        if enabled:
            memory.aimdo_enabled = True


def random_weight(
    shape: Sequence[int], generator: torch.Generator, device: torch.device, dtype: torch.dtype
) -> torch.Tensor:
    """N(0, 0.02), drawn on ``device``."""
    return torch.randn(tuple(shape), generator=generator, device=device, dtype=dtype).mul_(0.02)


def quantized_weights(
    shapes: dict[str, torch.Tensor],
    device: torch.device,
    dtype: torch.dtype,
    quantize: Callable[[str, torch.Tensor], dict],
) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors, random, in host memory one at a time: each drawn in ``dtype`` on ``device``
    and, where ``tiny_models``' rule quantizes it, replaced by what ``quantize(key, weight)`` makes of it
    there (quantized data, scales, configs by key)."""
    generator = torch.Generator(device=device).manual_seed(0)
    for key, meta in shapes.items():
        weight = random_weight(meta.shape, generator, device, dtype)
        made = quantize(key, weight) if tiny_quantized.quantized(key, weight) else {key: weight}
        yield from ((name, tensor.cpu()) for name, tensor in made.items())


def load_comfy_quant(comfy: Comfy, checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], device: torch.device,
                     dtype: torch.dtype):  # fmt: skip
    """A classic ModelPatcher over what the host's own loader makes of the checkpoint in ComfyUI's per-layer
    ``comfy_quant`` format (``tiny_models``' writer of that format, layer by layer)."""
    layer = tiny_quantized.SAFETENSORS_QUANT[checkpoint.quant].layer
    weights = dict(quantized_weights(shapes, device, dtype, lambda key, w: layer(key.removesuffix(".weight"), w)))
    options = {"dtype": dtype, "load_device": device, "offload_device": torch.device("cpu")}
    return comfy.sd.load_diffusion_model_state_dict(weights, model_options=options, disable_dynamic=True)


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
    """ComfyUI-GGUF's Unet Loader (GGUF) on the checkpoint written as GGUF into ``folder`` (its
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
    return loader().load_unet(path.name)[0]


def load_model(comfy: Comfy, checkpoint: Checkpoint, shapes: dict[str, torch.Tensor], device: torch.device,
               dtype: torch.dtype, folder: Path):  # fmt: skip
    """The classic ModelPatcher the benchmark measures, as the host (and ComfyUI-GGUF) load the checkpoint."""
    if checkpoint.quant is None:
        return build_model(comfy, shapes, device, dtype)
    if checkpoint.is_gguf:
        return load_gguf(checkpoint, shapes, device, folder)
    return load_comfy_quant(comfy, checkpoint, shapes, device, dtype)


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


def dynamic_twin(comfy: Comfy, classic, dtype: torch.dtype):
    """The same weights loaded by ComfyUI 0.33's own loader with Dynamic VRAM on (a ``ModelPatcherDynamic``;
    the weights are assigned, not copied again).

    A node on it builds its twin by running the loader's recipe again (``cached_patcher_init``: with Dynamic
    VRAM's loader, the weights views of the checkpoint file); here there is no file, and a clone of
    ``classic``, the same weights in host memory, stands in for that build: these rows have no file tier
    (every streamed block keeps a host buffer), and no read from disk is in their figures.
    """
    weights = {key: value.detach().clone() for key, value in classic.model.diffusion_model.state_dict().items()}
    dynamic = comfy.sd.load_diffusion_model_state_dict(weights, model_options={"dtype": dtype})
    dynamic.cached_patcher_init = (lambda disable_dynamic=False: classic.clone(), ())
    return dynamic


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
    return inputs


def forward(patcher, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.inference_mode():
        return patcher.model.apply_model(**inputs)


# -- configurations ------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Config:
    """What to load and how: the patcher to load, its budget, ComfyUI's offload streams."""

    method: str
    budget: Budget | None
    prepare: Callable[[], Any]  # -> the ModelPatcher to load
    comfy_streams: int = 2  # ComfyUI's async offload streams (``--async-offload``; 0 = off)

    def again(self) -> Config:
        """The same configuration as a second row: the noise control."""
        return Config(self.method + AGAIN, self.budget, self.prepare, self.comfy_streams)


def _output(node_output) -> Any:
    return node_output.result[0]


@dataclass
class Bases:
    """The models every configuration starts from, and the figures the budgets are worked out from."""

    classic: Any
    dynamic: Any | None  # None: no Dynamic VRAM here
    block_bytes: list[int]
    outside_bytes: int  # weights outside the blocks (embeddings, head), always resident
    activation_bytes: int  # what ComfyUI reserves for sampling beside the weights (its estimate and minimum)


def configs(
    comfy: Comfy, bases: Bases, budgets: list[Budget], rows: Sequence[str] = (), prefetch_choices=(1, 2)
) -> list[list[Config]]:
    """Every configuration whose method starts with one of ``rows`` (all without), in groups that take their
    rounds in turn, one group per budget (the budget-free rows first: the ratios need the resident one);
    each group ends with its first row measured again."""
    nodes = comfy.nodes

    def async_offload(model, resident: int, prefetch: int) -> Callable[[], Any]:
        return lambda: _output(nodes.AsyncBlockOffload.execute(model, resident, prefetch, True))

    def partial(model, weights_budget: int, policy: str) -> Callable[[], Any]:
        return lambda: _output(nodes.PartialGPUResidency.execute(model, weights_budget / GIB, policy, 1, True))

    def sequential(model, weights_budget: int) -> Callable[[], Any]:
        return lambda: _output(
            nodes.SequentialOffloadWrapper.execute(model, "as loaded", weights_budget / GIB, 2, True)
        )

    def leading_that_fit(model, weights_budget: int, prefetch: int) -> Callable[[], Any]:
        # The engine's own budget rule (OffloadPlan.build): as many leading blocks as fit beside the slots.
        room = max(0, weights_budget - bases.outside_bytes)
        fit = comfy.offload.OffloadPlan.build(bases.block_bytes, budget_bytes=room, prefetch=prefetch)
        return async_offload(model, len(fit.resident), prefetch)

    classic = bases.classic
    groups = [
        [Config(RESIDENT, None, classic.clone)]
        + [Config(f"{ALL_STREAMED}, prefetch {p}", None, async_offload(classic, 0, p)) for p in prefetch_choices]
    ]
    for budget in budgets:
        comfyui = [
            Config(f"{COMFYUI}, async offload on", budget, classic.clone, comfy_streams=2),
            Config(f"{COMFYUI}, async offload off", budget, classic.clone, comfy_streams=0),
        ]
        if budget.kind == SHARE:
            weights = budget.nbytes
            pack = [
                Config(
                    f"Async Block Offload, leading blocks that fit, prefetch {p}",
                    budget,
                    leading_that_fit(classic, weights, p),
                )
                for p in prefetch_choices
            ] + [Config(f"Partial GPU Residency, {policy}", budget, partial(classic, weights, policy)) for policy in
                 ("trailing", "strided", "auto")]  # fmt: skip
        else:
            # On a card, ComfyUI's loader grants the weights what its reserve and the activations leave;
            # Partial GPU Residency takes that grant itself (budget 0: automatic), the others need a figure.
            weights = budget.nbytes - bases.activation_bytes
            pack = [
                Config("Async Block Offload, leading blocks that fit, prefetch 1", budget,
                       leading_that_fit(classic, weights, 1)),
                *(Config(f"Partial GPU Residency, {policy}", budget, partial(classic, 0, policy)) for policy in
                  ("strided", "auto")),
            ]  # fmt: skip
        pack.append(Config("Sequential Offload Wrapper, prefetch 2", budget, sequential(classic, weights)))
        dynamic = []
        if budget.kind == CARD and bases.dynamic is not None:
            model = bases.dynamic
            dynamic = [
                Config(COMFYUI_DYNAMIC, budget, model.clone),
                Config(f"Async Block Offload {DYNAMIC}", budget, leading_that_fit(model, weights, 1)),
                Config(f"Partial GPU Residency, auto {DYNAMIC}", budget, partial(model, 0, "auto")),
                Config(f"Sequential Offload Wrapper {DYNAMIC}", budget, sequential(model, weights)),
            ]
        groups.append(comfyui + dynamic + pack)
    chosen = [[c for c in group if not rows or c.method.startswith(tuple(rows))] for group in groups]
    return [[*group, group[0].again()] for group in chosen if group]


T = TypeVar("T")


def interleaved(groups: Sequence[Sequence[T]], rounds: int) -> list[T]:
    """The order rows are measured in: each group's rows in turn, ``rounds`` times (A B C A B C), group after
    group, so a drift of the machine during a group touches all its rows alike."""
    return [row for group in groups for _ in range(rounds) for row in group]


# -- measuring -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placed:
    """What a loaded patcher placed: a summary, a key equal for equal placements, bytes streamed per step,
    overlap, the planner's prediction, and whether it was an automatic placement's measuring run."""

    placement: str
    placement_key: str
    streamed_bytes: int
    overlap: float | None
    predicted_ms: float | None
    measuring: bool
    copied_bytes: int | None = None  # the pack's engine, its last step (its recorder)


def placed(patcher) -> Placed:
    engine = getattr(patcher, "offload_engine", None)
    if engine is None:
        loaded = patcher.loaded_size()
        cast = patcher.model_size() - loaded
        summary = f"{loaded / GIB:.2f} GiB loaded, {cast / GIB:.2f} GiB cast on demand"
        return Placed(summary, "", cast, None, None, False)
    step = engine.recorder.latest()
    plan = engine.plan
    streamed = plan.streamed_bytes if plan is not None else (step.bytes_copied if step else 0)
    key = "" if plan is None else f"resident {sorted(plan.resident)}, prefetch {plan.prefetch}, pin {plan.pin_memory}"
    placement = engine.placement
    overlap = step.overlap if step is not None else None
    copied = step.bytes_copied if step is not None else None
    return Placed(placement.summary, key, streamed, overlap, engine.predicted_ms, placement.measuring, copied)


@contextlib.contextmanager
def card(mm: ModuleType, device: torch.device, budget: Budget | None) -> Iterator[int]:
    """For a card budget, a filler allocation that leaves ``budget.nbytes`` of device memory free while the
    row loads and runs (ComfyUI and comfy-aimdo ask the driver what is free), and ComfyUI's
    ``get_total_memory`` answering the device's memory less the filler, as a card that size would (its
    ``maximum_vram_for_weights``, which the nodes' step-aside rule reads, counts the total); yields the
    filler's bytes."""
    if budget is None or budget.kind != CARD:
        yield 0
        return
    free, _ = torch.cuda.mem_get_info(device)
    if free < budget.nbytes:
        raise ValueError(f"a {budget.nbytes / GIB:g} GiB card: only {free / GIB:.1f} GiB of the device are free")
    filler = torch.empty(free - budget.nbytes, dtype=torch.uint8, device=device)
    filled, total_memory = filler.numel(), mm.get_total_memory

    def card_total(dev=None, torch_total_too=False):
        total = total_memory(dev, torch_total_too)
        return (total[0] - filled, total[1]) if torch_total_too else total - filled

    mm.get_total_memory = card_total
    try:
        yield filled
    finally:
        mm.get_total_memory = total_memory
        del filler
        torch.cuda.empty_cache()


class DevicePeak:
    """The most device memory the process used while it was open, as the driver counts it
    (``cudaMemGetInfo``, sampled every millisecond on a thread), above what was used when it opened: the same
    measure for every row, whoever allocates (torch's allocator, comfy-aimdo's own mappings, cuBLAS)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _used(self) -> int:
        free, total = torch.cuda.mem_get_info(self.device)
        return total - free

    def _sample(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, self._used() - self._base)

    def __enter__(self) -> DevicePeak:
        self._base = self._used()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used() - self._base)


def measure_round(comfy: Comfy, config: Config, inputs: dict, steps: int, need_bytes: int) -> tuple[Round, Placed]:
    """Loads ``config``, runs ``steps`` steps on it and unloads it: one round."""
    device = next(iter(inputs.values())).device
    comfy.mm.NUM_STREAMS = config.comfy_streams  # read by ComfyUI's loader and its casts at call time
    cuda = device.type == "cuda"
    with card(comfy.mm, device, config.budget), DevicePeak(device) if cuda else contextlib.nullcontext() as sampled:
        started = time.perf_counter()
        patcher = config.prepare()
        try:
            if config.budget is not None and config.budget.kind == CARD:
                comfy.mm.load_models_gpu([patcher], memory_required=need_bytes, minimum_memory_required=need_bytes)
            else:
                patcher.partially_load(device, 1e32 if config.budget is None else config.budget.nbytes)
            forward(patcher, inputs)
            synchronize(device)
            first = time.perf_counter()
            step_ms = ms_of_each_call(lambda: forward(patcher, inputs), device, steps - 1)
            wall = time.perf_counter()
            peak = sampled.peak if cuda else None
            engine = getattr(patcher, "offload_engine", None)
            done = Round(
                started,
                (first - started) * 1000,
                tuple(step_ms),
                (wall - started) * 1000,
                peak,
                psutil.Process().memory_info().rss,
                comfy.offload.pinned_bytes(),
                None if engine is None else engine.packing_s * 1000,
                None if engine is None else engine.runner.packed_bytes,
            )
            where = placed(patcher)
        finally:
            comfy.mm.unload_all_models()
            patcher.detach(unpatch_all=True)
            gc.collect()
            if cuda:
                torch.cuda.empty_cache()
    return done, where


def measure_all(
    groups: list[list[Config]],
    rounds: int,
    measure: Callable[[Config], tuple[Round, Placed]],
    out_of_memory: list[str],
) -> list[Measurement]:
    """Every configuration over ``rounds`` interleaved rounds, in the groups' order. An automatic placement
    measures its costs on its first load: that load is a row of its own, before the rounds. A configuration
    out of device memory is dropped (and named in ``out_of_memory``) rather than cost the others."""
    done: dict[Config, list[Round]] = {}
    where: dict[Config, Placed] = {}
    first_runs: dict[Config, Measurement] = {}
    failed: set[Config] = set()

    def attempt(config: Config) -> tuple[Round, Placed] | None:
        try:
            return measure(config)
        except torch.OutOfMemoryError:
            budget = "" if config.budget is None else f" at {config.budget.nbytes / GIB:.2f} GiB ({config.budget.kind})"
            progress(f"{config.method}{budget}: out of device memory")
            out_of_memory.append(config.method + budget)
            failed.add(config)
            return None

    # The costs are kept per device and model, whatever the budget: the first automatic row measures them.
    auto = next((c for group in groups for c in group if c.method == AUTO), None)
    measured = None if auto is None else attempt(auto)
    if measured is not None and measured[1].measuring:
        first_runs[auto] = _measurement(f"{AUTO} (first run: strided, measuring)", auto, [measured[0]], measured[1])
    for config in interleaved(groups, rounds):
        if config in failed:
            continue
        measured = attempt(config)
        if measured is not None:
            done.setdefault(config, []).append(measured[0])
            where[config] = measured[1]
            # Each round's figures as measured, so a run stopped by its time limit still leaves them in its log.
            done_round = measured[0]
            steps = sorted(done_round.step_ms)
            peak = done_round.peak_vram_bytes
            vram = "" if peak is None else f", peak VRAM {peak / GIB:.2f} GiB"
            packing = done_round.packing_ms
            packed = done_round.packed_bytes or 0
            packing_said = "" if packing is None else f" (packing {packed / GIB:.2f} GiB: {packing / 1000:.2f} s)"
            progress(
                f"{config.method}: median {steps[len(steps) // 2] / 1000:.3f} s/step, at most {steps[-1] / 1000:.3f}, "
                f"load + first step {done_round.load_first_ms / 1000:.2f} s{packing_said}{vram}; "
                f"{measured[1].placement}"
            )
    found = []
    for config in (c for group in groups for c in group):
        if config in first_runs:
            found.append(first_runs[config])
        if config in done:
            found.append(_measurement(config.method, config, done[config], where[config]))
    return found


def _measurement(method: str, config: Config, rounds: list[Round], where: Placed) -> Measurement:
    return Measurement(
        method,
        config.budget,
        tuple(rounds),
        where.streamed_bytes,
        where.overlap,
        where.predicted_ms,
        where.placement,
        where.placement_key,
        where.measuring,
        where.copied_bytes,
    )


def run_model(comfy: Comfy, checkpoint: Checkpoint, args: argparse.Namespace, device: torch.device, bandwidth: float,
              folder: Path):  # fmt: skip
    """Every configuration on ``checkpoint``'s model (a GGUF one written into ``folder`` first)."""
    dtype = torch.float32 if args.smoke else torch.bfloat16
    started = time.perf_counter()
    shapes = checkpoint.shapes(dtype)
    classic = load_model(comfy, checkpoint, shapes, device, dtype, folder)
    notes = {}
    if args.no_dynamic_vram:
        notes["Dynamic VRAM rows"] = "skipped: --no-dynamic-vram"
    elif comfy.no_dynamic_vram:
        notes["Dynamic VRAM rows"] = f"skipped: {comfy.no_dynamic_vram}"
    elif checkpoint.is_gguf:
        notes["Dynamic VRAM rows"] = "skipped: ComfyUI-GGUF's loader makes its own classic patcher (GGUFModelPatcher)"
    dynamic = None if "Dynamic VRAM rows" in notes else dynamic_twin(comfy, classic, dtype)
    # As stored (quantized data and scales), as the pack's plan counts them: budgets and lower bounds in these.
    model_bytes = comfy.offload.module_bytes(classic.model.diffusion_model)
    progress(f"{checkpoint.name}: built in {time.perf_counter() - started:.0f} s, {model_bytes / GIB:.2f} GiB")
    inputs = make_inputs(checkpoint, shapes, device)
    blocks = comfy.find_blocks(classic.model.diffusion_model).blocks
    block_bytes = [comfy.offload.module_bytes(block) for _, block in blocks]
    # What the host holds a block's Linear weights as (a quantized model's tensor kind).
    weight = next(w for _, block in blocks for w in block.parameters() if w.dim() == 2)
    notes["block weights"] = f"{type(weight).__name__}, {weight.dtype}"
    # ComfyUI's own estimate of the sampling activations (what its sampler asks load_models_gpu to leave free).
    need = int(classic.model.memory_required(inputs["x"].shape))
    bases = Bases(
        classic, dynamic, block_bytes, model_bytes - sum(block_bytes), need + comfy.mm.minimum_inference_memory()
    )
    budgets = [Budget(SHARE, int(share * model_bytes)) for share in args.budgets]
    if device.type == "cuda":
        budgets += [Budget(CARD, int(gib * GIB)) for gib in args.cards]
    elif args.cards:
        notes["card budgets"] = "skipped: a card is imposed by a filler allocation on a CUDA device"
    out_of_memory: list[str] = []
    measurements = measure_all(
        configs(comfy, bases, budgets, args.rows),
        args.rounds,
        lambda config: measure_round(comfy, config, inputs, args.steps, need),
        out_of_memory,
    )
    comfy.mm.NUM_STREAMS = 2
    meta = run_meta(device, args)
    meta["wall time"] = f"{time.perf_counter() - started:.0f} s"
    meta.update(notes)
    if out_of_memory:
        meta["out of device memory"] = "; ".join(out_of_memory)
    return ModelRun(checkpoint.name, checkpoint.title, model_bytes, bandwidth, measurements, meta)


def run_meta(device: torch.device, args: argparse.Namespace) -> dict[str, str]:
    def output(*command: str) -> str:
        try:
            return subprocess.run(command, capture_output=True, text=True, check=True, cwd=REPO).stdout.strip()
        except (OSError, subprocess.CalledProcessError):
            return "unknown"

    import comfyui_version  # ComfyUI's own, on the path once import_comfy ran

    dirty = output("git", "status", "--porcelain")

    meta = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "driver": output("nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader")
        if device.type == "cuda"
        else "",
        "torch": torch.__version__,
        "ComfyUI": comfyui_version.__version__,
        # The device machine's copy of the checkout may carry an older .git: the commit sent with it is named.
        "commit": os.environ.get(COMMIT_ENV)
        or output("git", "rev-parse", "--short", "HEAD") + (" (with uncommitted changes)" if dirty else ""),
        "command": " ".join(["python -m bench.comfy_bench", *args.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "steps": f"{args.rounds} interleaved rounds of {args.steps} steps (the first step of each is not steady)",
    }
    return {key: value for key, value in meta.items() if value}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(CHECKPOINTS), default=list(CHECKPOINTS))
    parser.add_argument(
        "--budgets", nargs="*", type=float, default=[0.25, 0.5, 0.75], help="shares of the model's bytes"
    )
    parser.add_argument("--cards", nargs="*", type=float, default=[8, 12, 16, 24], help="VRAM sizes in GiB (CUDA)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds per row (each loads the model)")
    parser.add_argument("--steps", type=int, default=20, help="steps per round; all but the first are steady")
    parser.add_argument(
        "--rows",
        nargs="+",
        default=[],
        help="only the methods starting with one of these (a run that must fit "
        "a time limit; fully resident is always needed)",
    )
    parser.add_argument(
        "--no-dynamic-vram",
        action="store_true",
        help="no Dynamic VRAM rows: their model is a second copy of the weights in host memory (about 3x the "
        "model's bytes with the classic one; too much for a 20B model on a 128 GiB machine)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument(
        "--smoke", action="store_true", help="tiny shapes on the CPU: checks the script, times mean nothing"
    )
    args = parser.parse_args(argv)
    args.argv = argv
    if args.budgets and not 0 < min(args.budgets) <= max(args.budgets) < 1:
        parser.error("budgets are shares of the model's bytes, between 0 and 1")
    if args.rows and not any(RESIDENT.startswith(row) for row in args.rows):
        parser.error(f"--rows must keep {RESIDENT!r}: every ratio is to it")
    if args.rounds < 1 or args.steps < 2:
        parser.error("at least 1 round of 2 steps: the first step of a round is not a steady one")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # ComfyUI's and the pack's INFO lines: off
    if not torch.cuda.is_available() and not args.smoke:
        print(
            "comfy_bench: no CUDA device. This benchmark compares GPU offloading and its figures only mean "
            "something on a GPU; run it on a CUDA machine (docs/benchmarks.md). "
            "--smoke runs the same code with tiny shapes on the CPU, to test the script only.",
            file=sys.stderr,
        )
        return NO_CUDA_EXIT
    device = torch.device("cpu") if args.smoke else torch.device("cuda")
    if args.smoke:
        torch.set_num_threads(1)  # tiny shapes: threads only add contention on a shared machine
    with tempfile.TemporaryDirectory(prefix="comfy_bench_user_") as user_dir:
        comfy = import_comfy(args.smoke, Path(user_dir))
        bandwidth = h2d_bandwidth_gbps(device, nbytes=(64 << 20) if args.smoke else (1 << 30))
        for name in args.models:
            checkpoint = (SMOKE_CHECKPOINTS if args.smoke else CHECKPOINTS)[name]
            reason = cannot_load(checkpoint)
            if reason is not None:
                progress(f"{name}: skipped: {reason}")
                data, table = write_skipped(name, checkpoint.title, reason, run_meta(device, args), args.out)
                print(f"wrote {data}, {table}")
                continue
            run = run_model(comfy, checkpoint, args, device, bandwidth, Path(user_dir))
            data, table = write(run, args.out)
            chart = line_chart(
                series(run),
                args.out / f"{run.model}.png",
                title=f"{run.title}: step time vs VRAM budget ({run.meta.get('device', '')})",
                x_label="VRAM budget for the model's weights (GiB)",
                y_label="seconds per step (median)",
            )
            print(markdown(run))
            print(f"wrote {data}, {table}, {chart}")
    return 0


def progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
