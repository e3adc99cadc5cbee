"""Benchmark: the voxcpm package serialised under a lock vs vox-ws's batched scheduler.

Same process, same checkpoint, same traffic for both arms: N clients start at staggered times and
each sends `--rounds` requests back to back (random texts and lengths, fixed seeds):

  (a) serial:  the package's own `generate_streaming`, one request at a time in arrival order,
               as any server without a batching scheduler must run it;
  (b) batched: vox-ws's EngineLoop + VoxCPMEngine, every active request advancing each step.

Per concurrency N it prints aggregate audio seconds per wall second, first-audio p50/p95
(arrival -> first chunk), playback underruns per stream (a chunk arriving after the audio
before it would have finished playing; playback starts at the first chunk and re-buffers
after each underrun), and the throughput ratio (b)/(a). `--profile` also times the parts of
one batched step at several batch sizes.

    python -m benchmarks.scheduler [--model DIR] [--concurrency 1,2,4,8,16] [--profile] [--compile on]

Without --model it builds the tiny random-weight VoxCPM2 in a temporary directory.

`--burst` measures as nanovllm-voxcpm's benchmark does instead: N requests of one short text
("Hello world.") sent at once, for each N, on one engine load (a short warm-up burst of each N
first); first audio p50/p95 per N and audio seconds per second, eager, and then, where
`--compile` is not off, with the step the background compile made (as a default start serves
it). The engine runs in an engine process of its own, started as `vox-ws serve` starts it
(`benchmarks/served_engine.py`), this process its server's side: the figures are what a
server's streams receive. The package's serial arm runs N = 1 only, here, on a model of its
own loaded once the engine process has ended:

    python -m benchmarks.scheduler --burst --concurrency 1,32,64 [--compile auto --compile-wait-s 300]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from vox_ws.clients.playback import count_underruns

if TYPE_CHECKING:
    from benchmarks.served_engine import ServedEngine

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

TEXTS = [
    "Hello there.",
    "The weather today is mild, with a light breeze from the west.",
    "Please hold while I transfer your call.",
    "Your order has shipped and should arrive on Thursday afternoon.",
    "Yes.",
    "I can help with that, just give me a moment to look it up.",
    "The meeting moved to three o'clock.",
    "Thanks for waiting; here is what I found about your account balance.",
]


@dataclass
class Job:
    client: int
    text: str
    seed: int
    max_len: int
    ready: float = 0.0            # when the client sent it (relative to the run's start)
    chunks: list[tuple[float, float]] = field(default_factory=list)   # (arrival time, seconds of audio)
    done_at: float = 0.0
    error: str = ""               # why it failed, where it did


def make_clients(n: int, rounds: int, min_steps: int, max_steps: int, seed: int) -> list[list[Job]]:
    """N clients, each with `rounds` requests of random text and length, sent back to back."""
    rng = random.Random(seed * 1000 + n)
    return [[Job(client=c, text=rng.choice(TEXTS), seed=rng.randrange(1 << 31),
                 max_len=rng.randint(min_steps, max_steps)) for _ in range(rounds)] for c in range(n)]


def start_offsets(n: int, stagger: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(n):
        offsets.append(t)
        t += rng.expovariate(1.0 / stagger) if stagger > 0 else 0.0
    return offsets


def summarise(clients: list[list[Job]], t0: float) -> dict:
    jobs = [j for c in clients for j in c]
    audio = sum(s for j in jobs for _, s in j.chunks)
    wall = max(j.done_at for j in jobs) - t0
    first = sorted((j.chunks[0][0] - (t0 + j.ready)) * 1000 for j in jobs)
    return {
        "requests": len(jobs),
        "audio_s": round(audio, 2),
        "wall_s": round(wall, 2),
        "throughput": round(audio / wall, 3),
        "ttfa_p50_ms": round(_pct(first, 50), 1),
        "ttfa_p95_ms": round(_pct(first, 95), 1),
        "underruns_per_stream": round(sum(count_underruns(j.chunks) for j in jobs) / len(jobs), 3),
    }


def _pct(values: list[float], q: float) -> float:
    return values[0] if len(values) == 1 else float(np.percentile(values, q))


def run_serial(tts, clients: list[list[Job]], offsets: list[float], sample_rate: int) -> dict:
    """One request at a time in the order clients sent them: a lock around the package."""
    import heapq

    import torch

    ready = [(offsets[c], c, 0) for c in range(len(clients))]
    heapq.heapify(ready)
    t0 = time.perf_counter()
    while ready:
        at, c, k = heapq.heappop(ready)
        job = clients[c][k]
        job.ready = at
        delay = t0 + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        torch.manual_seed(job.seed)
        for chunk in tts.generate_streaming(text=job.text, max_len=job.max_len, retry_badcase=False):
            job.chunks.append((time.perf_counter(), len(chunk) / sample_rate))
        job.done_at = time.perf_counter()
        if k + 1 < len(clients[c]):
            heapq.heappush(ready, (job.done_at - t0, c, k + 1))
    return summarise(clients, t0)


class _Sink:
    def __init__(self, job: Job, rate: int, events: queue.Queue) -> None:
        self.job, self.rate, self.events = job, rate, events

    def deliver(self, pcm: np.ndarray, words=None, phonemes=None) -> None:
        self.job.chunks.append((time.perf_counter(), len(pcm) / self.rate))

    def finish(self, reason) -> None:
        self.job.done_at = time.perf_counter()
        self.events.put(self.job)

    def fail(self, kind, message: str, retry_after_s=None) -> None:
        print(f"request failed: {kind.value}: {message}", file=sys.stderr)
        self.job.error = f"{kind.value}: {message}"
        self.finish("error")

    def backlogged(self) -> bool:
        return False

    def audio_ahead_s(self) -> float:
        return 0.0


def run_batched(model_dir: str, device: str, clients: list[list[Job]], offsets: list[float], threads: int,
                compile: str = "off", compile_cache: str | None = None) -> dict:
    from vox_ws.engine import GenerationRequest
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine
    from vox_ws.scheduling.loop import EngineLoop

    n = len(clients)
    engine = VoxCPMEngine(model=model_dir, device=device, threads=threads, slots=n, compile=compile,
                          compile_cache=compile_cache)
    scheduler = EngineLoop(engine, slots=n, max_queue=n)
    scheduler.start()
    scheduler.ready_event.wait()
    if scheduler.status != "ready":
        raise RuntimeError(scheduler.error)
    events: queue.Queue = queue.Queue()

    def send(job: Job, at: float) -> None:
        job.ready = at
        request = GenerationRequest(text=job.text, sink=_Sink(job, engine.sample_rate, events),
                                    options={"seed": job.seed, "max_len": job.max_len})
        engine.check(request)
        scheduler.submit(request)

    starts = sorted(range(n), key=lambda c: offsets[c])
    remaining = sum(len(c) for c in clients)
    t0 = time.perf_counter()
    while remaining:
        # Clients yet to start and clients whose last request finished, in time order.
        while starts and t0 + offsets[starts[0]] <= time.perf_counter():
            c = starts.pop(0)
            send(clients[c][0], offsets[c])
        try:
            timeout = max(0.0, t0 + offsets[starts[0]] - time.perf_counter()) if starts else None
            job = events.get(timeout=timeout)
        except queue.Empty:
            continue
        remaining -= 1
        k = clients[job.client].index(job)
        if k + 1 < len(clients[job.client]):
            send(clients[job.client][k + 1], job.done_at - t0)
    stats = scheduler.stats()
    scheduler.stop()
    return {**summarise(clients, t0), "mean_step_ms": stats["mean_step_ms"], "steps": stats["steps_total"],
            **_memory(device)}


BURST_TEXT = "Hello world."        # nanovllm-voxcpm's benchmark prompt


def serve_voxcpm(model_dir: str, device: str, threads: int, slots: int, compile: str = "off",
                 compile_cache: str | None = None, compile_buckets: tuple[int, ...] | None = None) -> ServedEngine:
    """The VoxCPM2 engine in an engine process of its own, started as `vox-ws serve --engine
    voxcpm` starts it with these settings (the step compiling in the background where `compile`
    is not off: `--compile-wait` is not given): a `served_engine.ServedEngine`, started."""
    from benchmarks.served_engine import ServedEngine

    settings = {"model": model_dir, "compile": compile, "compile_cache": compile_cache,
                "compile_buckets": compile_buckets, "compile_wait": False}
    served = ServedEngine("voxcpm", settings, device, threads, slots)
    try:
        served.start()
    except BaseException:
        served.stop()
        raise
    return served


def _burst(served: ServedEngine, n: int, length: int, seed: int = 0) -> dict:
    """N requests of BURST_TEXT submitted at once to the served engine, each `length` patches
    long: first audio per request from the moment they were all sent, audio seconds per second
    until the last ended (as this process, the server's side, receives them), and the steps that
    carried them."""
    from vox_ws.engine import GenerationRequest

    engine, steps = served.engine, served.steps
    jobs = [Job(client=i, text=BURST_TEXT, seed=seed * 1000 + i, max_len=length) for i in range(n)]
    events: queue.Queue = queue.Queue()
    requests = []
    for job in jobs:
        request = GenerationRequest(text=job.text, sink=_Sink(job, engine.sample_rate, events),
                                    options={"seed": job.seed, "max_len": job.max_len})
        engine.check(request)
        requests.append(request)
    taken = len(steps.taken)
    t0 = time.perf_counter()
    served.submit(requests)
    for _ in jobs:
        events.get(timeout=600)
    failed = [job.error for job in jobs if job.error]
    if failed:
        raise RuntimeError(f"{len(failed)} of {n} requests failed: {failed[0]}")
    # Each step is recorded before the requests it ended finish: every step of these is here.
    ran = steps.taken[taken:]
    return {**summarise([[job] for job in jobs], t0),
            "mean_step_ms": round(sum(s for _, s in ran) / len(ran) * 1000, 2) if ran else 0.0,
            "steps": len(ran), "largest_step_rows": max((r for r, _ in ran), default=0)}


def loaded(served: ServedEngine, started: float, timeout: float | None = None) -> dict[str, Any]:
    """Once the served engine is ready (else its error): the seconds since `started` (its process
    started as `vox-ws serve` starts it: the fork server importing the model's modules, then the
    load), its slots, attention kernel, dtype, its process's id and peak memory (as it declares
    them: `describe()["memory"]`)."""
    served.wait_ready(timeout)
    seconds = round(time.perf_counter() - started, 1)
    info = served.described()
    stats = served.proxy.stats()
    return {"seconds": seconds, "slots": info["slots"], "step_rows": info["step_rows"],
            "slots_reason": stats["slots_reason"], "attention": info["attention"], "dtype": info["dtype"],
            "pid": stats["pid"], **info["memory"]}


def background_status(described: dict[str, Any]) -> str | None:
    """The background compile's status as the engine declares it (None: there is none)."""
    background = described["compile"].get("background")
    return background["status"] if background is not None else None


def run_bursts(model_dir: str, device: str, ns: list[int], threads: int, length: int = 25,
               compile: str = "off", compile_cache: str | None = None, compile_buckets: tuple[int, ...] | None = None,
               compile_wait_s: float = 0.0, report: Any = None) -> dict:
    """Bursts of N = `ns` on one engine load, the engine in a process of its own as `vox-ws serve`
    starts it: eager (with a background compile running where `compile` is not off: as a default
    start serves), then compiled once the background compile is done (waited for
    `compile_wait_s` at most); then the serial arm (the package's own loop, N = 1, here:
    `serial_arm`). `report(partial)` is called after each figure."""
    result: dict[str, Any] = {"text": BURST_TEXT, "length_patches": length, "ns": ns}
    tell = report or (lambda _: None)
    started = time.perf_counter()
    with serve_voxcpm(model_dir, device, threads, max(ns), compile, compile_cache, compile_buckets) as served:
        result["load"] = loaded(served, started)
        tell(result)
        for phase in ("eager", "compiled"):
            if phase == "compiled":
                if background_status(served.described()) is None:
                    break
                deadline = time.monotonic() + compile_wait_s
                while background_status(served.described()) == "compiling" and time.monotonic() < deadline:
                    time.sleep(0.5)
                for n in ns:               # the step adopts what has arrived at its next turn
                    _burst(served, n, 2)
            runs = result[phase] = {"compile": served.described()["compile"], "results": []}
            for n in ns:
                _burst(served, n, 3, seed=1)          # warm-up: this N's shapes
                runs["results"].append({"n": n, **_burst(served, n, length, seed=2)})
                tell(result)
            described = served.described_now()
            runs["adopted"] = described["compile"]["buckets"]
            result["peak"] = described["memory"]
    result["serial"] = serial_arm(model_dir, device, length)
    tell(result)
    return result


def serial_arm(model_dir: str, device: str, length: int) -> dict:
    """The package's own generate_streaming, one request (`_serial_once`), on its own model
    loaded in this process as the package loads it (the engine runs in a process of its own, so
    its model is not here to borrow): run once the served engine has ended, so that neither
    measures beside the other, nor holds a second copy of the model beside it. The load's
    seconds are kept apart (`load_s`)."""
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    started = time.perf_counter()
    tts = import_voxcpm().VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False, device=device)
    load_s = round(time.perf_counter() - started, 1)
    try:
        return {**_serial_once(tts, length), "load_s": load_s}
    finally:
        del tts
        if device.startswith("cuda"):
            import torch

            torch.cuda.empty_cache()


def _serial_once(tts: Any, length: int) -> dict:
    """The package's own generate_streaming on `tts` (a `voxcpm.VoxCPM`), one request: what a
    server without a batching scheduler gives one stream (a warm-up request first)."""
    import torch

    rate = tts.tts_model.sample_rate
    list(tts.generate_streaming(text="Warm up.", max_len=3, retry_badcase=False))
    torch.manual_seed(0)
    job = Job(client=0, text=BURST_TEXT, seed=0, max_len=length)
    t0 = time.perf_counter()
    for chunk in tts.generate_streaming(text=job.text, max_len=length, min_len=length, retry_badcase=False):
        job.chunks.append((time.perf_counter(), len(chunk) / rate))
    job.done_at = time.perf_counter()
    return {"n": 1, **summarise([[job]], t0)}


def print_bursts(result: dict) -> None:
    load = result["load"]
    print(f"# one engine process (pid {load['pid']}), loaded in {load['seconds']} s, {load['slots']} slots "
          f"({load['slots_reason']})")
    print(f"{'phase':>9} {'N':>3} {'ttfa p50':>9} {'ttfa p95':>9} {'audio s/s':>9} {'step ms':>8}")
    serial = result.get("serial")
    if serial:
        print(f"{'serial':>9} {1:>3} {serial['ttfa_p50_ms']:>7.0f}ms {serial['ttfa_p95_ms']:>7.0f}ms "
              f"{serial['throughput']:>9.2f} {'':>8}")
    for phase in ("eager", "compiled"):
        for r in result.get(phase, {}).get("results", []):
            print(f"{phase:>9} {r['n']:>3} {r['ttfa_p50_ms']:>7.0f}ms {r['ttfa_p95_ms']:>7.0f}ms "
                  f"{r['throughput']:>9.2f} {r['mean_step_ms']:>8.1f}")


def _memory(device: str) -> dict:
    """The process's peak memory: the device's (PyTorch's allocator) on a GPU, else the RSS."""
    import resource

    import torch

    figures = {"peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    if device.startswith("cuda"):
        figures["peak_gpu_mb"] = round(torch.cuda.max_memory_allocated(torch.device(device)) / 2**20, 1)
    return figures


def profile_step(model_dir: str, device: str, threads: int, batch_sizes: list[int], steps: int = 20) -> dict:
    """Time one batched step at several batch sizes: as served (on a CPU, with the decoder
    process), then with the VAE inline and its parts timed by wrapping the runner's functions."""
    import torch

    from vox_ws.engines.voxcpm import runner as vb
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    timings: dict[str, float] = {}

    def timed(name, fn):
        def wrapper(*args, **kwargs):
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            timings[name] = timings.get(name, 0.0) + time.perf_counter() - start
            return out
        return wrapper

    def run(runner) -> list[dict]:
        rows_out = []
        for b in batch_sizes:
            rows = [runner.prefill(vb.PrefillInput(engine._prompt(TEXTS[i % len(TEXTS)] * 4, None), seed=i,
                                                cfg_value=2.0, timesteps=10, min_len=2, max_len=4096))
                    for i in range(b)]
            for _ in range(3):                   # warm-up, and the decoder process's pipeline filled
                runner.step(rows)
            timings.clear()
            start = time.perf_counter()
            for _ in range(steps):
                runner.step(rows)
            total = (time.perf_counter() - start) / steps * 1000
            parts = {k: round(v / steps * 1000, 2) for k, v in timings.items()}
            parts["other"] = round(total - sum(parts.values()), 2)
            rows_out.append({"batch": b, "step_ms": round(total, 2), **parts,
                             "audio_x_realtime": round(b * 0.16 / (total / 1000), 2)})
            for row in rows:
                runner.release(row)
        return rows_out

    engine = VoxCPMEngine(model=model_dir, device=device, threads=threads, slots=max(batch_sizes))
    engine.load()
    runner = engine.runner
    generate, decoder = runner._generate, runner.decoding.process
    runner._generate = timed("generate", generate)
    if decoder is not None:
        decoder.wait = timed("waiting_for_decoder", decoder.wait)
    try:
        served = run(runner)
    finally:
        runner._generate = generate
        engine.close()
    # Inline, so that the parts add up to the step.
    runner = engine.runner = vb.BatchedVoxCPM2(engine.tts.tts_model, max(batch_sizes), decode_process=False)
    # The step's pieces, eager (`compiled.EagerStep`), timed on this runner alone.
    runner.eager.solve = timed("cfm", runner.eager.solve)
    runner.eager.advance = timed("stop+locenc+lms", runner.eager.advance)
    runner.vae.decode = timed("vae", runner.vae.decode)
    inline = run(runner)
    return {"as_served": served, "decoder_process": decoder is not None, "inline": inline}


def print_profile(profile: dict) -> None:
    titles = {"as_served": "one batched step as served" + (", VAE in the decoder process" if profile["decoder_process"]
                                                           else ""),
              "inline": "one batched step with the VAE inline"}
    for key, title in titles.items():
        rows = profile[key]
        print(f"\n# {title}, ms (mean of 20)")
        keys = [k for k in rows[0] if k != "batch"]
        print(" ".join(f"{k:>19}" for k in ["batch", *keys]))
        for row in rows:
            print(" ".join(f"{row[k]:>19}" for k in ["batch", *keys]))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--size", choices=["tiny", "real"], default="tiny", help="random model to build without --model")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--concurrency", default="1,2,4,8,16")
    ap.add_argument("--stagger", type=float, default=0.1, help="mean seconds between clients' first requests")
    ap.add_argument("--rounds", type=int, default=4, help="requests each client sends, back to back")
    ap.add_argument("--min-steps", type=int, default=20, help="shortest request, in 160 ms chunks")
    ap.add_argument("--max-steps", type=int, default=60, help="longest request, in 160 ms chunks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="also time the parts of one step")
    ap.add_argument("--compile", choices=["off", "on", "auto"], default="off",
                    help="the batched arm's --compile (compiled at each N's load; cached across them)")
    ap.add_argument("--burst", action="store_true", help="N requests of one short text at once per N, one load")
    ap.add_argument("--length", type=int, default=25, help="--burst: patches (160 ms each) per request")
    ap.add_argument("--buckets", help="--burst: the batch sizes the background compile compiles")
    ap.add_argument("--compile-wait-s", type=float, default=300.0,
                    help="--burst: how long to wait for the background compile before the compiled round")
    ap.add_argument("--json", help="write all results to this file")
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(args.threads)
    from vox_ws.engines.voxcpm.loading import import_voxcpm

    model_dir = args.model
    if model_dir is None:
        from vox_ws.testing.tiny_voxcpm import build

        model_dir = str(build(tempfile.mkdtemp(prefix="vox-ws-bench-"), size=args.size))
    if args.burst:
        from vox_ws.engines.voxcpm import parse_buckets

        result = run_bursts(model_dir, args.device, [int(x) for x in args.concurrency.split(",")], args.threads,
                            args.length, args.compile, os.path.join(model_dir, "compile-cache"),
                            parse_buckets(args.buckets) if args.buckets else None, args.compile_wait_s)
        print_bursts(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": vars(args), **result}, f, indent=2)
        return 0
    voxcpm = import_voxcpm()
    tts = voxcpm.VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False, device=args.device)
    rate = tts.tts_model.sample_rate
    # Warm both paths once so neither arm pays first-call costs.
    list(tts.generate_streaming(text="Warm up.", max_len=3, retry_badcase=False))

    print(f"# vox-ws scheduler benchmark: model={model_dir} device={args.device} threads={args.threads} "
          f"compile={args.compile} lengths={args.min_steps}-{args.max_steps} steps, {args.rounds} requests per client, "
          f"client starts {args.stagger}s apart on average", flush=True)
    header = (f"{'N':>3} {'arm':>8} {'audio s':>8} {'wall s':>7} {'audio s/s':>9} {'ttfa p50':>9} "
              f"{'ttfa p95':>9} {'underruns':>9} {'(b)/(a)':>8}")
    print(header)
    results = []
    for n in [int(x) for x in args.concurrency.split(",")]:
        offsets = start_offsets(n, args.stagger, args.seed)

        def traffic(n: int = n) -> list[list[Job]]:
            return make_clients(n, args.rounds, args.min_steps, args.max_steps, args.seed)

        serial = run_serial(tts, traffic(), offsets, rate)
        batched = run_batched(model_dir, args.device, traffic(), offsets, args.threads, args.compile,
                              os.path.join(model_dir, "compile-cache"))
        ratio = batched["throughput"] / serial["throughput"]
        for arm, r in (("serial", serial), ("batched", batched)):
            print(f"{n:>3} {arm:>8} {r['audio_s']:>8.1f} {r['wall_s']:>7.2f} {r['throughput']:>9.2f} "
                  f"{r['ttfa_p50_ms']:>7.0f}ms {r['ttfa_p95_ms']:>7.0f}ms {r['underruns_per_stream']:>9.2f} "
                  f"{ratio if arm == 'batched' else float('nan'):>8.2f}", flush=True)
        results.append({"n": n, "serial": serial, "batched": batched, "ratio": round(ratio, 2)})
    profile = None
    if args.profile:
        profile = profile_step(model_dir, args.device, args.threads, [1, 4, 8, 16])
        print_profile(profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "profile": profile}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
