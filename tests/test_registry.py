"""The pack as the Comfy Registry and ComfyUI-Manager see it (issue 51).

* ``pyproject.toml`` against the registry's written spec (https://docs.comfy.org/registry/specifications) and the
  rules its backend enforces on the two ids (Comfy-Org/registry-backend, ``mapper/node.go`` and
  ``mapper/publisher.go``): a publish with a bad id, or an icon the registry cannot show, is refused or shows a
  broken image only after the release is tagged, so it is checked here.
* ``comfy node validate`` (comfy-cli, requirements-dev.txt) on the files a publish uploads. It needs neither the
  network nor a git repository: it parses pyproject.toml (warning on a license, classifier or version it cannot
  read) and runs ruff's S102 (exec), S307 (eval) and E702 (two statements on a line) over the folder, then says
  "All validation checks passed" only when ruff found nothing. It exits 0 either way (the checks only warn for
  now), so the test reads its output; a second test shows it does report an ``eval``.
* The two ways a user installs the pack, each laid out as its installer lays it out and loaded by a real ComfyUI
  server: ComfyUI-Manager's ``git clone`` into ``custom_nodes/<repository name>`` (``ComfyUI-Block-Offload``) then
  ``pip install -r requirements.txt``, and the registry's ``comfy node install block-offload``, which extracts the
  archive ``comfy node pack`` builds into ``custom_nodes/<node id>``. Both folder names hold hyphens, and neither
  is ``block_offload``, the name the suite's own server loads the pack under.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable, Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

import pytest
from PIL import Image

from harness.comfy_host import REPO, ComfyHost

if sys.version_info >= (3, 11):
    from tomllib import loads as toml_loads
else:  # Python 3.10: comfy-cli (requirements-dev.txt) brings tomlkit, the parser it reads pyproject.toml with
    from tomlkit import loads as toml_loads

#: The three nodes, by node id, with the names the menu shows (nodes/offload_nodes.py).
NODES = MappingProxyType(
    {
        "AsyncBlockOffload": "Async Block Offload",
        "PartialGPUResidency": "Partial GPU Residency",
        "SequentialOffloadWrapper": "Sequential Offload Wrapper",
    }
)
#: The torch family: an install step that would touch one of these replaces the user's CUDA build.
TORCH_FAMILY = frozenset({"torch", "torchvision", "torchaudio"})
#: What comfy-cli prints when its security checks found nothing (its validate_node_for_publishing).
VALIDATE_PASSED = "All validation checks passed successfully"
#: The registry backend's rules: a node id (mapper/node.go's IsValidNodeID, at most 50 characters) and a
#: publisher id (mapper/publisher.go's IsValidPublisherID).
NODE_ID = re.compile(r"^[a-z][a-z0-9-_]+(\.[a-z0-9-_]+)*$")
PUBLISHER_ID = re.compile(r"^[a-z][a-z0-9-]*$")
#: A version constraint as comfy-cli's validate_version reads requires-comfyui: [operator]X.Y.Z[-suffix], comma
#: separated; anything else is dropped with a warning, and the registry then shows no ComfyUI requirement.
VERSION_CONSTRAINT = re.compile(r"^(?:(==|>=|<=|!=|~=|>|<|<>|=)\s*)?\d+\.\d+\.\d+(?:-[a-zA-Z0-9]+)?$")
MAX_ICON_PX = 400  # the spec's largest icon, square
#: Every path the registry's archive may hold, folder by folder: what ComfyUI imports and serves (the entry point,
#: the nodes, the engine, the panel and its icon), the example workflows ComfyUI lists, and what the installers and
#: the registry read. Nothing else: not tests/, harness/, bench/, scripts/, docs/ or its records.
ARCHIVE_ALLOWED = (
    "__init__.py",
    "pyproject.toml",
    "requirements.txt",
    "README.md",
    "LICENSE",
    "nodes/*.py",
    "offload/*.py",
    "web/*.js",
    "web/*.json",
    "web/icon.png",
    "example_workflows/*.json",
    "example_workflows/api/*.json",
)
INSTALL_TIMEOUT_S = 120

#: comfy-cli's checks of the pack's own files, the same whichever ComfyUI is installed.
PACK_FILES_ONLY = pytest.mark.one_host(reason="comfy-cli checks the pack's own files")


def pyproject() -> dict[str, Any]:
    return dict(toml_loads((REPO / "pyproject.toml").read_text()))


def git_checkout() -> None:
    """Skips unless the repository is a git checkout: a publish, and both installers, start from one."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--verify", "HEAD"], capture_output=True)
    if head.returncode != 0:
        pytest.skip(f"{REPO} is not a git checkout with a commit (a publish packs git's files; installs clone)")


def publish_files() -> list[str]:
    """The files a publish uploads, as they are in this working tree: comfy-cli packs ``git ls-files``; the
    untracked files git does not ignore are here too, so a file added but not yet committed counts."""
    git_checkout()
    listed = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sorted(name for name in listed.split("\0") if name and (REPO / name).is_file())


def comfy_cli(args: list[str], cwd: Path, home: Path) -> subprocess.CompletedProcess[str]:
    """Runs comfy-cli from this environment. ``DO_NOT_TRACK`` keeps it from sending telemetry, ``HOME`` keeps its
    config.ini out of the user's own ~/.config, ``--skip-prompt`` keeps it from asking anything."""
    if importlib.util.find_spec("comfy_cli") is None:
        pytest.skip("comfy-cli is not installed in this environment: run scripts/setup.sh (requirements-dev.txt)")
    env = {**os.environ, "DO_NOT_TRACK": "1", "HOME": str(home), "NO_COLOR": "1", "COLUMNS": "200"}
    return subprocess.run(
        [sys.executable, "-m", "comfy_cli", "--skip-prompt", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT_S,
    )


# ------------------------------------------------------------------------------------------ pyproject.toml
@PACK_FILES_ONLY
def test_pyproject_meets_the_registry_spec() -> None:
    data = pyproject()
    project, comfy = data["project"], data["tool"]["comfy"]

    name = project["name"]
    # The spec: under 100 characters, letters, digits, - _ . only, no two special characters in a row, starting
    # with a letter, and best without "ComfyUI"; the backend: at most 50, lowercase.
    assert len(name) <= 50 and NODE_ID.fullmatch(name), name
    assert not re.search(r"[-_.]{2}", name) and "comfyui" not in name.lower(), name
    assert re.fullmatch(r"\d+\.\d+\.\d+", project["version"]), "the registry wants a three-part X.Y.Z version"
    assert 0 < len(project["description"]) <= 1000  # the backend refuses a longer one
    # The spec's two accepted forms; comfy-cli sends {"file": ...} or {"text": ...} as the registry's license.
    license_ = project["license"]
    assert isinstance(license_, dict) and set(license_) in ({"file"}, {"text"}), license_
    if "file" in license_:
        assert (REPO / license_["file"]).is_file() and license_["file"] in publish_files()

    assert PUBLISHER_ID.fullmatch(comfy["PublisherId"]), comfy["PublisherId"]
    assert comfy["DisplayName"].strip()
    requires = comfy["requires-comfyui"]
    assert all(VERSION_CONSTRAINT.fullmatch(part.strip()) for part in requires.split(",")), requires
    # Every folder `includes` forces into the archive must exist (the spec's use: a build output git ignores).
    assert all((REPO / folder).is_dir() for folder in comfy["includes"]), comfy["includes"]
    # Never torch: ComfyUI-Manager and the registry would install it over the user's CUDA build.
    assert not {re.split(r"[\s<>=!~;\[]", dep, maxsplit=1)[0].lower() for dep in project["dependencies"]} & (
        TORCH_FAMILY
    )


@PACK_FILES_ONLY
def test_the_project_urls_point_at_the_repository() -> None:
    urls = pyproject()["project"]["urls"]
    repository = urls["Repository"]  # required to publish: comfy-cli sends it as the node's repository
    assert re.fullmatch(r"https://github\.com/[A-Za-z0-9-]+/[A-Za-z0-9._-]+", repository), repository
    assert urls["Documentation"].startswith(repository + "#") or urls["Documentation"].startswith(repository + "/")
    assert urls["Bug Tracker"] == repository + "/issues"


@PACK_FILES_ONLY
def test_the_icon_is_a_square_image_of_this_repository() -> None:
    """The Icon URL is the raw file of this repository's main branch, the file is here and published, and it is
    what the spec asks: PNG, square, 400 x 400 px at most (an SVG would reach the browser as text/plain from
    raw.githubusercontent.com, and an <img> does not draw that)."""
    data = pyproject()
    owner_repo = data["project"]["urls"]["Repository"].removeprefix("https://github.com/")
    icon_url = data["tool"]["comfy"]["Icon"]
    raw_main = f"https://raw.githubusercontent.com/{owner_repo}/main/"
    assert icon_url.startswith(raw_main), f"{icon_url} is not a file of {owner_repo} at main"
    path = icon_url.removeprefix(raw_main)
    assert path in publish_files(), f"{path} is not in the repository (or git ignores it)"
    with Image.open(REPO / path) as image:
        assert image.format == "PNG"
        assert image.width == image.height <= MAX_ICON_PX, image.size


# -------------------------------------------------------------------------------------- comfy node validate
@PACK_FILES_ONLY
def test_comfy_node_validate_passes_on_what_a_publish_uploads(tmp_path: Path) -> None:
    export = tmp_path / "export"
    for name in publish_files():
        (export / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, export / name)
    result = comfy_cli(["node", "validate"], cwd=export, home=tmp_path / "home")
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "Validating node configuration..." in output and "Running security checks..." in output, output
    # A field it could not read is a warning, exit code 0: the registry would then get it empty.
    assert "Warning" not in output, output
    assert VALIDATE_PASSED in output and "Security warnings found" not in output, output


@PACK_FILES_ONLY
def test_comfy_node_validate_reports_an_eval(tmp_path: Path) -> None:
    """The check above is live: the same pyproject.toml beside one ``eval`` gets ruff's S307 and no pass."""
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    (tmp_path / "node.py").write_text("def run(text: str) -> object:\n    return eval(text)\n")
    result = comfy_cli(["node", "validate"], cwd=tmp_path, home=tmp_path / "home")
    output = result.stdout + result.stderr
    assert "Security warnings found" in output and "S307" in output and "node.py" in output, output
    assert VALIDATE_PASSED not in output, output


# ------------------------------------------------------------------------------------------- installation
def clone_head(dest: Path) -> Path:
    """ComfyUI-Manager's first step, from this repository's committed HEAD (a local clone, no network)."""
    git_checkout()
    subprocess.run(["git", "clone", "--quiet", str(REPO), str(dest)], check=True, timeout=INSTALL_TIMEOUT_S)
    return dest


def manager_layout(base: Path, tmp_path: Path) -> Path:
    """``git clone <Repository> custom_nodes/<repository name>``, as ComfyUI-Manager installs from a URL."""
    name = pyproject()["project"]["urls"]["Repository"].rstrip("/").rsplit("/", 1)[-1].removesuffix(".git")
    return clone_head(base / "custom_nodes" / name)


def on_the_allow_list(name: str) -> bool:
    """Whether an archive path matches one of ``ARCHIVE_ALLOWED``, folder by folder (``*`` never crosses a ``/``)."""
    parts = name.split("/")
    return any(
        len(parts) == len(allowed)
        and all(fnmatch.fnmatchcase(part, glob) for part, glob in zip(parts, allowed, strict=True))
        for allowed in (pattern.split("/") for pattern in ARCHIVE_ALLOWED)
    )


def packed_archive(tmp_path: Path) -> Path:
    """``comfy node pack`` in a clone of HEAD: the archive ``comfy node publish`` uploads. Every path in it is on
    the allow-list, and every file of the clone that is on it is in the archive (.comfyignore)."""
    clone = clone_head(tmp_path / "clone")
    packed = comfy_cli(["node", "pack"], cwd=clone, home=tmp_path / "home")
    assert packed.returncode == 0 and (clone / "node.zip").is_file(), packed.stdout + packed.stderr
    with zipfile.ZipFile(clone / "node.zip") as archive:
        names = archive.namelist()
    refused = sorted(name for name in names if not on_the_allow_list(name))
    assert not refused, f"the registry's archive holds what does not run in ComfyUI: {refused}"
    tracked = subprocess.run(["git", "-C", str(clone), "ls-files"], capture_output=True, text=True, check=True)
    runtime = {name for name in tracked.stdout.splitlines() if on_the_allow_list(name)}
    assert sorted(names) == sorted(runtime), sorted(set(names) ^ runtime)
    assert {"__init__.py", "pyproject.toml", "LICENSE", "README.md", "web/icon.png"} <= runtime, sorted(runtime)
    return clone / "node.zip"


@PACK_FILES_ONLY
def test_the_registry_archive_holds_only_what_runs_in_comfyui(tmp_path: Path) -> None:
    """No test, tool, record or doc page reaches a user: every path of the archive, in every folder, checked."""
    with zipfile.ZipFile(packed_archive(tmp_path)) as archive:
        names = archive.namelist()
    for folder in ("nodes/", "offload/", "web/", "example_workflows/api/"):
        assert any(name.startswith(folder) for name in names), folder
    assert not [name for name in names if name.startswith(("docs/", "tests/", "harness/", "bench/", "scripts/"))]


def registry_layout(base: Path, tmp_path: Path) -> Path:
    """The archive ``comfy node pack`` builds (``packed_archive``), extracted into ``custom_nodes/<node id>`` as
    ``comfy node install`` and the Manager's registry install do."""
    folder = base / "custom_nodes" / pyproject()["project"]["name"]
    with zipfile.ZipFile(packed_archive(tmp_path)) as archive:
        archive.extractall(folder)
    return folder


def pip_would_install(requirements: Path, report: Path) -> list[str]:
    """What ``pip install -r requirements`` (the installers' next step) would install into this host's
    environment, the one the server runs in, asked with --dry-run: nothing is installed."""
    pip = [sys.executable, "-m", "pip", "install", "--dry-run", "--quiet", "--report", str(report)]
    subprocess.run(
        [*pip, "-r", str(requirements)],
        check=True,
        capture_output=True,
        timeout=INSTALL_TIMEOUT_S,
    )
    return sorted(item["metadata"]["name"].lower() for item in json.loads(report.read_text())["install"])


def served_nodes(object_info: Mapping[str, Any], folder: str) -> dict[str, str]:
    """The nodes /object_info lists from ``custom_nodes/<folder>``, with their display names."""
    return {
        node_id: info["display_name"]
        for node_id, info in object_info.items()
        if info.get("python_module") == f"custom_nodes.{folder}"
    }


@pytest.mark.parametrize("layout", [manager_layout, registry_layout], ids=["comfyui-manager", "comfy-registry"])
def test_an_installed_pack_loads_in_comfyui(layout: Callable[[Path, Path], Path], tmp_path: Path) -> None:
    base = tmp_path / "base"
    installed = layout(base, tmp_path)
    folder = installed.name
    assert (installed / "__init__.py").is_file() and (installed / "pyproject.toml").is_file()

    # The installers then run `pip install -r requirements.txt` and install.py: neither may touch torch.
    if (installed / "requirements.txt").is_file():
        would_install = pip_would_install(installed / "requirements.txt", tmp_path / "pip-report.json")
        assert not set(would_install) & TORCH_FAMILY, would_install
        # The README's promise: nothing beyond ComfyUI's own requirements, which this host already has.
        assert would_install == [], would_install
    assert not (installed / "install.py").exists(), "an install.py runs on every install and update"

    # --quick-test-for-ci would exit 0 with the pack failed to import: a server is asked what it loaded.
    with ComfyHost(base_dir=base) as host:
        nodes = served_nodes(host.object_info(), folder)
        extensions = host.get_json("/extensions")
        panel = f"/extensions/{folder}/block_offload_panel.js"
        panel_status = host.get(panel).status_code
        log = host.log_text()
    assert nodes == dict(NODES), f"custom_nodes/{folder} gave {nodes}; the server's log:\n{log[-4000:]}"
    assert not re.search(rf"(IMPORT FAILED|Cannot import).*{re.escape(folder)}", log), log[-4000:]
    assert re.search(rf"^\s*\d+\.\d+ seconds: \S*custom_nodes/{re.escape(folder)}$", log, re.MULTILINE), log[-4000:]
    # The panel is served from the pack's own folder name.
    assert panel in extensions and panel_status == 200, extensions
