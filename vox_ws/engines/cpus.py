"""The CPUs this process may use: those it may run on, fewer where its cgroup's CPU quota allows
fewer. A container's quota does not narrow `sched_getaffinity` (a pod limited to two CPUs on a
96-CPU node sees 96), so what sizes a pool of processes or threads by the CPUs reads this.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Callable

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cpu_limit(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> int:
    """The CPUs this process may use: those it may run on (`sched_getaffinity`), fewer where its
    cgroup's CPU quota allows fewer (cgroup v2's `cpu.max`, "QUOTA PERIOD" or "max PERIOD";
    else v1's `cpu.cfs_quota_us` / `cpu.cfs_period_us`, -1 for none), rounded up: a quota of 1.5
    CPUs is 2. The quota of the process's own cgroup and every one above it count (the
    smallest binds); a file that is missing or unreadable is no limit. `root` is where the
    cgroup file systems are mounted; `membership` says which cgroup the process is in."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    quotas = [q for q in (_v2_quota(root, membership), _v1_quota(root, membership)) if q is not None]
    return max(1, min([cpus, *quotas]))


def _cgroup_paths(membership: Path, controller: str | None) -> list[str]:
    """The process's cgroup in the hierarchy of `controller` (None: the v2 one), and each above
    it, from /proc/self/cgroup's lines "ID:CONTROLLERS:PATH"."""
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return ["/"]
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        controllers = parts[1].split(",")
        if (controller is None and parts[0] == "0" and parts[1] == "") or (controller in controllers):
            path = Path(parts[2] or "/")
            return [str(p) for p in (path, *path.parents)]
    return ["/"]


def _quota(paths: list[Path], read: Callable[[Path], int | None]) -> int | None:
    # A path that is not there is another mount's view (a container sees its own cgroup at the
    # root): each that is there counts.
    found = [q for q in (read(p) for p in paths) if q is not None]
    return min(found) if found else None


def _v2_quota(root: Path, membership: Path) -> int | None:
    def read(directory: Path) -> int | None:
        try:
            quota, period = (directory / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else math.ceil(int(quota) / int(period))
        except (OSError, ValueError, ZeroDivisionError):
            return None
    return _quota([root / p.lstrip("/") for p in _cgroup_paths(membership, None)], read)


def _v1_quota(root: Path, membership: Path) -> int | None:
    def read(directory: Path) -> int | None:
        try:
            quota = int((directory / "cpu.cfs_quota_us").read_text())
            period = int((directory / "cpu.cfs_period_us").read_text())
            return None if quota < 0 or period <= 0 else math.ceil(quota / period)
        except (OSError, ValueError):
            return None
    paths = _cgroup_paths(membership, "cpu")
    mounts = [root / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
    return _quota([mount / p.lstrip("/") for mount in mounts for p in paths], read)
