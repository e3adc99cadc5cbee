"""The device check (`benchmarks.device_check`) end to end on the CPU with the tiny model (its GPU
run needs a lent device), with what the device lacks made unimportable: its steps in their order,
each in its own process group, the JSON and every step's log written after each, a step that
fails or runs out of time costing only itself and keeping what it measured, no process of a step
left behind; a GPU run that did not carry the wheels failing at once; and the wheels it carries
to the device."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

import psutil
import pytest

from benchmarks.device_check import CPU_BUDGET_S, FIRST_CALL, GPU_BUDGET_S, STEPS, _reporter, _run_step
from benchmarks.device_stack import missing_modules, write_sitecustomize

# Every step of the check on a CPU: 15-30 min here (its budget 30), the compiles of the whole
# step and of the pieces for one bucket most of it, minutes each on 2 shared cores.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700)]

ROOT = Path(__file__).resolve().parent.parent


def _device_stack_env(tmp_path: Path) -> dict:
    """The environment of a Python that, as on the lent GPU machine, cannot import what its image
    lacks and the wheels do not bring (Starlette, uvicorn, PyAV, ...): a sitecustomize on
    PYTHONPATH installs the blocker in every process, the check's steps and their children."""
    blocker = tmp_path / "device-stack"
    write_sitecustomize(blocker)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(blocker), str(ROOT)])}


def test_the_blocker_hides_what_the_device_lacks_and_the_check_imports_without_it(tmp_path):
    env = _device_stack_env(tmp_path)
    blocked = subprocess.run([sys.executable, "-c", "import starlette"], capture_output=True, text=True, env=env,
                             cwd=ROOT)
    assert blocked.returncode != 0 and "No module named 'starlette'" in blocked.stderr
    # What the device lacks, the server's front doors need: the blocker does not let it by.
    server = subprocess.run([sys.executable, "-c", "import vox_ws.server"], capture_output=True, text=True, env=env,
                            cwd=ROOT)
    assert server.returncode != 0 and "No module named" in server.stderr
    # Every module the check's steps import, under the blocker (the scheduler's server side and
    # its engine process's too); and `find_spec` agrees with import.
    code = ("import importlib.util, benchmarks.device_check, benchmarks.scheduler, benchmarks.attention, "
            "benchmarks.equivalence, benchmarks.served_engine, vox_ws.engine_process.main, "
            "vox_ws.engines.voxcpm.engine, vox_ws.engines.voxcpm.compile_main, vox_ws.engines.voxcpm.text_rules, "
            "vox_ws.scheduling.loop; from vox_ws.engines.voxcpm.loading import import_voxcpm; import_voxcpm(); "
            "assert importlib.util.find_spec('uvicorn') is None and importlib.util.find_spec('av') is None")
    imports = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert imports.returncode == 0, imports.stderr[-3000:]
    assert {"starlette", "uvicorn", "httptools", "multipart", "av", "webvtt"} <= missing_modules()
    assert not {"torch", "numpy", "voxcpm", "pydantic", "websockets", "soxr"} & missing_modules()


def test_the_device_check_runs_on_a_cpu_with_only_the_devices_packages(tmp_path):
    """One whole run, in the new order, with the steps step made to overrun: it blocks after its
    first figure (`--overrun`) and is killed at its time-out, keeping that figure, and the run
    goes on to the steps after it."""
    out = tmp_path / "out"
    # One torch thread: the step's threads beside its decoder process on a 2-core host, or beside
    # another run, spin against each other (the scheduler's bursts took 16 s with one thread and
    # 366-480 s with two on this host shared with other runs).
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--device", "cpu", "--size", "tiny",
                          "--out", str(out), "--overrun", "steps=40", "--threads", "1"],
                         capture_output=True, text=True, timeout=2400, cwd=ROOT, env=_device_stack_env(tmp_path))
    report = json.loads((out / "device-check.json").read_text())
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-3000:]
    order = ["environment", "checkpoint", "whole", "equivalence", "steps", "attention", "whole_large", "scheduler",
             "compiled"]
    assert [name for name, _, _ in STEPS] == order and list(report["steps"]) == order
    assert {name for name, step in report["steps"].items() if step["status"] != "ok"} == {"steps"}, \
        {name: step.get("error", "")[-1500:] for name, step in report["steps"].items()}
    assert all(step["expected_s"] > 0 for step in report["steps"].values())
    # A lent GPU's first call (540 s) is planned for the first steps, the whole step captured first.
    assert FIRST_CALL == tuple(order[:6]) and sum(e for n, _, e in STEPS if n in FIRST_CALL) <= GPU_BUDGET_S - 40
    assert report["budget_s"] == CPU_BUDGET_S
    # The card labels every figure: this CPU has no GPU, and says so.
    assert report["card"] == "no GPU" or report["gpu"]["driver"]
    assert all(step["card"] == "CPU" for step in report["steps"].values())
    result = {name: step["result"] for name, step in report["steps"].items()}
    environment = result["environment"]
    assert environment["nvidia_smi"] == report["gpu"]
    assert environment["web_stack"] is False and environment["precompile"] is True
    assert environment["attention_kernel"]["after"] in ("flash_attention", "efficient_attention", "math")
    assert {"typing_extensions", "numba", "anyio"} <= set(environment["packages"])
    scheduler = result["scheduler"]
    assert scheduler["load"]["slots"] == 64 and scheduler["load"]["slots_reason"]
    # The engine ran in a process of its own, which declared its peak memory.
    assert scheduler["load"]["pid"] and scheduler["load"]["peak_rss_mb"] > 0
    assert scheduler["peak"]["peak_rss_mb"] >= scheduler["load"]["peak_rss_mb"]
    assert scheduler["serial"]["n"] == 1 and scheduler["serial"]["ttfa_p50_ms"] > 0
    eager = scheduler["eager"]["results"]
    assert [r["n"] for r in eager] == [1, 32, 64]
    assert all(r["requests"] == r["n"] and r["ttfa_p95_ms"] >= r["ttfa_p50_ms"] > 0 and r["throughput"] > 0
               for r in eager)
    # N requests sent at once share steps: the largest step of a burst carries all of them.
    assert [r["largest_step_rows"] for r in eager] == [1, 32, 64]
    # Nothing waits for a compile: no compiled round (a CPU's scheduler starts none).
    assert "compiled" not in scheduler and scheduler["background"] is None
    # Killed at its time-out, the steps step keeps the figure it wrote: 4,000 positions asked,
    # the tiny model's max_length allows fewer.
    steps = report["steps"]["steps"]
    assert steps["status"] == "timeout" and steps["timeout_s"] == 40 and steps["error"].startswith("over its 40 s")
    partial = steps["result"]
    assert partial["partial"] is True and partial["captured"]["status"] == "no CUDA"
    assert partial["contexts"] == [{"asked": asked, "positions": partial["max_length"] - 16} for asked in (4000, 8000)]
    (first,) = partial["results"]
    assert first["context"] == 4000 and first["positions"] == partial["max_length"] - 16 and first["batch"] == 1
    assert first["cfm_ms"] > 0 and first["advance_ms"] > 0 and first["vae_ms"] > 0
    assert all(r["max_abs_diff"] < 1e-4 for r in result["attention"]["results"])
    # The whole step as `--cuda-graphs` serves it: compiled for its bucket, attending in place
    # through what CUDA's lowering takes as flex decoding, compared and timed; no CUDA to capture.
    # The second call's step loads the first's graph (a CPU's: its code run without a compile).
    for name, kind in (("whole", "compiled"), ("whole_large", "loaded")):
        whole = result[name]
        assert whole["attention"] == {"in_place": True, "why_not": None, "kernel": None}
        (bucket,) = whole["results"]
        assert bucket["bucket"] == 1 and bucket["status"] == "compiled; not captured: no CUDA", bucket
        assert bucket["kernel_on_cuda"] == "flex_decoding" and bucket["kernel_lowered"] is None
        assert bucket["graphs"] and {g[1] for g in bucket["graphs"]} == {kind}
        assert [t["positions"] for t in bucket["timings"]] == whole["contexts"] and len(whole["contexts"]) == 2
        assert all(t["eager_ms"] > 0 and t["compiled_ms"] > 0 and "captured_ms" not in t for t in bucket["timings"])
    compiled = result["compiled"]
    # One compile of one bucket in the step's process, given what was left of the run's time; a
    # fresh process loads every graph; compiled and eager agree.
    assert compiled["precompile"] is True and compiled["graphs_first"] and compiled["given_s"] > 60
    assert {g[1] for g in compiled["graphs_first"]} == {"compiled"}
    assert len(compiled["graphs_second"]) == len(compiled["graphs_first"])
    assert {g[1] for g in compiled["graphs_second"]} == {"loaded"}
    assert compiled["step_ms"]["eager_ms"] > 0 and compiled["step_ms"]["compiled_ms"] > 0
    assert len(compiled["comparison"]["max_abs_diff"]) == 3 and compiled["comparison"]["max_abs_diff"][0] < 1e-3
    assert compiled["attention"]["in_place"] and compiled["kernel_on_cuda"] == "flex_decoding"
    assert result["equivalence"]["equal"] and result["equivalence"]["loads"] == 1
    table = (out / "device-check.txt").read_text()
    assert "ttfa p50" in table and "equal within" in table and "precompile on" in table
    assert "the whole step as --cuda-graphs serves it on CPU" in table and "flex_decoding" in table
    assert "not run in this call" not in table
    assert f"card: {report['gpu']['line']}" in table and "on CPU" in table and "no CUDA" in table
    assert "OpenBMB/VoxCPM issue #374" in table and "its README" in table and "vLLM-Omni" in table
    # Every step's log, a passing step's too, and the run's own.
    with tarfile.open(out / "logs.tar.gz") as tar:
        logs = {member.name: tar.extractfile(member).read().decode() for member in tar.getmembers()}
    assert {f"logs/{name}.log" for name in order} | {"logs/run.log", "logs/compiled-reload.log"} <= set(logs)
    assert "== steps: timeout" in logs["logs/run.log"] and "== equivalence: ok" in logs["logs/run.log"]
    assert report["gpu"]["line"] in logs["logs/run.log"]


def test_a_gpu_run_without_the_wheels_fails_before_any_step_starts(tmp_path):
    """The device has no network: a run that did not carry `.whl` says so at once, loads no
    model, and keeps its report and log."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--device", "cuda", "--out", str(out),
                          "--wheels", str(tmp_path / "not-carried")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 1, run.stderr[-3000:]
    report = json.loads((out / "device-check.json").read_text())
    environment = report["steps"]["environment"]
    assert environment["status"] == "failed" and "scripts/device-wheels.sh" in environment["error"]
    assert {step["status"] for name, step in report["steps"].items() if name != "environment"} == {"skipped"}
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert tar.getnames() == ["logs/run.log"]
    assert "no wheels in" in (out / "device-check.txt").read_text()


def test_a_step_that_fails_costs_only_itself_and_keeps_what_it_measured(tmp_path):
    """No checkpoint was built: the scheduler fails, and the report still says so, with the
    error; the steps after it run."""
    out = tmp_path / "out"
    run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--device", "cpu", "--size", "tiny",
                          "--out", str(out), "--only", "scheduler,attention"],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 1
    report = json.loads((out / "device-check.json").read_text())
    assert report["steps"]["scheduler"]["status"] == "failed" and "model" in report["steps"]["scheduler"]["error"]
    assert report["steps"]["attention"]["status"] == "ok"
    ctx = _context(tmp_path)
    failed = _run_step("tests.test_gpu_check:measures_then_fails", ctx, dict(os.environ), timeout=600)
    assert failed["status"] == "failed" and "after its first figure" in failed["error"]
    assert failed["result"] == {"first": 1, "partial": True}


def _context(tmp_path: Path) -> dict:
    return {"device": "cpu", "size": "tiny", "dtype": "float32", "threads": 1, "work": str(tmp_path),
            "model": str(tmp_path / "none"), "max_rows": 1, "compile_bucket": 1}


def measures_then_fails(ctx: dict) -> dict:
    """(A step for the test above.) One figure reported, then an error."""
    _reporter(ctx)({"first": 1})
    raise RuntimeError("failed after its first figure")


def leaves_a_child_that_ignores_sigterm(ctx: dict) -> dict:
    """(A step for the test below.) A child that ignores SIGTERM, as a stuck decoder process
    does, its pid written once it runs; then the step reports, and ends or hangs as asked."""
    pid_file = Path(ctx["work"]) / "child.pid"
    child = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time; "
                              "signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                              f"open({str(pid_file)!r} + '.tmp', 'w').write(str(os.getpid())); "
                              f"os.replace({str(pid_file)!r} + '.tmp', {str(pid_file)!r}); time.sleep(3600)"])
    while not pid_file.exists() and child.poll() is None:
        time.sleep(0.01)
    _reporter(ctx)({"child": child.pid})
    if ctx["hang"]:
        threading.Event().wait()
    return {"child": child.pid}


@pytest.mark.parametrize("hang", [False, True], ids=["ends", "overruns"])
def test_no_process_of_a_step_outlives_it_whether_it_ends_or_is_killed(tmp_path, hang):
    ctx = {**_context(tmp_path), "hang": hang}
    # Overrunning: killed at its time-out (the child is killed with it whether or not it had
    # started by then); ending: its group is killed after it.
    outcome = _run_step("tests.test_gpu_check:leaves_a_child_that_ignores_sigterm", ctx, dict(os.environ),
                        timeout=20 if hang else 600)
    assert outcome["status"] == ("timeout" if hang else "ok"), outcome
    if hang:
        assert outcome["error"].startswith("over its 20 s, killed")
    pid_file = tmp_path / "child.pid"
    if pid_file.exists():
        child = int(pid_file.read_text())
        assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    if "result" in outcome:
        assert outcome["result"]["child"] > 0


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


def test_a_failed_capture_is_reported_as_failed_and_never_timed_as_captured():
    """The table of a GPU run whose captures failed (their reasons as `CapturedSteps.failed` words
    them): the whole step's bucket says `capture FAILED` with why and has no captured time; the
    steps' table says FAILED where a captured time would be."""
    from benchmarks.device_check import _steps_lines, _whole_lines

    why = "its replay differs from the uncompiled step: the whole step's audio ... differ from eager by 3.1e-01"
    whole = {"buckets": [1, 8], "attention": {"in_place": True, "why_not": None, "kernel": "flex_decoding"},
             "results": [{"bucket": 1, "kernel_on_cuda": "flex_decoding", "kernel_lowered": "flex_decoding",
                          "compile_s": 80.0, "status": "captured",
                          "timings": [{"positions": 20, "eager_ms": 90.0, "compiled_ms": 30.0, "captured_ms": 9.5}]},
                         {"bucket": 8, "kernel_on_cuda": "flex_decoding", "kernel_lowered": "flex_decoding",
                          "compile_s": 85.0, "status": "capture FAILED", "failed": {"8x8192x10": why},
                          "timings": [{"positions": 20, "eager_ms": 95.0, "compiled_ms": 33.0}]}]}
    lines = _whole_lines("the whole step", whole, "H100")
    (one,) = [line for line in lines if line.lstrip().startswith("1 ")]
    (eight,) = [line for line in lines if line.lstrip().startswith("8 ")]
    assert "9.5" in one and one.rstrip().endswith("captured")
    assert "capture FAILED: 8x8192x10: its replay differs" in eight and " - " in eight
    steps = {"contexts": [{"asked": 4000, "positions": 4000}], "max_length": 8192,
             "captured": {"status": f"failed: 8x256x10: {why}"},
             "results": [{"positions": 4000, "batch": 8, "step_ms": 50.0, "cfm_ms": 20.0, "advance_ms": 20.0,
                          "vae_ms": 10.0, "peak_rss_mb": 1.0, "captures": {"failed": {"8x256x10": why}}}]}
    table = "\n".join(_steps_lines(steps, "H100"))
    assert "captured ms" in table and "FAILED" in table.splitlines()[-1]
