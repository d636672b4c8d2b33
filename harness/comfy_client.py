"""Talk to a running ComfyUI server over HTTP and its websocket: queue a prompt, follow it, read what it wrote.

A :class:`ComfyClient` needs only the server's URL and folders, so it works with any ComfyUI; the one
harness/comfy_host.py starts holds one as ``host.client`` (and forwards its calls)::

    client = ComfyClient("http://127.0.0.1:8188", base_dir=comfyui, output_dir=comfyui / "output")
    result = client.run(prompt, timeout=300)
    print(result.status, result.latent_files())
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import requests
import websocket

# Events after which ComfyUI is done with a prompt (it still sends `executing` with
# node None once the history entry is written).
_OUTCOME_EVENTS = {
    "execution_success": "success",
    "execution_error": "error",
    "execution_interrupted": "interrupted",
}


class ComfyHostError(RuntimeError):
    """Anything that went wrong starting or talking to the ComfyUI server (the base of comfy_host's errors
    too, so one ``except ComfyHostError`` covers both)."""


class PromptValidationError(ComfyHostError):
    """POST /prompt answered 400: ComfyUI rejected the workflow before running it."""

    def __init__(self, error: Any, node_errors: Mapping[str, Any]) -> None:
        self.error = error
        self.node_errors = dict(node_errors)
        super().__init__("ComfyUI rejected the prompt:\n" + format_prompt_errors(error, node_errors))


class RunTimeoutError(ComfyHostError):
    """A prompt did not finish in time (it was interrupted)."""


def format_prompt_errors(error: Any, node_errors: Mapping[str, Any]) -> str:
    """ComfyUI's /prompt error and per-node validation errors as readable lines."""
    lines: list[str] = []
    if isinstance(error, Mapping):
        head = str(error.get("message", "")).strip()
        details = str(error.get("details", "")).strip()
        lines.append(f"{head}: {details}" if details else head)
    elif error:
        lines.append(str(error))
    for node_id, info in node_errors.items():
        class_type = info.get("class_type", "?") if isinstance(info, Mapping) else "?"
        errors = info.get("errors", []) if isinstance(info, Mapping) else [info]
        for err in errors:
            if isinstance(err, Mapping):
                msg = str(err.get("message", ""))
                details = str(err.get("details", ""))
                lines.append(f"  node {node_id} ({class_type}): {msg}" + (f": {details}" if details else ""))
            else:
                lines.append(f"  node {node_id} ({class_type}): {err}")
    return "\n".join(line for line in lines if line)


@dataclass
class WsEvent:
    """One websocket message: ``type`` and ``data`` of a JSON message, or ``binary`` for a binary frame
    (then ``type`` is "binary" and ``data`` is ``{"event": <int>}``, ComfyUI's binary event number)."""

    type: str
    data: Any
    binary: bytes | None = None
    received_at: float = 0.0


@dataclass
class RunResult:
    prompt_id: str
    status: str  # "success" | "error" | "interrupted"
    events: list[WsEvent]
    history: dict[str, Any]
    wall_s: float
    base_dir: Path
    output_dir: Path = field(default=Path())

    @property
    def ok(self) -> bool:
        return self.status == "success"

    def events_of(self, *types: str) -> list[WsEvent]:
        return [e for e in self.events if e.type in types]

    def event_types(self) -> list[str]:
        return [e.type for e in self.events]

    def error(self) -> dict[str, Any] | None:
        """The ``execution_error`` message's data (exception_message, traceback, node_type...), if any."""
        errs = self.events_of("execution_error")
        return errs[-1].data if errs else None

    def error_text(self) -> str:
        err = self.error()
        if err is None:
            return ""
        trace = "".join(err.get("traceback") or [])
        return (
            f"node {err.get('node_id')} ({err.get('node_type')}): "
            f"{err.get('exception_type')}: {err.get('exception_message')}\n{trace}"
        )

    def outputs(self) -> dict[str, Any]:
        """``history['outputs']``: node id -> the ``ui`` dict that node returned."""
        return dict(self.history.get("outputs", {}))

    def output_files(self, kind: str | None = None) -> list[Path]:
        """Paths of the files the output nodes reported (``kind``: "latents", "images", ... or all)."""
        folders = {"output": self.output_dir, "temp": self.base_dir / "temp", "input": self.base_dir / "input"}
        paths: list[Path] = []
        for node_out in self.outputs().values():
            if not isinstance(node_out, Mapping):
                continue
            for key, items in node_out.items():
                if kind is not None and key != kind or not isinstance(items, list):
                    continue
                for item in items:
                    if isinstance(item, Mapping) and "filename" in item:
                        folder = folders.get(str(item.get("type", "output")), self.output_dir)
                        paths.append(folder / str(item.get("subfolder", "")) / str(item["filename"]))
        return paths

    def latent_files(self) -> list[Path]:
        """The ``.latent`` files SaveLatent wrote (safetensors with a ``latent_tensor`` key)."""
        return self.output_files("latents")

    def summary(self) -> dict[str, Any]:
        counts: dict[str, int] = {}
        for e in self.events:
            counts[e.type] = counts.get(e.type, 0) + 1
        return {
            "prompt_id": self.prompt_id,
            "status": self.status,
            "wall_s": round(self.wall_s, 3),
            "outputs": [str(p) for p in self.output_files()],
            "events": counts,
        }


class ComfyClient:
    """HTTP and websocket calls to the ComfyUI server at ``url``.

    base_dir, output_dir: the server's base directory and output folder, where a RunResult looks for the
    files a run wrote. check_alive: raises when the server is known to be gone (a host whose process
    exited); called before each request and while waiting on the websocket, so a dead server fails at once
    instead of timing out. log_tail: the server's log's last lines, put into a RunTimeoutError.
    """

    def __init__(
        self,
        url: str,
        *,
        base_dir: Path,
        output_dir: Path,
        check_alive: Callable[[], None] | None = None,
        log_tail: Callable[[], str] | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.ws_url = "ws" + self.url.removeprefix("http")  # http -> ws, https -> wss
        self.base_dir = base_dir
        self.output_dir = output_dir
        self._check_alive = check_alive
        self._log_tail = log_tail
        self._http = requests.Session()

    def close(self) -> None:
        self._http.close()

    def _alive(self) -> None:
        if self._check_alive is not None:
            self._check_alive()

    def answers(self, timeout: float = 2.0) -> bool:
        """Whether GET /system_stats answers 200 now (no liveness check: what a starting server is polled with)."""
        try:
            return self._http.get(f"{self.url}/system_stats", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    # ---------------------------------------------------------------------- HTTP
    def get(self, path: str, timeout: float = 60.0) -> requests.Response:
        self._alive()
        return self._http.get(self.url + path, timeout=timeout)

    def post(self, path: str, payload: Any = None, timeout: float = 60.0) -> requests.Response:
        self._alive()
        return self._http.post(self.url + path, json=payload if payload is not None else {}, timeout=timeout)

    def get_json(self, path: str, timeout: float = 60.0) -> Any:
        resp = self.get(path, timeout)
        if resp.status_code != 200:
            raise ComfyHostError(f"GET {path} answered {resp.status_code}: {resp.text[:2000]}")
        return resp.json()

    def system_stats(self) -> dict[str, Any]:
        return dict(self.get_json("/system_stats"))

    def object_info(self, node_class: str | None = None) -> dict[str, Any]:
        return dict(self.get_json("/object_info" + (f"/{node_class}" if node_class else "")))

    def queue(
        self, prompt: Mapping[str, Any], client_id: str | None = None, extra_data: Mapping[str, Any] | None = None
    ) -> str:
        """POST /prompt; returns the prompt id. Raises PromptValidationError with ComfyUI's node_errors on 400."""
        payload: dict[str, Any] = {"prompt": dict(prompt)}
        if client_id is not None:
            payload["client_id"] = client_id
        if extra_data:
            payload["extra_data"] = dict(extra_data)
        resp = self.post("/prompt", payload)
        try:
            body = resp.json()
        except ValueError:
            body = None
        if resp.status_code == 400 and isinstance(body, dict):
            raise PromptValidationError(body.get("error"), body.get("node_errors") or {})
        if resp.status_code != 200 or not isinstance(body, dict) or "prompt_id" not in body:
            raise ComfyHostError(f"POST /prompt answered {resp.status_code}: {resp.text[:2000]}")
        return str(body["prompt_id"])

    def history(self, prompt_id: str) -> dict[str, Any]:
        """The /history entry of ``prompt_id`` ({} until the prompt has finished)."""
        return dict(self.get_json(f"/history/{prompt_id}").get(prompt_id, {}))

    def interrupt(self, prompt_id: str | None = None) -> None:
        """Interrupt the running prompt (only ``prompt_id`` if given)."""
        self.post("/interrupt", {"prompt_id": prompt_id} if prompt_id else {}).raise_for_status()

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        """Ask ComfyUI to unload models / free memory (it does so before its next prompt or when idle)."""
        self.post("/free", {"unload_models": unload_models, "free_memory": free_memory}).raise_for_status()

    # ------------------------------------------------------------------- running
    def run(
        self,
        prompt: Mapping[str, Any],
        timeout: float = 600.0,
        on_event: Callable[[WsEvent], None] | None = None,
    ) -> RunResult:
        """Queue ``prompt`` and follow it over the websocket until ComfyUI is done with it.

        Every message for this run is kept in order: ComfyUI's own (execution_start,
        executing, progress, executed, ...) and any custom type a pack sends. Messages
        that name another prompt_id are dropped; messages without one (status, a pack's
        custom events) are kept. ``on_event`` sees each kept message as it arrives (to
        interrupt at a chosen moment, say). On timeout the prompt is interrupted and
        RunTimeoutError raised.
        """
        self._alive()
        client_id = uuid.uuid4().hex
        t0 = time.monotonic()
        deadline = t0 + timeout
        ws = websocket.create_connection(f"{self.ws_url}/ws?clientId={client_id}", timeout=10)
        events: list[WsEvent] = []
        status: str | None = None
        prompt_id = ""
        try:
            prompt_id = self.queue(prompt, client_id=client_id)
            grace_end: float | None = None  # after an outcome event, wait briefly for `executing` None
            while True:
                now = time.monotonic()
                if grace_end is not None and now > grace_end:
                    break
                if now > deadline:
                    with contextlib.suppress(Exception):
                        self.interrupt(prompt_id)
                    seen = ", ".join(e.type for e in events[-15:])
                    tail = f"\n--- ComfyUI log tail ---\n{self._log_tail()}" if self._log_tail is not None else ""
                    raise RunTimeoutError(
                        f"prompt {prompt_id} did not finish within {timeout:.0f} s (interrupted it). "
                        f"Last events: {seen}{tail}"
                    )
                ws.settimeout(max(0.05, min(1.0, deadline - now, (grace_end or deadline) - now)))
                try:
                    opcode, raw = ws.recv_data()
                except websocket.WebSocketTimeoutException:
                    self._alive()
                    continue
                except websocket.WebSocketConnectionClosedException as exc:
                    self._alive()
                    raise ComfyHostError(f"websocket closed while running prompt {prompt_id}") from exc
                event = _decode(opcode, raw)
                if event is None:
                    continue
                data = event.data
                other = isinstance(data, Mapping) and "prompt_id" in data and data["prompt_id"] != prompt_id
                if other:
                    continue
                events.append(event)
                if on_event is not None:
                    on_event(event)
                if event.type in _OUTCOME_EVENTS:
                    status = _OUTCOME_EVENTS[event.type]
                    grace_end = time.monotonic() + 10.0
                elif event.type == "executing" and isinstance(data, Mapping) and data.get("node") is None:
                    break
        finally:
            ws.close()
        history = self._wait_history(prompt_id, deadline=time.monotonic() + 15.0)
        if status is None:
            status_str = history.get("status", {}).get("status_str")
            status = "success" if status_str == "success" else "error"
        return RunResult(
            prompt_id=prompt_id,
            status=status,
            events=events,
            history=history,
            wall_s=time.monotonic() - t0,
            base_dir=self.base_dir,
            output_dir=self.output_dir,
        )

    def _wait_history(self, prompt_id: str, deadline: float) -> dict[str, Any]:
        while True:
            entry = self.history(prompt_id)
            if entry or time.monotonic() > deadline:
                return entry
            time.sleep(0.1)


def _decode(opcode: int, raw: bytes | str) -> WsEvent | None:
    now = time.monotonic()
    if opcode == websocket.ABNF.OPCODE_TEXT:
        text = raw.decode("utf-8", errors="replace") if isinstance(raw, bytes) else raw
        try:
            msg = json.loads(text)
        except ValueError:
            return WsEvent("text", text, received_at=now)
        if isinstance(msg, dict) and "type" in msg:
            return WsEvent(str(msg["type"]), msg.get("data"), received_at=now)
        return WsEvent("text", msg, received_at=now)
    if opcode == websocket.ABNF.OPCODE_BINARY:
        payload = raw if isinstance(raw, bytes) else raw.encode()
        number = int.from_bytes(payload[:4], "big") if len(payload) >= 4 else -1
        return WsEvent("binary", {"event": number}, binary=payload[4:], received_at=now)
    return None
