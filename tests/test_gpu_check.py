"""The device check (`benchmarks.device_check`) end to end on the CPU with the tiny model (its GPU
run needs a lent device): every step in its own process, the JSON written after each, a step
that fails or runs out of time costing only itself; and the wheels it carries to the device."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from benchmarks.device_check import STEPS, _run_step

# Every step of the check on a CPU: some 3.5 min here, the compile of one bucket most of it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parent.parent


def test_the_device_check_runs_on_a_cpu(tmp_path):
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--device", "cpu", "--size", "tiny",
                          "--out", str(tmp_path), "--budget", "840"],
                         capture_output=True, text=True, timeout=880, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert list(report["steps"]) == [name for name, _, _ in STEPS]
    assert all(step["status"] == "ok" and step["expected_s"] > 0 for step in report["steps"].values())
    result = {name: step["result"] for name, step in report["steps"].items()}
    assert result["environment"]["attention_kernel"]["after"] in ("flash_attention", "efficient_attention", "math")
    assert result["load"]["slots"] >= result["load"]["step_rows"] >= 1 and result["load"]["attention"]
    steps = result["steps"]["results"]
    assert [(r["context"], r["batch"]) for r in steps] == [(c, b) for c in ("short", "long") for b in (1, 8, 32, 64)]
    assert all(r["cfm_ms"] > 0 and r["advance_ms"] > 0 and r["vae_ms"] > 0 for r in steps)
    assert all(r["positions"] == 1000 for r in steps if r["context"] == "long")
    assert all(r["max_abs_diff"] < 1e-4 for r in result["attention"]["results"])
    compiled = result["compiled"]
    # The first start compiles the step's graphs (the VAE's may come from the decoder process,
    # which compiles it beside); a fresh process loads every one.
    assert {g[1] for g in compiled["graphs_first"] if not g[0].startswith("vae")} == {"compiled"}
    assert compiled["graphs_second"] and {g[1] for g in compiled["graphs_second"]} == {"loaded"}
    assert result["equivalence"]["equal"]
    assert [r["n"] for r in result["scheduler"]["results"]] == [1, 64]
    table = (tmp_path / "device-check.txt").read_text()
    assert "step ms" in table and "equal within" in table and "nanovllm-voxcpm" in table


def test_a_step_that_fails_or_overruns_costs_only_itself(tmp_path):
    """No checkpoint was built: the load fails, and the report still says so, with the error."""
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--device", "cpu", "--size", "tiny",
                          "--out", str(tmp_path), "--only", "load,attention"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 1
    report = json.loads((tmp_path / "device-check.json").read_text())
    assert report["steps"]["load"]["status"] == "failed" and "model" in report["steps"]["load"]["error"]
    assert report["steps"]["attention"]["status"] == "ok"
    # A step past its time-out is ended and reported, not waited for: no process imports torch
    # and builds an engine within 10 ms.
    ctx = {"device": "cpu", "size": "tiny", "dtype": "float32", "threads": 1, "work": str(tmp_path),
           "model": str(tmp_path / "none"), "max_rows": 1, "compile_bucket": 1}
    overrun = _run_step("load", ctx, {}, timeout=0.01)
    assert overrun["status"] == "timeout" and "over its" in overrun["error"]


@pytest.mark.packaging
def test_the_wheels_for_the_device_fit_its_python_and_one_call(tmp_path):
    run = subprocess.run(["scripts/device-wheels.sh"], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    assert sum(w.stat().st_size for w in wheels) < 32 * 2**20          # the call carries 64 MiB with the tree
    names = [w.name.split("-")[0].lower() for w in wheels]
    assert len(names) == len(set(names)) and "voxcpm" in names and "pydantic_core" in names
    for wheel in wheels:
        tags = wheel.name[:-4].split("-")[-3:]
        assert tags[0] in ("py3", "py2.py3", "cp312") and (tags[2] == "any" or "x86_64" in tags[2]), wheel.name
        with zipfile.ZipFile(wheel) as z:
            assert any(n.endswith("/METADATA") for n in z.namelist())
    # They install together as the device check installs them, for the device's Python.
    platforms = [arg for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
                               "manylinux1_x86_64") for arg in ("--platform", p)]
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--only-binary",
                              ":all:", "--python-version", "3.12", "--implementation", "cp", *platforms,
                              "--target", str(tmp_path / "site"), *map(str, wheels)],
                             capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]
    assert (tmp_path / "site" / "voxcpm").is_dir() and (tmp_path / "site" / "pydantic_core").is_dir()
