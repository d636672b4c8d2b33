"""Tests that hold a model of gigabytes take turns, across every suite and worker on the machine.

The tiny Flux is 1 GB (its width is fixed at 3072), and a server that samples it through the nodes peaks near
5.4 GiB; a template's server holds its models as fp32, the Z-Image's 0.9 B parameters near 7 GB. ``scripts/test.sh``
runs both hosts' suites at once on a 24 GiB machine, so two such at the same time are enough for the kernel to kill
a server. Each holds an exclusive lock on one file beside the hosts' shared models while it runs: a template run
(``harness/templates.py``) that loads a big model, or a whole test marked ``big_model``, which also leaves the
session's server holding no model. The other template runs go on beside them.
"""

from __future__ import annotations

import fcntl
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from .comfy_host import SETUP_DIR, ComfyHost
from .prompts import evict_cached_models

LOCK = SETUP_DIR / "big-model.lock"
TINY_FLUX = pytest.mark.big_model(reason="it samples the 1 GB tiny Flux")
#: A prompt whose model files hold more than this loads a big model: the tiny Z-Image template's 2.2 GB do; the other
#: templates' (at most Krea 2's 1.4 GB, most of it a CLIP-G) do not.
BIG_FILES = 2 * 2**30

_held = 0  # this process's depth of one_at_a_time: a second flock on a new descriptor would wait for itself


@contextmanager
def one_at_a_time() -> Iterator[None]:
    """Waits for the other processes' big models to be let go, then holds the machine's turn until the block ends."""
    global _held
    if _held:
        _held += 1
        try:
            yield
        finally:
            _held -= 1
        return
    LOCK.parent.mkdir(parents=True, exist_ok=True)
    with LOCK.open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        _held = 1
        try:
            yield
        finally:
            _held = 0
            fcntl.flock(lock, fcntl.LOCK_UN)


def loads_a_big_model(prompt: Mapping[str, Mapping[str, Any]], models_dir: Path) -> bool:
    """Whether the files of ``models_dir``'s folders that ``prompt``'s inputs name hold more than :data:`BIG_FILES`."""
    sizes = {path.name: path.stat().st_size for path in models_dir.glob("*/*") if path.is_file()}
    named = {value for node in prompt.values() for value in node["inputs"].values() if isinstance(value, str)}
    return sum(sizes.get(name, 0) for name in named) > BIG_FILES


def drop_models(host: ComfyHost) -> None:
    """Leaves ``host`` holding no model and no cached output. ComfyUI's worker reads ``/free``'s flags between
    prompts, so they are done once a second prompt has run after them."""
    host.free()
    for _ in range(2):
        evict_cached_models(host)
