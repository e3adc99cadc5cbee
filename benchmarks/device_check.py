"""The device check: what a first run of vox-ws on a lent GPU must learn, in one call of at most
10 minutes, its findings and every step's log kept even where a step fails or runs out of time;
then a second call for the rest.

    scripts/device-wheels.sh                     # here: the wheels the device lacks, into .whl/
    python3 -m benchmarks.device_check --out "$OUT"          # there, with the device's python3
    python3 -m benchmarks.device_check --out "$OUT" \
        --only environment,checkpoint,whole_large,scheduler,compiled        # a second call

The order is the order a first run needs its figures in (`STEPS`, with each step's expected
seconds on an H100): the environment (the card, its driver line from `nvidia-smi`, torch,
Triton, the compiler, precompile, the SDPA kernels; on a GPU, a run that did not carry `.whl`
fails here, in seconds, before any model is loaded), a checkpoint of the released shape, the
whole step as `--cuda-graphs` serves it for 1 and 8 rows (each bucket compiled, its attention
kernel named, compared with the uncompiled step, captured, each capture's replay compared with
it, and timed eager, compiled and replayed on a synchronised device; each bucket written as it
is done), the equivalence with the package (one model load), the step's parts at attention
lengths 4,000 and 8,000 (and the uncompiled whole step replayed from a CUDA graph, which needs
no compile; a failed capture reported as failed, never timed), the attention (the fold, and
gathered against in place, the in-place graph with the kernel it gets): that much in the first
call's 540 s. Then the whole step for 16, 32 and 64 rows, the scheduler in bursts (N requests of
one short text at once, N = 1, 32, 64, the engine in an engine process of its own started as
`vox-ws serve` starts it, the check's process its server's side: eager while the step compiles
in the background, which is not waited for; the seconds it took per bucket so far and the engine
process's peak memory kept as the engine declares them; then the package's own loop at N = 1 in
the check's process, on a model of its own) and the compiled pieces (one bucket: each graph's
seconds reported as it is done, compiled against eager in time, synchronised, and in output,
and a second process loading the saved graphs where a minute is left): a second call's, which
the table names.

Each step runs in a process group of its own with its own time-out (its expected seconds,
doubled on a GPU with the real-size model; the compiled step gets what is left of the run's
`--budget` but the last step's share); a step past it is killed whole (SIGKILL to the group: an
engine process, the fork server it came from, and their decoder and compile children too). A
step writes its partial results as it goes, so a step that fails or overruns keeps what it
measured; `device-check.json`, the table `device-check.txt` and `logs.tar.gz` (every step's
output, passing steps' too) are written again after every step, and every figure says which
card it was measured on (H100 or H200: the device is either). Where
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
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
TEXT = "The quick brown fox jumps over the lazy dog, and then it runs away."
STEP_BATCHES = (1, 8, 32, 64)
BURSTS = (1, 32, 64)
# The attention lengths the step is timed at (positions attended), as far as the model's
# max_length allows: a long answer's context, where the attention is most of an advance.
CONTEXTS = (4000, 8000)
# Positions kept free past a context for the steps timed there (2 warm-up and 5 timed).
CONTEXT_ROOM = 16
# The whole step replayed from a CUDA graph, where the engine has it (written beside this check):
# `capture_step(runner, rows) -> step`, `step(rows)` as `runner.step(rows)`.
CAPTURED_STEP = ("vox_ws.engines.voxcpm.cuda_graphs", "capture_step")
# The compiled step's second process (loading the saved graphs) only with this much time left.
RELOAD_NEEDS_S = 60.0
# The peers' published first-audio figures, each with its source.
PUBLISHED = (
    "nanovllm-voxcpm (its README), RTX 4090, N requests of a short prompt at once: first audio p50 195 / 213 / "
    "273 ms at 1 / 32 / 64 streams",
    "nanovllm-voxcpm (OpenBMB/VoxCPM issue #374), RTX 4090: first audio 67 / 79 / 86 / 114 / 189 ms at 1 / 8 / "
    "16 / 32 / 64 streams",
    "vLLM-Omni (its H100 nightly benchmark), VoxCPM2: first audio 66-76 ms at 1 stream, 308-352 ms at 8",
    "nanovllm-voxcpm, H800 (as issue 70 gives them; no source checked here): first audio 62 / 66 / 74 ms at 1 / 8 / "
    "16 streams",
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
    time-out, or failing later, still hands over. A step named in `--overrun` blocks for good
    after its first report, so that a test sees the kill at its time-out keep what it wrote."""
    path = Path(ctx["result"])

    def report(result: dict) -> None:
        _write_whole(path, {**result, "partial": True})
        if ctx.get("overrun"):
            import threading

            threading.Event().wait()
    return report


def _write_whole(path: Path, result: dict) -> None:
    """`result` as JSON in `path`, written aside and renamed over: a reader (the run, after a
    kill) finds the last whole one, never a part."""
    aside = path.with_name(f".{path.name}.partial")
    aside.write_text(json.dumps(result))
    os.replace(aside, path)


def _left_s(ctx: dict) -> float:
    """Seconds left before this step is killed (the run's clock: CLOCK_MONOTONIC is one clock
    for every process of the machine)."""
    return ctx["deadline"] - time.monotonic() if "deadline" in ctx else float("inf")


def _version(package: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def step_environment(ctx: dict) -> dict:
    """The card and its driver (`nvidia-smi`, as the run found them), the GPU as torch sees it,
    torch, Triton, the C compiler Triton and inductor need, whether this torch saves compiled
    graphs (and its precompile flag as it comes), the SDPA kernels it allows and the one the
    decode attention runs on, before and after the fold."""
    import importlib.util

    torch = _torch(ctx)
    aot_flag = getattr(torch._dynamo.config, "enable_aot_compile", None)      # as this torch comes
    from benchmarks.attention import before, inputs
    from vox_ws.engines.voxcpm.graphs import precompile_available
    from vox_ws.engines.voxcpm.kv import attend, sdpa_kernel_of

    compiler = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    found = {"nvidia_smi": ctx.get("gpu") or nvidia_smi(),
             "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
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
        found.update(gpu=props.name, card=card_of(props.name), capability=f"{props.major}.{props.minor}",
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
    """The scheduler in bursts (`benchmarks.scheduler`'s), the engine in an engine process of its
    own started as `vox-ws serve` starts it (`benchmarks.served_engine`: `--slots` the largest N;
    on a GPU the step compiling in the background), this process its server's side, submitting
    through the engine's stand-in and receiving the steps' audio as a server's streams do: N = 1,
    32, 64 at once, eager. The background compile is not waited for (it takes minutes; the
    compiled step measures it): what it has done by the end, with its seconds per bucket, is kept,
    as the engine declares it (`describe()["compile"]["background"]`), and so is the engine
    process's peak memory (`describe()["memory"]`). Then the package's serial arm at N = 1."""
    _torch(ctx)
    from benchmarks.scheduler import BURST_TEXT, _burst, loaded, serial_arm, serve_voxcpm

    report = _reporter(ctx)
    ns, length, device = list(ctx["bursts"]), ctx["burst_length"], ctx["device"]
    result: dict[str, Any] = {"text": BURST_TEXT, "length_patches": length, "ns": ns}
    started = time.perf_counter()
    with serve_voxcpm(ctx["model"], device, ctx["threads"], max(ns), ctx["scheduler_compile"],
                      str(Path(ctx["work"]) / "scheduler-cache"), tuple(ns)) as served:
        result["load"] = loaded(served, started)
        report(result)
        runs = result["eager"] = {"compile": served.described()["compile"], "results": []}
        for n in ns:
            _burst(served, n, 3, seed=1)              # warm-up: this N's shapes
            runs["results"].append({"n": n, **_burst(served, n, length, seed=2)})
            result["background"] = _background(served.described())
            report(result)
        described = served.described_now()
        runs["adopted"] = described["compile"]["buckets"]
        # Compared with eager on the background compile's reader thread, during the bursts.
        runs["mismatched"] = described["compile"]["mismatched"]
        result["background"] = _background(described)
        result["peak"] = described["memory"]
        report(result)
    # The package's own loop needs the model in this process, and the engine's is in another:
    # it loads its own (a second load), after the bursts, once the engine process has ended,
    # so that neither measures beside the other and the GPU never holds two copies; and a step
    # cut at its time-out has kept the bursts, the figures it is for.
    result["serial"] = serial_arm(ctx["model"], device, length)
    return result


def _background(described: dict) -> dict | None:
    """The background compile's progress as the engine declares it (None: there is none), with
    its seconds per bucket (`compile_s`) and how long it has run."""
    background = described["compile"].get("background")
    if background is None:
        return None
    return {**background, "running_s": round(time.time() - background["started_at"], 1)}


def _package_model(ctx: dict) -> Any:
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    return import_voxcpm().VoxCPM.from_pretrained(ctx["model"], load_denoiser=False, optimize=False,
                                                  device=ctx["device"]).tts_model


def _captured_step_maker(device: str) -> tuple[Callable | None, str]:
    """The engine's whole step replayed from a CUDA graph (`CAPTURED_STEP`), and why not where
    there is none."""
    if not device.startswith("cuda"):
        return None, "no CUDA"
    import importlib

    module, name = CAPTURED_STEP
    try:
        make = getattr(importlib.import_module(module), name, None)
    except ImportError as exc:
        return None, f"not available ({module}: {exc})"
    return (make, "measured") if callable(make) else (None, f"not available (no {module}.{name})")


def _median_ms(samples: list[dict]) -> dict[str, float]:
    return {key: round(sorted(s[key] for s in samples)[len(samples) // 2], 2) for key in samples[0]}


def step_steps(ctx: dict) -> dict:
    """The eager step at B = 1, 8, 32, 64, attending over 4,000 and 8,000 positions (as far as
    the model's max_length allows: the lengths used are in the result), split into the CFM, the
    advance (LocEnc, stop head, both LMs) and the VAE decode; the median of 5 steps after 2, and
    the peak memory of each B. On CUDA, the same rows stepped by the whole step replayed from a
    CUDA graph too (no compile), where the engine has it."""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    device = ctx["device"]
    model = _package_model(ctx)
    batches = [b for b in STEP_BATCHES if b <= ctx["max_rows"]]
    runner = BatchedVoxCPM2(model, slots=max(batches), decode_process=False, warm_rows=1)
    parts = {"cfm": 0.0, "advance": 0.0, "vae": 0.0}
    report = _reporter(ctx)
    limit = model.config.max_length - CONTEXT_ROOM
    contexts = [{"asked": asked, "positions": min(asked, limit)} for asked in CONTEXTS]
    make_captured, captured_status = _captured_step_maker(device)
    result: dict[str, Any] = {"max_length": model.config.max_length, "contexts": contexts,
                              "captured": {"status": captured_status, "api": ".".join(CAPTURED_STEP)},
                              "results": []}

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

    def median_step_ms(step: Callable, rows: list, with_parts: bool) -> dict[str, float]:
        samples = []
        for index in range(7):
            for part in parts:
                parts[part] = 0.0
            _sync(torch, device)
            started = time.perf_counter()
            step(rows)
            _sync(torch, device)
            if index >= 2:
                samples.append({"step_ms": (time.perf_counter() - started) * 1000,
                                **({f"{part}_ms": seconds * 1000 for part, seconds in parts.items()}
                                   if with_parts else {})})
        return _median_ms(samples)

    runner.eager.solve = timed("cfm", runner.eager.solve)
    runner.eager.advance = timed("advance", runner.eager.advance)
    runner.vae.decode = timed("vae", runner.vae.decode)
    prompt = build_prompt(model, TEXT, None)
    measured: set[int] = set()
    for asked, positions in ((c["asked"], c["positions"]) for c in contexts):
        if positions in measured:          # a small model's max_length: both lengths clamp alike
            continue
        measured.add(positions)
        for batch in batches:
            if device.startswith("cuda"):
                torch.cuda.reset_peak_memory_stats()
            rows = runner.prefill_many([PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                     max_len=4096) for i in range(batch)])
            for row in rows:
                row.position = max(row.position, positions)   # as long a context, whatever K/V holds
            row_result = {"context": asked, "positions": rows[0].position, "batch": batch,
                          **median_step_ms(runner.step, rows, with_parts=True), **_memory_mb(torch, device)}
            result["results"].append(row_result)
            if make_captured is not None and result["captured"]["status"] == "measured":
                try:
                    started = time.perf_counter()
                    captured = make_captured(runner, batch)
                    row_result["capture_s"] = round(time.perf_counter() - started, 2)
                    row_result["captures"] = runner.captured.describe()
                    # A capture that failed (or whose replay differed) leaves its step uncaptured:
                    # that step is not timed as captured, and the figure says why.
                    if row_result["captures"]["failed"]:
                        result["captured"]["status"] = "failed: " + "; ".join(
                            f"{name}: {why}" for name, why in row_result["captures"]["failed"].items())[:400]
                    else:
                        row_result["captured_ms"] = median_step_ms(captured, rows, with_parts=False)["step_ms"]
                except Exception as exc:  # noqa: BLE001 - the eager figures stand; the table says why
                    result["captured"]["status"] = f"failed: {type(exc).__name__}: {exc}"[:400]
                finally:
                    runner.whole = runner.captured = None     # the next figures are eager again
            for row in rows:
                runner.release(row)
            report(result)
    runner.close()
    if result["captured"]["status"].startswith("failed"):
        raise RuntimeError(f"the whole step from a CUDA graph: {result['captured']['status']}")
    return result


def _timed_steps(torch: Any, runner: Any, prompt: Any, rows: int, positions: int) -> float:
    """The median of 5 steps (after 2) of `rows` rows at `positions` positions, as the runner
    serves them now (eager, its compiled whole step, or that replayed from CUDA graphs), each
    step timed from a synchronised device to a synchronised device (the step reads its stop flags
    back, but a CUDA graph's replay is queued before it: the figure is the device's, not the
    queueing's)."""
    from vox_ws.engines.voxcpm.runner import PrefillInput

    batch = runner.prefill_many([PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                              max_len=4096) for i in range(rows)])
    for row in batch:
        row.position = max(row.position, positions)       # as long a context, whatever K/V holds
    samples = []
    try:
        for index in range(7):
            _sync(torch, str(runner.device))
            started = time.perf_counter()
            runner.step(batch)
            _sync(torch, str(runner.device))
            if index >= 2:
                samples.append((time.perf_counter() - started) * 1000)
    finally:
        for row in batch:
            runner.release(row)
    return round(sorted(samples)[len(samples) // 2], 3)


def _as_served(runner: Any, whole: Any, captured: Any, timed: Callable[[], float]) -> float:
    """`timed()` with the runner stepping through `whole` and `captured` (None: eager, or the
    whole step uncaptured), then as it was."""
    kept = runner.whole, runner.captured
    runner.whole, runner.captured = whole, captured
    try:
        return timed()
    finally:
        runner.whole, runner.captured = kept


def _whole_bucket(torch: Any, runner: Any, compiled: Any, bucket: int, contexts: list[int], prompt: Any) -> dict:
    """One bucket of the whole step: compiled (each graph's FlexAttention kernel as the CUDA
    lowering chose it, where it lowered one here, and as it takes it for the graph's shapes),
    compared with the uncompiled step (`compile_whole`), captured where the device is CUDA (each
    capture's replay compared with it before it serves; a failed capture reported as failed,
    never timed), and each way timed at each context."""
    from vox_ws.engines.voxcpm.cuda_graphs import CudaCapture
    from vox_ws.engines.voxcpm.flex_kernels import lowered, summary
    from vox_ws.engines.voxcpm.runner import _padding_step
    from vox_ws.engines.voxcpm.whole_step import WHOLE_TIMESTEPS

    decode = runner.decoding.process is None
    row: dict[str, Any] = {"bucket": bucket}
    started, made = time.perf_counter(), len(compiled.store.seconds)
    with lowered() as chosen:
        runner.compile_whole(compiled, (bucket,))
    row["compile_s"] = round(time.perf_counter() - started, 1)
    row["graphs"] = compiled.store.seconds[made:]        # (graph, "compiled" or "loaded", seconds)
    row["kernel_lowered"] = summary(chosen) if chosen else None
    row["kernel_on_cuda"] = summary(runner.whole.attention_kernels(WHOLE_TIMESTEPS[0], decode,
                                                                   _padding_step(runner, bucket, 2)))
    if not runner.whole.serves(bucket, WHOLE_TIMESTEPS[0], decode):
        row["status"] = f"differs from the uncompiled step: {compiled.mismatched.get(f'whole {bucket}')}"
        return row
    whole = runner.whole
    row["timings"] = [{"positions": positions,
                       "eager_ms": _as_served(runner, None, None, lambda p=positions: _timed_steps(
                           torch, runner, prompt, bucket, p)),
                       "compiled_ms": _as_served(runner, whole, None, lambda p=positions: _timed_steps(
                           torch, runner, prompt, bucket, p))}
                      for positions in contexts]
    if runner.device.type != "cuda":
        row["status"] = "compiled; not captured: no CUDA"
        return row
    started = time.perf_counter()
    runner.captured = None
    runner.capture_whole(CudaCapture(runner.device), buckets=(bucket,))
    captured = runner.captured.describe()
    row["capture_s"] = round(time.perf_counter() - started, 2)
    row["failed"] = {name: why for name, why in captured["failed"].items() if name.startswith(f"{bucket}x")}
    if row["failed"]:
        row["status"] = "capture FAILED"
        return row
    row["status"] = "captured"
    for timing in row["timings"]:
        timing["captured_ms"] = _as_served(runner, whole, runner.captured, lambda p=timing["positions"]: _timed_steps(
            torch, runner, prompt, bucket, p))
    return row


def _whole_steps(ctx: dict, buckets: list[int]) -> dict:
    """The whole step as `--cuda-graphs` serves it, bucket by bucket (`_whole_bucket`), each
    bucket's figures written as soon as it is done: a run cut short keeps the buckets before."""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.compiled import CompiledStep
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    report = _reporter(ctx)
    model = _package_model(ctx)
    runner = BatchedVoxCPM2(model, slots=max(buckets), decode_process=False, warm_rows=1)
    started = time.perf_counter()
    # How it attends: chosen here as a start chooses it (on a GPU, the in-place attention's probe).
    compiled = CompiledStep(model, tuple(buckets), str(Path(ctx["work"]) / "whole-cache"),
                            cuda_graphs=ctx["device"].startswith("cuda"))
    prompt = build_prompt(model, TEXT, None)
    limit = model.config.max_length - CONTEXT_ROOM
    contexts = sorted({min(prompt.text_tokens.shape[0], limit), min(CONTEXTS[0], limit)})
    result: dict[str, Any] = {"buckets": buckets, "attention": compiled.attention.describe(),
                              "attention_s": round(time.perf_counter() - started, 1), "contexts": contexts,
                              "results": []}
    report(result)
    try:
        for bucket in buckets:
            try:
                result["results"].append(_whole_bucket(torch, runner, compiled, bucket, contexts, prompt))
            except Exception as exc:  # noqa: BLE001 - the next bucket is measured all the same
                result["results"].append({"bucket": bucket, "status": f"FAILED: {type(exc).__name__}: {exc}"[:500]})
            result["results"][-1].update(_memory_mb(torch, ctx["device"]))
            report(result)
    finally:
        runner.close()
    failed = [r for r in result["results"] if r["status"] not in ("captured", "compiled; not captured: no CUDA")]
    if failed:
        raise RuntimeError(f"the whole step of {[r['bucket'] for r in failed]} rows: "
                           + "; ".join(f"{r['bucket']}: {r['status']}" for r in failed))
    return result


def step_whole(ctx: dict) -> dict:
    """The whole step as `--cuda-graphs` serves it, for the buckets a first run must have (1 and
    8 on a GPU): compiled, compared, captured, timed synchronised, named by its attention kernel."""
    return _whole_steps(ctx, ctx["whole_buckets"])


def step_whole_large(ctx: dict) -> dict:
    """The same for the larger buckets (16, 32 and 64 on a GPU): a second call's (`--only`). A
    CPU's run loads the first step's bucket again here (its code run, without another compile)."""
    return _whole_steps(ctx, ctx["whole_large_buckets"])


def step_attention(ctx: dict) -> dict:
    """The decode attention before and after the fold (`benchmarks.attention`), at the step's
    context lengths too on a GPU (a CPU's memory and time allow 100 and 1,000); and the compiled
    step's two ways to attend, gathered against in place (`benchmarks.attention --in-place`),
    which decide `kv.in_place_attention`'s default."""
    _torch(ctx)
    from benchmarks.attention import in_place_rows, run

    on_gpu = ctx["device"].startswith("cuda")
    lengths = [100, 1000] + (list(CONTEXTS) if on_gpu else [])
    result = {"dtype": ctx["dtype"], "results": run(ctx["device"], ctx["dtype"], list(STEP_BATCHES), lengths)}
    if not on_gpu:      # a CPU's figures come from `benchmarks.attention --in-place` (minutes of compiling)
        return result
    report = _reporter(ctx)
    report(result)
    result["in_place"] = []
    try:
        for batch in STEP_BATCHES:      # each batch's figures kept as they come: a kill keeps them
            result["in_place"] += in_place_rows(ctx["device"], ctx["dtype"], [batch], lengths, max(lengths))
            report(result)
    except Exception as exc:  # noqa: BLE001 - the fold's figures stand without it
        result["in_place_error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
    return result


def _compiled_step(ctx: dict, model: Any, runner: Any, load_only: bool,
                   after_graph: Callable[[Any], None] | None = None) -> Any:
    """The step of `ctx`'s bucket compiled into (or, `load_only`, loaded from) its cache, and the
    decode's graphs with it, as a start makes them; `after_graph(store)` once each graph is."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep

    bucket = ctx["compile_bucket"]
    compiled = CompiledStep(model, (bucket,), ctx["compile_cache"], load_only=load_only)
    store = compiled.store
    if after_graph is not None:
        graph = store.graph

        def graph_then_report(*args: Any, **kwargs: Any) -> Any:
            made = graph(*args, **kwargs)
            after_graph(store)
            return made
        # Every graph goes through the store (`GraphsBySize` calls `store.graph`): a compile of
        # minutes reports each of its graphs as it is done, not all at the end.
        store.graph = graph_then_report
    compiled.warm_up(runner.base_kv, runner.residual_kv, (bucket,))
    runner.vae.compile((bucket,), model.patch_size, store)
    return compiled


def step_compiled(ctx: dict) -> dict:
    """The step's pieces, one bucket compiled, each graph's seconds reported as it is done, its
    advance's attention kernel named; the compiled step against eager in the same process, in
    time (synchronised) and in output (`comparison`); then, where a minute is left, a second
    process loading the saved graphs (none compiled). A torch that saves no graphs, or an empty
    list of graphs either way, fails the step. (The whole step, captured: `whole`.)"""
    torch = _torch(ctx)
    from vox_ws.engines.voxcpm.compile_main import time_eager_and_compiled
    from vox_ws.engines.voxcpm.flex_kernels import lowered, summary
    from vox_ws.engines.voxcpm.lora import NO_ADAPTER
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    report = _reporter(ctx)
    bucket = ctx["compile_bucket"]
    ctx = {**ctx, "compile_cache": str(Path(ctx["work"]) / "compile-cache")}
    result: dict[str, Any] = {"bucket": bucket, "given_s": round(_left_s(ctx)), "graphs_first": []}
    model = _package_model(ctx)
    runner = BatchedVoxCPM2(model, slots=bucket, decode_process=False, warm_rows=1)
    started = time.perf_counter()

    def after_graph(store: Any) -> None:
        result.update(precompile=store.precompile, graphs_first=list(store.seconds),
                      compiling_s=round(time.perf_counter() - started, 1))
        report(result)

    with lowered() as chosen:
        compiled = _compiled_step(ctx, model, runner, load_only=False, after_graph=after_graph)
    # How its advance attends: the kernel the CUDA lowering took here, and takes for its shapes.
    result.update(attention=compiled.attention.describe(), kernel_lowered=summary(chosen) if chosen else None,
                  kernel_on_cuda=summary(compiled.attention_kernels(runner.base_kv, runner.residual_kv, bucket)))
    result.pop("compiling_s", None)
    result.update(precompile=compiled.store.precompile, first_start_s=round(time.perf_counter() - started, 1),
                  graphs_first=list(compiled.store.seconds))
    report(result)
    prompt = build_prompt(model, TEXT, None)
    result["step_ms"] = time_eager_and_compiled(runner, compiled, prompt, bucket, NO_ADAPTER)
    result["step_ms"]["compiled_vs_eager"] = round(result["step_ms"]["compiled_ms"] / result["step_ms"]["eager_ms"],
                                                   3)
    report(result)
    result["comparison"] = _compare_eager_and_compiled(runner, compiled, prompt, bucket)
    report(result)
    runner.close()
    del runner, compiled, model
    if ctx["device"].startswith("cuda"):
        torch.cuda.empty_cache()
    left = _left_s(ctx)
    if left < RELOAD_NEEDS_S:
        result["reload"] = f"not run: {left:.0f} s left of the step's time, {RELOAD_NEEDS_S:.0f} needed"
    else:
        result.update(_reload(ctx, left - 10))
    report(result)
    if not result["precompile"]:
        raise RuntimeError("this torch saves no compiled graphs (precompile off): every start would compile")
    if not result["graphs_first"] or ("graphs_second" in result and not result["graphs_second"]):
        raise RuntimeError(f"empty graph lists: compiled {result['graphs_first']}, "
                           f"loaded {result.get('graphs_second')}")
    if any(kind != "loaded" for _, kind, _ in result.get("graphs_second", [])):
        raise RuntimeError(f"the second process compiled graphs instead of loading them: {result['graphs_second']}")
    return result


def _reload(ctx: dict, timeout: float) -> dict:
    """The saved graphs loaded by a second process (`step_compiled_reload`), its output logged
    beside the steps'; within `timeout` seconds."""
    out = Path(ctx["work"]) / "compiled-reload.json"
    log = Path(ctx["work"]) / "logs" / "compiled-reload.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w+b") as log_file:
        try:
            reload = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--run-step", "compiled_reload",
                                     "--context", json.dumps({**ctx, "result": str(out)}), "--result", str(out)],
                                    stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT, cwd=ROOT,
                                    timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"reload": f"the second process was not done within {timeout:.0f} s"}
        log_file.seek(0)
        tail = log_file.read()[-2000:].decode(errors="replace")
    if reload.returncode != 0:
        raise RuntimeError("the second process could not load the graphs: " + tail)
    second = json.loads(out.read_text())
    return {"second_start_s": second["seconds"], "graphs_second": second["graphs"]}


def _compare_eager_and_compiled(runner: Any, compiled: Any, prompt: Any, rows: int, steps: int = 3) -> dict:
    """The same `rows` rows (one prompt, the same seeds) stepped eager and then compiled: the
    largest |difference| of each step's latents (the first patch's is the kernels' alone; later
    ones carry it on through the condition and the KV)."""
    import torch

    from vox_ws.engines.voxcpm.runner import PrefillInput

    outputs: dict[str, list[Any]] = {}
    for name, step in (("eager", None), ("compiled", compiled)):
        runner.compiled = step
        batch = runner.prefill_many([PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                  max_len=4096) for i in range(rows)])
        with torch.inference_mode():
            outputs[name] = [runner._generate(batch)[1].float().cpu() for _ in range(steps)]
        for row in batch:
            runner.release(row)
    runner.compiled = None
    differences = [float((eager - done).abs().max()) for eager, done in zip(outputs["eager"], outputs["compiled"])]
    return {"rows": rows, "steps": steps, "max_abs_diff": differences,
            "largest_latent": float(max(t.abs().max() for t in outputs["eager"]))}


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


def step_equivalence(ctx: dict) -> dict:
    """The batched runner against the voxcpm package, request by request, in the serving dtype
    (`benchmarks.equivalence`'s five requests), on one model load: the package's requests first,
    then the runner's on the same model (the runner folds the VAE's weight norm in place, which
    changes no output, and keeps its state in its own KV slots)."""
    torch = _torch(ctx)
    import numpy as np

    from benchmarks.equivalence import TOLERANCE, reference_audio, run_batched, scenario, voice_wavs
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    if ctx["device"].startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False      # the same kernels' precision on both sides
        torch.backends.cudnn.allow_tf32 = False
    tts = import_voxcpm().VoxCPM.from_pretrained(ctx["model"], load_denoiser=False, optimize=False,
                                                 device=ctx["device"])
    dtype = str(next(tts.tts_model.base_lm.parameters()).dtype).replace("torch.", "")
    work = Path(tempfile.mkdtemp(prefix="vox-ws-equivalence-", dir=ctx["work"]))
    requests = scenario(voice_wavs(work))
    expected = [reference_audio(tts, text, seed, voice, **opts) for text, seed, _, voice, opts in requests]
    got, batch_sizes, runner = run_batched(tts.tts_model, requests)
    diffs = [float(np.max(np.abs(got[i] - want))) if got[i].shape == want.shape else float("inf")
             for i, want in enumerate(expected)]
    tolerance = TOLERANCE.get(dtype, 1e-4)
    return {"device": ctx["device"], "dtype": dtype, "loads": 1, "requests": len(requests), "slots": max(batch_sizes),
            "max_abs_diff": diffs, "tolerance": tolerance, "equal": all(d < tolerance for d in diffs),
            "slots_returned": sorted(runner._free_slots) == list(range(runner.slots))}


# (name, what it measures, expected seconds on an H100 with the real-size model), in the order
# they run. One call of the run's 540 s takes the first five (the whole step captured for 1 and
# 8 rows first: the figures a first run must bring back), as far as its budget goes; a second
# call the rest, named with the two every step needs first (`--only environment,checkpoint,
# whole_large,scheduler,compiled`). The compiled step is given what is left.
STEPS: list[tuple[str, Callable[[dict], dict], int]] = [
    ("environment", step_environment, 15),
    ("checkpoint", step_checkpoint, 60),
    ("whole", step_whole, 200),
    ("equivalence", step_equivalence, 30),
    ("steps", step_steps, 90),
    ("attention", step_attention, 95),
    ("whole_large", step_whole_large, 300),
    # The bursts' 120 s, and the engine process's fork server importing torch and the model's
    # modules, and the package's serial arm loading a model of its own (an estimate: unmeasured).
    ("scheduler", step_scheduler, 150),
    ("compiled", step_compiled, 150),
]
# A run's seconds: a lent GPU's call is 10 minutes at most; a CPU's (CI, a copy of the device's
# stack) compiles the whole step and the pieces for minutes each, bound by nothing but its test.
GPU_BUDGET_S = 540
CPU_BUDGET_S = 1800
# What every other step needs (the card, the model): a second call (`--only`) names them too.
ALWAYS = ("environment", "checkpoint")
# The steps a first call's 540 s are planned for (by their expected seconds, 490 in all).
FIRST_CALL = ("environment", "checkpoint", "whole", "equivalence", "steps", "attention")
# Run only inside another step's process group.
HELPERS: dict[str, Callable[[dict], dict]] = {"compiled_reload": step_compiled_reload}


# ------------------------------------------------------------------ the run


def card_of(name: str) -> str:
    """The card's short name, which labels every figure: "H100" or "H200" (the device is
    either), else the name as given; "no GPU" for none."""
    upper = name.upper()
    for card in ("H200", "H100"):
        if card in upper:
            return card
    return name.strip() or "no GPU"


def nvidia_smi(timeout_s: float = 10.0) -> dict[str, Any]:
    """The card and its driver as `nvidia-smi` says them, each call within `timeout_s` (a hung
    driver must not hold the run): `card` (see `card_of`), `line` (name, driver, memory),
    `head` (the first lines of plain `nvidia-smi`), or `card` "no GPU" and why."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return {"card": "no GPU", "line": "no GPU (no nvidia-smi on this machine)", "head": []}

    def ask(*arguments: str) -> tuple[str | None, str]:
        try:
            done = subprocess.run([smi, *arguments], capture_output=True, text=True, timeout=timeout_s)
        except (subprocess.TimeoutExpired, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return (done.stdout if done.returncode == 0 else None), (done.stderr or done.stdout).strip()[-300:]

    query, why = ask("--query-gpu=name,driver_version,memory.total", "--format=csv,noheader")
    plain, _ = ask()
    head = plain.splitlines()[:12] if plain else []
    lines = [line.strip() for line in (query or "").splitlines() if line.strip()]
    if not lines:
        return {"card": "no GPU", "line": f"no GPU (nvidia-smi: {why or 'lists none'})", "head": head}
    name, driver, memory = ([part.strip() for part in lines[0].split(",")] + ["", ""])[:3]
    return {"card": card_of(name), "name": name, "driver": driver, "memory": memory, "line": lines[0],
            "gpus": len(lines), "head": head}


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


def missing_wheels(wheels: Path) -> str | None:
    """Why a GPU run cannot go on without the wheels it carries (the device lacks voxcpm, and
    has no network to fetch it), or None."""
    if not wheels.is_dir() or not any(wheels.glob("*.whl")):
        return (f"no wheels in {wheels}: run scripts/device-wheels.sh here and carry .whl (the device lacks voxcpm "
                "and what it imports, and has no network)")
    return None


def _figures_on(report: dict) -> str:
    """What every figure is labelled with: the card, or the CPU where the run used none."""
    return report["card"] if report["device"].startswith("cuda") else "CPU"


def _status_line(name: str, step: dict) -> str:
    line = f"  {name:12s} {step['status']:8s} {step['seconds']:6.1f} s (expected {step['expected_s']} s)"
    if step["status"] == "timeout":
        line += f"  over its {step['timeout_s']} s, killed" + ("; partial results below" if step.get("result") else "")
    elif step.get("error"):
        line += f"  {step['error'].strip().splitlines()[-1][:110]}"
    return line


def table(report: dict) -> str:
    """The report as the text table `device-check.txt` holds (partial results included), every
    section labelled with the card its figures come from."""
    on = _figures_on(report)
    lines = [f"vox-ws device check on {on}: {report['device']}, {report['size']} model, {report['dtype']}, "
             f"{report['seconds']:.0f} s of {report['budget_s']} s",
             f"card: {report['gpu']['line']}" + (f" (driver {report['gpu']['driver']})"
                                                 if report["gpu"].get("driver") else ""),
             f"every step's log: {report['logs']}"]
    lines += [_status_line(name, step) for name, step in report["steps"].items()]
    get = lambda name: report["steps"].get(name, {}).get("result")  # noqa: E731
    if env := get("environment"):
        gpu = f"{env['gpu']} (sm {env['capability']})" if "gpu" in env else "no GPU"
        packages = env["packages"]
        lines += ["", f"{gpu}; Python {env['python']}, torch {env['torch']}, CUDA {env['cuda']}, Triton "
                      f"{packages['triton']}; compiler: {env['compiler']}; {env['threads']} threads of {env['cpus']}",
                  f"precompile {'on' if env['precompile'] else 'OFF'} (enable_aot_compile as shipped: "
                  f"{env['enable_aot_compile']}); attention kernel {env['attention_kernel']['before']} -> "
                  f"{env['attention_kernel']['after']} on {on}" + (f"; SDPA enabled {env['sdpa_enabled']}"
                                                                   if "sdpa_enabled" in env else "")]
    if scheduler := get("scheduler"):
        lines += ["", *_scheduler_lines(scheduler, on)]
    if whole := get("whole"):
        lines += ["", *_whole_lines("the whole step as --cuda-graphs serves it", whole, on)]
    if steps := get("steps"):
        lines += ["", *_steps_lines(steps, on)]
    if whole := get("whole_large"):
        lines += ["", *_whole_lines("the whole step, larger buckets", whole, on)]
    if attention := get("attention"):
        lines += ["", f"the decode attention on {on}:",
                  f"{'B':>3} {'length':>6} {'attention before ms':>20} {'after ms':>9} {'kernels':>36}"]
        for r in attention["results"]:
            lines.append(f"{r['batch']:>3} {r['length']:>6} {r['before_ms']:>20.3f} {r['after_ms']:>9.3f} "
                         f"{r['before_kernel'] + ' -> ' + r['after_kernel']:>36}")
        if attention.get("in_place"):
            from benchmarks.attention import in_place_table

            lines += ["", f"the compiled decode attention on {on}, gathered against in place:",
                      *in_place_table(attention["in_place"])]
        if "in_place_error" in attention:
            lines += [f"the compiled in-place attention on {on} FAILED: {attention['in_place_error']}"]
    if compiled := get("compiled"):
        lines += ["", *_compiled_lines(compiled, on)]
    if equivalence := get("equivalence"):
        lines += ["", f"equivalence with the package on {on} ({equivalence['dtype']}, one load): "
                      f"{'equal' if equivalence['equal'] else 'DIFFERENT'} within {equivalence['tolerance']:g}, "
                      "largest |difference| " + ", ".join(f"{d:.2e}" for d in equivalence["max_abs_diff"])]
    lines += ["", "published, for comparison:", *(f"  {line}" for line in PUBLISHED)]
    left = [name for name, _, _ in STEPS if name not in ALWAYS and (name not in report["steps"] or (
        report["steps"][name]["status"] == "skipped" and "no time left" in report["steps"][name].get("error", "")))]
    if left:
        lines += ["", f"not run in this call: {', '.join(left)} (a next call: --only {','.join((*ALWAYS, *left))})"]
    return "\n".join(lines) + "\n"


def _scheduler_lines(scheduler: dict, on: str) -> list[str]:
    lines = []
    if load := scheduler.get("load"):
        lines.append(f"one engine process started as vox-ws serve starts it on {on}, loaded in {load['seconds']} s: "
                     f"{load['slots']} slots, {load['step_rows']} rows a step ({load['slots_reason']}); peak "
                     f"{load.get('peak_gpu_mb', load['peak_rss_mb'])} MB")
    lines.append(f"bursts of \"{scheduler['text']}\" on {on}, {scheduler['length_patches']} patches each, all sent "
                 "at once:")
    lines.append(f"  {'phase':>9} {'N':>3} {'ttfa p50':>9} {'ttfa p95':>9} {'audio s/s':>9} {'step ms':>8}")
    if serial := scheduler.get("serial"):
        lines.append(f"  {'package':>9} {1:>3} {serial['ttfa_p50_ms']:>7.0f}ms {serial['ttfa_p95_ms']:>7.0f}ms "
                     f"{serial['throughput']:>9.2f} {'':>8}  (in the check's own process, its model loaded in "
                     f"{serial['load_s']} s)")
    for r in scheduler.get("eager", {}).get("results", []):
        lines.append(f"  {'eager':>9} {r['n']:>3} {r['ttfa_p50_ms']:>7.0f}ms {r['ttfa_p95_ms']:>7.0f}ms "
                     f"{r['throughput']:>9.2f} {r['mean_step_ms']:>8.1f}")
    background = scheduler.get("background")
    if background:
        seconds = ", ".join(f"{rows} rows {s} s" for rows, s in background["compile_s"].items()) or "none yet"
        lines.append(f"  (the background compile, not waited for: {background['status']} after "
                     f"{background['running_s']} s, buckets compiled {background['compiled']} of "
                     f"{background['buckets']} ({seconds}), in use {background['adopted']})")
        if mismatched := scheduler.get("eager", {}).get("mismatched"):
            lines.append(f"  (compared with eager on its reader thread and left eager: {mismatched})")
    elif "eager" in scheduler:
        lines.append("  (no background compile: eager throughout)")
    return lines


def _steps_lines(steps: dict, on: str) -> list[str]:
    contexts = ", ".join(f"{c['asked']} -> {c['positions']}" if c["asked"] != c["positions"] else str(c["asked"])
                         for c in steps["contexts"])
    captured = steps["captured"]
    tried = any("captures" in r for r in steps["results"])
    lines = [f"the step on {on}, eager, attending over {contexts} positions (max_length {steps['max_length']}); "
             f"the uncompiled whole step from a CUDA graph: {captured['status']}",
             f"{'length':>6} {'B':>3} {'step ms':>8} {'CFM':>7} {'advance':>8} {'VAE':>7} {'memory MB':>10}"
             + (f" {'captured ms':>12}" if tried else "")]
    for r in steps["results"]:
        lines.append(f"{r['positions']:>6} {r['batch']:>3} {r['step_ms']:>8.2f} {r['cfm_ms']:>7.2f} "
                     f"{r['advance_ms']:>8.2f} {r['vae_ms']:>7.2f} {r.get('peak_gpu_mb', r['peak_rss_mb']):>10.0f}"
                     + (f" {r['captured_ms']:>12.2f}" if "captured_ms" in r
                        else f" {'FAILED':>12}" if "captures" in r else ""))
    return lines


def _whole_lines(title: str, whole: dict, on: str) -> list[str]:
    """A whole-step step's table: per bucket, its attention kernel (as the CUDA lowering takes it
    for the graph's shapes, and as it chose it where it compiled it here), how it ended, and its
    step times eager, compiled and replayed from CUDA graphs at each context."""
    attention = whole["attention"]
    how = ("in place" + (f" ({attention['kernel']})" if attention.get("kernel") else "") if attention["in_place"]
           else f"through the gather ({attention['why_not']})")
    lines = [f"{title} on {on}, buckets {whole['buckets']}: attends {how}",
             f"  {'B':>3} {'kernel on CUDA':>16} {'lowered here':>14} {'compile s':>9}  {'positions':>9} "
             f"{'eager ms':>9} {'compiled ms':>11} {'captured ms':>11}  status"]
    for r in whole["results"]:
        timings = r.get("timings") or [{}]
        for index, timing in enumerate(timings):
            head = (f"  {r['bucket']:>3} {r.get('kernel_on_cuda', '?'):>16} {str(r.get('kernel_lowered')):>14} "
                    f"{r.get('compile_s', 0):>9.1f}" if index == 0 else f"  {'':>3} {'':>16} {'':>14} {'':>9}")
            figures = (f"{timing['positions']:>9} {timing['eager_ms']:>9.2f} {timing['compiled_ms']:>11.2f} "
                       f"{timing['captured_ms'] if 'captured_ms' in timing else '-':>11}" if timing
                       else f"{'':>9} {'':>9} {'':>11} {'':>11}")
            status = r["status"] if index == 0 else ""
            if index == 0 and r.get("failed"):
                status += ": " + "; ".join(f"{name}: {why}" for name, why in r["failed"].items())[:300]
            lines.append(f"{head}  {figures}  {status}".rstrip())
    return lines


def _compiled_lines(compiled: dict, on: str) -> list[str]:
    graphs = ", ".join(f"{g[0]} {g[2]:.1f} s" for g in compiled["graphs_first"]) or "NONE"
    if "first_start_s" in compiled:
        start = f"first start {compiled['first_start_s']} s"
    else:
        start = f"still compiling after {compiled.get('compiling_s', 0)} s"
    lines = [f"compiled bucket {compiled['bucket']} on {on} (precompile "
             f"{'on' if compiled.get('precompile') else 'OFF'}; {compiled['given_s']} s given): {start} ({graphs})"]
    if step := compiled.get("step_ms"):
        lines.append(f"  B={compiled['bucket']}: eager {step['eager_ms']} ms, compiled {step['compiled_ms']} ms "
                     f"({step['compiled_vs_eager']}x)")
    if comparison := compiled.get("comparison"):
        lines.append(f"  compiled against eager, {comparison['rows']} rows, {comparison['steps']} steps: largest "
                     "|difference| of the latents " + ", ".join(f"{d:.2e}" for d in comparison["max_abs_diff"])
                     + f" (largest latent {comparison['largest_latent']:.2f})")
    if "kernel_on_cuda" in compiled:
        how = "in place" if compiled["attention"]["in_place"] else "through the gather"
        lines.append(f"  its advance attends {how}: kernel on CUDA {compiled['kernel_on_cuda']} (lowered here: "
                     f"{compiled['kernel_lowered']})")
    if "graphs_second" in compiled:
        loaded = [g for g in compiled["graphs_second"] if g[1] == "loaded"]
        lines.append(f"  a fresh process: {len(loaded)} of {len(compiled['graphs_second'])} graphs loaded in "
                     f"{compiled['second_start_s']} s" + ("" if compiled["graphs_second"] else ": NONE SAVED"))
    elif "reload" in compiled:
        lines.append(f"  a fresh process: {compiled['reload']}")
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


def _overruns(given: list[str]) -> dict[str, float]:
    """`--overrun STEP=SECONDS` as {step: seconds}."""
    overruns = {}
    for item in given:
        name, _, seconds = item.partition("=")
        overruns[name] = float(seconds)
    return overruns


class _Run:
    """One run's report and where it is kept: `device-check.json`, `device-check.txt` and
    `logs.tar.gz` in `out`, rewritten after every step (a run killed whole keeps what the steps
    before said); the logs themselves under `work`, outside `out`, whose files a lent machine
    hands back only a few of."""

    def __init__(self, out: Path, logs: Path, report: dict) -> None:
        self.out, self.logs, self.report = out, logs, report
        logs.mkdir(parents=True, exist_ok=True)

    def say(self, line: str) -> None:
        print(line, file=sys.stderr, flush=True)
        with open(self.logs / "run.log", "a") as log:
            log.write(line + "\n")

    def keep(self, started: float) -> None:
        self.report["seconds"] = round(time.monotonic() - started, 1)
        _write_text(self.out / "device-check.json", json.dumps(self.report, indent=1))
        _write_text(self.out / "device-check.txt", table(self.report))
        aside = self.out / ".logs.tar.gz.partial"
        with tarfile.open(aside, "w:gz") as tar:
            for log in sorted(self.logs.glob("*.log")):
                tar.add(log, arcname=f"logs/{log.name}")
        os.replace(aside, self.out / "logs.tar.gz")


def _write_text(path: Path, text: str) -> None:
    aside = path.with_name(f".{path.name}.partial")
    aside.write_text(text)
    os.replace(aside, path)


def _run_all(args: argparse.Namespace, out: Path, work: Path, started: float) -> int:
    on_gpu = args.device.startswith("cuda")
    gpu = nvidia_smi()
    report: dict[str, Any] = {"device": args.device, "size": args.size, "dtype": "bfloat16" if on_gpu else "float32",
                              "threads": args.threads, "budget_s": args.budget, "seconds": 0.0, "gpu": gpu,
                              "card": gpu["card"], "logs": "logs.tar.gz", "steps": {}}
    run = _Run(out, work / "logs", report)
    run.say(f"card: {gpu['line']}")
    for line in gpu["head"]:
        run.say(f"  {line}")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TQDM_DISABLE="1", PYTHONUNBUFFERED="1")
    paths = [str(ROOT)]
    site = work / "site"
    # On a GPU the wheels are the difference between a run and seven failures after model loads.
    wheels = Path(args.wheels)
    cannot = missing_wheels(wheels) if on_gpu else None
    wheel_error = None if cannot else install_wheels(wheels, site)
    if wheel_error and on_gpu:
        cannot = f"the wheels in {wheels} did not install: {wheel_error}"
    elif wheel_error:
        report["wheels_error"] = wheel_error
    if site.exists():
        paths.insert(0, str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    real_gpu = on_gpu and args.size == "real"
    ctx = {"device": args.device, "size": args.size, "dtype": report["dtype"], "gpu": gpu,
           "threads": args.threads, "work": str(work), "model": str(work / "model"),
           "max_rows": 64 if on_gpu or args.size == "tiny" else 8, "compile_bucket": 32 if on_gpu else 1,
           # The whole step per bucket: a first call's buckets, then a second's. A CPU compiles
           # one of each (minutes apiece here).
           # A CPU's second is the first's bucket, its graph loaded from the run's cache: the
           # step's code run in seconds, not another compile of minutes.
           "whole_buckets": [1, 8] if on_gpu else [1], "whole_large_buckets": [16, 32, 64] if on_gpu else [1],
           "bursts": list(BURSTS), "burst_length": 25,
           # The scheduler starts as `vox-ws serve` does on this device: compiling in the background
           # on a GPU (a CPU's check compiles in its own step only: its compile takes minutes here).
           "scheduler_compile": "auto" if on_gpu else "off"}
    overruns = _overruns(args.overrun)
    wanted = [name for name, _, _ in STEPS if not args.only or name in args.only.split(",")]
    for index, (name, _, expected) in enumerate(STEPS):
        if name not in wanted:
            continue
        left = args.budget - (time.monotonic() - started)
        if name in overruns:
            timeout = min(overruns[name], left)
        elif name == "compiled":
            # What is left, but the later steps' expected share: its compile is the figure
            # most likely to need more than its estimate.
            timeout = left - sum(e for n, _, e in STEPS[index + 1:] if n in wanted)
        else:
            timeout = min(2 * expected if real_gpu else 2 * expected + 240, left)
        step: dict[str, Any] = {"expected_s": expected, "timeout_s": round(timeout), "seconds": 0.0,
                                "card": _figures_on(report)}
        if cannot:
            step.update(status="failed" if name == "environment" else "skipped",
                        error=cannot if name == "environment" else "the environment failed")
        elif timeout < 5:
            step.update(status="skipped", error="no time left in the budget")
        else:
            step.update(_run_step(name, {**ctx, "overrun": name in overruns}, env, timeout))
        run.say(f"== {name}: {step['status']} in {step['seconds']:.1f} s (expected {expected} s)")
        report["steps"][name] = step
        run.keep(started)
    print(table(report))
    failed = [n for n, s in report["steps"].items() if s["status"] != "ok"]
    return 1 if failed else 0


def _run_step(name: str, ctx: dict, env: dict, timeout: float) -> dict:
    """One step in a process group of its own, its output in `logs/NAME.log` under the run's
    work directory (a file: a child left holding a pipe could hold the wait); past `timeout` the
    whole group is killed, and it is killed after a normal end too, so no child of a step
    outlives it."""
    work = Path(ctx["work"])
    result_file = work / f"{name}.json"
    result_file.unlink(missing_ok=True)
    log_path = work / "logs" / f"{re.sub(r'[^A-Za-z0-9_.-]', '-', name)}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    context = {**ctx, "result": str(result_file), "deadline": started + timeout}
    with open(log_path, "w+b") as log_file:
        process = subprocess.Popen([sys.executable, "-m", "benchmarks.device_check", "--run-step", name,
                                    "--context", json.dumps(context), "--result", str(result_file)],
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
    ap.add_argument("--budget", type=int,
                    help=f"seconds for the whole run (default: {GPU_BUDGET_S} on a GPU, 9 minutes of a lent call's "
                         f"10; {CPU_BUDGET_S} on a CPU, whose compiles take minutes each)")
    ap.add_argument("--threads", type=int, default=min(16, os.cpu_count() or 1),
                    help="torch threads in each step (default: the cores, at most 16)")
    ap.add_argument("--only", help="these steps alone (comma-separated names)")
    ap.add_argument("--wheels", default=str(ROOT / ".whl"),
                    help="the wheels the device lacks (scripts/device-wheels.sh); a GPU run without them fails at once")
    # A test's: STEP's time-out is SECONDS, and it blocks for good after its first partial results.
    ap.add_argument("--overrun", action="append", default=[], metavar="STEP=SECONDS", help=argparse.SUPPRESS)
    ap.add_argument("--run-step", help=argparse.SUPPRESS)
    ap.add_argument("--context", help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.budget is None:
        args.budget = GPU_BUDGET_S if args.device.startswith("cuda") else CPU_BUDGET_S
    if args.run_step:
        _write_whole(Path(args.result), _step_function(args.run_step)(json.loads(args.context)))
        return 0
    return run_all(args)


if __name__ == "__main__":
    raise SystemExit(main())
