"""ComfyUI's official workflow templates, as the 0.33 host installs them (the ``comfyui-workflow-templates`` package
and its ``comfyui_workflow_templates_json`` part). The 0.3.75 host pins an older template package without them,
so its tests read the 0.33 host's copy from ``.venv-0.33.0`` where scripts/setup.sh put it.

The newest template package on PyPI (``NEWEST_TEMPLATES``) is unpacked apart, into ``.host/templates/VERSION/``,
for the tests that try the action on every template (:func:`newest_templates`); the hosts keep the ones they pin.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from .comfy_host import REPO, SETUP_DIR

PACKAGE = "comfyui_workflow_templates_json"
#: The newest ``comfyui-workflow-templates-json``. The one place its version is named: scripts/setup.sh reads this
#: line and unpacks the wheel's templates/ into NEWEST_TEMPLATES_DIR.
NEWEST_TEMPLATES = "0.1.123"
NEWEST_TEMPLATES_DIR = SETUP_DIR / "templates" / NEWEST_TEMPLATES


class TemplateMissingError(FileNotFoundError):
    pass


def template_dirs() -> list[Path]:
    """Where the templates are: this interpreter's package first, then the 0.33 host's environment."""
    dirs = []
    spec = importlib.util.find_spec(PACKAGE)
    if spec is not None and spec.origin is not None:
        dirs.append(Path(spec.origin).parent / "templates")
    dirs += sorted(REPO.glob(f".venv-0.33.0/lib/python3*/site-packages/{PACKAGE}/templates"))
    return [d for d in dirs if d.is_dir()]


def official_template(name: str) -> dict[str, Any]:
    """The UI workflow of the official template ``name`` (its file name without ``.json``)."""
    for folder in template_dirs():
        path = folder / f"{name}.json"
        if path.is_file():
            return json.loads(path.read_text())
    raise TemplateMissingError(
        f"no official template {name!r} in {[str(d) for d in template_dirs()] or PACKAGE}: "
        "run scripts/setup.sh (the 0.33.0 host installs the template package)"
    )


def newest_templates() -> dict[str, dict[str, Any]]:
    """Every UI workflow of the newest template package, by name (its index files left out)."""
    if not (NEWEST_TEMPLATES_DIR / "index.json").is_file():
        raise TemplateMissingError(
            f"the templates {NEWEST_TEMPLATES} are not unpacked at {NEWEST_TEMPLATES_DIR}: scripts/setup.sh could not "
            "download comfyui-workflow-templates-json (offline?); run it again online"
        )
    paths = sorted(p for p in NEWEST_TEMPLATES_DIR.glob("*.json") if not p.name.startswith("index"))
    return {path.stem: json.loads(path.read_text()) for path in paths}
