"""The live panel's status messages as the tests check them: the schema of ``block_offload.status``
(``nodes/report.py``) and the tiny Wan workflow the panel tests and the browser test run."""

from __future__ import annotations

import json
import uuid
from typing import Any

from .comfy_host import REPO

WORKFLOW = REPO / "example_workflows" / "api" / "async_block_offload_wan21_t2v.json"
NODE_NAME = "Async Block Offload"
BLOCKS = 5  # tiny Wan 2.1's blocks; the workflow keeps 1 resident (leading)
PLACEMENT = "RSSSS"
STATUS_EVENT = "block_offload.status"
MIN_INTERVAL_S = 0.25
SPAN_FIELDS = ["block", "copy_start", "copy_end", "compute_start", "compute_end", "stall", "bytes_copied"]
MEMORY_FIELDS = {
    "allocated", "reserved", "peak_allocated", "free", "total",
    "resident_weights", "streaming_buffers", "other", "process_rss", "host_total", "pinned_host",
}  # fmt: skip
STATUS_FIELDS = {
    "v": int, "seq": int, "time": float, "running": bool, "prompt_id": (str, type(None)),
    "node": (str, type(None)), "plan": (str, type(None)), "device": str, "accelerator": bool,
    "step": (int, type(None)), "steps_done": int, "block": (int, type(None)), "blocks": int, "placement": str,
    "prefetch": (int, type(None)), "ring_bytes": (int, type(None)), "pinned": (bool, type(None)),
    "streamed_host_bytes": (int, type(None)),
    "notices": list, "memory": dict, "models": list,
}  # fmt: skip
OPTIONAL_NUMBER = (int, float, type(None))


def wan_prompt(steps: int) -> dict[str, Any]:
    """The example workflow as shipped (scripts/demo.py runs it unchanged) with ``steps`` sampler steps,
    and a seed and output prefix of its own, so ComfyUI's cache cannot skip the sampler."""
    tag = uuid.uuid4().hex
    prompt = json.loads(WORKFLOW.read_text())
    prompt["7"]["inputs"].update(steps=steps, seed=int(tag[:8], 16))
    prompt["8"]["inputs"]["filename_prefix"] = f"tests/panel/{tag}"
    return prompt


def check_status(status: dict[str, Any]) -> None:
    """The schema every message and the report share (nodes/report.py)."""
    for name, kind in STATUS_FIELDS.items():
        assert isinstance(status.get(name), kind), f"{name}={status.get(name)!r} is not {kind}"
    assert status["v"] == 1
    assert set(status["memory"]) == MEMORY_FIELDS, status["memory"]
    assert all(isinstance(text, str) for text in status["notices"])
    assert len(status["placement"]) == status["blocks"] and set(status["placement"]) <= {"R", "S"}
    memory = status["memory"]
    assert memory["process_rss"] > 0 and memory["host_total"] >= memory["process_rss"]
    if status["accelerator"]:
        assert all(isinstance(memory[k], int) for k in ("allocated", "reserved", "free", "total")), memory
        assert 0 <= memory["free"] <= memory["total"] and memory["allocated"] <= memory["reserved"], memory
    else:
        assert all(memory[k] is None for k in ("allocated", "reserved", "free", "total", "other")), memory
    for model in status["models"]:  # every model streaming now, one per node
        assert set(model) == {"node", "placement", "prefetch", "ring_bytes", "pinned", "running"}, model
        assert set(model["placement"]) <= {"R", "S"}
    if "last_step" in status:
        check_step(status["last_step"], status["placement"])


def check_step(step: dict[str, Any], placement: str) -> None:
    """A compact step: one row per block call; streamed blocks were copied, resident ones not."""
    assert list(step["span_fields"]) == SPAN_FIELDS
    assert isinstance(step["step"], int) and step["step"] >= 0
    assert step["duration_ms"] > 0 and 0.0 <= step["overlap"] <= 1.0
    for name in ("copy_ms", "stall_ms", "bandwidth_gbps"):
        assert isinstance(step[name], OPTIONAL_NUMBER), (name, step[name])
    assert [row[0] for row in step["spans"]] == list(range(len(placement))), step["spans"]
    for block, copy_start, copy_end, compute_start, compute_end, stall, copied in step["spans"]:
        assert 0 <= compute_start <= compute_end <= step["duration_ms"], step
        assert stall >= 0
        if placement[block] == "S":
            assert copy_start is not None and copy_start <= copy_end and copied > 0, (block, step)
        else:
            assert copy_start is None and copied == 0, (block, step)
    assert step["bytes_copied"] == sum(row[6] for row in step["spans"])
