"""The panel's messages, the one place their fields are named, as ``web/status_schema.json`` declares them.

Every message goes through ``Message.build``, which refuses an undeclared field and a missing required one, so a renamed
or forgotten field fails where it is built, not in a browser. ``panel.py`` decides when a message goes; this module only
says what it holds."""

from __future__ import annotations

import json
import operator
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import psutil
import torch

from ..offload import StepTimeline, memory_snapshot, pinned_bytes
from ..offload.device import is_accelerator
from .comfy_memory import host_ram
from .engine import Engine

SCHEMA_PATH = Path(__file__).resolve().parents[1] / "web" / "status_schema.json"


@dataclass(frozen=True)
class Message:
    """One message (or part) of the schema: its fields in declared order, and the required ones."""

    name: str
    fields: tuple[str, ...]
    required: frozenset[str]
    declared: frozenset[str]

    def build(self, **values: Any) -> dict[str, Any]:
        """``values`` as the message; raises ``ValueError`` unless they are exactly its fields (optional ones may be
        left out)."""
        given = values.keys()
        if given != self.declared and (self.required - given or given - self.declared):
            missing, unknown = sorted(self.required - given), sorted(given - self.declared)
            raise ValueError(f"{self.name} message: {missing} missing, {unknown} not in {SCHEMA_PATH.name}")
        return values


def _message(name: str) -> Message:

    def fields_of(name: str) -> dict[str, dict[str, Any]]:
        message = _SCHEMA["messages"][name]
        base = fields_of(message["extends"]) if "extends" in message else {}
        return base | message["fields"]

    fields = fields_of(name)
    required = frozenset(field for field, spec in fields.items() if "absent_when" not in spec)
    return Message(name, tuple(fields), required, frozenset(fields))


_SCHEMA: Final = json.loads(SCHEMA_PATH.read_text())  # read once, never changed

VERSION: int = _SCHEMA["version"]
STATUS_EVENT: str = _SCHEMA["messages"]["status"]["event"]
REPORT_ROUTE: str = _SCHEMA["messages"]["report"]["route"]
TIMELINE_ROUTE: str = _SCHEMA["messages"]["timeline"]["route"]
RESIDENT: str = _SCHEMA["placement_letters"]["resident"]
STREAMED: str = _SCHEMA["placement_letters"]["streamed"]
FROM_FILE: str = _SCHEMA["placement_letters"]["from_file"]

STATUS = _message("status")
REPORT = _message("report")
MEMORY = _message("memory")
MODEL = _message("model")
STEP = _message("step")
SPAN = _message("span")
READ = _message("read")
FULL_STEP = _message("full_step")
TIMELINE = _message("timeline")


# -- one sampling run as the panel keeps it


# Block calls a run's downloadable timeline keeps, to bound its size.
MAX_RUN_SPANS = 200_000


@dataclass
class RunRecord:
    """One run of an engine: one sampling call, or, when a sampler skips ComfyUI's ``pre_run``, everything since the
    engine started.

    Written on the sampling thread, read by the routes on the server's thread: a new run gets a new record, and
    ``steps`` is only appended to, since a route may still be reading it."""

    prompt_id: str | None = None
    resident_weights: int | None = None  # bytes ComfyUI loaded as the run started
    running: bool = False
    first_step: int | None = None  # recorder indices, recorded steps or not
    step: int | None = None
    block: int | None = None
    steps: list[StepTimeline] = field(default_factory=list)
    last_step: StepTimeline | None = None
    steps_done: int = 0
    truncated: bool = False
    spans: int = 0

    def record(self, step: StepTimeline) -> bool:
        """Keeps a resolved step; False for a late step of an earlier run."""
        if self.first_step is None or step.step < self.first_step:
            return False
        self.steps_done = step.step - self.first_step + 1  # unrecorded steps ran too
        self.spans += len(step.spans)
        if self.spans <= MAX_RUN_SPANS:
            self.steps.append(step)
        else:
            self.truncated = True
        self.last_step = step
        return True


# -- the messages


_span_row = operator.attrgetter(*SPAN.fields)
_read_row = operator.attrgetter(*READ.fields)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _row(values: tuple[Any, ...]) -> list[Any]:
    """A span or read as a row, times rounded to 0.1 us."""
    return [None if value is None else round(value, 4) for value in values]


def compact_step(step: StepTimeline, first_step: int) -> dict[str, Any]:
    """A step for the websocket: one row per block call, columns named by ``span_fields``, times in ms."""
    return STEP.build(
        step=step.step - first_step,
        duration_ms=_rounded(step.duration_ms),
        copy_ms=_rounded(step.copy_ms),
        stall_ms=_rounded(step.stall_ms),
        bytes_copied=step.bytes_copied,
        overlap=_rounded(step.overlap),
        bandwidth_gbps=_rounded(step.bandwidth_gbps),
        peak_allocated=step.peak_allocated,
        span_fields=SPAN.fields,
        spans=[_row(_span_row(span)) for span in step.spans],
        bytes_read=step.bytes_read,
        read_gbps=_rounded(step.read_gbps),
        read_fields=READ.fields,
        reads=[_row(_read_row(read)) for read in step.reads],
    )


def full_step(step: StepTimeline, first_step: int) -> dict[str, Any]:
    data = step.as_dict()
    data["step"] -= first_step
    return FULL_STEP.build(**data)


def placement_letters(engine: Engine) -> str:
    """One letter per unit: resident, streamed from host memory, or from the checkpoint file."""
    report = engine.runner.report()
    streamed, from_file = report.streamed, report.read_each_step
    return "".join(
        FROM_FILE if i in from_file else STREAMED if i in streamed else RESIDENT for i in range(report.units)
    )


@dataclass(frozen=True)
class EngineFacts:
    """What the panel shows of one engine, read as it starts. Only the placement changes later (the sequential
    wrapper promotes modules), and then a new ``EngineFacts`` replaces this one, since routes may be reading it."""

    node: str
    plan: str
    device: torch.device
    notices: list[str]  # the engine's own list: notices added later show too
    prefetch: int
    ring_bytes: int | None
    pinned: bool
    streaming_buffers: int
    streamed_host_bytes: int | None
    placement: str

    @classmethod
    def of(cls, engine: Engine) -> EngineFacts:
        plan = engine.plan
        return cls(
            node=engine.request.node,
            plan=engine.summary,
            device=engine.recorder.device,
            notices=engine.notices,
            prefetch=plan.prefetch if plan else engine.request.prefetch,
            # A ring sized in bytes copies as far ahead as it holds, so its size says more than prefetch.
            ring_bytes=plan.slot_bytes if plan and plan.ring_bytes else None,
            pinned=plan.pin_memory if plan else engine.request.pin_memory,
            streaming_buffers=engine.placement.buffer_bytes,
            streamed_host_bytes=plan.streamed_bytes if plan else None,
            placement=placement_letters(engine),
        )

    def placement_fields(self) -> dict[str, Any]:
        return {
            "placement": self.placement,
            "prefetch": self.prefetch,
            "ring_bytes": self.ring_bytes,
            "pinned": self.pinned,
        }


class MemoryGauge:
    def __init__(self) -> None:
        self._process = psutil.Process()
        self._host_total = host_ram().total  # a container's limit, where it has one

    def reading(
        self, device: torch.device, resident_weights: int | None, streaming_buffers: int | None
    ) -> dict[str, Any]:
        """Device memory (None on the CPU) split as the panel's bar shows it, and host memory."""
        snap = memory_snapshot(device)
        other = None
        if snap.allocated is not None:
            other = max(0, snap.allocated - (resident_weights or 0) - (streaming_buffers or 0))
        return MEMORY.build(
            allocated=snap.allocated,
            reserved=snap.reserved,
            peak_allocated=snap.peak_allocated,
            free=snap.free,
            total=snap.total,
            resident_weights=resident_weights,
            streaming_buffers=streaming_buffers,
            other=other,  # activations, other models, the allocator's cache
            process_rss=self._process.memory_info().rss,
            pinned_host=pinned_bytes(),
            host_total=self._host_total,
        )


def _idle_device() -> torch.device:
    """The device ComfyUI computes on, for the figures before any model streamed."""
    try:
        import comfy.model_management

        return comfy.model_management.get_torch_device()
    except ImportError:  # in-process, without ComfyUI
        return torch.device("cpu")


def idle_status(memory: MemoryGauge, models: list[dict[str, Any]], seq: int) -> dict[str, Any]:
    device = _idle_device()
    return STATUS.build(
        v=VERSION,
        running=False,
        prompt_id=None,
        node=None,
        plan=None,
        device=str(device),
        accelerator=is_accelerator(device),
        step=None,
        steps_done=0,
        block=None,
        blocks=0,
        placement="",
        prefetch=None,
        ring_bytes=None,
        pinned=None,
        streamed_host_bytes=None,
        notices=[],
        memory=memory.reading(device, None, None),
        models=models,
        seq=seq,  # the outbox's last: it stamps a message's own as it sends it
        time=time.time(),
    )


def status_of_run(
    facts: EngineFacts,
    run: RunRecord,
    last_step: StepTimeline | None,
    memory: dict[str, Any],
    models: list[dict[str, Any]],
    seq: int,
) -> dict[str, Any]:
    """The status of an engine's run, with ``last_step`` (compact) when one finished since the last message."""
    first = run.first_step or 0
    finished = {} if last_step is None else {"last_step": compact_step(last_step, first)}
    return STATUS.build(
        v=VERSION,
        running=run.running,
        prompt_id=run.prompt_id,
        node=facts.node,
        plan=facts.plan,
        device=str(facts.device),
        accelerator=is_accelerator(facts.device),
        step=None if run.step is None else run.step - first,
        steps_done=run.steps_done,
        block=run.block,
        blocks=len(facts.placement),
        **facts.placement_fields(),
        streamed_host_bytes=facts.streamed_host_bytes,
        notices=list(facts.notices),
        memory=memory,
        models=models,
        **finished,
        seq=seq,  # the outbox's last: it stamps a message's own as it sends it
        time=time.time(),
    )


def report_message(status: dict[str, Any], last_step: dict[str, Any] | None) -> dict[str, Any]:
    return REPORT.build(**status, timeline=last_step, process_rss_bytes=status["memory"]["process_rss"])


def model_entry(facts: EngineFacts, running: bool, pinning: str | None) -> dict[str, Any]:
    """One engine's entry in the list of models streaming now; ``pinning``: background progress."""
    return MODEL.build(node=facts.node, **facts.placement_fields(), running=running, pinning=pinning)


def timeline_of_run(facts: EngineFacts, run: RunRecord) -> dict[str, Any]:
    first = run.first_step or 0
    return TIMELINE.build(
        v=VERSION,
        node=facts.node,
        prompt_id=run.prompt_id,
        plan=facts.plan,
        device=str(facts.device),
        **facts.placement_fields(),
        running=run.running,
        steps_done=run.steps_done,
        truncated=run.truncated,
        steps=[full_step(step, first) for step in list(run.steps)],
    )


def no_timeline() -> dict[str, Any]:
    return TIMELINE.build(v=VERSION, node=None, prompt_id=None, running=False, steps_done=0, steps=[])
