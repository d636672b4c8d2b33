"""The live panel's status messages as the tests check them, against the schema the pack declares them in
(``web/status_schema.json``), and the tiny Wan workflow the panel tests and the browser test run."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch

from .comfy_host import REPO
from .transformer_stack import transformer_stack

WORKFLOW = REPO / "example_workflows" / "api" / "async_block_offload_wan21_t2v.json"
NODE_NAME = "Async Block Offload"
BLOCKS = 5  # tiny Wan 2.1's blocks; the workflow keeps 1 resident (leading)
PLACEMENT = "RSSSS"
STATUS_EVENT = "block_offload.status"
MIN_INTERVAL_S = 0.25
# Read from the file itself, not through the pack (``nodes/panel_messages.py``): importing ``nodes`` needs ComfyUI
# on the path, which a test module importing this one may not have yet.
SCHEMA_PATH = REPO / "web" / "status_schema.json"
SCHEMA: dict[str, Any] = json.loads(SCHEMA_PATH.read_text())
STATUS_EVENT = SCHEMA["messages"]["status"]["event"]
BASE_TYPES: dict[str, Callable[[Any], bool]] = {
    "int": lambda value: isinstance(value, int) and not isinstance(value, bool),
    "number": lambda value: isinstance(value, (int, float)) and not isinstance(value, bool),
    "str": lambda value: isinstance(value, str),
    "bool": lambda value: isinstance(value, bool),
}


def fields_of(message: str) -> dict[str, dict[str, Any]]:
    """The fields the schema declares for ``message``, with those of the one it ``extends`` first."""
    declared = SCHEMA["messages"][message]
    base = fields_of(declared["extends"]) if "extends" in declared else {}
    return base | declared["fields"]


def schema_errors(message: str, value: Any, where: str = "") -> list[str]:
    """Where ``value`` is not the schema's ``message``: a field missing (one with ``absent_when`` may be), one
    not declared, or a value not of its field's type, at any depth. Empty when it is exactly that message."""
    where = where or message
    if not isinstance(value, dict):
        return [f"{where}: {value!r} is not a {message} object"]
    fields = fields_of(message)
    required = {name for name, spec in fields.items() if "absent_when" not in spec}
    errors = [f"{where}.{name}: missing" for name in sorted(required - value.keys())]
    errors += [f"{where}.{name}: not in the schema's {message}" for name in sorted(value.keys() - fields.keys())]
    for name, item in value.items():
        if name in fields:
            errors += type_errors(fields[name]["type"], item, f"{where}.{name}")
    return errors


def type_errors(kind: str, value: Any, where: str) -> list[str]:
    """Where ``value`` is not of the schema's type ``kind`` (see the schema's own comment for the types)."""
    if kind.endswith("?"):
        return [] if value is None else type_errors(kind[:-1], value, where)
    if kind.startswith("list["):
        if not isinstance(value, list):
            return [f"{where}: {value!r} is not a list"]
        return [error for i, item in enumerate(value) for error in type_errors(kind[5:-1], item, f"{where}[{i}]")]
    if kind.startswith("row["):
        fields = fields_of(kind[4:-1])
        if not isinstance(value, list) or len(value) != len(fields):
            return [f"{where}: {value!r} is not a row of {list(fields)}"]
        return [
            error
            for (name, spec), item in zip(fields.items(), value, strict=True)
            for error in type_errors(spec["type"], item, f"{where}.{name}")
        ]
    if kind in BASE_TYPES:
        return [] if BASE_TYPES[kind](value) else [f"{where}: {value!r} is not {kind}"]
    return schema_errors(kind, value, where)


def streaming_engine(pack: SimpleNamespace, num_blocks: int, resident: int, dim: int = 64) -> tuple[Any, Any]:
    """A tiny transformer stack streaming on the CPU, wrapped in the engine state the patcher builds (``pack``:
    the pack's ``offload`` and ``engine`` modules, imported with ComfyUI on the path)."""
    off = pack.offload
    model = transformer_stack(num_blocks=num_blocks, dim=dim, heads=4)
    plan = off.OffloadPlan.build([off.module_bytes(b) for b in model.blocks], resident_count=resident)
    recorder = off.TimelineRecorder(torch.device("cpu"))
    runner = off.stream_blocks(
        model.blocks, "cpu", plan.streamed, off.StreamSpec(calls=off.CallOptions(root=model), recorder=recorder)
    )
    request = pack.engine.OffloadRequest(node="panel test")
    engine = pack.engine.Engine(request, pack.engine.Placement.of_plan(plan), runner, recorder)
    return model, engine


def wan_prompt(steps: int) -> dict[str, Any]:
    """The example workflow as shipped (scripts/demo.py runs it unchanged) with ``steps`` sampler steps,
    and a seed and output prefix of its own, so ComfyUI's cache cannot skip the sampler."""
    tag = uuid.uuid4().hex
    prompt = json.loads(WORKFLOW.read_text())
    prompt["7"]["inputs"].update(steps=steps, seed=int(tag[:8], 16))
    prompt["8"]["inputs"]["filename_prefix"] = f"tests/panel/{tag}"
    return prompt


def check_status(status: dict[str, Any], message: str = "status") -> None:
    """A status message (``message``: "report" for GET /block_offload/report) exactly as the schema declares it,
    and its figures consistent. Checked as a client receives it: as JSON (a tuple arrives as a list)."""
    status = json.loads(json.dumps(status))
    errors = schema_errors(message, status)
    assert not errors, errors
    assert status["v"] == SCHEMA["version"]
    assert len(status["placement"]) == status["blocks"] and set(status["placement"]) <= {"R", "S"}
    memory = status["memory"]
    assert memory["process_rss"] > 0 and memory["host_total"] >= memory["process_rss"]
    if status["accelerator"]:
        assert all(isinstance(memory[k], int) for k in ("allocated", "reserved", "free", "total")), memory
        assert 0 <= memory["free"] <= memory["total"] and memory["allocated"] <= memory["reserved"], memory
    else:
        assert all(memory[k] is None for k in ("allocated", "reserved", "free", "total", "other")), memory
    for model in status["models"]:  # every model streaming now, one per node
        assert set(model["placement"]) <= {"R", "S"}
    if "last_step" in status:
        check_step(status["last_step"], status["placement"])


def check_step(step: dict[str, Any], placement: str) -> None:
    """A compact step (its types checked with its status): one row per block call; streamed blocks were
    copied, resident ones not."""
    assert step["span_fields"] == list(fields_of("span")) and step["read_fields"] == list(fields_of("read"))
    assert step["step"] >= 0
    assert step["duration_ms"] > 0 and 0.0 <= step["overlap"] <= 1.0
    assert [row[0] for row in step["spans"]] == list(range(len(placement))), step["spans"]
    for block, copy_start, copy_end, compute_start, compute_end, stall, copied in step["spans"]:
        assert 0 <= compute_start <= compute_end <= step["duration_ms"], step
        assert stall >= 0
        if placement[block] == "S":
            assert copy_start is not None and copy_start <= copy_end and copied > 0, (block, step)
        else:
            assert copy_start is None and copied == 0, (block, step)
    assert step["bytes_copied"] == sum(row[6] for row in step["spans"])
