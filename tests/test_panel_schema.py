"""The panel's messages have one schema, ``web/status_schema.json``, and both sides keep to it.

* The Python side: real messages, built in-process by a real panel (``nodes/panel.py``) following a real
  engine on the CPU, are exactly the schema's: every status the outbox sends, the report before any run,
  after a node stepped aside and after a run, the downloadable timeline before and after, and a step with
  file-tier reads. The pack's reading of the schema (``nodes/panel_messages.py``) agrees with the tests'.
* The panel's side: ``web/block_offload_panel.js`` reads only fields the schema declares, on the names it gives
  each message (its header says which), and reads every declared field but those marked ``not_displayed``;
  its constants (version, event, routes, placement letters) are the schema's.

The two checkers are tested on small cases first, so that a test that passes is one that could have failed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from harness.comfy_host import REPO
from harness.panel import SCHEMA, SCHEMA_PATH, fields_of, schema_errors, streaming_engine

PANEL_JS = REPO / "web" / "block_offload_panel.js"
# What the panel calls each message it reads (the panel's header comment says so): a JS name -> the message.
JS_NAMES = {
    "status": "status",
    "report": "report",
    "memory": "memory",
    "step": "step",
    "state.lastStep": "step",
    "model": "model",
    "span": "span",
    "read": "read",
}
IDENTIFIER = r"[A-Za-z_$][\w$]*"


# -- the panel's side: what the JS reads -------------------------------------------------------------------


def js_code(source: str) -> str:
    """``source`` with its comments and the text of its strings blanked out; a template literal's ``${...}``
    parts kept, being code. (The panel has no regular-expression literal, which this would not know.)"""
    out: list[str] = []
    depths: list[int] = []  # per open ${ of a template, the braces opened inside it since
    in_template = False
    i = 0
    while i < len(source):
        char, pair = source[i], source[i : i + 2]
        if in_template:
            if char == "\\":
                i += 2
                continue
            if char == "`":
                in_template = False
            elif pair == "${":
                depths.append(0)
                in_template = False
                out.append(" ")
                i += 2
                continue
            i += 1
            continue
        if pair == "//":
            i = source.find("\n", i) if "\n" in source[i:] else len(source)
        elif pair == "/*":
            i = source.index("*/", i) + 2
        elif char in "'\"":
            end = i + 1
            while source[end] != char:
                end += 2 if source[end] == "\\" else 1
            out.append('""')
            i = end + 1
        elif char == "`":
            in_template = True
            i += 1
        else:
            if char == "{" and depths:
                depths[-1] += 1
            elif char == "}" and depths:
                if depths[-1] == 0:  # the end of a template's ${...}: back in its text
                    depths.pop()
                    in_template = True
                    i += 1
                    continue
                depths[-1] -= 1
            out.append(char)
            i += 1
    return "".join(out)


def js_reads(source: str, names: dict[str, str]) -> dict[str, set[str]]:
    """For each JS name of ``names``, the fields the code reads on it: ``name.field``, ``name?.field``, and
    ``const { field, other: alias } = name``."""
    code = js_code(source)
    reads: dict[str, set[str]] = {}
    for name in names:
        at_name = r"(?<![\w$.])" + re.escape(name)
        found = set(re.findall(at_name + r"\??\.(" + IDENTIFIER + ")", code))
        for pattern in re.findall(r"(?:const|let|var)\s*\{([^}]*)\}\s*=\s*" + re.escape(name) + r"\b", code):
            found |= {part.split(":")[0].split("=")[0].strip() for part in pattern.split(",") if part.strip()}
        reads[name] = found
    return reads


def js_constant(source: str, name: str) -> str:
    match = re.search(rf"const {name} = (\"[^\"]*\"|\d+);", source)
    assert match, f"no const {name} in {PANEL_JS.name}"
    return json.loads(match.group(1))


def test_js_reads_finds_reads_in_code_only() -> None:
    source = """
    // status.commented is no read; nor is a "status.quoted" string
    const text = `step ${step.step + 1}: ${memory?.total} of ${bytes(status.memory.total)} "status.in_text"`;
    const { node, ring_bytes: ringBytes, pinned = false } = status;
    if (status?.running && state.status.block) draw(state.lastStep?.spans, other.status.not_ours);
    """
    reads = js_reads(source, JS_NAMES)
    assert reads["status"] == {"memory", "node", "ring_bytes", "pinned", "running"}
    assert reads["state.lastStep"] == {"spans"}
    assert reads["step"] == {"step"} and reads["memory"] == {"total"}


def test_the_panel_reads_what_the_schema_declares_and_all_it_displays() -> None:
    source = PANEL_JS.read_text()
    reads = js_reads(source, JS_NAMES)
    assert all(reads.values()), f"a name the panel no longer reads on: {reads}"
    read_in: dict[str, set[str]] = {message: set() for message in SCHEMA["messages"]}
    for name, fields in reads.items():
        message = JS_NAMES[name]
        undeclared = fields - fields_of(message).keys()
        assert not undeclared, f"{PANEL_JS.name} reads {sorted(undeclared)} on `{name}`, not in the {message} message"
        read_in[message] |= fields
    for message, declared in SCHEMA["messages"].items():
        # A field a message inherits (the report's from the status) counts as read wherever it is read.
        read = set().union(*(read_in[other] for other in SCHEMA["messages"] if message in lineage(other)))
        for field, spec in declared["fields"].items():
            hidden = declared.get("not_displayed") or spec.get("not_displayed")
            if hidden:
                assert field not in read, f"{message}.{field} is marked not_displayed ({hidden}) yet read"
            else:
                assert field in read, f"{message}.{field} is displayed, says the schema, yet the panel never reads it"


def lineage(message: str) -> list[str]:
    """``message`` and the messages it extends."""
    extends = SCHEMA["messages"][message].get("extends")
    return [message, *(lineage(extends) if extends else [])]


def test_the_panels_constants_are_the_schemas() -> None:
    source = PANEL_JS.read_text()
    messages = SCHEMA["messages"]
    assert js_constant(source, "SCHEMA_VERSION") == SCHEMA["version"]
    assert js_constant(source, "STATUS_EVENT") == messages["status"]["event"]
    assert js_constant(source, "REPORT_PATH") == messages["report"]["route"]
    assert js_constant(source, "TIMELINE_PATH").split("?")[0] == messages["timeline"]["route"]
    assert js_constant(source, "RESIDENT") == SCHEMA["placement_letters"]["resident"]
    assert js_constant(source, "FROM_FILE") == SCHEMA["placement_letters"]["from_file"]


# -- the Python side: the messages built ---------------------------------------------------------------------


def test_schema_errors_sees_a_field_missing_extra_or_mistyped() -> None:
    model = {"node": "n", "placement": "RS", "prefetch": 1, "ring_bytes": None, "pinned": True, "running": False,
             "pinning": None}  # fmt: skip
    assert schema_errors("model", model) == []
    assert schema_errors("model", {**model, "extra": 1}) == ["model.extra: not in the schema's model"]
    assert schema_errors("model", {k: v for k, v in model.items() if k != "node"}) == ["model.node: missing"]
    assert schema_errors("model", {**model, "prefetch": "1"}) == ["model.prefetch: '1' is not int"]
    assert schema_errors("model", {**model, "running": 0}) == ["model.running: 0 is not bool"]
    row = [3, None, None, 0.5, 1.0, 0.0, 0]
    assert schema_errors("span", dict(zip(fields_of("span"), row, strict=True))) == []
    step = {"step": 0, "duration_ms": 1.0, "copy_ms": 0, "stall_ms": 0, "bytes_copied": 0, "overlap": 1.0,
            "bandwidth_gbps": None, "peak_allocated": None, "span_fields": list(fields_of("span")), "spans": [row],
            "bytes_read": 0, "read_gbps": None, "read_fields": list(fields_of("read")),
            "reads": [[1, 0.1]]}  # fmt: skip
    (error,) = schema_errors("step", step)
    assert error == "step.reads[0]: [1, 0.1] is not a row of ['block', 'start', 'end', 'bytes_read']"


def test_the_pack_reads_the_schema_as_the_tests_do(schema_module: Any) -> None:
    for name in SCHEMA["messages"]:
        message = getattr(schema_module, name.upper())
        fields = fields_of(name)
        assert message.fields == tuple(fields)
        assert message.required == {field for field, spec in fields.items() if "absent_when" not in spec}
    assert SCHEMA["version"] == schema_module.VERSION and SCHEMA_PATH == schema_module.SCHEMA_PATH
    with pytest.raises(ValueError, match=r"\['running'\] missing, \['runing'\] not in status_schema.json"):
        schema_module.MODEL.build(
            node="n", placement="", prefetch=None, ring_bytes=None, pinned=None, runing=True, pinning=None
        )


@pytest.fixture(scope="module")
def schema_module(comfy: SimpleNamespace) -> Any:
    return importlib.import_module("block_offload.nodes.panel_messages")


class FakeServer:
    """ComfyUI's PromptServer as the panel uses it: what it sends, kept as a client receives it (JSON)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, dict[str, Any]]] = []
        self.last_prompt_id = "prompt-1"

    def send_sync(self, event: str, data: dict[str, Any]) -> None:
        self.sent.append((event, json.loads(json.dumps(data))))


def exactly(message: str, value: dict[str, Any]) -> None:
    errors = schema_errors(message, json.loads(json.dumps(value)))
    assert not errors, errors


def test_every_message_built_is_exactly_the_schemas(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A panel of its own (not the one the in-process pack set up) follows a real engine's run; with no rate
    limit, every block call sends a status."""
    monkeypatch.setattr(importlib.import_module("block_offload.nodes.panel"), "MIN_INTERVAL_S", 0.0)
    pack = SimpleNamespace(
        offload=importlib.import_module("block_offload.offload"),
        engine=importlib.import_module("block_offload.nodes.engine"),
    )
    server = FakeServer()
    panel = comfy.panel_feed.Panel(server)

    # Before any run: the report and the timeline say so. A node that stepped aside: its status sent and reported.
    exactly("report", panel.snapshot())
    exactly("timeline", panel.run_timeline())
    panel.node_stepped_aside("Async Block Offload", "the model fits")
    exactly("report", panel.snapshot())

    model, engine = streaming_engine(pack, num_blocks=4, resident=1)
    engine.runner.enable()
    panel.engine_started(engine)
    publisher = engine.recorder.listener  # the panel's, which stopping the engine detaches
    try:
        comfy.panel_feed.run_started(engine, resident_weights=0)
        with torch.inference_mode():
            for _ in range(3):
                model(torch.randn(1, 8, 64))
        exactly("report", panel.snapshot())  # mid-run
        comfy.panel_feed.run_finished(engine)
    finally:
        engine.stop()

    assert {event for event, _ in server.sent} == {SCHEMA["messages"]["status"]["event"]}
    statuses = [status for _, status in server.sent]
    assert any("last_step" in status for status in statuses) and any(status["models"] for status in statuses)
    for status in statuses:
        exactly("status", status)
    report = panel.snapshot()
    exactly("report", report)
    assert report["timeline"] is not None and "last_step" in report
    timeline = panel.run_timeline()
    exactly("timeline", timeline)
    assert timeline["steps_done"] == len(timeline["steps"]) == 3

    # A step that read a block from its checkpoint file (the file tier): its reads as rows, and in full.
    read = pack.offload.ReadSpan(block=1, start=0.1, end=0.4, bytes_read=4096)
    last = publisher.run.last_step
    with_reads = dataclasses.replace(last, step=last.step + 1, reads=(read,))
    publisher.step_resolved(with_reads)
    status = publisher.status(with_reads)
    exactly("status", status)
    assert status["last_step"]["reads"] == [[1, 0.1, 0.4, 4096]]
    timeline = json.loads(json.dumps(panel.run_timeline()))
    exactly("timeline", timeline)
    assert timeline["steps"][-1]["reads"] == [{"block": 1, "start": 0.1, "end": 0.4, "bytes_read": 4096}]
