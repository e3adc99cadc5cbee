"""Benchmark: the whole step compiled once per batch bucket, or once with a symbolic batch.

Today the whole step (`whole_step.WholeSteps`) is compiled once per bucket (1, 2, 4, ... 64):
the same graph seven times, at a cold compile's cost each. A symbolic batch would compile it
once for every bucket of at least 2 rows (dynamo specialises a size of 1: bucket 1 keeps a graph
of its own). What decides is whether the symbolic graph steps as fast, and whether it stays
symbolic at all (a size that some operation needs as a number is specialised).

Three figures, on the tiny VoxCPM2 unless `--model` names another checkpoint:
- compile: each arm in a fresh process with an empty compile cache (inductor's and the
  store's): per bucket (`--buckets`, each its own graph, as today) against one graph for bucket
  1 and one with a symbolic batch compiled at 2 rows; seconds per graph;
- step: the median of `--repeats` interleaved runs of `--steps` calls of each arm's graph at
  each of `--batches` (distinct slots, attention over `--length` positions), in one process,
  the graphs loaded from the two arms' stores (`graphs.GraphStore`, the saved precompile);
- the symbolic graph's largest difference from the eager step at each batch (outputs and the
  state it writes), and whether the store's call check takes it at each batch.

`--graph generate` is the step a CPU compiles (its decode in the decoder process), `decode` the
step with the VAE decode inside as a GPU runs it, with the VAE as this CPU lays it out (its
depthwise convolutions folded into one row: `vae.BatchedStreamingVAE`), `decode-unfolded` as a
GPU lays it out.

    python -m benchmarks.dynamic_batch [--model DIR] [--graph generate|decode|decode-unfolded]
        [--buckets 1,8,32] [--batches 1,8,32] [--steps 10] [--repeats 3] [--length 64] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

# The whole step's symbolic sizes today (`WholeSteps`): the KV and state buffers' slot counts and
# the attention length; the symbolic arm adds the batch (the rows' first size).
FIXED_BATCH = {"caches": 0, "buffers": 0, "keys_at": 0}
SYMBOLIC_BATCH = {**FIXED_BATCH, "rows": 0}
TIMESTEPS = 10


def _runner(model_dir: str, slots: int, graph: str) -> Any:
    """A runner decoding in its own thread (the whole step's decode is inline), with the VAE's
    layout `graph` names."""
    import torch

    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2
    from vox_ws.engines.voxcpm.vae import BatchedStreamingVAE

    torch.set_num_threads(1)
    model = import_voxcpm().VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    runner = BatchedVoxCPM2(model, slots=slots, decode_process=False)
    if graph == "decode-unfolded":     # the GPU's layout: each depthwise convolution over B rows
        runner.vae = BatchedStreamingVAE(model.audio_vae, slots, fold_depthwise=False)
        runner._buffers = runner._buffers[:4] + list(runner.vae.states)
    return runner


def _inputs(runner: Any, rows: int, length: int) -> Any:
    """A whole step's inputs of `rows` rows in slots 0.. (each its own noise key), attending over
    `length` positions."""
    import torch

    from vox_ws.engines.voxcpm.whole_step import StepInputs

    placed = torch.tensor([[slot, length - 1, slot] for slot in range(rows)], dtype=torch.long)
    return StepInputs(runner.vae, runner._caches, runner._buffers, placed, torch.arange(length))


def _graph(store: Any, runner: Any, graph: str, rows: int, symbolic: bool) -> Any:
    """The whole step's graph for `rows` rows from `store` (compiled or loaded), at the length
    a warm-up compiles it (2)."""
    from vox_ws.engines.voxcpm.whole_step import graph_context, graph_name, step_function

    decode = graph != "generate"
    return store.graph(graph_name(TIMESTEPS, decode), step_function(TIMESTEPS, decode),
                       (runner.model, *_inputs(runner, rows, 2)),
                       context=graph_context(runner.model, runner.vae),
                       dynamic=SYMBOLIC_BATCH if symbolic and rows > 1 else FIXED_BATCH)


def _store(cache: str, load_only: bool = False) -> Any:
    from vox_ws.engines.voxcpm.compiled import traced_sources, use_cache_dir
    from vox_ws.engines.voxcpm.graphs import GraphStore

    return GraphStore(use_cache_dir(Path(cache)), sources=traced_sources(), load_only=load_only)


def compile_arm(model_dir: str, graph: str, cache: str, sizes: list[int], symbolic: bool, slots: int
                ) -> dict[str, Any]:
    """Compile the graphs of `sizes` into an empty `cache` (this process's first compile): the
    seconds of each, and for the symbolic graph whether it takes other batches than its own."""
    import torch

    runner = _runner(model_dir, slots, graph)
    store = _store(cache)
    seconds, takes = {}, {}
    try:
        with torch.inference_mode():
            for rows in sizes:
                started = time.perf_counter()
                compiled = _graph(store, runner, graph, rows, symbolic)
                compiled(runner.model, *_inputs(runner, rows, 2))
                seconds[rows] = round(time.perf_counter() - started, 1)
            if symbolic:     # the graph compiled at 2 rows, called at 3: still symbolic?
                try:
                    compiled(runner.model, *_inputs(runner, 3, 2))
                    takes["3"] = "yes"
                except Exception as exc:  # noqa: BLE001 - reported: specialised, or refused
                    takes["3"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
    finally:
        runner.close()
    return {"seconds": seconds, "takes_other_batches": takes}


def _compile_in_child(model_dir: str, graph: str, cache: str, sizes: list[int], symbolic: bool, slots: int
                      ) -> dict[str, Any]:
    code = ("import json; from benchmarks.dynamic_batch import compile_arm; print(json.dumps(compile_arm("
            f"{model_dir!r}, {graph!r}, {cache!r}, {sizes!r}, {symbolic!r}, {slots})))")
    path = os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": path})
    if run.returncode != 0:
        raise RuntimeError(f"compiling failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def _time(fn: Any, steps: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(steps):
        fn()
    return (time.perf_counter() - started) / steps * 1000


def _difference(runner: Any, graph: Any, rows: int, length: int, decode: bool) -> float:
    """The largest difference between the graph's step and the eager step's at `rows` rows,
    over their outputs and the state they write, from the same state."""
    from vox_ws.engines.voxcpm.whole_step import step_function

    state = runner._caches + runner._buffers
    before = [t.clone() for t in state]
    got = graph(runner.model, *_inputs(runner, rows, length))
    got_state = [t.clone() for t in state]
    for t, saved in zip(state, before):
        t.copy_(saved)
    want = step_function(TIMESTEPS, decode)(runner.model, *_inputs(runner, rows, length))
    worst = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, want))
    return max(worst, max(float((a.float() - b.float()).abs().max()) for a, b in zip(got_state, state)))


def run(model_dir: str, graph: str, buckets: list[int], batches: list[int], steps: int, repeats: int,
        length: int) -> dict[str, Any]:
    import torch

    from vox_ws.engines.voxcpm.graphs import GraphMismatch

    slots = max(buckets + batches)
    per_bucket_cache = tempfile.mkdtemp(prefix="vox-ws-per-bucket-")
    symbolic_cache = tempfile.mkdtemp(prefix="vox-ws-symbolic-")
    per_bucket = _compile_in_child(model_dir, graph, per_bucket_cache, sorted(buckets), False, slots)
    symbolic = _compile_in_child(model_dir, graph, symbolic_cache, [1, 2], True, slots)
    result: dict[str, Any] = {"graph": graph, "compile_s": {"per_bucket": per_bucket["seconds"],
                                                            "symbolic": symbolic["seconds"]},
                              "symbolic_takes_3_rows": symbolic["takes_other_batches"].get("3"),
                              "steps_ms": []}
    runner = _runner(model_dir, slots, graph)
    try:
        stores = {"per_bucket": _store(per_bucket_cache, load_only=True),
                  "symbolic": _store(symbolic_cache, load_only=True)}
        with torch.inference_mode():
            graphs = {"per_bucket": {b: _graph(stores["per_bucket"], runner, graph, b, False)
                                     for b in batches},
                      "symbolic": {1: _graph(stores["symbolic"], runner, graph, 1, True),
                                   2: _graph(stores["symbolic"], runner, graph, 2, True)}}
            samples: dict[tuple[str, int], list[float]] = {}
            errors: dict[int, str] = {}
            for _ in range(repeats):
                for batch in batches:
                    for arm in ("per_bucket", "symbolic"):
                        fn = graphs[arm][batch] if arm == "per_bucket" else graphs[arm][min(batch, 2)]
                        if (arm, batch) in errors:
                            continue
                        try:
                            samples.setdefault((arm, batch), []).append(
                                _time(lambda: fn(runner.model, *_inputs(runner, batch, length)), steps))
                        except (GraphMismatch, AssertionError, RuntimeError) as exc:
                            errors[batch] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                            samples.pop((arm, batch), None)
            for batch in batches:
                per_bucket_ms = statistics.median(samples[("per_bucket", batch)])
                row: dict[str, Any] = {"batch": batch, "per_bucket_ms": round(per_bucket_ms, 2)}
                if ("symbolic", batch) in samples:
                    row["symbolic_ms"] = round(statistics.median(samples[("symbolic", batch)]), 2)
                    row["symbolic_vs_per_bucket"] = round(row["symbolic_ms"] / row["per_bucket_ms"], 3)
                    row["symbolic_max_difference"] = _difference(
                        runner, graphs["symbolic"][min(batch, 2)], batch, length, graph != "generate")
                else:
                    row["symbolic_error"] = errors.get(batch)
                result["steps_ms"].append(row)
    finally:
        runner.close()
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--graph", choices=("generate", "decode", "decode-unfolded"), default="generate")
    ap.add_argument("--buckets", default="1,8,32", help="the buckets compiled one graph each (today's way)")
    ap.add_argument("--batches", default="1,8,32", help="the batches timed: each one of --buckets")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--length", type=int, default=64, help="the attention length of the timed steps")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    buckets = [int(b) for b in args.buckets.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    if not set(batches) <= set(buckets):
        ap.error("every timed batch must be a compiled bucket")
    model_dir = args.model
    if model_dir is None:
        from vox_ws.testing.tiny_voxcpm import build

        model_dir = str(build(tempfile.mkdtemp(prefix="vox-ws-tiny-"), stop="never"))
    result = run(model_dir, args.graph, buckets, batches, args.steps, args.repeats, args.length)
    compile_s = result["compile_s"]
    per_bucket = compile_s["per_bucket"]
    print(f"the whole step ({args.graph}), compiled in a fresh process with an empty cache, seconds a graph:")
    print("  per bucket: " + ", ".join(f"B={b} {s} s" for b, s in per_bucket.items())
          + f" (mean {statistics.mean(per_bucket.values()):.1f} s)")
    print("  symbolic batch: " + ", ".join(f"B={b} {s} s" for b, s in compile_s["symbolic"].items())
          + f"; the symbolic graph called at 3 rows: {result['symbolic_takes_3_rows']}")
    print(f"one step at {args.length} positions, median of {args.repeats} interleaved runs of {args.steps}:")
    print(f"{'B':>4}{'per bucket ms':>15}{'symbolic ms':>13}{'ratio':>8}{'max |diff| vs eager':>21}")
    for row in result["steps_ms"]:
        if "symbolic_ms" in row:
            print(f"{row['batch']:>4}{row['per_bucket_ms']:>15.2f}{row['symbolic_ms']:>13.2f}"
                  f"{row['symbolic_vs_per_bucket']:>8.3f}{row['symbolic_max_difference']:>21.2e}")
        else:
            print(f"{row['batch']:>4}{row['per_bucket_ms']:>15.2f}   symbolic: {row['symbolic_error']}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
