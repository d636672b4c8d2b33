"""What the pack is doing and last did: for the panel (web/), the demo, and anyone asking.

* websocket message ``block_offload.status`` (``STATUS_EVENT``), pushed to every client while a
  model streams, never more often than once per ``MIN_INTERVAL_S``, whichever engine sends it:
  the run (node, prompt, plan, which blocks are resident), the step and block running now,
  device and process memory, the engine's notices and, when a step finished since the last
  message, that step's per-block copy and compute spans (``last_step``, see ``_compact_step``).
  A run's first message and its last (``running`` false, with the run's last step) always go,
  delayed when one went less than an interval before.
* ``GET /block_offload/report``: the same status for a panel opened mid-run, with the last step
  in full (``timeline``) and the process RSS (``process_rss_bytes``).
* ``GET /block_offload/timeline``: every step of the current or last sampling run, to download.

Every field of these messages is declared once, in ``web/status_schema.json`` (``nodes/status_schema.py``):
each message is built through it.

All the panel's state is one ``Panel``, created where ComfyUI sets the pack up (``install_panel``, from
``comfy_entrypoint``), never as this module is imported. Every engine that starts gets a ``_Publisher``
from it (the engine tells the panel, an ``EngineWatcher``, without importing it). Its recorder calls the
publisher (a ``TimelineListener``) on the sampling thread: a block call costs it one clock read and one
compare (~0.15 us on the CPU here); building and queueing a message (~50 us) happens only when one is due
(bench/recorder_overhead.py measures both). ``send_sync`` hands the message to ComfyUI's event loop, which
serialises and sends it off the sampling thread. The routes read the publisher from the server's thread; it
only appends and replaces, never mutates what it shared.
"""

from __future__ import annotations

import operator
import threading
import time
import weakref
from typing import Any

import psutil
import torch

from ..offload import memory_snapshot, pinned_bytes
from ..offload.device import is_accelerator
from ..offload.timeline import StepTimeline
from . import extension
from .engine import Engine
from .status_schema import (
    FROM_FILE,
    FULL_STEP,
    MEMORY,
    MODEL,
    READ,
    REPORT,
    REPORT_ROUTE,
    RESIDENT,
    SPAN,
    STATUS,
    STATUS_EVENT,
    STEP,
    STREAMED,
    TIMELINE,
    TIMELINE_ROUTE,
    VERSION,
)

MIN_INTERVAL_S = 0.25  # at most four messages a second
# What the downloadable timeline of one run may hold (block calls in all its steps): ~30 MB at most.
MAX_RUN_SPANS = 200_000
# A step's spans and reads go to the websocket as rows, their values in the schema's order of fields.
_span_row = operator.attrgetter(*SPAN.fields)
_read_row = operator.attrgetter(*READ.fields)


class _Outbox:
    """The one rate limit every message obeys: the panel sees a single stream.

    A message that must go (a run's first and last) but comes inside the interval waits for its end;
    statuses are snapshots, so a newer one waiting replaces an older one instead of queueing behind
    it, and a burst of short runs never builds a backlog that would hold back the next run's updates.
    """

    def __init__(self, server: Any | None) -> None:
        self._server = server  # ComfyUI's PromptServer; None in-process (tests, benchmarks): nobody to tell
        self.next_at = 0.0  # perf_counter time from which a message may go
        self.seq = 0
        self._waiting: dict[str, Any] | None = None
        self._lock = threading.Lock()  # the sampling thread sends, the server's loop sends what waited

    def send(self, status: dict[str, Any], force: bool = False) -> bool:
        """Sends ``status`` if one is due; ``force`` sends it anyway, when the interval ends."""
        with self._lock:
            delay = self.next_at - time.perf_counter()
            if delay <= 0:
                # A status waiting for its turn is older than this one: sent after it, it would go back in time.
                self._waiting = None
                self._emit(status)
                return True
            if not force:
                return False
            first_to_wait = self._waiting is None
            self._waiting = status
        if first_to_wait and self._server is not None:
            self._server.loop.call_soon_threadsafe(self._server.loop.call_later, delay, self._send_waiting)
        return True

    def _send_waiting(self) -> None:
        """On the server's loop, when a waiting status's interval has ended (a message sent directly since
        may have started another: then it waits for that one's end)."""
        with self._lock:
            if self._waiting is None:
                return
            delay = self.next_at - time.perf_counter()
            if delay <= 0:
                status, self._waiting = self._waiting, None
                self._emit(status)
                return
        if self._server is not None:
            self._server.loop.call_later(delay, self._send_waiting)

    def _emit(self, status: dict[str, Any]) -> None:
        self.next_at = time.perf_counter() + MIN_INTERVAL_S
        self.seq += 1
        status.update(seq=self.seq, time=time.time())
        if self._server is not None:
            self._server.send_sync(STATUS_EVENT, status)


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _row(values: tuple[Any, ...]) -> list[Any]:
    """A span or read as a row: times rounded to 0.1 us (its counts are ints, which rounding leaves as they are)."""
    return [None if value is None else round(value, 4) for value in values]


def _compact_step(step: StepTimeline, first_step: int) -> dict[str, Any]:
    """A step for the websocket: one row per block call, its columns named by ``span_fields``, times in ms."""
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


def _full_step(step: StepTimeline, first_step: int) -> dict[str, Any]:
    """A step as the recorder describes it, numbered from the run's first step."""
    data = step.as_dict()
    data["step"] -= first_step
    return FULL_STEP.build(**data)


def _idle_device() -> torch.device:
    """The device ComfyUI computes on, for the memory figures before any model streamed."""
    try:
        import comfy.model_management

        return comfy.model_management.get_torch_device()
    except ImportError:  # in-process use without ComfyUI on the path
        return torch.device("cpu")


class Panel:
    """Everything the panel shows, for the life of the process: created once, where ComfyUI sets the pack up
    (``install_panel``); told of every engine as it starts and stops (the engine's ``EngineWatcher``); read by
    the routes and the tests.

    Two threads touch it. The thread that samples (the engines' recorders call their publishers on it) and the
    one that starts and stops engines write which publisher is current, the aside status and the live
    publishers; the server's thread reads them for the routes. ``_lock`` guards those three, held only to read
    or replace them, never while a message is built or sent: the outbox has its own lock, and a publisher takes
    this one to make itself current.
    """

    def __init__(self, server: Any | None) -> None:
        self.server = server  # ComfyUI's PromptServer; None in-process (tests, benchmarks)
        self.outbox = _Outbox(server)
        self._process = psutil.Process()
        self._host_total = psutil.virtual_memory().total
        self._lock = threading.Lock()
        # The publisher whose run the panel shows: the last one that started, ran a run or sent a message.
        self._current: _Publisher | None = None
        # The status of the last node that ran without streaming (stepped aside), shown while no engine has run
        # since; sent, then only read (copied by the routes).
        self._aside: dict[str, Any] | None = None
        # Every engine streaming now, oldest first, for the panel's per-node placement. Replaced, never changed
        # in place: a reader iterates the list it got under the lock after letting go of it.
        self._live: list[weakref.ref[_Publisher]] = []

    # -- EngineWatcher: the thread that starts and stops engines ----------------------------

    def engine_started(self, engine: Engine) -> None:
        publisher = _Publisher(engine, self)
        engine.recorder.listener = publisher
        with self._lock:
            self._current = publisher
            self._live = [ref for ref in self._live if ref() is not None] + [weakref.ref(publisher)]

    def engine_stopped(self, engine: Engine) -> None:
        """The report goes on describing the stopped engine's last run."""
        publisher = _publisher_of(engine)
        if publisher is None:
            return
        with self._lock:
            self._live = [ref for ref in self._live if ref() not in (None, publisher)]
        if publisher.running:
            publisher.finish_run()
        engine.recorder.listener = None

    # -- what happens --------------------------------------------------------------------------

    def show(self, publisher: _Publisher) -> None:
        """``publisher``'s run is the one the panel shows."""
        with self._lock:
            self._current = publisher

    def node_stepped_aside(self, node: str, reason: str) -> None:
        """A node returned its model unchanged (``offload.step_aside``)."""
        self.node_not_streaming(node, f"{node} stepped aside; ComfyUI runs the model itself: {reason}.")

    def node_not_streaming(self, node: str, notice: str) -> None:
        """A node's model runs without an engine: the panel says why instead of showing an earlier run as if
        it were this prompt's."""
        status = self.empty_status()
        status.update(node=node, prompt_id=self.prompt_id(), notices=[notice])
        with self._lock:
            self._current = None
            self._aside = status
        self.outbox.send(status, force=True)

    # -- what the panel reads --------------------------------------------------------------------

    def prompt_id(self) -> str | None:
        return getattr(self.server, "last_prompt_id", None)

    def memory(
        self, device: torch.device, resident_weights: int | None, streaming_buffers: int | None
    ) -> dict[str, Any]:
        """Device memory (None on the CPU) split as the panel's bar shows it, and the process's host memory."""
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
            other=other,  # activations, other models, the allocator's cache: what is left of allocated
            process_rss=self._process.memory_info().rss,
            pinned_host=pinned_bytes(),  # page-locked by the pack, exactly (no allocator rounding)
            host_total=self._host_total,
        )

    def models(self) -> list[dict[str, Any]]:
        """The placement of every model streaming now, one entry per engine (so per node), oldest first."""
        with self._lock:
            live = self._live
        return [publisher.placement_entry() for ref in live if (publisher := ref()) is not None]

    def empty_status(self) -> dict[str, Any]:
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
            memory=self.memory(device, None, None),
            models=self.models(),
            seq=self.outbox.seq,  # the outbox stamps a message's own as it sends it
            time=time.time(),
        )

    def snapshot(self) -> dict[str, Any]:
        """The latest status, its last step in full, and the process's RSS."""
        with self._lock:
            publisher, aside = self._current, self._aside
        if publisher is None:
            status = dict(aside) if aside is not None else self.empty_status()
            timeline = None
        else:
            last = publisher.last_step
            status = publisher.status(last)
            timeline = _full_step(last, publisher.first_step or 0) if last is not None else None
        status.update(seq=self.outbox.seq, time=time.time())  # an aside status has those of when it was sent
        return REPORT.build(**status, timeline=timeline, process_rss_bytes=status["memory"]["process_rss"])

    def run_timeline(self) -> dict[str, Any]:
        """Every step of the current or last sampling run (``steps`` is empty before any)."""
        with self._lock:
            publisher = self._current
        if publisher is None:
            return TIMELINE.build(v=VERSION, node=None, prompt_id=None, running=False, steps_done=0, steps=[])
        return publisher.run_timeline()

    def register_routes(self) -> None:
        """The report and the timeline, on ComfyUI's server (one the panel was set up with)."""
        from aiohttp import web

        assert self.server is not None, "an in-process panel has no server to serve from"
        routes = self.server.routes

        @routes.get(REPORT_ROUTE)
        async def get_report(request: web.Request) -> web.Response:
            return web.json_response(self.snapshot())

        @routes.get(TIMELINE_ROUTE)
        async def get_timeline(request: web.Request) -> web.Response:
            response = web.json_response(self.run_timeline())
            if "download" in request.query:
                response.headers["Content-Disposition"] = 'attachment; filename="block_offload_timeline.json"'
            return response


class _Publisher:
    """Follows one engine's recorder (a ``TimelineListener``) and keeps its current or last sampling run.

    A run is one sampling call (``run_started`` .. ``run_finished``), or, when a sampler calls the
    model without ComfyUI's ``pre_run``, everything since the engine started.
    """

    def __init__(self, engine: Engine, panel: Panel) -> None:
        self._engine = weakref.ref(engine)  # the engine holds the recorder that holds us: no cycle
        self._panel = panel
        self._outbox = panel.outbox  # read at every block call: one attribute away
        self.node = engine.request.node
        self.plan = engine.summary
        self.device = engine.recorder.device
        self.notices = engine.notices  # the engine's own list: notices added later show too
        self.prefetch = engine.plan.prefetch if engine.plan else engine.request.prefetch
        # A ring sized in bytes (a planned placement) copies as far ahead as it holds: its size says more.
        self.ring_bytes = engine.plan.slot_bytes if engine.plan and engine.plan.ring_bytes else None
        self.pinned = engine.plan.pin_memory if engine.plan else engine.request.pin_memory
        self.streaming_buffers = engine.placement.buffer_bytes
        self.streamed_host_bytes = engine.plan.streamed_bytes if engine.plan else None
        self.placement = self._placement(engine)
        self.resident_weights: int | None = None
        self.prompt_id: str | None = None
        self.running = False
        self.first_step: int | None = None  # the recorder's index of the run's first step
        self.step: int | None = None
        self.block: int | None = None
        self.steps: list[StepTimeline] = []
        self.last_step: StepTimeline | None = None
        self.steps_done = 0
        self.truncated = False
        self._spans = 0
        self._unsent: StepTimeline | None = None

    @staticmethod
    def _placement(engine: Engine) -> str:
        """One letter per block (per module for the sequential wrapper): resident, streamed from host memory,
        or streamed from the checkpoint file."""
        runner = engine.runner
        streamed, from_file = runner.streamed, runner.read_each_step
        return "".join(
            FROM_FILE if i in from_file else STREAMED if i in streamed else RESIDENT for i in range(runner.units)
        )

    # -- the run -----------------------------------------------------------------------------

    def start_run(self, resident_weights: int) -> None:
        self.resident_weights = resident_weights
        self.prompt_id = self._panel.prompt_id()
        self.running = True
        self.first_step = None
        self.step = self.block = None
        self.steps = []  # a new list: a route may still be reading the old one
        self.last_step = None
        self.steps_done = self._spans = 0
        self.truncated = False
        self._unsent = None
        self.publish(force=True)

    def finish_run(self) -> None:
        engine = self._engine()
        if engine is not None:
            engine.recorder.latest()  # resolves the steps still pending on the device (calls step_resolved)
            self.placement = self._placement(engine)  # the sequential wrapper promotes modules after a pass
        self.running = False
        self.block = None
        self._unsent = self.last_step  # the final message always carries the run's last step
        self.publish(force=True)

    # -- TimelineListener: the sampling thread ----------------------------------------------

    def block_called(self, step: int, block: int) -> None:
        self.step, self.block = step, block
        if self.first_step is None:
            self.first_step = step
            self.running = True
            self.prompt_id = self.prompt_id or self._panel.prompt_id()
        if time.perf_counter() >= self._outbox.next_at:
            self.publish()

    def step_resolved(self, timeline: StepTimeline) -> None:
        if self.first_step is None or timeline.step < self.first_step:
            return  # the end of an earlier run, resolved late
        self.steps_done += 1
        self._spans += len(timeline.spans)
        if self._spans <= MAX_RUN_SPANS:
            self.steps.append(timeline)
        else:
            self.truncated = True
        self.last_step = self._unsent = timeline
        if time.perf_counter() >= self._outbox.next_at:
            self.publish()

    def publish(self, force: bool = False) -> None:
        self._panel.show(self)
        status = self.status(self._unsent)
        if self._outbox.send(status, force):
            self._unsent = None

    # -- what the panel reads ----------------------------------------------------------------

    def status(self, last_step: StepTimeline | None) -> dict[str, Any]:
        first = self.first_step or 0
        finished = {} if last_step is None else {"last_step": _compact_step(last_step, first)}
        return STATUS.build(
            v=VERSION,
            running=self.running,
            prompt_id=self.prompt_id,
            node=self.node,
            plan=self.plan,
            device=str(self.device),
            accelerator=is_accelerator(self.device),
            step=None if self.step is None else self.step - first,
            steps_done=self.steps_done,
            block=self.block,
            blocks=len(self.placement),
            placement=self.placement,
            prefetch=self.prefetch,
            ring_bytes=self.ring_bytes,
            pinned=self.pinned,
            streamed_host_bytes=self.streamed_host_bytes,
            notices=list(self.notices),
            memory=self._panel.memory(self.device, self.resident_weights, self.streaming_buffers),
            models=self._panel.models(),
            **finished,
            seq=self._outbox.seq,  # the outbox stamps a message's own as it sends it
            time=time.time(),
        )

    def placement_entry(self) -> dict[str, Any]:
        return MODEL.build(
            node=self.node,
            placement=self.placement,
            prefetch=self.prefetch,
            ring_bytes=self.ring_bytes,
            pinned=self.pinned,
            running=self.running,
        )

    def run_timeline(self) -> dict[str, Any]:
        first = self.first_step or 0
        return TIMELINE.build(
            v=VERSION,
            node=self.node,
            prompt_id=self.prompt_id,
            plan=self.plan,
            device=str(self.device),
            placement=self.placement,
            prefetch=self.prefetch,
            ring_bytes=self.ring_bytes,
            pinned=self.pinned,
            running=self.running,
            steps_done=self.steps_done,
            truncated=self.truncated,
            steps=[_full_step(step, first) for step in list(self.steps)],
        )


def _publisher_of(engine: Engine) -> _Publisher | None:
    listener = engine.recorder.listener
    return listener if isinstance(listener, _Publisher) else None


# -- the panel's one way in: set up once, then reached from anywhere ---------------------------------


def install_panel(server: Any | None) -> Panel:
    """The panel, created on the first call (where ComfyUI sets the pack up, with its ``PromptServer``; in-process,
    with None) and kept by the extension (``nodes/extension.py``); every later call returns the same one."""
    panel = extension.install_once(lambda: Panel(server))
    assert isinstance(panel, Panel), panel  # the extension keeps nothing else
    return panel


def installed_panel() -> Panel | None:
    """The panel, once set up (``install_panel``); None before, and in a process that never sets the pack up."""
    panel = extension.installed()
    return panel if isinstance(panel, Panel) else None


# -- what the patcher and the nodes tell the panel ---------------------------------------------------


def run_started(engine: Engine, resident_weights: int) -> None:
    """A sampling run begins on ``engine``; ``resident_weights``: the bytes ComfyUI loaded of the model."""
    publisher = _publisher_of(engine)
    if publisher is not None:
        publisher.start_run(resident_weights)


def run_finished(engine: Engine) -> None:
    publisher = _publisher_of(engine)
    if publisher is not None:
        publisher.finish_run()


def node_stepped_aside(node: str, reason: str) -> None:
    """A node returned its model unchanged (``offload.step_aside``)."""
    panel = installed_panel()
    if panel is not None:
        panel.node_stepped_aside(node, reason)


def node_not_streaming(node: str, notice: str) -> None:
    """A node's model runs without an engine (see ``Panel.node_not_streaming``)."""
    panel = installed_panel()
    if panel is not None:
        panel.node_not_streaming(node, notice)
