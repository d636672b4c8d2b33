"""The tests that need only torch: the engine (``offload/``) and the repository's own rules. Nothing in them
depends on ComfyUI's version, so ``scripts/test.sh`` runs them on one host; ``scripts/test_fast.sh`` runs them
alone, in a venv of torch and pytest, with this file as their only conftest (``--confcutdir``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.fake_cudart import cudart_fixture  # noqa: F401 (the ``cudart`` fixture)
from harness.pack import skip_pack_setup

HERE = Path(__file__).parent


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_pack_setup(items)
    for item in items:
        if item.path.is_relative_to(HERE):
            item.add_marker(pytest.mark.one_host(reason="needs only torch, not ComfyUI"))
