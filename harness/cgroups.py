"""A real memory cgroup with a limit, for the test process itself: what a container's ``--memory`` does to it.

``limited(limit)`` creates a child of the process's own memory cgroup (v1's memory controller, or v2), sets its
limit, moves the process into it, and moves it back and removes the group afterwards. The kernel then counts what
the process allocates meanwhile against the limit and kills it past the limit, as in a container; pages it held
before stay charged where they were. Creating one needs write access to the cgroup file system (root, or a
delegated subtree); where there is none, ``CgroupUnavailable`` says why.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from block_offload.offload.system_memory import V1_FILES, MemoryCgroup, memory_cgroups


class CgroupUnavailable(RuntimeError):
    """No memory cgroup can be made for this process here."""


def _own_group() -> MemoryCgroup:
    """The process's memory cgroup with a memory controller (v1 first: with both, v1's holds the memory files)."""
    groups = memory_cgroups()
    for group in sorted(groups, key=lambda group: group.files != V1_FILES):
        if (group.directory / group.files.usage).exists():
            return group
    raise CgroupUnavailable(f"no memory cgroup with a memory controller among {[str(g.directory) for g in groups]}")


@contextmanager
def limited(limit: int) -> Iterator[Path]:
    """This process in a new memory cgroup of ``limit`` bytes for the ``with`` block; yields the group."""
    own = _own_group()
    parent, limit_file = own.directory, own.files.limit
    group = parent / f"block-offload-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
    except OSError as error:
        raise CgroupUnavailable(f"cannot create a cgroup under {parent}: {error}") from error
    try:
        try:
            (group / limit_file).write_text(str(limit))
            (group / "cgroup.procs").write_text(str(os.getpid()))
        except OSError as error:
            raise CgroupUnavailable(f"cannot limit {group} and move into it: {error}") from error
        try:
            yield group
        finally:
            (parent / "cgroup.procs").write_text(str(os.getpid()))
    finally:
        group.rmdir()
