"""The house's static checks, run as CI runs the suite: the engine (``offload/``) type-checks under mypy's strict
mode, and the whole repository is ruff clean (lint and format). The same commands by hand, from the repository
root: ``python -m mypy --strict offload`` and ``ruff check . && ruff format --check .``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
#: Where third-party code has no annotations of its own (torch's private helpers, ComfyUI), mypy reads it as Any.
MYPY = [sys.executable, "-m", "mypy", "--ignore-missing-imports", "--follow-imports=silent", "--python-version=3.10"]


def checked(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO)


def test_the_engine_type_checks_under_strict_mypy() -> None:
    done = checked(*MYPY, "--strict", "offload")
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_repository_is_ruff_clean() -> None:
    ruff = Path(sys.executable).with_name("ruff")
    lint = checked(str(ruff), "check", ".")
    assert lint.returncode == 0, lint.stdout + lint.stderr
    formatted = checked(str(ruff), "format", "--check", ".")
    assert formatted.returncode == 0, formatted.stdout + formatted.stderr
