"""Host RAM as the kernel enforces it inside a container (``offload/system_memory.py``): psutil's figures clamped
to the limits of the process's memory cgroups, which psutil does not see.

The layouts are those the kernel writes (``/proc/self/cgroup``, ``/proc/self/mountinfo``, the cgroup files) as
Docker, Kubernetes and this machine lay them out, written under a temporary folder; then a real cgroup with a limit,
with this process moved into it, read as the kernel counts it.
"""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from harness.cgroups import CgroupUnavailable, limited

from block_offload.offload.system_memory import ProcFiles, clamp_to_cgroups

GIB = 2**30
HOST_TOTAL = 64 * GIB
HOST_AVAILABLE = 40 * GIB
V1_UNLIMITED = "9223372036854771712"  # what cgroup v1 writes for "no limit"


class Layout:
    """A process's cgroup membership and mounts, and the cgroup files, under ``root``."""

    def __init__(self, root: Path, membership: str) -> None:
        self.root = root
        self.files = ProcFiles(root / "proc-self-cgroup", root / "proc-self-mountinfo")
        self.files.cgroup.write_text(membership)
        self.files.mountinfo.write_text("")

    def mount(self, kind: str, mount_root: str, at: str, options: str = "rw") -> Path:
        point = self.root / at
        point.mkdir(parents=True, exist_ok=True)
        escaped = str(point).replace(" ", "\\040")
        line = f"35 31 0:32 {mount_root} {escaped} rw,relatime - {kind} {kind} {options}\n"
        self.files.mountinfo.write_text(self.files.mountinfo.read_text() + line)
        return point

    @staticmethod
    def group(directory: Path, **files: str) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name.replace("_", ".", 1)).write_text(text)

    def clamp(self):
        return clamp_to_cgroups(HOST_TOTAL, HOST_AVAILABLE, self.files)


def test_a_docker_container_on_cgroup_v2_is_held_to_its_limit_less_its_working_set(tmp_path: Path) -> None:
    """Docker's default (a private cgroup namespace): the container's group is the mount's root."""
    layout = Layout(tmp_path, "0::/\n")
    point = layout.mount("cgroup2", "/", "sys/fs/cgroup")
    stat = f"anon {3 * GIB}\ninactive_file {1 * GIB}\nactive_file {GIB // 2}\n"
    layout.group(point, memory_max=str(8 * GIB), memory_current=str(4 * GIB), memory_stat=stat)
    ram = layout.clamp()
    # The working set: the usage less the inactive file pages, which the kernel reclaims before it kills.
    assert (ram.total, ram.available) == (8 * GIB, 5 * GIB), ram
    assert ram.cgroup is not None and ram.cgroup.path == point and ram.cgroup.working_set == 3 * GIB


def test_the_tightest_of_the_group_and_its_ancestors_binds(tmp_path: Path) -> None:
    """A Kubernetes pod seen from the host's namespace: the container's group under its pod's. The pod has the
    least room left though its limit is the lower of the two; the root group sets none (v2's root has no
    ``memory.max``)."""
    layout = Layout(tmp_path, "0::/kubepods/pod1/ctr\n")
    point = layout.mount("cgroup2", "/", "sys/fs/cgroup")
    layout.group(point / "kubepods", memory_max="max", memory_current=str(20 * GIB))
    layout.group(point / "kubepods/pod1", memory_max=str(12 * GIB), memory_current=str(11 * GIB))
    layout.group(point / "kubepods/pod1/ctr", memory_max=str(16 * GIB), memory_current=str(2 * GIB))
    ram = layout.clamp()
    assert (ram.total, ram.available) == (12 * GIB, 1 * GIB), ram
    assert ram.cgroup is not None and ram.cgroup.path == point / "kubepods/pod1"


def test_cgroup_v1_s_memory_controller_is_read_beside_an_empty_v2_mount(tmp_path: Path) -> None:
    """This machine's layout: v1's memory controller, the unified (v2) hierarchy mounted without it, the process
    in a child group; v1 writes its huge "no limit" at the root and counts inactive file pages hierarchically."""
    layout = Layout(tmp_path, "4:memory:/process_api/abc\n1:cpu:/\n0::/\n")
    memory = layout.mount("cgroup", "/", "sys/fs/cgroup/memory", "rw,memory")
    layout.mount("cgroup", "/", "sys/fs/cgroup/cpu", "rw,cpu")
    layout.mount("cgroup2", "/", "sys/fs/cgroup/unified")
    layout.group(memory, memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=str(30 * GIB))
    layout.group(memory / "process_api", memory_limit_in_bytes=V1_UNLIMITED)
    stat = f"inactive_file {GIB}\ntotal_inactive_file {2 * GIB}\n"
    group = memory / "process_api/abc"
    layout.group(group, memory_limit_in_bytes=str(24 * GIB), memory_usage_in_bytes=str(10 * GIB), memory_stat=stat)
    ram = layout.clamp()
    assert (ram.total, ram.available) == (24 * GIB, 16 * GIB), ram
    assert ram.cgroup is not None and ram.cgroup.path == group


def test_a_v1_mount_of_the_container_s_own_group_is_that_group(tmp_path: Path) -> None:
    """Docker on cgroup v1: the memory hierarchy is mounted from the container's group, so the path in
    ``/proc/self/cgroup`` is the mount's root, and nothing above it is visible."""
    layout = Layout(tmp_path, "9:memory:/docker/abc\n")
    memory = layout.mount("cgroup", "/docker/abc", "sys fs/cgroup/memory", "rw,memory")
    layout.group(memory, memory_limit_in_bytes=str(6 * GIB), memory_usage_in_bytes=str(GIB))
    ram = layout.clamp()
    assert (ram.total, ram.available) == (6 * GIB, 5 * GIB), ram


def test_no_limit_leaves_the_host_s_figures(tmp_path: Path) -> None:
    """No limit (v2's ``max``, v1's huge number), a limit above the host's RAM, or no cgroup file system at
    all (Windows, macOS): the host's figures, and no cgroup named."""
    layout = Layout(tmp_path, "0::/a\n4:memory:/b\n")
    v2 = layout.mount("cgroup2", "/", "v2")
    v1 = layout.mount("cgroup", "/", "v1", "rw,memory")
    layout.group(v2 / "a", memory_max="max", memory_current=str(GIB))
    layout.group(v1 / "b", memory_limit_in_bytes=V1_UNLIMITED, memory_usage_in_bytes=str(GIB))
    layout.group(v1, memory_limit_in_bytes=str(HOST_TOTAL + GIB), memory_usage_in_bytes=str(GIB))
    for files in (layout.files, ProcFiles(tmp_path / "absent", tmp_path / "absent")):
        ram = clamp_to_cgroups(HOST_TOTAL, HOST_AVAILABLE, files)
        assert (ram.total, ram.available, ram.cgroup) == (HOST_TOTAL, HOST_AVAILABLE, None), ram


def test_a_group_over_its_limit_has_no_room_and_the_host_s_available_can_be_lower(tmp_path: Path) -> None:
    layout = Layout(tmp_path, "0::/\n")
    point = layout.mount("cgroup2", "/", "sys/fs/cgroup")
    layout.group(point, memory_max=str(8 * GIB), memory_current=str(9 * GIB))
    assert layout.clamp().available == 0
    layout.group(point, memory_max=str(60 * GIB), memory_current=str(GIB))
    assert layout.clamp().available == HOST_AVAILABLE  # the host itself has less left than the group


def test_a_real_cgroup_is_read_as_the_kernel_counts_it() -> None:
    """This process in a memory cgroup of 1 GiB (the kernel's own files, not a layout of the test's): the limit
    is the total, and what the process allocates inside it comes off the available RAM."""
    try:
        with limited(GIB) as group:
            before = clamp_to_cgroups(psutil.virtual_memory().total, psutil.virtual_memory().available)
            held = bytearray(256 * 2**20)
            held[::4096] = b"\1" * len(held[::4096])  # every page touched: charged to the group
            after = clamp_to_cgroups(psutil.virtual_memory().total, psutil.virtual_memory().available)
            del held
    except CgroupUnavailable as why:
        pytest.skip(f"no memory cgroup can be made here ({why}); the layouts above are read all the same")
    assert before.cgroup is not None and before.cgroup.path == group, before
    assert before.total == after.total == GIB, (before, after)
    grown = before.available - after.available
    assert 256 * 2**20 <= grown <= 300 * 2**20, (before, after)
