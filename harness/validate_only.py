"""ComfyUI's own validation of an API prompt (POST /prompt), asked so that the server cannot queue it.

POST /prompt validates each output node of the prompt (execution.validate_prompt: an output and everything
upstream of it, every input of every node, errors gathered node by node), answers 400 with the node errors and
queues nothing when no output validates, and queues the outputs that do. So the prompt is posted with
``partial_execution_targets`` naming only the outputs that cannot validate: those upstream of which a model loader
names a file the server's ``/object_info`` does not list. The server validates
those outputs whole, says what is wrong and where, and queues nothing. A prompt with no such output is not posted.
A 200 answer (something was queued after all) is interrupted and cleared, and raised.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .comfy_host import ComfyHost
from .template_prompts import output_node_ids, reachable


class QueuedError(AssertionError):
    """The server queued a prompt that was posted for validation only."""


@dataclass(frozen=True)
class Validation:
    """What the server said: its error's type, and per node id the errors (type, message, details, input)."""

    error: str
    node_errors: dict[str, list[tuple[str, str, str, str]]]


def known_nodes(prompt: Mapping[str, Any], object_info: Mapping[str, Any]) -> dict[str, Any]:
    """``prompt`` without the nodes the server does not know (API nodes, packs it lacks): with one of them the
    server checks nothing else."""
    return {node_id: node for node_id, node in prompt.items() if node.get("class_type") in object_info}


def _listed(object_info: Mapping[str, Any], class_type: str, name: str) -> list[Any] | None:
    """The values the server lists for list input ``name`` of ``class_type``, or None for no list input."""
    inputs = object_info[class_type].get("input", {})
    spec = {**inputs.get("required", {}), **inputs.get("optional", {})}.get(name)
    if not spec:
        return None
    if isinstance(spec[0], list):
        return spec[0]
    if spec[0] == "COMBO" and len(spec) > 1 and isinstance(spec[1], Mapping):
        return list(spec[1].get("options") or [])
    return None


def _loads_a_model(definition: Mapping[str, Any]) -> bool:
    """Whether a node of this definition gives a MODEL and takes none (it checks its file against the list: a node
    that validates its inputs itself may accept a value that is not listed)."""
    inputs = definition.get("input", {})
    taken = [spec[0] for part in ("required", "optional") for spec in inputs.get(part, {}).values() if spec]
    return "MODEL" in (definition.get("output") or []) and "MODEL" not in taken


def unlisted(prompt: Mapping[str, Any], object_info: Mapping[str, Any]) -> set[str]:
    """The model loaders whose file the server does not list: they cannot validate."""
    return {
        node_id
        for node_id, node in prompt.items()
        if _loads_a_model(object_info[node["class_type"]])
        for name, value in node.get("inputs", {}).items()
        if not isinstance(value, list)
        and (listed := _listed(object_info, node["class_type"], name)) is not None
        and value not in listed
    }


def failing_outputs(prompt: Mapping[str, Any], object_info: Mapping[str, Any]) -> list[str]:
    """The output nodes of ``prompt`` that cannot validate: a node upstream of each is :func:`unlisted`."""
    bad = unlisted(prompt, object_info)
    return sorted(i for i in output_node_ids(prompt, object_info) if reachable(prompt, [i]).keys() & bad)


def validate(host: ComfyHost, prompt: Mapping[str, Any], targets: list[str]) -> Validation:
    """The server's validation of the output nodes ``targets`` of ``prompt`` (each of :func:`failing_outputs`)."""
    response = host.post("/prompt", {"prompt": dict(prompt), "partial_execution_targets": targets})
    body = response.json()
    if response.status_code == 200:
        host.interrupt()
        host.post("/queue", {"clear": True})
        raise QueuedError(f"the server queued a prompt posted for validation only: {body}")
    errors = {
        node_id: sorted(
            (
                e.get("type", ""),
                e.get("message", ""),
                e.get("details", ""),
                str(e.get("extra_info", {}).get("input_name")),
            )
            for e in info.get("errors", [])
        )
        for node_id, info in (body.get("node_errors") or {}).items()
    }
    return Validation(str((body.get("error") or {}).get("type")), errors)
