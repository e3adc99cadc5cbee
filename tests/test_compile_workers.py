"""Inductor's compile workers: one per CPU of the cgroup's quota (v2 `cpu.max`, v1 CFS quota),
read from a cgroup file system given here; the user's TORCHINDUCTOR_COMPILE_THREADS first; one
in a serving process, so that loading a kernel starts no pool."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from vox_ws import compile_workers as workers
from vox_ws.compile_workers import ENV, compile_workers, cpu_limit, use_compile_workers

AFFINITY = len(os.sched_getaffinity(0))


@pytest.fixture
def inductor_config():
    """Inductor's config, its compile workers put back after (monkeypatch would delete the
    setting: the config module hides one deleted)."""
    import torch._inductor.config as config

    before = config.compile_threads
    yield config
    config.compile_threads = before


def cgroup(tmp_path, membership: str, files: dict[str, str]):
    """A cgroup file system at `tmp_path/cgroup` holding `files` (path -> text), and the process's
    /proc/self/cgroup saying `membership`."""
    root = tmp_path / "cgroup"
    root.mkdir()
    for path, text in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(text)
    (tmp_path / "membership").write_text(membership)
    return root, tmp_path / "membership"


@pytest.mark.parametrize(("quota", "cpus"), [("200000 100000", 2), ("150000 100000", 2), ("100000 100000", 1),
                                             ("50000 100000", 1), ("max 100000", None)])
def test_a_cgroup_v2_quota_is_its_cpus_rounded_up_and_max_is_none(tmp_path, quota, cpus):
    root, membership = cgroup(tmp_path, "0::/\n", {"cpu.max": quota + "\n"})
    assert cpu_limit(root, membership) == (AFFINITY if cpus is None else min(AFFINITY, cpus))


def test_the_smallest_quota_on_the_way_up_from_the_process_cgroup_binds(tmp_path):
    root, membership = cgroup(tmp_path, "0::/service/worker\n", {"service/cpu.max": "100000 100000",
                                                                  "service/worker/cpu.max": "max 100000"})
    assert cpu_limit(root, membership) == 1


@pytest.mark.parametrize("controllers", ["cpu,cpuacct", "cpu"])
def test_a_cgroup_v1_cfs_quota_counts_and_minus_one_is_none(tmp_path, controllers):
    root, membership = cgroup(tmp_path, f"7:memory:/x\n4:{controllers}:/\n0::/\n",
                              {f"{controllers}/cpu.cfs_quota_us": "100000\n",
                               f"{controllers}/cpu.cfs_period_us": "100000\n"})
    assert cpu_limit(root, membership) == 1
    (root / controllers / "cpu.cfs_quota_us").write_text("-1\n")
    assert cpu_limit(root, membership) == AFFINITY


def test_missing_or_unreadable_cgroup_files_are_no_limit(tmp_path):
    root, membership = cgroup(tmp_path, "0::/\n", {})
    assert cpu_limit(root, membership) == AFFINITY
    assert cpu_limit(root, tmp_path / "no-such-file") == AFFINITY
    (root / "cpu.max").write_text("lots\n")
    assert cpu_limit(root, membership) == AFFINITY


def test_compile_workers_are_the_users_setting_else_the_cpus_at_most_32(tmp_path, monkeypatch):
    root, membership = cgroup(tmp_path, "0::/\n", {"cpu.max": "100000 100000"})
    monkeypatch.setattr(workers, "_USER_SETTING", None)
    assert compile_workers(root, membership) == 1
    monkeypatch.setattr(workers, "cpu_limit", lambda root, membership: 96)
    assert compile_workers(root, membership) == 32
    monkeypatch.setattr(workers, "_USER_SETTING", "3")
    assert compile_workers(root, membership) == 3


def test_one_worker_reaches_inductor_here_and_in_the_processes_started_after(monkeypatch, inductor_config):
    from torch._inductor.async_compile import AsyncCompile

    config = inductor_config
    monkeypatch.setenv(ENV, "5")                                    # put back after
    use_compile_workers(1)
    assert os.environ[ENV] == "1" and config.compile_threads == 1
    # What inductor asks before it would start its pool for a kernel it loads.
    assert AsyncCompile.use_process_pool() is False
    code = "import torch._inductor.config as c; print(c.compile_threads)"
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           timeout=120)
    assert child.stdout.split() == ["1"]


def test_a_server_that_only_serves_takes_one_worker(tiny_model, monkeypatch, inductor_config):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    config = inductor_config
    monkeypatch.delenv(ENV, raising=False)
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="off")
    try:
        engine.load()
    finally:
        engine.close()
    assert os.environ[ENV] == "1" and config.compile_threads == 1
