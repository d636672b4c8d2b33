"""The live panel's feed: the ``block_offload.status`` websocket messages and the report routes.

Through the real server (the session's ``comfy_host``, CPU streaming allowed): the tiny Wan
example workflow, with more steps so the run outlasts several rate-limit intervals, is queued
while a second websocket client listens as a panel would. Every message must follow the
schema (web/status_schema.json), none may come sooner than ``MIN_INTERVAL_S`` after the one before, the last
says the run finished and carries its last step, and the routes must return that run.

On a CUDA machine, a GPU server of its own: the messages carry the device's memory figures.

In-process (no server): the real publisher on a real engine, to prove the throttle holds when
steps come far faster than messages may, and to measure what a block call costs it.
"""

from __future__ import annotations

import importlib
import json
import threading
import time
import uuid
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import websocket
from conftest import DEVICES

from harness.comfy_client import RunResult
from harness.comfy_host import ComfyHost
from harness.panel import (
    BLOCKS,
    MIN_INTERVAL_S,
    NODE_NAME,
    PLACEMENT,
    STATUS_EVENT,
    check_status,
    streaming_engine,
    wan_prompt,
)

from block_offload.offload.timeline import FIRST_STEPS_RECORDED, UNWATCHED_PERIOD_S

pytestmark = pytest.mark.usefixtures("tiny_models")

# Each tiny Wan step takes ~12 ms on two idle CPU cores: 150 steps outlast several intervals.
LONG_RUN_STEPS = 150


class StatusListener:
    """A second websocket client, as a browser panel is: collects the pack's messages with their arrival time."""

    def __init__(self, host: ComfyHost) -> None:
        self.messages: list[tuple[float, dict[str, Any]]] = []
        self._ws = websocket.create_connection(f"ws://{host.host}:{host.port}/ws?clientId={uuid.uuid4().hex}")
        self._ws.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._listen, daemon=True)
        self._thread.start()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                raw = self._ws.recv()
            except websocket.WebSocketTimeoutException:
                continue
            except websocket.WebSocketConnectionClosedException:
                return
            if isinstance(raw, str):
                message = json.loads(raw)
                if message.get("type") == STATUS_EVENT:
                    self.messages.append((time.monotonic(), message["data"]))

    def of(self, prompt_id: str) -> list[tuple[float, dict[str, Any]]]:
        return [(at, data) for at, data in self.messages if data["prompt_id"] == prompt_id]

    def wait_finished(self, prompt_id: str, timeout: float = 10.0) -> list[tuple[float, dict[str, Any]]]:
        """This prompt's messages, once the one saying its run finished has come."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            received = self.of(prompt_id)
            if received and not received[-1][1]["running"]:
                return received
            time.sleep(0.05)
        raise AssertionError(f"no finishing status for {prompt_id} in {timeout} s; got {self.of(prompt_id)}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self._ws.close()


@pytest.fixture(scope="module")
def long_run(comfy_host: ComfyHost) -> tuple[RunResult, list[tuple[float, dict[str, Any]]]]:
    """One run of LONG_RUN_STEPS steps and the status messages a listening client received for it."""
    # The workflow's placement is automatic: its first run on a device measures (strided), the next are planned.
    assert comfy_host.run(wan_prompt(2), timeout=300).ok
    listener = StatusListener(comfy_host)
    try:
        result = comfy_host.run(wan_prompt(LONG_RUN_STEPS), timeout=300)
        assert result.ok, result.error_text()
        received = listener.wait_finished(result.prompt_id)
    finally:
        listener.close()
    return result, received


def test_status_messages_follow_the_schema_and_the_run(long_run) -> None:
    result, received = long_run
    statuses = [data for _, data in received]
    for status in statuses:
        check_status(status)
    assert len(statuses) >= 4, f"a {result.wall_s:.1f} s run sent only {len(statuses)} messages"
    assert all(s["node"] == NODE_NAME and s["placement"] == PLACEMENT and s["blocks"] == BLOCKS for s in statuses)
    for status in statuses:  # the run's model is among those streaming (the session may hold others)
        assert (NODE_NAME, PLACEMENT) in [(m["node"], m["placement"]) for m in status["models"]], status["models"]
    assert all(s["running"] for s in statuses[:-1]) and not statuses[-1]["running"]
    seqs = [s["seq"] for s in statuses]
    assert seqs == sorted(set(seqs)), seqs
    done = [s["steps_done"] for s in statuses]
    assert done == sorted(done), done
    live = [s for s in statuses if s["block"] is not None]
    assert live, "no message named the block running"
    assert all(0 <= s["block"] < BLOCKS and 0 <= s["step"] < LONG_RUN_STEPS for s in live)
    # The final message carries the run's last step: one model pass per sampler step (cond and uncond batched).
    final = statuses[-1]
    assert final["steps_done"] == LONG_RUN_STEPS
    assert final["last_step"]["step"] == LONG_RUN_STEPS - 1
    assert sum("last_step" in s for s in statuses) >= 2
    # The pack's own copies on the CPU: RAM-to-RAM, but timed and counted like a device's.
    assert final["last_step"]["bytes_copied"] == final["streamed_host_bytes"]
    assert final["memory"]["resident_weights"] > 0 and final["memory"]["streaming_buffers"] > 0


def test_status_messages_respect_the_rate_limit(long_run) -> None:
    result, received = long_run
    sent = [data["time"] for _, data in received]
    gaps = [b - a for a, b in zip(sent, sent[1:], strict=False)]
    assert min(gaps) >= MIN_INTERVAL_S - 1e-3, f"messages sent {min(gaps) * 1e3:.1f} ms apart: {gaps}"
    # What the client saw: no more than the limit allows over the time they spanned (one interval of jitter).
    arrived = [at for at, _ in received]
    span = arrived[-1] - arrived[0]
    assert len(arrived) - 1 <= span / MIN_INTERVAL_S + 1, (len(arrived), span)
    rate = (len(arrived) - 1) / span
    print(f"\n{len(arrived)} status messages in {span:.2f} s ({rate:.2f}/s) over a {result.wall_s:.2f} s run")


def test_routes_return_the_last_run(comfy_host: ComfyHost, long_run) -> None:
    result, received = long_run
    report = comfy_host.get_json("/block_offload/report")
    check_status(report, "report")
    assert report["prompt_id"] == result.prompt_id and not report["running"]
    assert report["steps_done"] == LONG_RUN_STEPS and report["last_step"]["step"] == LONG_RUN_STEPS - 1
    assert report["timeline"]["step"] == LONG_RUN_STEPS - 1 and len(report["timeline"]["spans"]) == BLOCKS
    assert report["plan"] and report["node"] == NODE_NAME and report["process_rss_bytes"] > 0

    timeline = comfy_host.get_json("/block_offload/timeline")
    assert timeline["prompt_id"] == result.prompt_id and timeline["node"] == NODE_NAME
    assert timeline["steps_done"] == LONG_RUN_STEPS and not timeline["truncated"]
    assert [s["step"] for s in timeline["steps"]] == list(range(LONG_RUN_STEPS))
    for step in timeline["steps"]:
        assert [span["block"] for span in step["spans"]] == list(range(BLOCKS))
        assert step["bytes_copied"] == report["streamed_host_bytes"]
        assert 0.0 <= step["overlap"] <= 1.0 and step["duration_ms"] > 0
    # The last step the websocket carried is the last step of the downloadable timeline.
    last = timeline["steps"][-1]
    compact = received[-1][1]["last_step"]
    assert compact["duration_ms"] == pytest.approx(last["duration_ms"], abs=1e-3)

    download = comfy_host.get("/api/block_offload/timeline?download=1")
    assert download.status_code == 200
    assert "attachment" in download.headers["Content-Disposition"]
    assert download.json()["prompt_id"] == result.prompt_id


def test_a_prompt_nobody_follows_is_sampled_and_still_counts_every_step(comfy_host: ComfyHost, long_run) -> None:
    """Queued over HTTP alone, as a headless script may: no client on the websocket, so nobody can follow the
    steps, and the engine records a few (offload/timeline.py: the first steps of an engine, the step after a
    followed one, then one per period); the run still counts every step it ran."""
    steps = 60
    start = time.monotonic()
    prompt_id = comfy_host.queue(wan_prompt(steps))
    while not comfy_host.client.history(prompt_id):
        assert time.monotonic() - start < 300, f"prompt {prompt_id} did not finish in 300 s"
        time.sleep(0.05)
    wall_s = time.monotonic() - start
    timeline = comfy_host.get_json("/block_offload/timeline")
    assert timeline["prompt_id"] == prompt_id and not timeline["running"]
    assert timeline["steps_done"] == steps == comfy_host.get_json("/block_offload/report")["steps_done"]
    recorded = [step["step"] for step in timeline["steps"]]
    most = FIRST_STEPS_RECORDED + wall_s / UNWATCHED_PERIOD_S + 1
    assert 1 <= len(recorded) <= most < steps, f"recorded steps {recorded} of {steps} in {wall_s:.1f} s"
    assert recorded == sorted(recorded) and recorded[-1] < steps
    for step in timeline["steps"]:
        assert [span["block"] for span in step["spans"]] == list(range(BLOCKS))


@pytest.mark.parametrize("device", [device for device in DEVICES if device != "cpu"])
def test_gpu_figures_on_a_cuda_device(gpu_hosts: Callable[[str], ComfyHost], device: str) -> None:
    """ComfyUI on the GPU, in each of its loading modes (servers of their own: the session's runs with
    --cpu): device memory in every message, and the last step's copies timed by CUDA events."""
    host = gpu_hosts(device)
    listener = StatusListener(host)
    try:
        result = host.run(wan_prompt(LONG_RUN_STEPS), timeout=300)
        assert result.ok, result.error_text()
        statuses = [data for _, data in listener.wait_finished(result.prompt_id)]
    finally:
        listener.close()
    for status in statuses:
        check_status(status)
        assert status["accelerator"] and status["device"].startswith("cuda"), status["device"]
    final = statuses[-1]
    memory = final["memory"]
    assert memory["total"] == torch.cuda.mem_get_info()[1]
    assert memory["resident_weights"] > 0 and memory["streaming_buffers"] > 0
    assert memory["allocated"] >= memory["streaming_buffers"] and memory["other"] >= 0
    step = final["last_step"]
    assert step["peak_allocated"] >= memory["streaming_buffers"]
    assert step["bytes_copied"] == final["streamed_host_bytes"] and step["bandwidth_gbps"] > 0.1
    print(f"\nGPU: overlap {step['overlap']:.2f}, {step['bandwidth_gbps']:.1f} GB/s, step {step['duration_ms']:.2f} ms")


# -- in-process: the publisher on a real engine --------------------------------------------------


@pytest.fixture(scope="module")
def pack(comfy: SimpleNamespace) -> SimpleNamespace:  # noqa: F811 - the fixture imported above
    """The pack's engine, patcher and report modules, imported as ComfyUI imports them, and its panel, set up
    without a server."""
    return SimpleNamespace(
        offload=importlib.import_module("block_offload.offload"),
        patcher=comfy.patcher,
        report=comfy.panel_feed,
        panel_outbox=importlib.import_module("block_offload.nodes.panel"),
        panel=comfy.panel,
        engine=importlib.import_module("block_offload.nodes.engine"),
    )


def test_publisher_throttles_a_fast_run_in_process(pack: SimpleNamespace) -> None:
    report, panel = pack.report, pack.panel
    model, engine = streaming_engine(pack, num_blocks=8, resident=2)
    engine.runner.enable()
    panel.engine_started(engine)
    x = torch.randn(1, 8, 64)
    try:
        first_seq = panel.outbox.seq
        report.run_started(engine, resident_weights=0)
        steps, start = 0, time.perf_counter()
        with torch.inference_mode():
            # At least 1.2 s, and block calls enough to send twice what the throttle lets through, however
            # slowly a busy machine runs them (a fixed 1.2 s once ran too few steps under load).
            while (ran := time.perf_counter() - start) < 1.2 or steps * 8 <= 2 * (ran / MIN_INTERVAL_S + 2):
                model(x)
                steps += 1
        report.run_finished(engine)
        elapsed = time.perf_counter() - start
    finally:
        engine.stop()
    sent = panel.outbox.seq - first_seq
    # The start and the end are always sent (deferred to keep the interval), the rest when one is due.
    assert 2 <= sent <= elapsed / MIN_INTERVAL_S + 2, (sent, elapsed, steps)
    timeline = panel.run_timeline()
    assert timeline["steps_done"] == steps and len(timeline["steps"]) == steps
    assert timeline["placement"] == "RRSSSSSS" and not timeline["running"]
    assert all(len(step["spans"]) == 8 for step in timeline["steps"])
    snapshot = panel.snapshot()
    check_status(snapshot, "report")
    assert snapshot["last_step"]["step"] == steps - 1


def test_a_waiting_status_never_goes_after_a_newer_one(pack: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> None:
    """A run's first status, forced inside the interval, waits for its end; a newer status due then goes at
    once and the older one is dropped (sent after it, it went back in time, 0.2 ms later: seen in a full
    run); a timer that fires while another interval runs waits for that one's end."""
    panel_outbox = pack.panel_outbox
    sent: list[int] = []
    timers: list[Callable[[], None]] = []
    loop = SimpleNamespace(
        call_soon_threadsafe=lambda call_later, delay, callback: timers.append(callback),
        call_later=lambda delay, callback: timers.append(callback),
    )
    server = SimpleNamespace(loop=loop, send_sync=lambda event, status: sent.append(status["n"]))
    now = [1000.0]
    monkeypatch.setattr(panel_outbox.time, "perf_counter", lambda: now[0])
    outbox = panel_outbox.Outbox(server)
    assert outbox.send({"n": 1})
    assert outbox.send({"n": 2}, force=True) and sent == [1]  # waits for the interval's end
    now[0] += MIN_INTERVAL_S
    assert outbox.send({"n": 3}) and sent == [1, 3]  # due: sent, the older waiting one dropped
    now[0] += 0.1
    assert outbox.send({"n": 4}, force=True)
    timers.pop(0)()  # 2's timer fires inside 3's interval: 4 waits on
    assert sent == [1, 3]
    now[0] += MIN_INTERVAL_S - 0.1
    while timers:
        timers.pop(0)()
    assert sent == [1, 3, 4]


def test_listener_cost_per_block_call(pack: SimpleNamespace) -> None:
    """What the panel adds to every block call: one clock read and one compare, and a message when due."""
    report, panel = pack.report, pack.panel
    model, engine = streaming_engine(pack, num_blocks=4, resident=0)
    engine.runner.enable()
    panel.engine_started(engine)
    report.run_started(engine, resident_weights=0)
    with torch.inference_mode():
        model(torch.randn(1, 8, 64))  # a step for the messages to carry
    listener = engine.recorder.listener  # the panel's, which stopping the engine detaches
    engine.stop()
    calls = 200_000
    first_seq = panel.outbox.seq
    start = time.perf_counter()
    for i in range(calls):
        listener.block_called(0, i & 3)
    per_call = (time.perf_counter() - start) / calls
    sent = panel.outbox.seq - first_seq
    start = time.perf_counter()
    for _ in range(200):
        listener.status(engine.recorder.latest())
    per_message = (time.perf_counter() - start) / 200
    print(f"\npanel listener: {per_call * 1e9:.0f} ns per block call, {per_message * 1e6:.0f} us per message built")
    assert per_call < 5e-6, f"{per_call * 1e6:.2f} us per block call"
    assert sent <= (per_call * calls) / MIN_INTERVAL_S + 1
