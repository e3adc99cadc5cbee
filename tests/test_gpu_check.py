"""scripts/gpu-check.sh end to end on the CPU with the tiny model (its GPU run needs a lent
device): it builds the model, checks the batched loop against the package, benchmarks the
scheduler, and writes its JSON and text table."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
import pytest

# The script runs every part of the device check on a CPU: some 4.5 min here, bounded by its own
# 600 s time-out below, which the suite's 300 s default must not cut short.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(660)]

ROOT = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_on_a_cpu(tmp_path):
    run = subprocess.run([str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu", "--size", "tiny",
                          "--out", str(tmp_path), "--concurrency", "1,4"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "gpu-check.json").read_text())
    assert report["equivalence"]["float32"]["equal"]
    assert report["equivalence"]["float32"]["loras"]["equal"] and "LoRA" in (tmp_path / "gpu-check.txt").read_text()
    assert [r["n"] for r in report["scheduler"]] == [1, 4]
    for row in report["scheduler"]:
        batched = row["batched"]
        assert batched["throughput"] > 0 and batched["mean_step_ms"] > 0 and batched["peak_rss_mb"] > 0
    assert [r["batch"] for r in report["compiled"]["steps_ms"]] == [1, 4]
    assert report["compiled"]["starts"]["compiled_second_s"] > 0
    table = (tmp_path / "gpu-check.txt").read_text()
    assert "equal" in table and "step ms" in table and "compiled/eager" in table and "nanovllm-voxcpm" in table
