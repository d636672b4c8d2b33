"""The changes a template's API prompt (``harness/templates.py``) takes to run on the tiny stand-ins of
``harness/template_models.py`` on a CPU, on either host, and the taps that make its runs comparable bit for bit.

The diffusion-model part of the graph (loaders, LoRAs, model patches, samplers and their settings) is the template's:
:func:`for_tiny_models` changes only what feeds it (text encoding, sizes), :func:`for_host` only how a host without the
frontend's logic nodes gets the same graph, and the rest are what tests switch or add (the LoRA toggle, taps).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

Prompt = dict[str, dict[str, Any]]

#: Width and height of every image and video (64 px: an 8x8 latent, 16 image tokens for the image models).
TINY_SIDE = 64
#: Frames of every video: 5 frames are two latent frames for Wan (its VAE compresses 4 frames into 1 after the first).
TINY_FRAMES = 5
#: CLIPLoader types changed, with why. A lone CLIP-L gives 768-wide hidden states under every type but ``sd3``
#: (zero-padded to 4096) and ``hidream``.
CLIP_TYPE_FOR_TINY: MappingProxyType[str, str] = MappingProxyType(
    {
        # ComfyUI builds every Wan with text_dim 4096 whatever the checkpoint holds (0.3.75 cannot be told otherwise),
        # so the tiny Wan takes 4096-wide text: the CLIP-L's states zero-padded to 4096, which type sd3 makes.
        "wan": "sd3",
    }
)
#: The nodes whose width and height (and length) set the size of the generated latent.
SIZE_NODES = frozenset(
    {
        "EmptyHunyuanLatentVideo",
        "EmptySD3LatentImage",
        "EmptyLatentImage",
        "EmptyFlux2LatentImage",
        "Flux2Scheduler",  # its width and height set the resolution-dependent shift: the latent's
        "EmptyLTXVLatentVideo",
        "MiniMaxH3ImageToVideo",
    }
)
#: Nodes that generate text with the text encoder as a language model (prompt enhancers).
TEXT_GENERATORS = frozenset({"TextGenerate", "TextGenerateLTX2Prompt"})
#: The frontend's logic nodes that ComfyUI 0.3.75 lacks; their outputs are fixed by their widgets, so
#: :func:`fold_switches` can evaluate them in the prompt.
SWITCH = "ComfySwitchNode"
PRIMITIVES = frozenset(
    {"PrimitiveInt", "PrimitiveFloat", "PrimitiveBoolean", "PrimitiveString", "PrimitiveStringMultiline"}
)
#: The decoders :func:`add_taps` taps, and the id prefixes of the nodes it adds.
DECODERS = frozenset({"VAEDecode", "VAEDecodeTiled"})
LATENT_TAP = "tap"
PIXEL_TAP = "pixels"


def is_link(value: Any) -> bool:
    """An API input that is a link: ``[source node id, output slot]``."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def for_tiny_models(prompt: Prompt) -> Prompt:
    """``prompt`` changed to run on the tiny stand-ins of ``harness/template_models.py`` on a CPU; the loaders, LoRAs,
    model patches and samplers and their settings (steps, cfg, seeds, shifts, LoRA strengths) stay the template's.

    * Text encoders: ComfyUI fixes every text encoder's config (comfy/text_encoders/*), so none can be tiny. The
      template's text-encoder file is a full-size CLIP under the template's name. A lone CLIP-L loads as CLIP-L
      (``SD1ClipModel``) whatever the CLIPLoader type, except ``sd3`` and ``hidream`` (comfy/sd.py
      ``load_text_encoder_state_dicts``, its ``# clip_l`` branch), giving 768-wide hidden states, which the tiny
      Z-Image and Flux 2 take (their caption/text widths are read from their weights). A lone CLIP-G likewise
      gives 1280-wide states (``SDXLRefinerClipModel``), which Krea 2 needs: its text fusion has 20 fixed heads,
      so its width (a part of the text width) must be a multiple of 20, which 768 and 4096 are not. Wan is the
      exception: :data:`CLIP_TYPE_FOR_TINY` changes its type (``wan`` -> ``sd3``, see there).
    * Prompt enhancers (TextGenerate, TextGenerateLTX2Prompt) generate text with the text encoder as a language
      model, which a CLIP is not: the switch that would feed their text to the encoder is set to the prompt itself
      (Krea 2's template enhances by default).
    * Sizes: every empty latent (and Flux2Scheduler, whose shift follows the size) is :data:`TINY_SIDE` square and
      a video :data:`TINY_FRAMES` frames long, a constant where the template computes it (the length and size
      nodes are left in the graph, unused).
    * Steps stay the template's: the tiny models take milliseconds to seconds a step.
    """
    prompt = copy.deepcopy(prompt)
    for node in prompt.values():
        inputs, class_type = node["inputs"], node["class_type"]
        if class_type == "CLIPLoader" and inputs.get("type") in CLIP_TYPE_FOR_TINY:
            inputs["type"] = CLIP_TYPE_FOR_TINY[inputs["type"]]
        if class_type in SIZE_NODES:
            for name in ("width", "height"):
                if name in inputs:
                    inputs[name] = TINY_SIDE
            if "length" in inputs:
                inputs["length"] = TINY_FRAMES
        if class_type == SWITCH:
            for branch, choice in (("on_true", False), ("on_false", True)):
                source = inputs.get(branch)
                if is_link(source) and prompt[source[0]]["class_type"] in TEXT_GENERATORS:
                    inputs["switch"] = choice  # the other branch: the prompt as written
    return prompt


def missing_nodes(prompt: Prompt, object_info: Mapping[str, Any]) -> list[str]:
    """The node classes of ``prompt`` the server (its ``/object_info``) lacks, sorted."""
    return sorted({str(node["class_type"]) for node in prompt.values()} - set(object_info))


def output_node_ids(prompt: Prompt, object_info: Mapping[str, Any]) -> list[str]:
    """The ids of ``prompt``'s output nodes (what ComfyUI runs, with what they need)."""
    return [nid for nid, node in prompt.items() if object_info.get(node["class_type"], {}).get("output_node")]


def constant(prompt: Prompt, value: Any) -> Any:
    """``value`` itself, or the widget value of the primitive node it links to; raises where it is computed."""
    if not is_link(value):
        return value
    node = prompt[value[0]]
    if node["class_type"] not in PRIMITIVES:
        raise ValueError(f"{value[0]} ({node['class_type']}) is computed, not a constant")
    return node["inputs"]["value"]


def fold_switches(prompt: Prompt) -> Prompt:
    """``prompt`` with each ComfySwitchNode replaced by the input it selects (its switch is a widget or a primitive
    node): what the node would pass on, so the graph computes the same. ComfyUI 0.3.75 has no ComfySwitchNode."""
    prompt = copy.deepcopy(prompt)
    for switch_id in [nid for nid, node in prompt.items() if node["class_type"] == SWITCH]:
        inputs = prompt.pop(switch_id)["inputs"]
        chosen = inputs["on_true" if constant(prompt, inputs["switch"]) else "on_false"]
        for node in prompt.values():
            for name, value in node["inputs"].items():
                if is_link(value) and value[0] == switch_id:
                    node["inputs"][name] = copy.deepcopy(chosen)
    return prompt


def reachable(prompt: Prompt, outputs: list[str]) -> Prompt:
    """The nodes ``outputs`` depend on (what ComfyUI runs), in ``prompt``'s order; a link to a node not in
    ``prompt`` leads nowhere."""
    needed, todo = set(), list(outputs)
    while todo:
        node_id = todo.pop()
        if node_id not in needed and node_id in prompt:
            needed.add(node_id)
            todo += [v[0] for v in prompt[node_id]["inputs"].values() if is_link(v)]
    return {nid: node for nid, node in prompt.items() if nid in needed}


def for_host(prompt: Prompt, object_info: Mapping[str, Any]) -> Prompt:
    """``prompt`` as it can run on the server whose ``/object_info`` is given: unchanged where the server has every
    node class; else its switches folded (:func:`fold_switches`) and the nodes no output needs dropped (the
    template's unused size and length nodes, the LoRA a switch leaves out), which ComfyUI would not run anyway but
    rejects when it lacks their class. What is still missing, :func:`missing_nodes` names."""
    if not missing_nodes(prompt, object_info):
        return prompt
    folded = fold_switches(prompt) if SWITCH not in object_info else prompt
    return reachable(folded, output_node_ids(folded, object_info))


def switch_primitives(prompt: Prompt, selects: str) -> list[str]:
    """The PrimitiveBoolean nodes that drive a switch one of whose inputs is a ``selects`` node (the templates' "use
    the turbo LoRA" toggle drives the switch between the loader and the LoraLoaderModelOnly)."""
    found = []
    for node in prompt.values():
        if node["class_type"] != SWITCH or not is_link(node["inputs"].get("switch")):
            continue
        branches = [node["inputs"].get(b) for b in ("on_true", "on_false")]
        if any(is_link(b) and prompt[b[0]]["class_type"] == selects for b in branches):
            source = node["inputs"]["switch"][0]
            if prompt[source]["class_type"] == "PrimitiveBoolean" and source not in found:
                found.append(source)
    return found


def with_lora(prompt: Prompt, strength: float | None = None) -> Prompt:
    """``prompt`` with the template's LoRA toggle on (its own setting for the LoRA: Wan's 4-step lightx2v, Flux 2's
    turbo), and every LoraLoaderModelOnly at ``strength`` when given."""
    prompt = copy.deepcopy(prompt)
    toggles = switch_primitives(prompt, "LoraLoaderModelOnly")
    if not toggles:
        raise ValueError("no LoRA toggle in this prompt")
    for node_id in toggles:
        prompt[node_id]["inputs"]["value"] = True
    if strength is not None:
        for node in prompt.values():
            if node["class_type"] == "LoraLoaderModelOnly":
                node["inputs"]["strength_model"] = strength
    return prompt


def add_taps(prompt: Prompt, prefix: str) -> Prompt:
    """``prompt`` with, on each VAE decoder, a SaveLatent of what it decodes (id ``tap:<decoder id>``) and a SaveImage
    of what it decoded (``pixels:<decoder id>``, PNG frames): the sampler's float output, and the pixels before a
    video encoder, lossy and not always the same from run to run, makes a video of them. The runs of a template
    compare bit for bit on these. Every output file's name starts with ``prefix``, so runs do not share names."""
    prompt = copy.deepcopy(prompt)
    for node_id in [nid for nid, node in prompt.items() if node["class_type"] in DECODERS]:
        prompt[f"{LATENT_TAP}:{node_id}"] = {
            "class_type": "SaveLatent",
            "inputs": {"samples": prompt[node_id]["inputs"]["samples"], "filename_prefix": f"{prefix}/latent"},
        }
        prompt[f"{PIXEL_TAP}:{node_id}"] = {
            "class_type": "SaveImage",
            "inputs": {"images": [node_id, 0], "filename_prefix": f"{prefix}/pixels"},
        }
    for node_id, node in prompt.items():
        if "filename_prefix" in node["inputs"] and not node_id.startswith((LATENT_TAP, PIXEL_TAP)):
            node["inputs"]["filename_prefix"] = f"{prefix}/{node['class_type']}"
    return prompt
