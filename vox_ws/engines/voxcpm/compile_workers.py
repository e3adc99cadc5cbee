"""How many worker processes inductor compiles with: as many as the CPUs this container may use.

Inductor sizes its pool of compile workers from the CPUs the process may run on (at most 32),
not from the container's CPU limit: on a large host a container limited to two CPUs starts
dozens of workers (0.3-0.5 GB each) that can only take turns. And a process that only loads
compiled graphs still starts the pool, as soon as it loads a Triton kernel.

So a process that compiles (the background compile's child, `vox-ws compile`, a server that
waits for its compile) takes `compile_workers()`: the CPUs of the cgroup's quota (`cpus.cpu_limit`),
or what the user set in `TORCHINDUCTOR_COMPILE_THREADS`; and a server that only loads what
another compiled takes one (no pool: loading a kernel compiles it in the process). Set with
`use_compile_workers`, before torch reads it or after (inductor sizes the pool when it starts it).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ..cpus import CGROUP_ROOT, PROC_CGROUP, cpu_limit

ENV = "TORCHINDUCTOR_COMPILE_THREADS"
# Inductor's own bound on its compile workers.
MAX_WORKERS = 32

# What the user set, as this process found it: `use_compile_workers` sets the variable too (for
# the processes this one starts), which must not then count as the user's.
_USER_SETTING = os.environ.get(ENV)


def compile_workers(root: Path = CGROUP_ROOT, membership: Path = PROC_CGROUP) -> int:
    """The compile workers for a process that compiles: what the user set in
    `TORCHINDUCTOR_COMPILE_THREADS`, else one per CPU of `cpu_limit` (at most inductor's 32)."""
    if _USER_SETTING is not None:
        try:
            return max(1, int(_USER_SETTING))
        except ValueError:
            pass
    return min(MAX_WORKERS, cpu_limit(root, membership))


def use_compile_workers(workers: int) -> None:
    """Inductor compiles with `workers` processes in this process (1: in the process itself, no
    pool started) and in the processes it starts after (through `TORCHINDUCTOR_COMPILE_THREADS`)."""
    os.environ[ENV] = str(workers)
    config = sys.modules.get("torch._inductor.config")
    if config is not None:      # imported already: it read the variable then
        config.compile_threads = workers
