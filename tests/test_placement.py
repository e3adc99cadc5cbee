"""Which CPUs each engine process runs on where several share a machine (`engine_process/placement.py`)."""

from __future__ import annotations

import pytest

from vox_ws.engine_process.placement import parse_cpu_lists, placed, share


def test_one_engine_process_is_not_pinned():
    assert share(list(range(16)), 1) == (None, None)


def test_several_share_the_cpus_each_its_own_the_server_the_rest():
    server, engines = share(list(range(16)), 2)
    assert engines == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9)] and server == [10, 11, 12, 13, 14, 15]
    server, engines = share(list(range(16)), 8)
    assert len(engines) == 8 and all(len(cpus) == 1 for cpus in engines) and len(server) == 8
    flat = [c for cpus in engines for c in cpus] + server
    assert sorted(flat) == list(range(16))            # each CPU once
    assert share([0, 1, 2], 3) == (None, None)        # no room for the server: left to the system


def test_cpus_said_by_hand():
    assert parse_cpu_lists("0-3;4-5,7") == [(0, 1, 2, 3), (4, 5, 7)]
    assert placed(2, "0-3;4-7", cpus=list(range(12))) == ([8, 9, 10, 11], [(0, 1, 2, 3), (4, 5, 6, 7)])
    assert placed(1, "0-1", cpus=[0, 1]) == (None, [(0, 1)])       # none left: the server anywhere
    for bad in ("0-3;", "a", "3-1", "0--2"):
        with pytest.raises(ValueError):
            parse_cpu_lists(bad)
    with pytest.raises(ValueError, match="2 CPU lists for 3"):
        placed(3, "0;1", cpus=[0, 1, 2, 3])
    with pytest.raises(ValueError, match="not this process's"):
        placed(1, "9", cpus=[0, 1])


def test_the_quota_bounds_what_is_shared(monkeypatch):
    from vox_ws.engine_process import placement

    monkeypatch.setattr(placement, "cpu_limit", lambda: 4)
    monkeypatch.setattr(placement.os, "sched_getaffinity", lambda pid: set(range(96)))
    assert placement.usable_cpus() == [0, 1, 2, 3]
