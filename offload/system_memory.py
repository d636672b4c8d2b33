"""Host RAM as the kernel enforces it, and giving freed host memory back.

``/proc/meminfo`` is not namespaced: in a container it reports the host's RAM while the kernel kills the process at its
cgroup's limit. So the room left is the least, over the process's limiting cgroups, of the limit less the working set
(usage less inactive file pages, reclaimed first). glibc keeps freed heap memory in its arenas, so freeing a model's
worth of small weights would otherwise leave the RSS as high as before."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import NamedTuple


class CgroupFiles(NamedTuple):
    """A cgroup version's files: limit, usage, and the ``memory.stat`` field of inactive file pages."""

    limit: str
    usage: str
    inactive_field: str


V2_FILES = CgroupFiles("memory.max", "memory.current", "inactive_file")
V1_FILES = CgroupFiles("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")


class MemoryCgroup(NamedTuple):
    """A memory cgroup of the process: its directory, the mount above which no ancestor is visible, and its version's
    files."""

    directory: Path
    mount: Path
    files: CgroupFiles


@dataclass(frozen=True)
class ProcFiles:
    cgroup: Path = Path("/proc/self/cgroup")
    mountinfo: Path = Path("/proc/self/mountinfo")


@dataclass(frozen=True)
class CgroupLimit:
    """A memory cgroup of the process, or above it, that sets a limit (bytes)."""

    path: Path
    limit: int
    working_set: int

    @property
    def room(self) -> int:
        return max(0, self.limit - self.working_set)


@dataclass(frozen=True)
class HostRam:
    """Total and available RAM as the process may use them; ``cgroup``: the limiting group with the least room."""

    total: int
    available: int
    cgroup: CgroupLimit | None = None


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def _number(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() else None


def _stat_field(path: Path, field: str) -> int:
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == field and value.isdigit():
            return int(value)
    return 0


def _unescape(field: str) -> str:
    """A mountinfo path field, whose spaces, tabs, newlines and backslashes are octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda match: chr(int(match[1], 8)), field)


def memory_cgroups(files: ProcFiles = ProcFiles()) -> list[MemoryCgroup]:
    memberships = []
    for line in (_read(files.cgroup) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        memberships.append((controllers, path))
    found = []
    for line in (_read(files.mountinfo) or "").splitlines():
        before, _, after = line.partition(" - ")
        fields, filesystem = before.split(), after.split()
        if len(fields) < 5 or len(filesystem) < 3:
            continue
        root, mount = _unescape(fields[3]), Path(_unescape(fields[4]))
        kind, options = filesystem[0], filesystem[2].split(",")
        for controllers, path in memberships:
            if kind == "cgroup2" and controllers == "":
                version = V2_FILES
            elif kind == "cgroup" and "memory" in options and "memory" in controllers.split(","):
                version = V1_FILES
            else:
                continue
            group = PurePosixPath(path)
            if group.is_relative_to(root):  # else outside what this mount shows
                found.append(MemoryCgroup(mount / group.relative_to(root), mount, version))
    return found


def cgroup_limits(host_total: int, files: ProcFiles = ProcFiles()) -> list[CgroupLimit]:
    """The limits below ``host_total`` set by the process's memory cgroups and visible ancestors."""
    limits = []
    for directory, mount, names in memory_cgroups(files):
        for group in (directory, *[parent for parent in directory.parents if parent.is_relative_to(mount)]):
            limit = _number(_read(group / names.limit))
            if limit is None or limit >= host_total:
                continue
            usage = _number(_read(group / names.usage)) or 0
            working_set = max(0, usage - _stat_field(group / "memory.stat", names.inactive_field))
            limits.append(CgroupLimit(group, limit, working_set))
    return limits


def clamp_to_cgroups(host_total: int, host_available: int, files: ProcFiles = ProcFiles()) -> HostRam:
    limits = cgroup_limits(host_total, files)
    if not limits:
        return HostRam(host_total, host_available)
    tightest = min(limits, key=lambda group: group.room)
    return HostRam(min(group.limit for group in limits), min(host_available, tightest.room), tightest)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    library = ctypes.CDLL(name) if name else None
    trim: Callable[[int], int] | None = getattr(library, "malloc_trim", None)  # glibc only
    return trim


def release_freed_host_memory() -> None:
    """Returns freed heap memory to the system (glibc's ``malloc_trim``; a no-op elsewhere). It walks the allocator's
    free lists, so call it after freeing many weights, not per step."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
