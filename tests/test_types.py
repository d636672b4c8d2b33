"""The house's static checks, run as CI runs the suite: the engine (``offload/``) type-checks under mypy's strict
mode, the ComfyUI adapters (``nodes/``) under its default mode, and the whole repository is ruff clean (lint and
format). The same commands by hand, from the repository root:
``MYPYPATH=. python -m mypy --explicit-package-bases --ignore-missing-imports --follow-imports=silent --strict
offload`` (and the same without ``--strict`` on ``nodes``), and ``ruff check . && ruff format --check .``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.one_host(reason="mypy and ruff read this repository only, not ComfyUI")

REPO = Path(__file__).resolve().parents[1]
#: Where third-party code has no annotations of its own (torch's private helpers, ComfyUI), mypy reads it as Any.
MYPY = [sys.executable, "-m", "mypy", "--explicit-package-bases", "--ignore-missing-imports", "--follow-imports=silent"]
MYPY += ["--python-version=3.10"]


def checked(*command: str) -> subprocess.CompletedProcess[str]:
    # The repository is a package itself (ComfyUI imports it by its folder's name, which may be no valid module
    # name): mypy names modules from the repository root instead of crawling up to it.
    env = {**os.environ, "MYPYPATH": str(REPO)}
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)


def test_the_engine_type_checks_under_strict_mypy() -> None:
    done = checked(*MYPY, "--strict", "offload")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_adapters_type_check_under_mypy() -> None:
    """Basic mode: ComfyUI has no annotations, so what the nodes take from it reads as Any; what they pass
    between themselves and to the engine is checked."""
    done = checked(*MYPY, "nodes")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_repository_is_ruff_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    lint = checked(str(ruff), "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    formatted = checked(str(ruff), "format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr


def test_both_engines_offer_everything_the_runner_protocol_declares() -> None:
    """The nodes hold an engine as a ``Runner``: whatever they call on it, the protocol declares and both engines
    have (mypy checks the calls against the protocol; this, the engines against it)."""
    import dataclasses

    import torch

    from harness.transformer_stack import transformer_stack

    from block_offload.offload import (
        CallOptions,
        Runner,
        SequentialOptions,
        StreamReport,
        StreamSpec,
        stream_blocks,
        stream_modules,
    )

    declared = {name for name in vars(Runner) if not name.startswith("_")}
    assert {"report", "wrote_content", "companions"} <= declared
    reported = {field.name for field in dataclasses.fields(StreamReport)}
    assert {"needs_content", "read_each_step"} <= reported
    model = transformer_stack(num_blocks=2, dim=8)
    for engine in (
        stream_blocks(model.blocks, torch.device("cpu"), [1], StreamSpec(calls=CallOptions(root=model))),
        stream_modules(model, "cpu", StreamSpec(), SequentialOptions()),
    ):
        missing = sorted(name for name in declared if not hasattr(engine, name))
        assert not missing, f"{type(engine).__name__} lacks {missing}"
        assert isinstance(engine.report(), StreamReport)


def test_the_seam_takes_only_the_typed_spec(tmp_path: Path) -> None:
    """What crosses from the nodes into the engine is one ``StreamSpec``: mypy rejects loose options at the entry
    points and a wrong type in a part, and a built spec cannot be changed, its mappings included."""
    import dataclasses

    import pytest

    from block_offload.offload import CallOptions, HostOptions, StreamSpec

    snippet = tmp_path / "seam.py"
    snippet.write_text(
        "from offload import FileOptions, HostOptions, StreamSpec, stream_blocks\n"
        "stream_blocks([], 'cpu', [], {'prefetch': 1})\n"
        "stream_blocks([], 'cpu', [], StreamSpec(host=FileOptions()))\n"
        "HostOptions(pin_memory='yes')\n"
    )
    done = checked(*MYPY, str(snippet))
    assert done.returncode != 0 and done.stdout.count("error:") == 3, done.stdout + done.stderr
    spec = StreamSpec(host=HostOptions(contents={0: "patched"}), calls=CallOptions(call_order=[1, 0]))
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.host.pin_memory = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.host.contents[1] = "other"  # type: ignore[index]
    assert spec.calls.call_order == (1, 0)
