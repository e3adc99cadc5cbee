"""The scheduler's burst benchmark (`benchmarks.scheduler.run_bursts`, which the device check's
scheduler step shares) on the tiny model: the engine in an engine process of its own, started as
`vox-ws serve` starts it, this process its server's side; its figures, the engine's own ones
included, come across the boundary; nothing it started outlives it."""

from __future__ import annotations

import os

import psutil
import pytest

from benchmarks.scheduler import run_bursts

pytestmark = pytest.mark.slow


def test_bursts_run_the_engine_in_a_process_of_its_own_and_bring_its_figures_back(tiny_model):
    reports = []
    result = run_bursts(str(tiny_model), "cpu", [1, 3], threads=1, length=8, report=lambda r: reports.append(dict(r)))
    load = result["load"]
    assert load["slots"] == 3 and load["slots_reason"] == "--slots" and load["dtype"] == "float32"
    # Its process: not this one, and gone once the bursts are done.
    assert load["pid"] not in (None, os.getpid()) and not psutil.pid_exists(load["pid"])
    # Its peak memory, as that process declared it (no GPU: no allocator's figure).
    assert load["peak_rss_mb"] > 0 and "peak_gpu_mb" not in load
    assert result["peak"]["peak_rss_mb"] >= load["peak_rss_mb"]
    eager = result["eager"]
    assert eager["compile"]["mode"] == "off" and eager["adopted"] == []
    # Every request's audio came back through the replay: 8 patches each, the steps counted
    # there, the burst's requests sharing its steps (sent at once, the last joins long before the
    # first's 8 steps are done).
    assert [r["n"] for r in eager["results"]] == [1, 3]
    for r in eager["results"]:
        assert r["requests"] == r["n"] and r["ttfa_p95_ms"] >= r["ttfa_p50_ms"] > 0
        assert r["audio_s"] == pytest.approx(r["n"] * 8 * 0.16, abs=1e-6)
        assert r["largest_step_rows"] == r["n"] and r["steps"] >= 8 and r["mean_step_ms"] > 0
    # No background compile (off): no compiled round.
    assert "compiled" not in result
    # The package's own loop, here, after the engine process ended, on a load of its own.
    assert result["serial"]["n"] == 1 and result["serial"]["ttfa_p50_ms"] > 0 and result["serial"]["load_s"] >= 0
    assert "load" in reports[0] and "serial" in reports[-1]
