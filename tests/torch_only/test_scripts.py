"""What the set-up scripts do to the disk: the hosts' venvs share the files pip installed alike
(``scripts/share_packages.py``), and a disk too small is said before any work (``scripts/hosts.sh``)."""

from __future__ import annotations

import base64
import errno
import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.pack import REPO


def install(venv: Path, dist: str, files: dict[str, bytes]) -> Path:
    """Writes ``files`` into venv's site-packages with pip's RECORD for ``dist`` (a dist-info folder's name)."""
    site = venv / "lib" / "python3.11" / "site-packages"
    rows = []
    for name, data in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        rows.append(f"{name},sha256={digest},{len(data)}")
    (site / dist).mkdir(parents=True, exist_ok=True)
    (site / dist / "RECORD").write_text("\n".join([*rows, f"{dist}/RECORD,,"]) + "\n")
    return site


def share(*venvs: Path) -> str:
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "share_packages.py"), *map(str, venvs)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_venvs_share_what_pip_recorded_alike_and_nothing_else(tmp_path: Path) -> None:
    same, other = b"\x7fELF the same library" * 1000, b"another build"
    a = install(tmp_path / "a", "torch-2.11.0.dist-info", {"torch/lib/libtorch.so": same, "torch/version.py": b"a"})
    b = install(tmp_path / "b", "torch-2.11.0.dist-info", {"torch/lib/libtorch.so": same, "torch/version.py": b"b"})
    install(tmp_path / "a", "gguf-0.17.0.dist-info", {"gguf/__init__.py": other})
    install(tmp_path / "b", "gguf-0.18.0.dist-info", {"gguf/__init__.py": other})  # another version: not shared

    said = share(tmp_path / "a", tmp_path / "b")

    assert f"now shares 1 files with a, {len(same) / 2**30:.2f} GiB" in said, said
    library = (a / "torch/lib/libtorch.so").stat(), (b / "torch/lib/libtorch.so").stat()
    assert library[0].st_ino == library[1].st_ino and library[0].st_nlink == 2
    assert (b / "torch/lib/libtorch.so").read_bytes() == same
    for name in ("torch/version.py", "gguf/__init__.py"):
        assert (a / name).stat().st_ino != (b / name).stat().st_ino, name
    assert (b / "torch/version.py").read_bytes() == b"b"
    assert not list(b.rglob("*.share-partial")), "a partial link was left behind"
    # Run again (every set-up does), it finds them linked and says nothing.
    assert share(tmp_path / "a", tmp_path / "b") == ""


def test_a_file_changed_since_pip_installed_it_is_not_shared(tmp_path: Path) -> None:
    data = b"installed" * 100
    a = install(tmp_path / "a", "torch-2.11.0.dist-info", {"torch/x.so": data})
    b = install(tmp_path / "b", "torch-2.11.0.dist-info", {"torch/x.so": data})
    (b / "torch/x.so").write_bytes(b"changed" * 10)  # another size than its RECORD says
    assert share(tmp_path / "a", tmp_path / "b") == ""
    assert (b / "torch/x.so").read_bytes() == b"changed" * 10
    assert (a / "torch/x.so").stat().st_ino != (b / "torch/x.so").stat().st_ino


def test_where_the_disk_has_no_hard_links_each_venv_keeps_its_own_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = importlib.util.spec_from_file_location("share_packages", REPO / "scripts" / "share_packages.py")
    assert spec and spec.loader
    share_packages = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(share_packages)
    data = b"library" * 100
    a = install(tmp_path / "a", "torch-2.11.0.dist-info", {"torch/x.so": data})
    b = install(tmp_path / "b", "torch-2.11.0.dist-info", {"torch/x.so": data})

    def refuse(*_: object) -> None:
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(share_packages.os, "link", refuse)
    assert share_packages.share(a, b) == (0, 0)
    assert "keeps its own files: cannot link" in capsys.readouterr().err
    assert (b / "torch/x.so").read_bytes() == data
    assert (a / "torch/x.so").stat().st_ino != (b / "torch/x.so").stat().st_ino
    assert sorted(p.name for p in (b / "torch").iterdir()) == ["x.so"]


def require_free(gib: int, folder: Path) -> subprocess.CompletedProcess[str]:
    script = f'source scripts/hosts.sh && require_free_gib {gib} "{folder}" "test.sh: the tiny checkpoints"'
    return subprocess.run(["bash", "-c", script], cwd=REPO, capture_output=True, text=True, timeout=60)


def test_a_disk_too_small_is_said_before_any_work_with_what_is_needed(tmp_path: Path) -> None:
    assert require_free(0, tmp_path).returncode == 0
    refused = require_free(1 << 30, tmp_path)
    assert refused.returncode == 1
    said = refused.stderr
    assert said.startswith(f"test.sh: the tiny checkpoints needs about {1 << 30} GiB free on the disk of {tmp_path}")
    assert "GiB are free there. Free some space" in said, said
