"""Shared fixtures: one real ComfyUI server per test session, and the tiny models it loads.

* ``comfy_host``: a started :class:`comfy_host.ComfyHost` (CPU, free loopback port,
  base directory ``.host/``, this pack in custom_nodes), stopped after the session.
* ``tiny_models``: the tiny random-weight checkpoints, written into ``.host/models`` once.
* ``comfyui_path``: the ComfyUI folder, put on ``sys.path`` so a test can import
  ``comfy``/``nodes`` in-process. Nothing here imports comfy at module level.
* ``comfy``: ComfyUI and this pack in the test process (``harness/inprocess.py``);
  ``allow_cpu_streaming``: the nodes stream on the CPU too; ``unstreamed``: a module's references, each
  sampled once for all the nodes' cases.
* ``cudart``: CUDA's runtime faked behind the engine's registrar, so pinning runs on the CPU.
* ``served_frontend``: the browser tests' frontends (``harness/browser.py``), the host's pinned one on the
  session's server and the newest one on a server of its own; the test id names it.

The helpers the tests share live in ``harness/``, which the tests import like any package (the
repository root is on ``sys.path``, pyproject's ``pythonpath``); importing it makes the pack
importable as ``block_offload``, the one name the tests use for it.
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from harness import big_model
from harness.browser import (
    NEWEST_FRONTEND,
    PINNED,
    ServedFrontend,
    frontend_args,
    frontend_missing,
    pinned_frontend_version,
)
from harness.comfy_host import (
    CLASSIC_CACHE,
    HOST_DIR,
    SETUP_DIR,
    ComfyHost,
    ComfyHostError,
    ensure_tiny_models,
    resolve_comfyui_path,
    share_setup_dir,
)
from harness.dynamic_vram import STORED, DynamicVram
from harness.fake_cudart import cudart_fixture  # noqa: F401 (the ``cudart`` fixture)
from harness.inprocess import Unstreamed, in_process_comfy
from harness.pack import skip_pack_setup
from harness.prompts import server_env


def comfyui_version() -> str:
    """The version of the ComfyUI the suite runs on (its ``comfyui_version.py``)."""
    try:
        text = (resolve_comfyui_path() / "comfyui_version.py").read_text()
    except (ComfyHostError, OSError):  # no host set up: the fixtures that need one say so
        return "unknown"
    return text.split("__version__ = ")[1].split()[0].strip("\"'")


HOST_VERSION = comfyui_version()

#: ComfyUI's loading modes on a GPU, by their command-line flags: 0.33's default (Dynamic VRAM, comfy-aimdo)
#: and the classic loader it keeps behind --disable-dynamic-vram; 0.3.x has only the classic one.
GPU_MODES: dict[str, tuple[str, ...]] = (
    {"classic": ()} if HOST_VERSION.startswith("0.3.") else {"dynamic-vram": (), "classic": ("--disable-dynamic-vram",)}
)
NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
#: Parameters for tests that run on the session's CPU server and on a GPU server in each mode.
DEVICES = ["cpu", *(pytest.param(f"cuda-{mode}", marks=NEEDS_CUDA, id=f"cuda-{mode}") for mode in GPU_MODES)]


def pytest_sessionstart(session: pytest.Session) -> None:
    if HOST_DIR != SETUP_DIR:  # a base directory of this suite's own (scripts/test.sh)
        share_setup_dir(HOST_DIR)


def pytest_report_header(config: pytest.Config) -> str:
    return f"ComfyUI host: {HOST_VERSION} ({os.environ.get('COMFYUI_PATH') or 'the set-up default'})"


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """Every test id names the ComfyUI it ran on (``[comfyui-0.33.0]``): the suite runs once per host."""
    if "comfyui_host" in metafunc.fixturenames:
        metafunc.parametrize("comfyui_host", [HOST_VERSION], ids=[f"comfyui-{HOST_VERSION}"], scope="session")


@pytest.fixture(autouse=True)
def _host_in_test_id(comfyui_host: str) -> None:
    """Pulls ``comfyui_host`` into every test, so ``pytest_generate_tests`` puts the host in its id."""


#: Set by scripts/test.sh for every host but one: the tests marked ``one_host`` run on that one.
ONE_HOST_ELSEWHERE_ENV = "BLOCK_OFFLOAD_ONE_HOST_ELSEWHERE"


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves out the ``one_host`` tests where another host of the same run has them. On pytest-xdist's workers
    (``scripts/test.sh`` turns xdist's own order off) the files go out with the ``big_model`` ones first, then by
    number of tests: a worker waiting for the machine's turn early leaves the other processes the cores, one
    waiting at the end leaves a core idle."""
    skip_pack_setup(items)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        big = {item.path for item in items if item.get_closest_marker("big_model") is not None}
        counts = Counter(item.path for item in items)
        items.sort(key=lambda item: (item.path not in big, -counts[item.path]))
    if not os.environ.get(ONE_HOST_ELSEWHERE_ENV):
        return
    kept, elsewhere = [], []
    for item in items:
        (kept if item.get_closest_marker("one_host") is None else elsewhere).append(item)
    if elsewhere:
        config.hook.pytest_deselected(items=elsewhere)
        items[:] = kept


@pytest.fixture(autouse=True)
def _big_model_takes_its_turn(request: pytest.FixtureRequest) -> Iterator[None]:
    """A ``big_model`` test waits for every other suite's to end (``harness/big_model.py``), and leaves the
    session's server holding no model."""
    if request.node.get_closest_marker("big_model") is None:
        yield
        return
    with big_model.one_at_a_time():
        yield
        host = request.node.funcargs.get("comfy_host")
        if isinstance(host, ComfyHost) and host.running:
            big_model.drop_models(host)


#: Each test's reports by phase (setup, call, teardown), for fixtures that share something only while tests pass.
PHASE_REPORTS = pytest.StashKey[dict[str, pytest.TestReport]]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    report: pytest.TestReport = yield
    item.stash.setdefault(PHASE_REPORTS, {})[report.when] = report
    return report


def failed(item: pytest.Item) -> bool:
    """Whether a phase of ``item`` run so far failed."""
    return any(report.failed for report in item.stash.get(PHASE_REPORTS, {}).values())


@pytest.fixture(scope="session")
def comfyui_path() -> Path:
    """The ComfyUI folder ($COMFYUI_PATH or the one scripts/setup.sh installed), on sys.path."""
    path = resolve_comfyui_path()
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    return path


@pytest.fixture(scope="session")
def tiny_models() -> dict[str, Path]:
    """The tiny checkpoints in .host/models (generated once per session)."""
    try:
        return ensure_tiny_models(HOST_DIR / "models")
    except ComfyHostError as exc:  # harness/tiny_models.py cannot write them
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def comfy_host() -> Iterator[ComfyHost]:
    """One ComfyUI server for the whole session, with the tiny models in place when they can be made."""
    try:
        ensure_tiny_models(HOST_DIR / "models")
    except ComfyHostError as exc:
        sys.stderr.write(f"conftest: {exc}\n")
    host = ComfyHost(env=server_env(), extra_args=CLASSIC_CACHE)
    host.start()
    try:
        yield host
    finally:
        host.stop()


#: The frontends the browser tests run on, each named in the test id: the host's pinned one, then the newest.
FRONTENDS = (
    pytest.param(PINNED, id=f"frontend-pinned-{pinned_frontend_version()}"),
    pytest.param(
        NEWEST_FRONTEND,
        id=f"frontend-{NEWEST_FRONTEND}",
        marks=pytest.mark.one_host(reason="the newest frontend is tried on the first host; each host runs its own"),
    ),
)


@pytest.fixture(scope="session", params=FRONTENDS)
def served_frontend(request: pytest.FixtureRequest) -> Iterator[ServedFrontend]:
    """A frontend and the server serving it: the pinned one is the session's ``comfy_host``; the newest gets a
    server of its own, started like that one (same base directory and flags) plus ``--front-end-root``, and
    stopped when the tests on it are done."""
    name: str = request.param
    missing = frontend_missing(name)
    if missing is not None:
        pytest.skip(missing)
    if name == PINNED:
        yield ServedFrontend(name, pinned_frontend_version(), (), request.getfixturevalue("comfy_host"))
        return
    args = frontend_args(name)
    with ComfyHost(env=server_env(), extra_args=(*CLASSIC_CACHE, *args)) as host:
        yield ServedFrontend(name, name, args, host)


@pytest.fixture(scope="session")
def gpu_hosts() -> Iterator[Callable[[str], ComfyHost]]:
    """ComfyUI servers on the GPU, one per mode (``"cuda-dynamic-vram"``, ``"cuda-classic"``), each
    started when a test first asks for it and stopped after the session."""
    started: dict[str, ComfyHost] = {}

    def host(device: str) -> ComfyHost:
        if device not in started:
            mode = GPU_MODES[device.removeprefix("cuda-")]
            started[device] = ComfyHost(cpu=False, env=server_env(), extra_args=(*mode, *CLASSIC_CACHE)).start()
        return started[device]

    yield host
    for server in started.values():
        server.stop()


@pytest.fixture(scope="session")
def comfy(comfyui_path: Path, tiny_models: dict[str, Path]) -> SimpleNamespace:
    """ComfyUI and this pack in the test process, on the CPU (``harness/inprocess.py``)."""
    return in_process_comfy(tiny_models)


@pytest.fixture(scope="module")
def unstreamed() -> Unstreamed:
    """What the module's graphs sample without the nodes (``harness.inprocess.Unstreamed``)."""
    return Unstreamed()


@pytest.fixture
def allow_cpu_streaming(monkeypatch: pytest.MonkeyPatch) -> None:
    """The nodes stream on the CPU (without it they pass the model through: no GPU memory to save)."""
    monkeypatch.setenv("BLOCK_OFFLOAD_ALLOW_CPU", "1")


@pytest.fixture(scope="session")
def stored_wan(comfy: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny Wan 2.1 checkpoint (fp32) saved again in each stored dtype of ``harness.dynamic_vram.STORED``."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("stored_wan")
    state_dict = load_file(comfy.models["wan21"])
    paths = {}
    for name, dtype in STORED.items():
        paths[name] = folder / f"wan21-{name}.safetensors"
        save_file({key: value.to(dtype) for key, value in state_dict.items()}, paths[name])
    return paths


@pytest.fixture
def dynamic_vram(comfy: SimpleNamespace, monkeypatch: pytest.MonkeyPatch) -> DynamicVram:
    """ComfyUI 0.33 with Dynamic VRAM on, on the CPU (``harness/dynamic_vram.py``)."""
    return DynamicVram(comfy, monkeypatch)
