"""The panel feed: the ``block_offload.status`` websocket message (at most once per ``MIN_INTERVAL_S`` across all
engines; a run's first and last always go), and the report and timeline routes. Every field is declared in
``web/status_schema.json``.

Threads: recorders call their ``_Publisher`` on the sampling thread, where a block call costs a clock read and a compare
and a message is built only when due; ``send_sync`` hands it to ComfyUI's event loop. The routes read from the server's
thread; publishers only append and replace, never mutate what they shared."""

from __future__ import annotations

import dataclasses
import threading
import time
import weakref
from typing import Any

from ..offload import StepTimeline
from . import extension
from .engine import Engine
from .panel_messages import (
    REPORT_ROUTE,
    STATUS_EVENT,
    TIMELINE_ROUTE,
    EngineFacts,
    MemoryGauge,
    RunRecord,
    full_step,
    idle_status,
    model_entry,
    no_timeline,
    placement_letters,
    report_message,
    status_of_run,
    timeline_of_run,
)
from .placement import pinning_progress


class Panel:
    """Everything the panel shows, for the life of the process; created by ``install_panel``, never at import.

    The sampling thread and the thread that starts and stops engines write the current publisher, the aside status and
    the live list; the server's thread reads them. ``_lock`` guards those three only to read or replace them, never
    while a message is built or sent (the outbox has its own lock)."""

    def __init__(self, server: Any | None) -> None:
        self.server = server  # ComfyUI's PromptServer; None in-process (tests, benchmarks)
        self.outbox = Outbox(server)
        self.memory = MemoryGauge()
        self._lock = threading.Lock()
        # The last publisher that started, ran or sent a message.
        self._current: _Publisher | None = None
        # The last node that ran without streaming, shown until an engine runs; only read once sent.
        self._aside: dict[str, Any] | None = None
        # Replaced, never changed in place: readers iterate it after releasing the lock.
        self._live: list[weakref.ref[_Publisher]] = []

    # -- EngineWatcher: the thread that starts and stops engines

    def engine_started(self, engine: Engine) -> None:
        publisher = _Publisher(engine, self)
        engine.recorder.listener = publisher
        engine.recorder.watched = self.watched
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
        if publisher.run.running:
            publisher.finish_run()
        engine.recorder.listener = None

    # -- what happens

    def show(self, publisher: _Publisher) -> None:
        with self._lock:
            self._current = publisher

    def node_stepped_aside(self, node: str, reason: str) -> None:
        """A node returned its model unchanged (``offload.step_aside``)."""
        self.node_not_streaming(node, f"{node} stepped aside; ComfyUI runs the model itself: {reason}.")

    def node_not_streaming(self, node: str, notice: str) -> None:
        """A model runs without an engine: say why, rather than show an earlier run as this prompt's."""
        status = self.empty_status()
        status.update(node=node, prompt_id=self.prompt_id(), notices=[notice])
        with self._lock:
            self._current = None
            self._aside = status
        self.outbox.send(status, force=True)

    # -- what the panel reads

    def watched(self) -> bool:
        """Whether a websocket client can follow every step; while nobody watches, recorders only sample steps.
        In-process (no server) the caller reads the recorder itself."""
        if self.server is None:
            return True
        return bool(getattr(self.server, "sockets", True))

    def prompt_id(self) -> str | None:
        return getattr(self.server, "last_prompt_id", None)

    def models(self) -> list[dict[str, Any]]:
        with self._lock:
            live = self._live
        return [publisher.placement_entry() for ref in live if (publisher := ref()) is not None]

    def empty_status(self) -> dict[str, Any]:
        return idle_status(self.memory, self.models(), self.outbox.seq)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            publisher, aside = self._current, self._aside
        if publisher is None:
            status = dict(aside) if aside is not None else self.empty_status()
            timeline = None
        else:
            run = publisher.run
            last = run.last_step
            status = publisher.status(last)
            timeline = full_step(last, run.first_step or 0) if last is not None else None
        status.update(seq=self.outbox.seq, time=time.time())
        return report_message(status, timeline)

    def run_timeline(self) -> dict[str, Any]:
        """Every step of the current or last sampling run (``steps`` empty before any)."""
        with self._lock:
            publisher = self._current
        if publisher is None:
            return no_timeline()
        return publisher.run_timeline()

    def register_routes(self) -> None:
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
    """Follows one engine's recorder (a ``TimelineListener``) and publishes its current or last run."""

    def __init__(self, engine: Engine, panel: Panel) -> None:
        self._engine = weakref.ref(engine)  # the engine holds the recorder that holds us: no cycle
        self._panel = panel
        self._outbox = panel.outbox  # read at every block call
        self.facts = EngineFacts.of(engine)
        self.run = RunRecord()
        self._unsent: StepTimeline | None = None  # the last step resolved, until a message carries it

    # -- the run

    def start_run(self, resident_weights: int) -> None:
        engine = self._engine()
        first_step = engine.recorder.steps_ended if engine is not None else None
        self.run = RunRecord(
            prompt_id=self._panel.prompt_id(), resident_weights=resident_weights, running=True, first_step=first_step
        )
        self._unsent = None
        self.publish(force=True)

    def finish_run(self) -> None:
        engine = self._engine()
        run = self.run
        if engine is not None:
            engine.recorder.latest()  # resolves pending steps (calls step_resolved)
            # The sequential wrapper promotes modules after a pass.
            self.facts = dataclasses.replace(self.facts, placement=placement_letters(engine))
            if run.first_step is not None:  # counts unrecorded steps too: the recorder may sample
                run.steps_done = engine.recorder.steps_ended - run.first_step
        run.running = False
        run.block = None
        self._unsent = run.last_step
        self.publish(force=True)

    # -- TimelineListener: the sampling thread

    def block_called(self, step: int, block: int) -> None:
        run = self.run
        run.step, run.block = step, block
        if run.first_step is None:
            run.first_step = step
            run.running = True
            run.prompt_id = run.prompt_id or self._panel.prompt_id()
        if time.perf_counter() >= self._outbox.next_at:
            self.publish()

    def step_resolved(self, timeline: StepTimeline) -> None:
        if not self.run.record(timeline):
            return
        self._unsent = timeline
        if time.perf_counter() >= self._outbox.next_at:
            self.publish()

    def publish(self, force: bool = False) -> None:
        self._panel.show(self)
        status = self.status(self._unsent)
        if self._outbox.send(status, force):
            self._unsent = None

    # -- what the panel reads

    def status(self, last_step: StepTimeline | None) -> dict[str, Any]:
        facts, run = self.facts, self.run
        memory = self._panel.memory.reading(facts.device, run.resident_weights, facts.streaming_buffers)
        return status_of_run(facts, run, last_step, memory, self._panel.models(), self._outbox.seq)

    def placement_entry(self) -> dict[str, Any]:
        engine = self._engine()
        pinning = pinning_progress(engine.runner.report()) if engine is not None else None
        return model_entry(self.facts, self.run.running, pinning)

    def run_timeline(self) -> dict[str, Any]:
        return timeline_of_run(self.facts, self.run)


def _publisher_of(engine: Engine) -> _Publisher | None:
    listener = engine.recorder.listener
    return listener if isinstance(listener, _Publisher) else None


# -- the panel's one way in: set up once, then reached from anywhere


def install_panel(server: Any | None) -> Panel:
    """The panel, created on the first call and kept by the extension; later calls return it."""
    panel = extension.install_once(lambda: Panel(server))
    assert isinstance(panel, Panel), panel
    return panel


def installed_panel() -> Panel | None:
    """The panel once set up; None before, and in a process that never sets the pack up."""
    panel = extension.installed()
    return panel if isinstance(panel, Panel) else None


# -- what the patcher and the nodes tell the panel


def run_started(engine: Engine, resident_weights: int) -> None:
    """A sampling run begins; ``resident_weights``: the bytes ComfyUI loaded of the model."""
    publisher = _publisher_of(engine)
    if publisher is not None:
        publisher.start_run(resident_weights)


def run_finished(engine: Engine) -> None:
    publisher = _publisher_of(engine)
    if publisher is not None:
        publisher.finish_run()


def node_stepped_aside(node: str, reason: str) -> None:
    panel = installed_panel()
    if panel is not None:
        panel.node_stepped_aside(node, reason)


def node_not_streaming(node: str, notice: str) -> None:
    panel = installed_panel()
    if panel is not None:
        panel.node_not_streaming(node, notice)


# -- the panel's one way out


MIN_INTERVAL_S = 0.25


class Outbox:
    """The one rate limit every message obeys, so the panel sees a single stream.

    A message that must go but comes inside the interval waits for its end. Statuses are snapshots, so a newer waiting
    one replaces the older instead of queueing, and bursts of short runs never build a backlog."""

    def __init__(self, server: Any | None) -> None:
        self._server = server  # None in-process (tests, benchmarks)
        self.next_at = 0.0  # perf_counter time from which a message may go
        self.seq = 0
        self._waiting: dict[str, Any] | None = None
        self._lock = threading.Lock()  # the sampling thread sends, the server's loop sends what waited

    def send(self, status: dict[str, Any], force: bool = False) -> bool:
        """Sends ``status`` if one is due; ``force`` sends it anyway, when the interval ends."""
        with self._lock:
            delay = self.next_at - time.perf_counter()
            if delay <= 0:
                # A waiting status is older; sent after this one it would go back in time.
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
        """On the server's loop when the interval ends; if a direct send started a new one, waits again."""
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
