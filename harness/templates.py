"""ComfyUI's official templates run on tiny models: their API prompts as the real frontend makes them, the few changes
tiny models and a CPU need, and what a run produced, for comparing runs bit for bit.

A template (``harness/official_templates.py``) is a UI workflow whose whole pipeline sits in one subgraph. The steps::

    prompt = api_prompt(page, official_template(name))       # the frontend flattens the subgraph ("57:3", ...)
    prompt = for_host(for_tiny_models(prompt), object_info)  # harness/template_prompts.py
    write_template_models(name, models_dir)                   # harness/template_models.py
    run = run_template(host, prompt, prefix)                  # taps added: its outputs compare bit for bit

To compare a run with another (a template with a node inserted), ``same_outputs(reference.outputs, run.outputs)``
lists the outputs that differ: the decoded latents and the decoded frames (PNG), not the lossy video files.

:func:`reference_prompt` does the first two, :func:`run_template` the last. The diffusion-model part of the graph
(loaders, LoRAs, model patches, samplers, their settings) stays the template's.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .big_model import loads_a_big_model, one_at_a_time
from .comfy_client import RunResult
from .comfy_host import ComfyHost
from .template_models import TEMPLATE_FILES
from .template_prompts import Prompt, add_taps, for_host, for_tiny_models


def _frozen(**entries: Any) -> MappingProxyType[str, Any]:
    return MappingProxyType(entries)


@dataclass(frozen=True)
class Template:
    """An official template and what running it on tiny models takes.

    name: its file name without ``.json``; model_class: the ``comfy.supported_models`` class its diffusion model
    is (a host without it skips the template); unused_keys: by ComfyUI version prefix, the suffixes of weights that
    version's loader reports missing although the model runs without them (the real checkpoints lack them too);
    host_limits: by ComfyUI version prefix, why the template cannot run on tiny models there; cannot_run: why it
    cannot run on tiny models anywhere, or None."""

    name: str
    model_class: str
    unused_keys: Mapping[str, tuple[str, ...]] = field(default_factory=_frozen)
    host_limits: Mapping[str, str] = field(default_factory=_frozen)
    cannot_run: str | None = None

    def limit_on(self, version: str) -> str | None:
        """Why the template cannot run on ComfyUI ``version``, or None."""
        return self.cannot_run or next(
            (why for prefix, why in self.host_limits.items() if version.startswith(prefix)), None
        )

    def unused_on(self, version: str) -> tuple[str, ...]:
        """The key suffixes :attr:`unused_keys` gives for ComfyUI ``version``."""
        return tuple(key for prefix, keys in self.unused_keys.items() if version.startswith(prefix) for key in keys)


TEMPLATES: tuple[Template, ...] = (
    # 0.3.75 loads the older scaled_fp8 format with a per-layer input scale its files never had, 1.0 when absent.
    Template("video_wan2_2_14B_t2v", "WAN21_T2V", unused_keys=_frozen(**{"0.3.": (".scale_input",)})),
    # 0.3.75's NextDiT builds a norm_final that Z-Image's forward never uses and its checkpoints lack.
    Template("image_z_image_turbo", "ZImage", unused_keys=_frozen(**{"0.3.": ("norm_final.weight",)})),
    Template(
        "image_qwen_image",
        "QwenImage",
        cannot_run=(
            "Qwen-Image takes 3584-wide text only: its joint_attention_dim (3584) and width (3072) are fixed by "
            "ComfyUI (QwenImageTransformer2DModel's defaults, not read from the checkpoint), and the one ComfyUI text "
            "encoder that gives 3584-wide hidden states is Qwen2.5-VL 7B, whose config ComfyUI fixes (28 layers of "
            "3584, ~7 B parameters: 15 GB in bf16, 8 GB in fp8, 28 GB once cast to fp32 on a CPU). No CLIPLoader type "
            "pads a CLIP to 3584 (sd3 pads to 4096), so no small text encoder can feed it"
        ),
    ),
    Template(
        "image_flux2_text_to_image",
        "Flux2",
        host_limits=_frozen(
            **{
                "0.3.": (
                    "ComfyUI 0.3.75 fixes Flux 2's heads at 48 (0.33 reads them from the width), so its Flux 2 is "
                    "6144 wide: one double and one single block make 2.1 B parameters (8 GB as fp32 on a CPU) and 20 "
                    "steps of it take minutes; the tiny Flux 2 (256 wide) is 0.33's"
                )
            }
        ),
    ),
    Template("image_krea2_turbo_t2i_int8", "Krea2"),
    Template(
        "video_ltx2_3_t2v",
        "LTXAV",
        cannot_run=(
            "LTX-2.3's text encoder loader (LTXAVTextEncoderLoader) builds Gemma 3 12B, whose config ComfyUI fixes "
            "(48 layers of 3840, 12 B parameters), and feeds the LTX-AV model's text connectors its stacked layer "
            "outputs; it is a node of its own, not a CLIPLoader whose type could be changed, so a small text encoder "
            "would mean replacing the template's text-encoder node (with its Gemma LoRA and prompt enhancer)"
        ),
    ),
    Template(
        "video_minimax_h3_t2v",
        "MiniMaxH3",
        cannot_run=(
            "ComfyUI builds MiniMax H3's video VAE at a fixed size whatever the file holds (MiniMaxH3VideoVAE() takes "
            "no config: 2.6 B parameters, 5.2 GB in fp16, 10 GB as fp32 on a CPU), and the template decodes its video "
            "with it; its diffusion model (sizes read from the weights) and text (text_dim read from condition_proj, "
            "so a CLIP-L would do) could be tiny"
        ),
    ),
)
TEMPLATE_BY_NAME: MappingProxyType[str, Template] = MappingProxyType({t.name: t for t in TEMPLATES})
#: The templates with tiny stand-ins, in the issue's priority order.
RUNNABLE: tuple[str, ...] = tuple(t.name for t in TEMPLATES if t.cannot_run is None and t.name in TEMPLATE_FILES)


# ----------------------------------------------------------------------------------------- the frontend's prompt
GRAPH_TO_PROMPT_JS = """
async (workflow) => {
  await window.app.loadGraphData(workflow);
  return (await window.app.graphToPrompt()).output;
}
"""


def api_prompt(page: Any, workflow: Mapping[str, Any]) -> Prompt:
    """The API prompt the real frontend on ``page`` (``harness/browser.py``) queues for the UI ``workflow``: it is
    loaded on the canvas and ``app.graphToPrompt()``'s output returned, subgraphs flattened into ids like "57:3".

    Seeds whose widget says "randomize" are only changed after a prompt is queued, so the prompt holds the
    workflow's own seeds: the same workflow gives the same prompt. A node this frontend has no definition for (a
    node class the host lacks) comes out with class_type None; it gets its type from the workflow here, so that
    ``template_prompts.for_host`` and ``template_prompts.missing_nodes`` can name it."""
    prompt: Prompt = page.evaluate(GRAPH_TO_PROMPT_JS, dict(workflow))
    types = dict(node_types(workflow))
    for node_id, node in prompt.items():
        if node.get("class_type") is None:
            node["class_type"] = types.get(node_id)
    return prompt


def node_types(
    workflow: Mapping[str, Any], graph: Mapping[str, Any] | None = None, path: str = ""
) -> Iterator[tuple[str, str]]:
    """(prompt id, node type) of every node of ``workflow``, subgraph nodes as the frontend numbers them
    ("outer:inner")."""
    subgraphs = {sg["id"]: sg for sg in workflow.get("definitions", {}).get("subgraphs", [])}
    for node in (graph or workflow)["nodes"]:
        node_id = f"{path}{node['id']}"
        if node["type"] in subgraphs:
            yield from node_types(workflow, subgraphs[node["type"]], f"{node_id}:")
        else:
            yield node_id, node["type"]


# ---------------------------------------------------------------------------------------------------- outputs
def _read(path: Path) -> torch.Tensor:
    """An output file's content as a tensor: a latent's floats, an image's or a video's 8-bit pixels ([frames,]
    height, width, channels), without the metadata the files carry."""
    if path.suffix == ".latent":
        from safetensors.torch import load_file

        return load_file(str(path))["latent_tensor"]
    if path.suffix == ".png":
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            return torch.from_numpy(np.array(image.convert("RGB")))
    import av  # ComfyUI's own video dependency
    import numpy as np

    with av.open(str(path)) as container:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    return torch.from_numpy(np.stack(frames))


def run_outputs(result: RunResult) -> dict[str, torch.Tensor]:
    """What ``result``'s run produced, by ``<node id>/<file kind>/<index><file suffix>``: each SaveLatent's latent
    (``template_prompts.add_taps``'s too) and each image's or video's decoded pixels."""
    outputs: dict[str, torch.Tensor] = {}
    folders = {"output": result.output_dir, "temp": result.base_dir / "temp"}
    for node_id, node_out in result.outputs().items():
        for kind, items in node_out.items():
            if not isinstance(items, list):
                continue
            files = [item for item in items if isinstance(item, Mapping) and "filename" in item]
            for index, item in enumerate(files):
                folder = folders.get(str(item.get("type", "output")), result.output_dir)
                path = folder / str(item.get("subfolder", "")) / str(item["filename"])
                outputs[f"{node_id}/{kind}/{index}{path.suffix}"] = _read(path)
    return outputs


#: Outputs encoded lossily: a video's pixels depend on the encoder (libx264, multi-threaded), whose output for the
#: same frames was seen to differ between runs on a loaded CPU; the frames before it are tapped as PNG instead.
LOSSY = (".mp4", ".webm", ".mov", ".webp")


def same_outputs(first: Mapping[str, torch.Tensor], second: Mapping[str, torch.Tensor]) -> list[str]:
    """The outputs in which two runs differ bit for bit (or that one lacks): [] when they are the same. Lossy files
    (:data:`LOSSY`) are left out: their frames are compared as the taps' PNGs."""
    names = sorted(name for name in set(first) | set(second) if not name.endswith(LOSSY))
    return [n for n in names if n not in first or n not in second or not torch.equal(first[n], second[n])]


# ------------------------------------------------------------------------------------------------------ runs
def comfyui_version(comfyui_path: Path) -> str:
    """The version of the ComfyUI in ``comfyui_path`` (its ``comfyui_version.py``)."""
    text = (comfyui_path / "comfyui_version.py").read_text()
    return text.split("__version__ = ")[1].split()[0].strip("\"'")


def has_model_class(comfyui_path: Path, model_class: str) -> bool:
    """Whether the ComfyUI in ``comfyui_path`` defines ``comfy.supported_models.<model_class>`` (read from its
    source: importing comfy would set up ComfyUI in the caller's process)."""
    return f"class {model_class}(" in (comfyui_path / "comfy" / "supported_models.py").read_text()


def why_not_runnable(name: str, comfyui_path: Path) -> str | None:
    """Why template ``name`` cannot run on tiny models on the ComfyUI in ``comfyui_path``, or None."""
    template = TEMPLATE_BY_NAME[name]
    version = comfyui_version(comfyui_path)
    limit = template.limit_on(version)
    if limit is not None:
        return limit
    if not has_model_class(comfyui_path, template.model_class):
        return f"ComfyUI {version} has no {template.model_class} model (comfy.supported_models)"
    return None


def reference_prompt(page: Any, name: str, object_info: Mapping[str, Any]) -> Prompt:
    """The template ``name``'s prompt as the frontend on ``page`` makes it, for the tiny models
    (``template_prompts.for_tiny_models``) and the server whose ``/object_info`` is given
    (``template_prompts.for_host``)."""
    from .official_templates import official_template

    return for_host(for_tiny_models(api_prompt(page, official_template(name))), object_info)


@dataclass(frozen=True)
class TemplateRun:
    """A run of a template's prompt: ComfyUI's result, what it produced (:func:`run_outputs`) and what the server
    logged meanwhile."""

    result: RunResult
    outputs: Mapping[str, torch.Tensor]
    log: str


def run_template(host: ComfyHost, prompt: Prompt, prefix: str, timeout: float = 600.0) -> TemplateRun:
    """Runs ``prompt`` on ``host`` with its decoders tapped (``template_prompts.add_taps``), its files under
    ``prefix``, in the machine's turn where it loads a big model (``harness/big_model.py``), its models unloaded
    after it (the next run loads them again, as a cold prompt does). Two runs of a template are the same when
    :func:`same_outputs` of their outputs is []."""
    with one_at_a_time() if loads_a_big_model(prompt, host.base_dir / "models") else nullcontext():
        start = len(host.log_text())
        result = host.run(add_taps(prompt, prefix), timeout=timeout)
        log = host.log_text()[start:]
        host.free()
    return TemplateRun(result, MappingProxyType(run_outputs(result) if result.ok else {}), log)


#: Warnings ComfyUI's loaders log when a file does not fit the model they built (comfy/model_base.py, comfy/sd.py)
#: or a LoRA key matches no weight (comfy/lora.py).
LOAD_WARNINGS = re.compile(r"^(unet missing|unet unexpected|clip missing|Missing VAE keys|lora key not loaded):? (.*)$")


def load_problems(log: str, unused: tuple[str, ...] = ()) -> list[str]:
    """The loader warnings in ``log`` (:data:`LOAD_WARNINGS`), less the keys ending in one of ``unused`` (weights
    the host builds but never reads, :attr:`Template.unused_keys`)."""
    problems = []
    for line in log.splitlines():
        match = LOAD_WARNINGS.match(line.strip())
        if match is None:
            continue
        try:
            keys = ast.literal_eval(match[2])
        except (ValueError, SyntaxError):  # a single key (lora key not loaded), not a list
            keys = [match[2]]
        left = [k for k in keys if not str(k).endswith(unused)] if isinstance(keys, list) else [keys]
        if left:
            problems.append(f"{match[1]}: {left}")
    return problems
