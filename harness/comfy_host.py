"""Run a real ComfyUI server with this pack in a child process; its ``client`` (harness/comfy_client.py)
drives it over HTTP and its websocket, and the host forwards the calls its callers make (``host.run`` is
``host.client.run``).

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
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import requests

from .comfy_client import ComfyClient, ComfyHostError, RunResult, WsEvent

REPO = Path(__file__).resolve().parent.parent
#: What scripts/setup.sh lays out: the prepared hosts (hosts.tsv, comfyui_path) and the default base directory.
SETUP_DIR = REPO / ".host"
BASE_DIR_ENV = "BLOCK_OFFLOAD_BASE_DIR"


def _base_dir() -> Path:
    """The base directory the servers run in (models, outputs, user data, custom_nodes): ``.host/``, or the folder
    ``BASE_DIR_ENV`` names, one more per pytest-xdist worker. scripts/test.sh gives each suite its own, so they run
    side by side without one server's start (ComfyUI empties its temp folder) or the planner's cost cache reaching
    another's."""
    named = os.environ.get(BASE_DIR_ENV)
    if not named:
        return SETUP_DIR
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return Path(f"{named}-{worker}" if worker else named).resolve()


HOST_DIR = _base_dir()


def share_setup_dir(base: Path) -> None:
    """Lays out a base directory of its own that shares ``.host/``'s custom_nodes (this pack, ComfyUI-GGUF) and
    models (the tiny checkpoints, written once for all: each file is written whole, then renamed into place)."""
    base.mkdir(parents=True, exist_ok=True)
    for shared in ("custom_nodes", "models"):
        link = base / shared
        if not link.is_symlink() and not link.exists():
            link.symlink_to(SETUP_DIR / shared, target_is_directory=True)


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
_NOT_STARTED = "The ComfyUI server is not started; use `with ComfyHost() as host:` or start()."


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


def resolve_comfyui_path(explicit: str | os.PathLike[str] | None = None, host_dir: Path = SETUP_DIR) -> Path:
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
        self._client: ComfyClient | None = None

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
    def log_open(self) -> bool:
        """Whether the host holds the server's log file open: from start() until stop() (or a failed start)
        closes it."""
        return self._log is not None

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
        self._client = ComfyClient(
            self.url,
            base_dir=self.base_dir,
            output_dir=self.output_dir,
            check_alive=self._check_alive,
            log_tail=self.log_tail,
        )
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
            if self.client.answers():
                return
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
            if self._client is not None:
                self._client.close()
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

    def _check_alive(self) -> None:
        """Raise unless the server runs: the client's check before each request, so a dead server fails fast."""
        if self._proc is None:
            raise ComfyHostError(_NOT_STARTED)
        code = self._proc.poll()
        if code is not None:
            raise ServerExitedError(f"The ComfyUI server has exited (code {code}).", self.log_tail())

    # ------------------------------------------------------- the client, and its calls forwarded
    @property
    def client(self) -> ComfyClient:
        """This server's client (start() makes it, for the port it picked). The host forwards the client's calls
        that callers make on it (``host.run(...)`` is ``host.client.run(...)``)."""
        if self._client is None:
            raise ComfyHostError(_NOT_STARTED)
        return self._client

    def get(self, path: str, timeout: float = 60.0) -> requests.Response:
        return self.client.get(path, timeout)

    def post(self, path: str, payload: Any = None, timeout: float = 60.0) -> requests.Response:
        return self.client.post(path, payload, timeout)

    def get_json(self, path: str, timeout: float = 60.0) -> Any:
        return self.client.get_json(path, timeout)

    def system_stats(self) -> dict[str, Any]:
        return self.client.system_stats()

    def object_info(self, node_class: str | None = None) -> dict[str, Any]:
        return self.client.object_info(node_class)

    def queue(
        self, prompt: Mapping[str, Any], client_id: str | None = None, extra_data: Mapping[str, Any] | None = None
    ) -> str:
        return self.client.queue(prompt, client_id, extra_data)

    def interrupt(self, prompt_id: str | None = None) -> None:
        self.client.interrupt(prompt_id)

    def free(self, unload_models: bool = True, free_memory: bool = True) -> None:
        self.client.free(unload_models, free_memory)

    def run(
        self, prompt: Mapping[str, Any], timeout: float = 600.0, on_event: Callable[[WsEvent], None] | None = None
    ) -> RunResult:
        return self.client.run(prompt, timeout, on_event)


def _die_with_parent() -> None:
    """In the child, before exec: get SIGTERM when the process that started it dies (Linux), so a
    killed test run or demo leaves no orphaned server behind."""
    import ctypes

    pr_set_pdeathsig = 1
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def interrupt_on_sigterm() -> None:
    """Ctrl-C, ``timeout`` and a plain ``kill`` all raise KeyboardInterrupt, so with-blocks unwind: servers stop,
    and a benchmark's temporary checkpoints (tens of GB on a GPU machine's disk, or in /dev/shm) are removed,
    where Python's default for SIGTERM ends the process at once. SIGINT may arrive ignored when a script started
    the process in the background."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)


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
    interrupt_on_sigterm()
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
