"""The CPUs a process may use (`vox_ws.engines.cpus`): those it may run on, fewer where its cgroup's quota
(v2 `cpu.max`, v1 CFS quota) allows fewer, read from a cgroup file system given here. What sizes
inductor's compile workers and the aligner's processes."""

from __future__ import annotations

import os

import pytest

from helpers import cgroup
from vox_ws.engines.cpus import cpu_limit

AFFINITY = len(os.sched_getaffinity(0))


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
