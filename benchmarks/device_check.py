"""The device check: what a first run of vox-ws on a lent GPU must learn, in one call of at most
10 minutes, its findings kept even where a step fails or runs out of time.

    scripts/device-wheels.sh                     # here: the wheels the device lacks, into .whl/
    python3 -m benchmarks.device_check --out "$OUT"          # there, with the device's python3

The figures that matter come first: the environment, a checkpoint of the released shape, then
the scheduler in bursts (N requests of one short text at once, N = 1, 32, 64, on one engine load
started as `vox-ws serve` starts it: eager while the step compiles in the background, then with
what it compiled), then the step's parts, the attention, equivalence with the package, and the
compiled step last (one bucket compiled, eager against compiled in one process, a second process
loading the saved graphs).

Each step runs in a process group of its own with its own time-out (its expected seconds, doubled
on a GPU with the real-size model, never past the whole run's `--budget`); a step past it is
killed whole (SIGKILL to the group: its decoder and compile children too). A step writes its
partial results as it goes, so a step that fails or overruns keeps what it measured;
`device-check.json` and the table `device-check.txt` are written again after every step. Where
`.whl/` holds wheels, they are installed into a private directory first (the device has no
network). The device lacks the web stack (Starlette, uvicorn, PyAV, ...): the check imports none
of it, which CI proves by running it with everything the device lacks unimportable
(`benchmarks.device_stack`).

CI runs it end to end on a CPU with the tiny model (`tests/test_gpu_check.py`):

    python -m benchmarks.device_check --device cpu --size tiny --out /tmp/device-check
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."
STEP_BATCHES = (1, 8, 32, 64)
BURSTS = (1, 32, 64)
CONTEXTS = {"short": 0, "long": 1000}      # positions the step attends over (0: the prompt's own)
# The peers' published first-audio figures, each with its source.
PUBLISHED = (
    "nanovllm-voxcpm (its README), RTX 4090, N requests of a short prompt at once: first audio p50 195 / 213 / "
    "273 ms at 1 / 32 / 64 streams",
    "nanovllm-voxcpm (OpenBMB/VoxCPM issue #374), RTX 4090: first audio 67 / 79 / 86 / 114 / 189 ms at 1 / 8 / "
    "16 / 32 / 64 streams",
    "vLLM-Omni (its H100 nightly benchmark), VoxCPM2: first audio 66-76 ms at 1 stream, 308-352 ms at 8",
)


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


def _reporter(ctx: dict) -> Callable[[dict], None]:
    """Writes a step's results so far (whole, replacing the last): what a step killed on its
    time-out, or failing later, still hands over."""
    path = Path(ctx["result"])

    def report(result: dict) -> None:
        _write_whole(path, {**result, "partial": True})
    return report


def _write_whole(path: Path, result: dict) -> None:
    """`result` as JSON in `path`, written aside and renamed over: a reader (the run, after a
    kill) finds the last whole one, never a part."""
    aside = path.with_name(f".{path.name}.partial")
    aside.write_text(json.dumps(result))
    os.replace(aside, path)


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_environment(ctx: dict) -> dict:
    """The GPU, torch, Triton, the C compiler Triton and inductor need, whether this torch saves
    compiled graphs (and its precompile flag as it comes), the SDPA kernels it allows and the one
    the decode attention runs on, before and after the fold."""
    import importlib.util

    torch = _torch(ctx)
    aot_flag = getattr(torch._dynamo.config, "enable_aot_compile", None)      # as this torch comes
    from benchmarks.attention import before, inputs
    from vox_ws.engines.voxcpm.graphs import precompile_available
    from vox_ws.engines.voxcpm.kv import attend, sdpa_kernel_of

    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    found = {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
             "compiler": compiler and subprocess.run([compiler, "--version"], capture_output=True,
                                                     text=True).stdout.splitlines()[0],
             "cpus": os.cpu_count(), "threads": ctx["threads"],
             "packages": {name: _version(name) for name in ("triton", "numpy", "voxcpm", "transformers",
                                                            "huggingface_hub", "typing_extensions", "numba", "anyio",
                                                            "pydantic", "websockets")},
             "enable_aot_compile": aot_flag, "precompile": precompile_available(),
             # The device has no web stack: the check must not need it (CI blocks it likewise).
             "web_stack": importlib.util.find_spec("starlette") is not None}
    device = torch.device(ctx["device"])
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        found.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                     gpu_memory_gb=round(props.total_memory / 2**30, 1), multiprocessors=props.multi_processor_count)
        backends = torch.backends.cuda
        found["sdpa_enabled"] = {name: getattr(backends, f"{name}_sdp_enabled")()
                                 for name in ("flash", "mem_efficient", "math", "cudnn")
                                 if hasattr(backends, f"{name}_sdp_enabled")}
    args = inputs(8, 1000, device, getattr(torch, ctx["dtype"]))
    found["attention_kernel"] = {"before": sdpa_kernel_of(before, args), "after": sdpa_kernel_of(attend, args)}
    return found


def step_checkpoint(ctx: dict) -> dict:
    """A random-weight VoxCPM2 of the released shape, in the serving dtype, in memory (/dev/shm)."""
    _torch(ctx)
    from vox_ws.testing.tiny_voxcpm import build

    started = time.perf_counter()
    path = build(ctx["model"], size=ctx["size"], stop="never", dtype=ctx["dtype"])
    size = sum(f.stat().st_size for f in path.iterdir())
    return {"path": str(path), "size": ctx["size"], "dtype": ctx["dtype"], "gb": round(size / 1e9, 2),
            "seconds": round(time.perf_counter() - started, 1)}


def step_scheduler(ctx: dict) -> dict:
    """The scheduler in bursts (`benchmarks.scheduler.run_bursts`): one engine load as a default
    start makes it (`--slots` the largest N; on a GPU the step compiling in the background), the
    package's serial arm at N = 1, then N = 1, 32, 64 at once, eager, and again with what the
    background compile made once it is done (waited for within this step's time)."""
    _torch(ctx)
    from benchmarks.scheduler import run_bursts

    # The wait leaves the step's time for its load, the eager bursts and the compiled ones.
    wait = max(0.0, min(ctx["compile_wait_s"], ctx["timeout_s"] - 150.0))
    return run_bursts(ctx["model"], ctx["device"], list(ctx["bursts"]), ctx["threads"], length=ctx["burst_length"],
                      compile=ctx["scheduler_compile"], compile_cache=str(Path(ctx["work"]) / "scheduler-cache"),
                      compile_buckets=tuple(ctx["bursts"]), compile_wait_s=wait, report=_reporter(ctx))


def _package_model(ctx: dict) -> Any:
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    return import_voxcpm().VoxCPM.from_pretrained(ctx["model"], load_denoiser=False, optimize=False,
                                                  device=ctx["device"]).tts_model


def step_steps(ctx: dict) -> dict:
    """The eager step at B = 1, 8, 32, 64, attending over the prompt alone (short) and over
    1,000 positions (long), split into the CFM, the advance (LocEnc, stop head, both LMs) and
    the VAE decode; the median of 5 steps after 2, and the peak memory of each B."""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    device = ctx["device"]
    model = _package_model(ctx)
    batches = [b for b in STEP_BATCHES if b <= ctx["max_rows"]]
    runner = BatchedVoxCPM2(model, slots=max(batches), decode_process=False, warm_rows=1)
    parts = {"cfm": 0.0, "advance": 0.0, "vae": 0.0}
    report = _reporter(ctx)

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
    results: list[dict] = []
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
            report({"results": results})
    runner.close()
    return {"results": results}


def step_attention(ctx: dict) -> dict:
    """The decode attention before and after the fold (`benchmarks.attention`)."""
    _torch(ctx)
    from benchmarks.attention import run

    return {"dtype": ctx["dtype"], "results": run(ctx["device"], ctx["dtype"], list(STEP_BATCHES), [100, 1000])}


def step_equivalence(ctx: dict) -> dict:
    """The batched runner against the voxcpm package, request by request, in the serving dtype
    (`benchmarks.equivalence`)."""
    _torch(ctx)
    from benchmarks.equivalence import compare

    work = Path(tempfile.mkdtemp(prefix="vox-ws-equivalence-", dir=ctx["work"]))
    return compare(ctx["model"], ctx["device"], work)


def _compiled_step(ctx: dict, model: Any, runner: Any, load_only: bool) -> Any:
    """The step of `ctx`'s bucket compiled into (or, `load_only`, loaded from) its cache, and the
    decode's graphs with it, as a start makes them."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep

    bucket = ctx["compile_bucket"]
    compiled = CompiledStep(model, (bucket,), ctx["compile_cache"], load_only=load_only)
    compiled.warm_up(runner.base_kv, runner.residual_kv, (bucket,))
    runner.vae.compile((bucket,), model.patch_size, compiled.store)
    return compiled


def step_compiled(ctx: dict) -> dict:
    """One bucket compiled, each graph's seconds; the compiled step against eager in the same
    process; then a second process loading the saved graphs (none compiled). A torch that saves
    no graphs, or an empty list of graphs either way, fails the step."""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.compile_main import time_eager_and_compiled
    from vox_ws.engines.voxcpm.lora import NO_ADAPTER
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    report = _reporter(ctx)
    bucket = ctx["compile_bucket"]
    ctx = {**ctx, "compile_cache": str(Path(ctx["work"]) / "compile-cache")}
    model = _package_model(ctx)
    runner = BatchedVoxCPM2(model, slots=bucket, decode_process=False, warm_rows=1)
    started = time.perf_counter()
    compiled = _compiled_step(ctx, model, runner, load_only=False)
    result: dict[str, Any] = {"bucket": bucket, "precompile": compiled.store.precompile,
                              "first_start_s": round(time.perf_counter() - started, 1),
                              "graphs_first": compiled.store.seconds}
    report(result)
    prompt = build_prompt(model, TEXT, None)
    result["step_ms"] = time_eager_and_compiled(runner, compiled, prompt, bucket, NO_ADAPTER)
    result["step_ms"]["compiled_vs_eager"] = round(result["step_ms"]["compiled_ms"] / result["step_ms"]["eager_ms"],
                                                   3)
    report(result)
    if ctx["device"].startswith("cuda"):
        try:
            result["cuda_graphs"] = _time_cuda_graphs(torch, model, compiled, bucket)
        except Exception as exc:  # noqa: BLE001 - the step's other figures stand; the table says why
            result["cuda_graphs"] = {"error": f"{type(exc).__name__}: {exc}"}
        report(result)
    runner.close()
    del runner, compiled, model
    if ctx["device"].startswith("cuda"):
        torch.cuda.empty_cache()
    out = Path(ctx["work"]) / "compiled-reload.json"
    reload = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--run-step", "compiled_reload",
                             "--context", json.dumps({**ctx, "result": str(out)}), "--result", str(out)],
                            capture_output=True, text=True, cwd=ROOT)
    if reload.returncode != 0:
        raise RuntimeError("the second process could not load the graphs: " + reload.stderr[-2000:])
    second = json.loads(out.read_text())
    result.update(second_start_s=second["seconds"], graphs_second=second["graphs"])
    report(result)
    if not result["precompile"]:
        raise RuntimeError("this torch saves no compiled graphs (precompile off): every start would compile")
    if not result["graphs_first"] or not result["graphs_second"]:
        raise RuntimeError(f"empty graph lists: compiled {result['graphs_first']}, loaded {result['graphs_second']}")
    if any(kind != "loaded" for _, kind, _ in result["graphs_second"]):
        raise RuntimeError(f"the second process compiled graphs instead of loading them: {result['graphs_second']}")
    return result


def _time_cuda_graphs(torch: Any, model: Any, compiled: Any, bucket: int, timesteps: int = 10) -> dict:
    """The CFM solve (ten LocDiT calls with guidance: most of a step's kernel launches) at B = 1,
    32, 64, eager against the same replayed from a CUDA graph (`cuda_graphs.CapturedSolves`);
    and at the compiled bucket, compiled against compiled replayed (`--cuda-graphs`)."""
    from vox_ws.engines.voxcpm.compiled import cfm_solve
    from vox_ws.engines.voxcpm.cuda_graphs import CapturedSolves

    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    hidden = model.lm_to_dit_proj.out_features + model.res_to_dit_proj.out_features

    def eager(mu: Any, cond: Any, noise: Any, steps: int, cfg: Any) -> Any:
        return cfm_solve(model.feat_decoder, mu, cond, noise, steps, cfg)

    def solve_inputs(rows: int) -> tuple:
        """mu, cond, noise (the same for a given `rows`), timesteps, cfg."""
        generator = torch.Generator(device="cpu").manual_seed(rows)
        return (*(torch.randn(shape, generator=generator).to(device, dtype) for shape in
                  ((rows, hidden), (rows, model.feat_dim, model.patch_size), (rows, model.feat_dim, model.patch_size))),
                timesteps, torch.full((rows,), 2.0, device=device, dtype=torch.float32))

    def median_ms(solve: Callable, rows: int) -> float:
        args = solve_inputs(rows)
        samples = []
        with torch.inference_mode():
            for index in range(12):
                torch.cuda.synchronize()
                started = time.perf_counter()
                solve(*args)
                torch.cuda.synchronize()
                if index >= 2:
                    samples.append((time.perf_counter() - started) * 1000)
        return round(sorted(samples)[len(samples) // 2], 3)

    def largest_difference(solve: Callable, graphed: Callable, rows: int) -> float:
        args = solve_inputs(rows)
        with torch.inference_mode():
            want, got = solve(*args), graphed(*args)
        return float((want.float() - got.float()).abs().max())

    captured = CapturedSolves(eager, device)
    rows = [{"batch": b, "eager_ms": median_ms(eager, b), "eager_graphed_ms": median_ms(captured, b),
             "max_abs_diff": largest_difference(eager, captured, b)} for b in BURSTS]
    graphed_compiled = CapturedSolves(compiled._solve_padded, device)
    return {"timesteps": timesteps, "solve": rows, "compiled": {
        "batch": bucket, "compiled_ms": median_ms(compiled._solve_padded, bucket),
        "compiled_graphed_ms": median_ms(graphed_compiled, bucket),
        "max_abs_diff": largest_difference(compiled._solve_padded, graphed_compiled, bucket)},
        "captured_s": {**captured.captured_s, **{f"compiled {k}": v for k, v in graphed_compiled.captured_s.items()}}}


def step_compiled_reload(ctx: dict) -> dict:
    """(The compiled step's second process.) The model loaded afresh and the bucket's graphs
    only loaded from the cache: a later start's cost, and proof they were saved."""
    _torch(ctx)
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    model = _package_model(ctx)
    runner = BatchedVoxCPM2(model, slots=ctx["compile_bucket"], decode_process=False, warm_rows=1)
    started = time.perf_counter()
    compiled = _compiled_step(ctx, model, runner, load_only=True)
    seconds = round(time.perf_counter() - started, 2)
    runner.close()
    return {"seconds": seconds, "graphs": compiled.store.seconds}


# (name, what it measures, expected seconds on an H200 with the real-size model): at most 480 in
# all, of the run's 540.
STEPS: list[tuple[str, Callable[[dict], dict], int]] = [
    ("environment", step_environment, 20),
    ("checkpoint", step_checkpoint, 60),
    ("scheduler", step_scheduler, 200),
    ("steps", step_steps, 50),
    ("attention", step_attention, 15),
    ("equivalence", step_equivalence, 45),
    ("compiled", step_compiled, 90),
]
# Run only inside another step's process group.
HELPERS: dict[str, Callable[[dict], dict]] = {"compiled_reload": step_compiled_reload}


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


def _status_line(name: str, step: dict) -> str:
    line = f"  {name:12s} {step['status']:8s} {step['seconds']:6.1f} s (expected {step['expected_s']} s)"
    if step["status"] == "timeout":
        line += f"  over its {step['timeout_s']} s, killed" + ("; partial results below" if step.get("result") else "")
    elif step.get("error"):
        line += f"  {step['error'].strip().splitlines()[-1][:110]}"
    return line


def table(report: dict) -> str:
    """The report as the text table `device-check.txt` holds (partial results included)."""
    lines = [f"vox-ws device check: {report['device']}, {report['size']} model, {report['dtype']}, "
             f"{report['seconds']:.0f} s of {report['budget_s']} s"]
    lines += [_status_line(name, step) for name, step in report["steps"].items()]
    get = lambda name: report["steps"].get(name, {}).get("result")  # noqa: E731
    if env := get("environment"):
        gpu = f"{env['gpu']} (sm {env['capability']})" if "gpu" in env else "no GPU"
        packages = env["packages"]
        lines += ["", f"{gpu}; Python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, Triton "
                      f"{packages['triton']}; compiler: {env['compiler']}; {env['threads']} threads of {env['cpus']}",
                  f"precompile {'on' if env['precompile'] else 'OFF'} (enable_aot_compile as shipped: "
                  f"{env['enable_aot_compile']}); attention kernel {env['attention_kernel']['before']} -> "
                  f"{env['attention_kernel']['after']}" + (f"; SDPA enabled {env['sdpa_enabled']}"
                                                           if "sdpa_enabled" in env else "")]
    if scheduler := get("scheduler"):
        lines += ["", *_scheduler_lines(scheduler)]
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
    if equivalence := get("equivalence"):
        lines += ["", f"equivalence with the package ({equivalence['dtype']}): "
                      f"{'equal' if equivalence['equal'] else 'DIFFERENT'} within {equivalence['tolerance']:g}, "
                      "largest |difference| " + ", ".join(f"{d:.2e}" for d in equivalence["max_abs_diff"])]
    if compiled := get("compiled"):
        lines += ["", *_compiled_lines(compiled)]
    lines += ["", "published, for comparison:", *(f"  {line}" for line in PUBLISHED)]
    return "\n".join(lines) + "\n"


def _scheduler_lines(scheduler: dict) -> list[str]:
    lines = []
    if load := scheduler.get("load"):
        lines.append(f"one engine load, {load['seconds']} s: {load['slots']} slots, {load['step_rows']} rows a step "
                     f"({load['slots_reason']}); peak {load.get('peak_gpu_mb', load['peak_rss_mb'])} MB")
    lines.append(f"bursts of \"{scheduler['text']}\", {scheduler['length_patches']} patches each, all sent at once:")
    lines.append(f"  {'phase':>9} {'N':>3} {'ttfa p50':>9} {'ttfa p95':>9} {'audio s/s':>9} {'step ms':>8}")
    if serial := scheduler.get("serial"):
        lines.append(f"  {'package':>9} {1:>3} {serial['ttfa_p50_ms']:>7.0f}ms {serial['ttfa_p95_ms']:>7.0f}ms "
                     f"{serial['throughput']:>9.2f} {'':>8}")
    for phase in ("eager", "compiled"):
        runs = scheduler.get(phase)
        if not runs:
            continue
        for r in runs["results"]:
            lines.append(f"  {phase:>9} {r['n']:>3} {r['ttfa_p50_ms']:>7.0f}ms {r['ttfa_p95_ms']:>7.0f}ms "
                         f"{r['throughput']:>9.2f} {r['mean_step_ms']:>8.1f}")
        background = runs["compile"].get("background")
        if background:
            lines.append(f"  ({phase}: background compile {background['status']}, buckets compiled "
                         f"{background['compiled']}, in use {runs.get('adopted', runs['compile']['buckets'])})")
    if "eager" in scheduler and "compiled" not in scheduler and scheduler["eager"]["compile"].get("background"):
        lines.append("  (compiled: the background compile was not done within the step's time)")
    return lines


def _compiled_lines(compiled: dict) -> list[str]:
    graphs = ", ".join(f"{g[0]} {g[2]:.1f} s" for g in compiled["graphs_first"]) or "NONE"
    lines = [f"compiled bucket {compiled['bucket']} (precompile {'on' if compiled['precompile'] else 'OFF'}): "
             f"first start {compiled['first_start_s']} s ({graphs})"]
    if step := compiled.get("step_ms"):
        lines.append(f"  B={compiled['bucket']}: eager {step['eager_ms']} ms, compiled {step['compiled_ms']} ms "
                     f"({step['compiled_vs_eager']}x)")
    graphs = compiled.get("cuda_graphs")
    if graphs and "error" in graphs:
        lines.append(f"  CUDA graphs of the CFM solve: FAILED ({graphs['error'][:150]})")
    elif graphs:
        lines.append(f"  the CFM solve ({graphs['timesteps']} timesteps), eager -> replayed from a CUDA graph: "
                     + ", ".join(f"B={r['batch']} {r['eager_ms']} -> {r['eager_graphed_ms']} ms" for r in graphs["solve"])
                     + f"; compiled B={graphs['compiled']['batch']} {graphs['compiled']['compiled_ms']} -> "
                       f"{graphs['compiled']['compiled_graphed_ms']} ms; largest |difference| "
                       f"{max([r['max_abs_diff'] for r in graphs['solve']] + [graphs['compiled']['max_abs_diff']]):.2e}")
    if "graphs_second" in compiled:
        loaded = [g for g in compiled["graphs_second"] if g[1] == "loaded"]
        lines.append(f"  a fresh process: {len(loaded)} of {len(compiled['graphs_second'])} graphs loaded in "
                     f"{compiled['second_start_s']} s" + ("" if compiled["graphs_second"] else ": NONE SAVED"))
    return lines


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
    real_gpu = on_gpu and args.size == "real"
    ctx = {"device": args.device, "size": args.size, "dtype": "bfloat16" if on_gpu else "float32",
           "threads": args.threads, "work": str(work), "model": str(work / "model"),
           "max_rows": 64 if on_gpu or args.size == "tiny" else 8, "compile_bucket": 32 if on_gpu else 1,
           "bursts": list(BURSTS), "burst_length": 25,
           # The scheduler starts as `vox-ws serve` does on this device: compiling in the background
           # on a GPU (a CPU's check compiles in its own step only: its compile takes minutes here).
           "scheduler_compile": "auto" if on_gpu else "off", "compile_wait_s": 90.0}
    report: dict[str, Any] = {"device": args.device, "size": args.size, "dtype": ctx["dtype"], "threads": args.threads,
                              "budget_s": args.budget, "seconds": 0.0, "steps": {}}
    if wheel_error:
        report["wheels_error"] = wheel_error
    wanted = args.only.split(",") if args.only else [name for name, _, _ in STEPS]
    for name, _, expected in STEPS:
        if name not in wanted:
            continue
        left = args.budget - (time.monotonic() - started)
        timeout = min(2 * expected if real_gpu else 2 * expected + 240, left)
        step: dict[str, Any] = {"expected_s": expected, "timeout_s": round(timeout), "seconds": 0.0}
        if timeout < 5:
            step["status"] = "skipped"
            step["error"] = "no time left in the budget"
        else:
            step.update(_run_step(name, {**ctx, "timeout_s": timeout}, env, timeout))
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
    """One step in a process group of its own, its output in a log file (a child left holding a
    pipe could hold the wait); past `timeout` the whole group is killed, and it is killed after a
    normal end too, so no child of a step outlives it."""
    work = Path(ctx["work"])
    result_file = work / f"{name}.json"
    result_file.unlink(missing_ok=True)
    log_path = work / f"{name}.log"
    started = time.monotonic()
    with open(log_path, "w+b") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "benchmarks.device_check", "--run-step", name,
                                    "--context", json.dumps({**ctx, "result": str(result_file)}),
                                    "--result", str(result_file)],
                                   stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                   cwd=ROOT, start_new_session=True)
        try:
            code: int | None = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            code = None
        _kill_group(process)
        log_file.seek(0)
        tail = log_file.read()[-3000:].decode(errors="replace")
    outcome: dict[str, Any] = {"seconds": round(time.monotonic() - started, 1)}
    found = json.loads(result_file.read_text()) if result_file.exists() else None
    if found is not None:
        outcome["result"] = found
    if code is None:
        return {**outcome, "status": "timeout", "error": f"over its {timeout:.0f} s, killed\n{tail}"}
    if code != 0 or found is None or found.get("partial"):
        return {**outcome, "status": "failed", "error": tail or f"exit {code}"}
    return {**outcome, "status": "ok"}


def _kill_group(process: subprocess.Popen, wait_s: float = 30.0) -> None:
    """SIGKILL to the step's process group (its children too: a decoder process that ignores
    SIGTERM), reap the step, and wait until no member of the group runs (a signal is delivered
    after `killpg` returns; SIGKILL cannot be caught, so the wait ends, bounded all the same)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()
    deadline = time.monotonic() + wait_s
    while _running_in_group(process.pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def _running_in_group(group: int) -> list[int]:
    """The processes of process group `group` that are not yet dead (zombies are: they await
    only their parent's reaping)."""
    running = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()     # after the command's name, which may hold spaces
        if int(fields[2]) == group and fields[0] not in ("Z", "X"):
            running.append(int(entry.name))
    return running


def _step_function(name: str) -> Callable[[dict], dict]:
    """A step by its name, or by `module:function` (a step of the caller's own, run the same way)."""
    if ":" in name:
        import importlib

        module, _, function = name.partition(":")
        return getattr(importlib.import_module(module), function)
    return {**{step: fn for step, fn, _ in STEPS}, **HELPERS}[name]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--size", choices=["real", "tiny"], default="real")
    ap.add_argument("--out", default=os.environ.get("OUT", "device-check-out"))
    ap.add_argument("--budget", type=int, default=540, help="seconds for the whole run (default 9 minutes)")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1),
                    help="torch threads in each step (default: the cores, at most 16)")
    ap.add_argument("--only", help="these steps alone (comma-separated names)")
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    ap.add_argument("--context", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.run_step:
        _write_whole(Path(args.result), _step_function(args.run_step)(json.loads(args.context)))
        return 0
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
