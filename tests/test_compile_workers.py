"""Inductor's compile workers: one per CPU of the cgroup's quota (`vox_ws.engines.cpus`, test_cpus.py),
read from a cgroup file system given here; the user's TORCHINDUCTOR_COMPILE_THREADS first; one
in a serving process, so that loading a kernel starts no pool."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import cgroup
from vox_ws.engines.voxcpm import compile_workers as workers
from vox_ws.engines.voxcpm.compile_workers import ENV, compile_workers, use_compile_workers


@pytest.fixture
def inductor_config():
    """Inductor's config, its compile workers put back after (monkeypatch would delete the
    setting: the config module hides one deleted)."""
    import torch._inductor.config as config

    before = config.compile_threads
    yield config
    config.compile_threads = before


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
