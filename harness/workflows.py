"""The example workflows: one source of truth, written out in both of ComfyUI's formats.

Each workflow is defined once below, as Python data in ComfyUI's API format (node id ->
``{"class_type", "inputs", "_meta": {"title"}}``, a link being ``[node id, output slot]``).
:func:`to_ui` converts one into the graph format the frontend loads (nodes with sockets,
widgets and positions, plus a links table); the widget order comes from ComfyUI's own
``/object_info``, so nothing about the nodes is restated here. Running ::

    .venv-0.33.0/bin/python -m harness.workflows   # starts ComfyUI 0.33.0 (with this pack) to ask /object_info
    python -m harness.workflows --url http://127.0.0.1:8188   # or asks a running one

writes ``example_workflows/<name>.json`` (UI format, what ComfyUI offers as a template) and
``example_workflows/api/<name>.json`` (API format, what ``POST /prompt`` and scripts/demo.py
take). The committed files follow the node definitions of ComfyUI ``GENERATED_FOR`` (what users
run now); tests/test_workflows.py checks on that host that they equal what this produces, and on
every host that the frontend loads them and the server runs them.

The workflows use the tiny random-weight models of harness/tiny_models.py, so they run on a
CPU in seconds: 2 euler steps, a fixed seed, a small latent, SaveLatent as output (no VAE).
Swap in real models (and a VAE decode) to use them for real.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from . import tiny_models as tm

#: The ComfyUI whose /object_info the committed workflows are written from. Its SaveLatent also
#: returns the latent (an output 0.3.75's lacks; unconnected here, so both frontends load the graphs).
GENERATED_FOR = "0.33.0"

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "example_workflows"

Prompt = dict[str, dict[str, Any]]
ObjectInfo = Mapping[str, Mapping[str, Any]]

SEED = 42
STEPS = 2
SAMPLER = "euler"
SCHEDULER = "simple"
#: Input types the frontend draws as a widget rather than a socket (a list type is a V1 combo).
WIDGET_TYPES = frozenset({"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO"})
#: Value of the extra widget the frontend adds after an input marked ``control_after_generate``.
CONTROL_AFTER_GENERATE = "fixed"


def _node(class_type: str, title: str, **inputs: Any) -> dict[str, Any]:
    return {"class_type": class_type, "inputs": inputs, "_meta": {"title": title}}


def text_to_latent(
    arch: str,
    offload: tuple[str, str, dict[str, Any]],
    latent: dict[str, Any],
    cfg: float,
    prefix: str,
    loader: tuple[str, str, dict[str, Any]] | None = None,
) -> Prompt:
    """loader -> offload node -> KSampler -> SaveLatent, conditioned by the tiny CLIP-L.

    ``offload`` and ``loader`` are (class_type, title, widget inputs), the loader by default Load
    Diffusion Model with ``arch``'s tiny checkpoint; ``latent`` the empty-latent node's inputs.
    """
    label = {tm.WAN21: "Wan 2.1", tm.FLUX: "Flux", tm.SD3: "SD3"}[arch]
    offload_class, offload_title, offload_inputs = offload
    loader_class, loader_title, loader_inputs = loader or (
        "UNETLoader",
        f"Load Diffusion Model (tiny {label})",
        {"unet_name": tm.FILES[arch], "weight_dtype": "default"},
    )
    latent_class = tm.EMPTY_LATENT_NODE[arch]
    return {
        "1": _node(loader_class, loader_title, **loader_inputs),
        "2": _node(offload_class, offload_title, model=["1", 0], **offload_inputs),
        "3": _node(
            "CLIPLoader",
            "Load CLIP (tiny CLIP-L)",
            clip_name=tm.CLIP_L_FILE,
            type=tm.CLIP_TYPE[arch],
            device="default",
        ),
        "4": _node("CLIPTextEncode", "Positive prompt", text="a lighthouse on a cliff at dusk", clip=["3", 0]),
        "5": _node("CLIPTextEncode", "Negative prompt", text="", clip=["3", 0]),
        "6": _node(latent_class, "Empty latent", **latent),
        "7": _node(
            "KSampler",
            f"KSampler ({STEPS} steps)",
            model=["2", 0],
            seed=SEED,
            steps=STEPS,
            cfg=cfg,
            sampler_name=SAMPLER,
            scheduler=SCHEDULER,
            positive=["4", 0],
            negative=["5", 0],
            latent_image=["6", 0],
            denoise=1.0,
        ),
        "8": _node("SaveLatent", "Save latent", samples=["7", 0], filename_prefix=f"block_offload/{prefix}"),
    }


def async_block_offload_wan21_t2v() -> Prompt:
    """Wan 2.1 text-to-video: one block stays on the GPU (the planner's pick, once measured), four stream."""
    return text_to_latent(
        tm.WAN21,
        (
            "AsyncBlockOffload",
            "Async Block Offload",
            {"resident_blocks": 1, "prefetch_blocks": 1, "pin_memory": True, "policy": "auto"},
        ),
        {"width": 32, "height": 32, "length": 5, "batch_size": 1},
        cfg=6.0,
        prefix="async_block_offload_wan21_t2v",
    )


def partial_gpu_residency_flux_t2i() -> Prompt:
    """Flux text-to-image under a 0.1 GiB budget: less than the weights outside the blocks, so every
    block streams (a real budget, say 8 GiB for Flux dev on a 12 GiB card, keeps some resident).
    0.1 rather than anything smaller: the widget steps by 0.1, so the frontend would show less as 0.0,
    which means "automatic"."""
    return text_to_latent(
        tm.FLUX,
        (
            "PartialGPUResidency",
            "Partial GPU Residency",
            {"vram_budget_gb": 0.1, "policy": "strided", "prefetch_blocks": 1, "pin_memory": True},
        ),
        {"width": 32, "height": 32, "batch_size": 1},
        cfg=1.0,  # Flux dev is guidance-distilled: no negative pass
        prefix="partial_gpu_residency_flux_t2i",
    )


def sequential_offload_wrapper_sd3_t2i() -> Prompt:
    """SD3 text-to-image, streamed module by module with the weights kept as loaded."""
    return text_to_latent(
        tm.SD3,
        (
            "SequentialOffloadWrapper",
            "Sequential Offload Wrapper",
            {"storage_dtype": "as loaded", "vram_limit_gb": 0.0, "prefetch_modules": 1, "pin_memory": True},
        ),
        {"width": 64, "height": 64, "batch_size": 1},
        cfg=4.0,
        prefix="sequential_offload_wrapper_sd3_t2i",
    )


def partial_gpu_residency_wan21_gguf_t2v() -> Prompt:
    """Wan 2.1 from a GGUF file (Q4_K) loaded by city96's ComfyUI-GGUF (Unet Loader (GGUF)), its blocks
    streamed as they are stored, quantized, and dequantized by ComfyUI-GGUF as each layer runs. The
    tiny Q4_K file is 3 MiB, so only a budget of a few MiB makes its blocks stream: the widget shows
    0.001 GiB as 0.0, but queues it as is. For a real model give the budget your card has for it
    (say 6 GiB of an 8 GiB card for a 10 GiB Wan 14B Q4_K)."""
    return text_to_latent(
        tm.WAN21,
        (
            "PartialGPUResidency",
            "Partial GPU Residency",
            {"vram_budget_gb": 0.001, "policy": "strided", "prefetch_blocks": 1, "pin_memory": True},
        ),
        {"width": 32, "height": 32, "length": 5, "batch_size": 1},
        cfg=6.0,
        prefix="partial_gpu_residency_wan21_gguf_t2v",
        loader=("UnetLoaderGGUF", "Unet Loader (GGUF) (tiny Wan 2.1, Q4_K)", {"unet_name": tm.FILES[tm.WAN21_Q4_K]}),
    )


#: name -> builder of its API-format prompt; the files are example_workflows/<name>.json and api/<name>.json.
WORKFLOWS: dict[str, Callable[[], Prompt]] = {
    f.__name__: f
    for f in (
        async_block_offload_wan21_t2v,
        partial_gpu_residency_flux_t2i,
        sequential_offload_wrapper_sd3_t2i,
        partial_gpu_residency_wan21_gguf_t2v,
    )
}


# ----------------------------------------------------------------------- API -> UI format
def is_link(value: Any) -> bool:
    """An API-format input value that is a link: ``[node id (str), output slot (int)]``."""
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and isinstance(value[1], int)


def input_specs(info: Mapping[str, Any]) -> list[tuple[str, Any, dict[str, Any]]]:
    """A node's inputs as (name, type, options), required then optional, in ``input_order``
    (hidden inputs are not part of the graph)."""
    specs = []
    order = info.get("input_order") or {s: list(info["input"].get(s, {})) for s in ("required", "optional")}
    for section in ("required", "optional"):
        for name in order.get(section, []):
            spec = info["input"][section][name]
            options = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
            specs.append((name, spec[0], options))
    return specs


def is_widget(input_type: Any, options: Mapping[str, Any]) -> bool:
    return (isinstance(input_type, list) or input_type in WIDGET_TYPES) and not options.get("forceInput", False)


def _default(input_type: Any, options: Mapping[str, Any]) -> Any:
    if "default" in options:
        return options["default"]
    choices = input_type if isinstance(input_type, list) else options.get("options")
    if choices:
        return choices[0]
    return {"INT": 0, "FLOAT": 0.0, "STRING": "", "BOOLEAN": False}.get(input_type)


def _topological(prompt: Prompt) -> list[str]:
    """Node ids in execution order (Kahn's algorithm, ties broken by numeric id)."""
    deps = {nid: {v[0] for v in node["inputs"].values() if is_link(v)} for nid, node in prompt.items()}
    order: list[str] = []
    done: set[str] = set()
    while len(order) < len(prompt):
        ready = sorted((n for n in prompt if n not in done and deps[n] <= done), key=int)
        if not ready:
            raise ValueError(f"the workflow has a cycle among {sorted(set(prompt) - done)}")
        order.append(ready[0])
        done.add(ready[0])
    return order


def _depths(prompt: Prompt, order: list[str]) -> dict[str, int]:
    """Column of each node: the longest chain of links that leads to it."""
    depth: dict[str, int] = {}
    for nid in order:
        sources = [v[0] for v in prompt[nid]["inputs"].values() if is_link(v)]
        depth[nid] = 1 + max((depth[s] for s in sources), default=-1)
    return depth


def _size(sockets: int, outputs: int, widgets: int, multiline: bool) -> list[int]:
    width = 400 if multiline else 315
    height = 30 + 20 * max(sockets, outputs) + 24 * widgets + (80 if multiline else 0)
    return [width, max(height, 60)]


def to_ui(prompt: Prompt, object_info: ObjectInfo) -> dict[str, Any]:
    """The frontend's graph format (version 0.4) of an API-format ``prompt``.

    Sockets and widgets follow ``object_info``; a widget the prompt leaves out takes its
    default, and an input marked ``control_after_generate`` (KSampler's seed) is followed by
    that widget's value, "fixed". Nodes are laid out in columns by their distance from the loaders.
    """
    missing = sorted({n["class_type"] for n in prompt.values()} - set(object_info))
    if missing:
        raise KeyError(f"/object_info lists no {', '.join(missing)}; is the pack (or ComfyUI) too old?")
    order = _topological(prompt)
    depth = _depths(prompt, order)
    nodes: dict[str, dict[str, Any]] = {}
    links: list[list[Any]] = []
    for nid in sorted(prompt, key=int):
        node = prompt[nid]
        info = object_info[node["class_type"]]
        given = node["inputs"]
        specs = input_specs(info)
        known = {name for name, _, _ in specs}
        unknown = sorted(set(given) - known)
        if unknown:
            raise KeyError(f"node {nid} ({node['class_type']}) has no input(s) {unknown}")
        inputs, widgets_values, multiline = [], [], False
        for name, input_type, options in specs:
            value = given.get(name)
            if is_widget(input_type, options):
                if is_link(value):
                    raise ValueError(f"node {nid}: widget input {name!r} driven by a link is not supported here")
                widgets_values.append(_default(input_type, options) if name not in given else value)
                if options.get("control_after_generate"):
                    widgets_values.append(CONTROL_AFTER_GENERATE)
                multiline = multiline or bool(options.get("multiline"))
            else:
                slot = {"name": name, "type": input_type, "link": None}
                if is_link(value):
                    slot["link"] = len(links) + 1
                    links.append([len(links) + 1, int(value[0]), value[1], int(nid), len(inputs), input_type])
                elif value is not None:
                    raise ValueError(f"node {nid}: socket input {name!r} must be a link, got {value!r}")
                inputs.append(slot)
        outputs = [
            {"name": out_name, "type": out_type, "links": [], "slot_index": i}
            for i, (out_type, out_name) in enumerate(zip(info["output"], info["output_name"], strict=True))
        ]
        ui: dict[str, Any] = {
            "id": int(nid),
            "type": node["class_type"],
            "pos": [0, 0],
            "size": _size(len(inputs), len(outputs), len(widgets_values), multiline),
            "flags": {},
            "order": order.index(nid),
            "mode": 0,
            "inputs": inputs,
            "outputs": outputs,
            "properties": {"Node name for S&R": node["class_type"]},
            "widgets_values": widgets_values,
        }
        title = node.get("_meta", {}).get("title")
        if title and title != info.get("display_name", node["class_type"]):
            ui["title"] = title
        nodes[nid] = ui
    for link_id, origin, slot, _target, _target_slot, _type in links:
        nodes[str(origin)]["outputs"][slot]["links"].append(link_id)
    # Columns by depth; within a column, top to bottom in id order.
    column_y: dict[int, int] = {}
    for nid in sorted(prompt, key=int):
        col = depth[nid]
        y = column_y.get(col, 50)
        nodes[nid]["pos"] = [50 + 450 * col, y]
        column_y[col] = y + nodes[nid]["size"][1] + 60
    return {
        "last_node_id": max(int(n) for n in prompt),
        "last_link_id": len(links),
        "nodes": [nodes[nid] for nid in sorted(prompt, key=int)],
        "links": links,
        "groups": [],
        "config": {},
        "extra": {"ds": {"scale": 1.0, "offset": [0, 0]}},
        "version": 0.4,
    }


# ----------------------------------------------------------------------------- the files
def render(object_info: ObjectInfo) -> dict[str, str]:
    """File name -> file text, for every workflow in both formats."""
    files: dict[str, str] = {}
    for name, build in WORKFLOWS.items():
        prompt = build()
        files[f"{name}.json"] = dump(to_ui(copy.deepcopy(prompt), object_info))
        # ComfyUI lists every example_workflows/*.json as a template; API twins sit one folder down.
        files[f"api/{name}.json"] = dump(prompt)
    return files


def dump(data: Any) -> str:
    return json.dumps(data, indent=2) + "\n"


def write(object_info: ObjectInfo, out_dir: Path = OUT_DIR) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for filename, text in render(object_info).items():
        path = out_dir / filename
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
        paths.append(path)
    return paths


def fetch_object_info(url: str | None) -> dict[str, Any]:
    """``/object_info`` of the server at ``url``, or of a ComfyUI started (and stopped) for it."""
    import requests

    if url:
        resp = requests.get(url.rstrip("/") + "/object_info", timeout=60)
        resp.raise_for_status()
        return dict(resp.json())
    from .comfy_host import ComfyHost

    with ComfyHost() as host:
        return host.object_info()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running ComfyUI with this pack (default: start one)")
    parser.add_argument("--out", type=Path, default=OUT_DIR, help=f"folder to write into (default {OUT_DIR})")
    args = parser.parse_args(argv)
    for path in write(fetch_object_info(args.url), args.out):
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
