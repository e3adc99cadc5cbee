"""The device check: what a first run of vox-ws on a lent GPU must learn, in one call of at most
10 minutes, its findings kept even where a step fails or runs out of time.

    scripts/device-wheels.sh                     # here: the wheels the device lacks, into .whl/
    python3 -m benchmarks.device_check --out "$OUT"          # there, with the device's python3

Each step runs in a process of its own with its own time-out (its expected seconds on an H200
with the real-size model, doubled, and never past the whole run's `--budget`), in the order a
first run needs them; `device-check.json` (and the table `device-check.txt`) is written again
after every step, so a step that hangs or crashes costs only itself. Where `.whl/` holds wheels,
they are installed into a private directory first (the device has no network).

CI runs it end to end on a CPU with the tiny model (`tests/test_gpu_check.py`):

    python -m benchmarks.device_check --device cpu --size tiny --out /tmp/device-check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."
STEP_BATCHES = (1, 8, 32, 64)
CONTEXTS = {"short": 0, "long": 1000}      # positions the step attends over (0: the prompt's own)
PUBLISHED = ("nanovllm-voxcpm, RTX 4090, VoxCPM2 (published): first audio p50 67 ms at 1 stream, "
             "114 ms at 32, 189 ms at 64")


# ------------------------------------------------------------------ the steps, each in its own process

def _torch(ctx: dict) -> Any:
    import torch

    torch.set_num_threads(ctx["threads"])
    return torch


def _sync(torch: Any, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _memory_mb(torch: Any, device: str) -> dict[str, float]:
    import resource

    figures = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.startswith("cuda"):
        figures["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
    return figures


def step_environment(ctx: dict) -> dict:
    """The GPU, torch, Triton, the C compiler Triton and inductor need, and the SDPA kernel the
    decode attention runs on, before and after the fold."""
    import importlib.metadata
    import shutil

    torch = _torch(ctx)
    from benchmarks.attention import before, inputs
    from vox_ws.engines.voxcpm.kv import attend, sdpa_kernel_of

    def version(package: str) -> str | None:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return None

    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
             "triton": version("triton"), "voxcpm": version("voxcpm"), "numpy": version("numpy"),
             "compiler": compiler and subprocess.run([compiler, "--version"], capture_output=True,
                                                     text=True).stdout.splitlines()[0],
             "cpus": os.cpu_count()}
    device = torch.device(ctx["device"])
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                     gpu_memory_gb=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
    args = inputs(8, 1000, device, getattr(torch, ctx["dtype"]))
    found["attention_kernel"] = {"before": sdpa_kernel_of(before, args), "after": sdpa_kernel_of(attend, args)}
    return found


def step_checkpoint(ctx: dict) -> dict:
    """A random-weight VoxCPM2 of the released shape, in the serving dtype, in memory (/dev/shm)."""
    from vox_ws.testing.tiny_voxcpm import build

    started = time.perf_counter()
    path = build(ctx["model"], size=ctx["size"], stop="never", dtype=ctx["dtype"])
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"path": str(path), "size": ctx["size"], "dtype": ctx["dtype"], "gb": round(size / 1e9, 2),
            "seconds": round(time.perf_counter() - started, 1)}


def step_load(ctx: dict) -> dict:
    """The engine's eager start with `--slots auto`: the slots and rows it sizes, its
    seconds and memory."""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    started = time.perf_counter()
    engine = VoxCPMEngine(model=ctx["model"], device=ctx["device"], threads=ctx["threads"], max_batch=None,
                          compile="off")
    engine.load()
    seconds = time.perf_counter() - started
    info = engine.describe()
    engine.close()
    return {"seconds": round(seconds, 1), "slots": info["max_batch"], "step_rows": info["step_rows"],
            "slots_reason": engine.slots()[1], "attention": info["attention"], "dtype": info["dtype"],
            **_memory_mb(torch, ctx["device"])}


def step_steps(ctx: dict) -> dict:
    """The eager step at B = 1, 8, 32, 64, attending over the prompt alone (short) and over
    1,000 positions (long), split into the CFM, the advance (LocEnc, stop head, both LMs) and
    the VAE decode; the median of 5 steps after 2, and the peak memory of each B."""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    device = ctx["device"]
    model = import_voxcpm().VoxCPM.from_pretrained(ctx["model"], load_denoiser=False, optimize=False,
                                                   device=device).tts_model
    batches = [b for b in STEP_BATCHES if b <= ctx["max_rows"]]
    runner = BatchedVoxCPM2(model, max_batch=max(batches), decode_process=False, warm_rows=1)
    parts = {"cfm": 0.0, "advance": 0.0, "vae": 0.0}

    def timed(part: str, fn: Callable) -> Callable:
        def call(*args: Any, **kwargs: Any) -> Any:
            _sync(torch, device)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                _sync(torch, device)
                parts[part] += time.perf_counter() - started
        return call

    runner.eager.solve = timed("cfm", runner.eager.solve)
    runner.eager.advance = timed("advance", runner.eager.advance)
    runner.vae.decode = timed("vae", runner.vae.decode)
    prompt = build_prompt(model, TEXT, None)
    results = []
    for context, positions in CONTEXTS.items():
        for batch in batches:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            rows = runner.prefill_many([PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                     max_len=4096) for i in range(batch)])
            for row in rows:
                row.position = max(row.position, positions)   # as long a context, whatever K/V holds
            attended = rows[0].position
            samples = []
            for index in range(7):
                for part in parts:
                    parts[part] = 0.0
                _sync(torch, device)
                started = time.perf_counter()
                runner.step(rows)
                _sync(torch, device)
                if index >= 2:
                    samples.append({"step_ms": (time.perf_counter() - started) * 1000,
                                    **{f"{part}_ms": seconds * 1000 for part, seconds in parts.items()}})
            for row in rows:
                runner.release(row)
            median = {key: round(sorted(s[key] for s in samples)[len(samples) // 2], 2) for key in samples[0]}
            results.append({"context": context, "positions": attended, "batch": batch, **median,
                            **_memory_mb(torch, device)})
    runner.close()
    return {"results": results}


def step_attention(ctx: dict) -> dict:
    """The decode attention before and after the fold (`benchmarks.attention`)."""
    _torch(ctx)
    from benchmarks.attention import run

    return {"dtype": ctx["dtype"], "results": run(ctx["device"], ctx["dtype"], list(STEP_BATCHES), [100, 1000])}


def step_compiled(ctx: dict) -> dict:
    """One bucket compiled: each graph's seconds, the compiled step against eager, and the
    graphs saved then loaded by a fresh process (`benchmarks.compiled`)."""
    _torch(ctx)
    from benchmarks.compiled import run, start

    bucket = ctx["compile_bucket"]
    cache = tempfile.mkdtemp(prefix="vox-ws-compile-", dir=ctx["work"])
    first = start(ctx["model"], bucket, "on", cache, ctx["device"], (bucket,))
    second = start(ctx["model"], bucket, "on", cache, ctx["device"], (bucket,))
    steps = run(ctx["model"], [bucket], steps=10, repeats=2, device=ctx["device"], starts=False, buckets=(bucket,))
    return {"bucket": bucket, "first_start_s": round(first["seconds"], 1), "graphs_first": first["graphs"],
            "second_start_s": round(second["seconds"], 1), "graphs_second": second["graphs"],
            "steps_ms": steps["steps_ms"]}


def step_equivalence(ctx: dict) -> dict:
    """The batched runner against the voxcpm package, request by request, in the serving dtype
    (`benchmarks.equivalence`)."""
    _torch(ctx)
    from benchmarks.equivalence import compare

    work = Path(tempfile.mkdtemp(prefix="vox-ws-equivalence-", dir=ctx["work"]))
    return compare(ctx["model"], ctx["device"], work)


def step_scheduler(ctx: dict) -> dict:
    """The scheduler benchmark at N = 1 and 64: throughput, first audio, step time, memory."""
    out = Path(ctx["work"]) / "scheduler.json"
    run = subprocess.run([sys.executable, "-m", "benchmarks.scheduler", "--model", ctx["model"], "--device",
                          ctx["device"], "--threads", str(ctx["threads"]), "--concurrency", "1,64",
                          "--rounds", "1", "--min-steps", "10", "--max-steps", "20", "--json", str(out)],
                         capture_output=True, text=True, cwd=ROOT)
    if run.returncode != 0:
        raise RuntimeError(run.stderr[-2000:])
    return {"results": json.loads(out.read_text())["results"]}


# (name, what it measures, expected seconds on an H200 with the real-size model)
STEPS: list[tuple[str, Callable[[dict], dict], int]] = [
    ("environment", step_environment, 15),
    ("checkpoint", step_checkpoint, 60),
    ("load", step_load, 60),
    ("steps", step_steps, 60),
    ("attention", step_attention, 15),
    ("compiled", step_compiled, 150),
    ("equivalence", step_equivalence, 60),
    ("scheduler", step_scheduler, 90),
]


# ------------------------------------------------------------------ the run


def install_wheels(wheels: Path, target: Path) -> str | None:
    """The wheels in `wheels` into `target` (no index, no dependencies: the device has no
    network); what went wrong, or None."""
    found = sorted(wheels.glob("*.whl"))
    if not found:
        return None
    run = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                          "--no-cache-dir", "--upgrade", "--target", str(target), *map(str, found)],
                         capture_output=True, text=True)
    return None if run.returncode == 0 else run.stderr[-2000:]


def table(report: dict) -> str:
    """The report as the text table `device-check.txt` holds."""
    lines = [f"vox-ws device check: {report['device']}, {report['size']} model, {report['dtype']}, "
             f"{report['seconds']:.0f} s of {report['budget_s']} s"]
    for name, step in report["steps"].items():
        lines.append(f"  {name:12s} {step['status']:8s} {step['seconds']:6.1f} s (expected {step['expected_s']} s)"
                     + (f"  {step['error'].splitlines()[-1][:100]}" if step.get("error") else ""))
    get = lambda name: report["steps"].get(name, {}).get("result")  # noqa: E731
    if env := get("environment"):
        gpu = f"{env['gpu']} (sm {env['capability']})" if "gpu" in env else "no GPU"
        lines += ["", f"{gpu}; torch {env['torch']}, CUDA "
                      f"{env['cuda']}, Triton {env['triton']}; compiler: {env['compiler']}; attention kernel "
                      f"{env['attention_kernel']['before']} -> {env['attention_kernel']['after']}"]
    if load := get("load"):
        lines.append(f"eager start {load['seconds']} s: {load['slots']} slots, {load['step_rows']} rows a step "
                     f"({load['slots_reason']}); peak {load.get('peak_gpu_mb', load['peak_rss_mb'])} MB")
    if steps := get("steps"):
        lines += ["", f"{'context':>7} {'B':>3} {'step ms':>8} {'CFM':>7} {'advance':>8} {'VAE':>7} {'memory MB':>10}"]
        for r in steps["results"]:
            lines.append(f"{r['context']:>7} {r['batch']:>3} {r['step_ms']:>8.2f} {r['cfm_ms']:>7.2f} "
                         f"{r['advance_ms']:>8.2f} {r['vae_ms']:>7.2f} {r.get('peak_gpu_mb', r['peak_rss_mb']):>10.0f}")
    if attention := get("attention"):
        lines += ["", f"{'B':>3} {'length':>6} {'attention before ms':>20} {'after ms':>9} {'kernels':>36}"]
        for r in attention["results"]:
            lines.append(f"{r['batch']:>3} {r['length']:>6} {r['before_ms']:>20.3f} {r['after_ms']:>9.3f} "
                         f"{r['before_kernel'] + ' -> ' + r['after_kernel']:>36}")
    if compiled := get("compiled"):
        graphs = ", ".join(f"{g[0]} {g[2]:.1f} s" for g in compiled["graphs_first"])
        lines += ["", f"compiled bucket {compiled['bucket']}: first start {compiled['first_start_s']} s ({graphs}); "
                      f"a fresh process loading them {compiled['second_start_s']} s"]
        for r in compiled["steps_ms"]:
            lines.append(f"  B={r['batch']}: eager {r['eager_ms']} ms, compiled {r['compiled_ms']} ms "
                         f"({r['compiled_vs_eager']}x)")
    if equivalence := get("equivalence"):
        lines += ["", f"equivalence with the package ({equivalence['dtype']}): "
                      f"{'equal' if equivalence['equal'] else 'DIFFERENT'} within {equivalence['tolerance']:g}, "
                      "largest |difference| " + ", ".join(f"{d:.2e}" for d in equivalence["max_abs_diff"])]
    if scheduler := get("scheduler"):
        lines += ["", f"{'N':>3} {'audio s/s':>10} {'x serial':>9} {'ttfa p50':>9} {'ttfa p95':>9} {'step ms':>8}"]
        for r in scheduler["results"]:
            b = r["batched"]
            lines.append(f"{r['n']:>3} {b['throughput']:>10.2f} {r['ratio']:>9.2f} {b['ttfa_p50_ms']:>7.0f}ms "
                         f"{b['ttfa_p95_ms']:>7.0f}ms {b['mean_step_ms']:>8.1f}")
    lines += ["", PUBLISHED]
    return "\n".join(lines) + "\n"


def run_all(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="vox-ws-device-check-", dir=_in_memory(12e9 if args.size == "real" else 1e8)))
    try:
        return _run_all(args, out, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _in_memory(needed: float) -> str | None:
    """/dev/shm where it can hold `needed` bytes (a container's is often 64 MB), else None: the
    temporary directory."""
    try:
        return "/dev/shm" if shutil.disk_usage("/dev/shm").free > needed and os.access("/dev/shm", os.W_OK) else None
    except OSError:
        return None


def _run_all(args: argparse.Namespace, out: Path, work: Path, started: float) -> int:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    paths = [str(ROOT)]
    site = work / "site"
    wheel_error = install_wheels(ROOT / ".whl", site)
    if site.exists():
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    on_gpu = args.device.startswith("cuda")
    ctx = {"device": args.device, "size": args.size, "dtype": "bfloat16" if on_gpu else "float32",
           "threads": args.threads, "work": str(work), "model": str(work / "model"),
           "max_rows": 64 if on_gpu or args.size == "tiny" else 8, "compile_bucket": 8 if on_gpu else 1}
    report: dict[str, Any] = {"device": args.device, "size": args.size, "dtype": ctx["dtype"],
                              "budget_s": args.budget, "seconds": 0.0, "steps": {}}
    if wheel_error:
        report["wheels_error"] = wheel_error
    wanted = args.only.split(",") if args.only else [name for name, _, _ in STEPS]
    for name, _, expected in STEPS:
        if name not in wanted:
            continue
        left = args.budget - (time.monotonic() - started)
        timeout = min(2 * expected if on_gpu and args.size == "real" else 2 * expected + 240, left)
        step: dict[str, Any] = {"expected_s": expected, "timeout_s": round(timeout), "seconds": 0.0}
        if timeout < 5:
            step["status"] = "skipped"
            step["error"] = "no time left in the budget"
        else:
            step.update(_run_step(name, ctx, env, timeout))
        print(f"== {name}: {step['status']} in {step['seconds']:.1f} s (expected {expected} s)", file=sys.stderr,
              flush=True)
        report["steps"][name] = step
        report["seconds"] = round(time.monotonic() - started, 1)
        (out / "device-check.json").write_text(json.dumps(report, indent=1))
        (out / "device-check.txt").write_text(table(report))
    print(table(report))
    failed = [n for n, s in report["steps"].items() if s["status"] != "ok"]
    return 1 if failed else 0


def _run_step(name: str, ctx: dict, env: dict, timeout: float) -> dict:
    result_file = Path(ctx["work"]) / f"{name}.json"
    started = time.monotonic()
    try:
        run = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--run-step", name,
                              "--context", json.dumps(ctx), "--result", str(result_file)],
                             capture_output=True, text=True, env=env, cwd=ROOT, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        tail = (exc.stderr or b"")[-2000:]
        return {"status": "timeout", "seconds": round(time.monotonic() - started, 1),
                "error": f"over its {timeout:.0f} s\n" + (tail.decode(errors="replace") if isinstance(tail, bytes) else tail)}
    seconds = round(time.monotonic() - started, 1)
    if run.returncode != 0 or not result_file.exists():
        return {"status": "failed", "seconds": seconds, "error": run.stderr[-3000:] or f"exit {run.returncode}"}
    return {"status": "ok", "seconds": seconds, "result": json.loads(result_file.read_text())}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=["real", "tiny"], default="real")
    ap.add_argument("--out", default=os.environ.get("OUT", "device-check-out"))
    ap.add_argument("--budget", type=int, default=540, help="seconds for the whole run (default 9 minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads in each step")
    ap.add_argument("--only", help="these steps alone (comma-separated names)")
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    ap.add_argument("--context", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_step:
        steps = {name: fn for name, fn, _ in STEPS}
        result = steps[args.run_step](json.loads(args.context))
        Path(args.result).write_text(json.dumps(result))
        return 0
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
