"""Run a real ComfyUI server with this pack, and drive it over HTTP and its websocket.

Used by the demo (scripts/demo.py), the tests (tests/conftest.py) and a person
(``python -m harness.comfy_host ui``, what scripts/ui.sh runs)::

    with ComfyHost() as host:
        result = host.run(prompt, timeout=300)
        print(result.status, result.latent_files())

The ComfyUI folder is ``$COMFYUI_PATH`` if set, else the one scripts/setup.sh wrote
into ``.host/comfyui_path``. The server runs with ``.host/`` as its base directory
(models, outputs, custom_nodes/block_offload -> this repo), on a loopback port only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import requests
import websocket

REPO = Path(__file__).resolve().parent.parent
HOST_DIR = REPO / ".host"
LOOPBACK = "127.0.0.1"
DEFAULT_UI_PORT = 8188
LOG_TAIL_LINES = 40
SERVER_ARGS_ENV = "BLOCK_OFFLOAD_SERVER_ARGS"  # more ComfyUI flags for every server started here

#: For test servers: ComfyUI's classic cache (0.3.75's default) keeps only the last prompt's outputs, so a
#: repeated sampler runs again and an unused model is dropped, the same on every host. 0.33 defaults to a
#: cache that evicts by free RAM, which would make "was this sampled again?" depend on the machine.
CLASSIC_CACHE = ("--cache-classic",)
_ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
_LEVEL_TAG = re.compile(r"^\[(?:DEBUG|DETAIL|INFO|WARNING|ERROR|CRITICAL)\] ", re.MULTILINE)

# Events after which ComfyUI is done with a prompt (it still sends `executing` with
# node None once the history entry is written).
_OUTCOME_EVENTS = {
    "execution_success": "success",
    "execution_error": "error",
    "execution_interrupted": "interrupted",
}


class ComfyHostError(RuntimeError):
    """Anything that went wrong starting or talking to the ComfyUI server."""


class ComfyPathError(ComfyHostError):
    """The ComfyUI folder is missing or is not a ComfyUI."""


class PortInUseError(ComfyHostError):
    """The requested port is already taken."""


class StartupError(ComfyHostError):
    """The server exited or did not answer in time; carries the log's tail."""

    def __init__(self, message: str, log_tail: str) -> None:
        super().__init__(f"{message}\n--- last {LOG_TAIL_LINES} lines of the ComfyUI log ---\n{log_tail}")
        self.log_tail = log_tail


class ServerExitedError(StartupError):
    """The server died while in use; carries the log's tail."""


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


def resolve_comfyui_path(explicit: str | os.PathLike[str] | None = None, host_dir: Path = HOST_DIR) -> Path:
    """The ComfyUI folder: ``explicit``, else $COMFYUI_PATH, else ``.host/comfyui_path``."""
    if explicit is not None:
        path, source = Path(explicit), "the ComfyUI folder given"
    elif os.environ.get("COMFYUI_PATH"):
        path, source = Path(os.environ["COMFYUI_PATH"]), "COMFYUI_PATH"
    else:
        marker = host_dir / "comfyui_path"
        if not marker.is_file():
            raise ComfyPathError(
                f"No ComfyUI found: {marker} does not exist. Run scripts/setup.sh first "
                "(it installs ComfyUI 0.3.75 into .comfyui/), or set COMFYUI_PATH to your own ComfyUI folder."
            )
        path, source = Path(marker.read_text().strip()), f"{marker}"
    if not (path / "main.py").is_file() or not (path / "comfy").is_dir():
        hint = (
            "Fix or unset COMFYUI_PATH"
            if source == "COMFYUI_PATH"
            else "Run scripts/setup.sh, or set COMFYUI_PATH to the folder that holds ComfyUI's main.py"
        )
        raise ComfyPathError(f"{path} (from {source}) is not a ComfyUI folder: no main.py and comfy/ there. {hint}.")
    return path.resolve()


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A port the OS says is free now (another process could still take it before ComfyUI binds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def cuda_available(python: str = sys.executable) -> bool:
    """Whether torch in ``python``'s environment sees a CUDA device (asked in a child process)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    try:
        return subprocess.run([python, "-c", probe], capture_output=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def ensure_tiny_models(models_dir: Path | None = None) -> dict[str, Path]:
    """Write the tiny random-weight checkpoints (harness/tiny_models.py) into ``models_dir``."""
    from . import tiny_models

    return dict(tiny_models.generate(models_dir or HOST_DIR / "models"))


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


class ComfyHost:
    """A ComfyUI server in a child process; a context manager that stops it on exit.

    port: None picks a free loopback port; a given port that is taken raises PortInUseError.
    cpu: pass ``--cpu`` (default) so runs behave the same with or without a GPU.
    extra_args: more ComfyUI command-line flags (see comfy/cli_args.py).
    """

    def __init__(
        self,
        comfyui_path: str | os.PathLike[str] | None = None,
        *,
        base_dir: Path | None = None,
        port: int | None = None,
        cpu: bool = True,
        extra_args: Sequence[str] = (),
        log_path: Path | None = None,
        python: str | None = None,
        startup_timeout: float = 180.0,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.comfyui_path = resolve_comfyui_path(comfyui_path)
        self.base_dir = (base_dir or HOST_DIR).resolve()
        self.host = LOOPBACK
        self.requested_port = port
        self.port = port or 0
        self.cpu = cpu
        self.extra_args = list(extra_args)
        self.log_path = log_path
        self.python = python or sys.executable
        self.startup_timeout = startup_timeout
        self.env = dict(env) if env is not None else None
        self.startup_s: float | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._http = requests.Session()

    # ----------------------------------------------------------------- lifecycle
    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def output_dir(self) -> Path:
        return self.base_dir / "output"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server process's id (to read its memory, say), while it runs."""
        return self._proc.pid if self.running else None

    def command(self) -> list[str]:
        cmd = [self.python, str(self.comfyui_path / "main.py")]
        if self.cpu:
            cmd.append("--cpu")
        cmd += [
            "--listen", self.host,
            "--port", str(self.port),
            "--base-directory", str(self.base_dir),
            "--database-url", "sqlite:///:memory:",
            "--disable-auto-launch",
        ]  # fmt: skip
        # SERVER_ARGS_ENV: flags every test server gets on a machine that needs them (the bare GPU machine
        # runs ComfyUI without its frontend package: --front-end-root at an empty folder).
        return cmd + self.extra_args + shlex.split(os.environ.get(SERVER_ARGS_ENV, ""))

    def start(self) -> ComfyHost:
        if self.running:
            return self
        if self.requested_port is not None:
            if not port_is_free(self.requested_port, self.host):
                raise PortInUseError(
                    f"Port {self.requested_port} on {self.host} is already in use (another ComfyUI?). "
                    "Stop whatever holds it, pick another port (e.g. --port 8189), "
                    "or leave the port out to get a free one."
                )
            self.port = self.requested_port
        else:
            self.port = free_port(self.host)
        for sub in ("custom_nodes", "models", "input", "output", "temp"):
            (self.base_dir / sub).mkdir(parents=True, exist_ok=True)
        if self.log_path is None:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            self.log_path = self.base_dir / "logs" / f"comfyui-{stamp}-{self.port}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - closed in stop()
        env = dict(os.environ if self.env is None else self.env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        t0 = time.monotonic()
        try:
            self._proc = subprocess.Popen(
                self.command(),
                cwd=self.comfyui_path,
                stdin=subprocess.DEVNULL,
                stdout=self._log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,  # a terminal's Ctrl-C reaches us, and we stop it
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
        except BaseException:
            self._close_log()
            raise
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        assert self._proc is not None
        deadline = t0 + self.startup_timeout
        while True:
            code = self._proc.poll()
            if code is not None:
                raise StartupError(
                    f"ComfyUI exited with code {code} while starting ({' '.join(self.command())}).",
                    self.log_tail(),
                )
            try:
                if self._http.get(f"{self.url}/system_stats", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            if time.monotonic() > deadline:
                raise StartupError(
                    f"ComfyUI did not answer GET /system_stats on {self.url} within {self.startup_timeout:.0f} s.",
                    self.log_tail(),
                )
            time.sleep(0.25)

    def stop(self, timeout: float = 15.0) -> int | None:
        """Terminate the server (kill it if it has not exited after ``timeout``); returns its exit code."""
        code: int | None = None
        try:
            if self._proc is not None:
                if self._proc.poll() is None:
                    self._proc.terminate()
                    try:
                        self._proc.wait(timeout)
                    except subprocess.TimeoutExpired:
                        self._proc.kill()
                        self._proc.wait(timeout)
                code = self._proc.returncode
        finally:
            self._close_log()
            self._http.close()
        return code

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> ComfyHost:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def log_text(self) -> str:
        """The server's output so far, as plain lines on every host: ComfyUI 0.33 and later start each
        logged line with a coloured level tag (``\\x1b[32m[INFO]\\x1b[0m ``), which is taken off."""
        if self.log_path is None or not self.log_path.exists():
            return ""
        if self._log is not None:
            self._log.flush()
        return _LEVEL_TAG.sub("", _ANSI_COLOUR.sub("", self.log_path.read_text(errors="replace")))

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # ---------------------------------------------------------------------- HTTP
    def _check_alive(self) -> None:
        if self._proc is None:
            raise ComfyHostError("The ComfyUI server is not started; use `with ComfyHost() as host:` or start().")
        code = self._proc.poll()
        if code is not None:
            raise ServerExitedError(f"The ComfyUI server has exited (code {code}).", self.log_tail())

    def get(self, path: str, timeout: float = 60.0) -> requests.Response:
        self._check_alive()
        return self._http.get(self.url + path, timeout=timeout)

    def post(self, path: str, payload: Any = None, timeout: float = 60.0) -> requests.Response:
        self._check_alive()
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
        self._check_alive()
        client_id = uuid.uuid4().hex
        t0 = time.monotonic()
        deadline = t0 + timeout
        ws = websocket.create_connection(f"ws://{self.host}:{self.port}/ws?clientId={client_id}", timeout=10)
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
                    raise RunTimeoutError(
                        f"prompt {prompt_id} did not finish within {timeout:.0f} s (interrupted it). "
                        f"Last events: {seen}\n--- ComfyUI log tail ---\n{self.log_tail()}"
                    )
                ws.settimeout(max(0.05, min(1.0, deadline - now, (grace_end or deadline) - now)))
                try:
                    opcode, raw = ws.recv_data()
                except websocket.WebSocketTimeoutException:
                    self._check_alive()
                    continue
                except websocket.WebSocketConnectionClosedException as exc:
                    self._check_alive()
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


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the process that started it dies (Linux), so a
    killed test run or demo leaves no orphaned server behind."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


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


# ------------------------------------------------------------------------ the UI
def _follow(path: Path, proc_alive: Any) -> Iterator[str]:
    with open(path, errors="replace") as fh:
        while True:
            line = fh.readline()
            if line:
                yield line
            elif not proc_alive():
                yield from fh.readlines()
                return
            else:
                time.sleep(0.2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    ui = sub.add_parser("ui", help="start ComfyUI with this pack for a person to open in a browser (Ctrl-C stops)")
    ui.add_argument("--port", type=int, default=DEFAULT_UI_PORT, help=f"loopback port (default {DEFAULT_UI_PORT})")
    ui.add_argument("--cpu", action="store_true", help="force --cpu even when a CUDA device exists")
    ui.add_argument("--no-tiny-models", action="store_true", help="do not write the tiny test models into .host/models")
    ui.add_argument("extra", nargs=argparse.REMAINDER, help="after --: more ComfyUI flags")
    args = parser.parse_args(argv)

    extra = [a for a in args.extra if a != "--"]
    # Ctrl-C and a plain `kill` both stop the server cleanly (SIGINT may arrive ignored when
    # started in the background by a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    if not args.no_tiny_models:
        try:
            ensure_tiny_models()
        except ComfyHostError as exc:
            print(f"note: {exc}", file=sys.stderr)
    cpu = args.cpu or not cuda_available()
    host = ComfyHost(port=args.port, cpu=cpu, extra_args=extra, startup_timeout=600)
    print(f"Starting ComfyUI from {host.comfyui_path} ({'CPU' if cpu else 'CUDA'}), base directory {host.base_dir} ...")
    try:
        host.start()
    except ComfyHostError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"\nComfyUI is running: open {host.url}  (log: {host.log_path}; Ctrl-C stops it)\n", flush=True)
    try:
        assert host.log_path is not None
        for line in _follow(host.log_path, lambda: host.running):
            sys.stdout.write(line)
            sys.stdout.flush()
        print(f"ComfyUI exited with code {host.stop()}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nStopping ComfyUI ...", file=sys.stderr)
        host.stop()
        return 0


if __name__ == "__main__":
    sys.exit(main())
