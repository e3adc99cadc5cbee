"""Benchmark: the compiled step (`--compile on`) against eager, and what compiling costs a start.

Per batch size B: the mean time of one generation step (`runner.step`, VAE decode inline so
that the two sides time the same work on a small CPU) of B rows, eager and compiled, measured in
one process, interleaved. Then the engine's start (`VoxCPMEngine.load`, each in a fresh process):
eager; compiled with an empty compile cache (first start); compiled again with that cache
(second start).

    python -m benchmarks.compiled [--model DIR] [--batches 1,8,16] [--steps 20] [--repeats 5] [--json FILE]
        [--no-starts] [--buckets 1,8,16] [--whole]

`--whole` times a third engine beside them: the whole step compiled as one graph per bucket
(`whole_step.py`, what `--cuda-graphs` captures on a GPU), compiled first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vox_ws.engines.voxcpm import parse_buckets

from ._steps import decode_inline, time_steps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

TEXT = "Compiled or eager, the same audio; one of them sooner."


def _engine(model_dir: str, slots: int, compile: str, cache: str | None, device: str = "cpu",
            buckets: tuple[int, ...] | None = None) -> Any:
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    return VoxCPMEngine(model=model_dir, device=device, threads=1, slots=slots, compile=compile,
                        compile_cache=cache, compile_buckets=buckets)


def start_seconds(model_dir: str, slots: int, compile: str, cache: str | None, device: str,
                  buckets: tuple[int, ...] | None = None) -> float:
    """One engine start in a process of its own (no compiled code in memory from before)."""
    return start(model_dir, slots, compile, cache, device, buckets)["seconds"]


def start(model_dir: str, slots: int, compile: str, cache: str | None, device: str,
          buckets: tuple[int, ...] | None = None) -> dict[str, Any]:
    """One engine start in a process of its own: its seconds and, compiled, each graph's
    (`GraphStore.seconds`: loaded or compiled)."""
    code = ("import json, sys, time; from benchmarks.compiled import _engine; started = time.perf_counter(); "
            f"engine = _engine({model_dir!r}, {slots}, {compile!r}, {cache!r}, {device!r}, {buckets!r}); "
            "engine.load(); took = time.perf_counter() - started; "
            "graphs = engine.runner.compiled.store.seconds if engine.runner.compiled else []; "
            "engine.close(); print(json.dumps({'seconds': took, 'graphs': graphs}))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(),
                                                                           os.environ.get("PYTHONPATH", "")])})
    return json.loads(run.stdout.strip().splitlines()[-1])


def run(model_dir: str, batches: list[int], steps: int, repeats: int, device: str,
        starts: bool = True, buckets: tuple[int, ...] | None = None, whole: bool = False) -> dict[str, Any]:
    import torch

    from vox_ws.engines.voxcpm.lora import NO_ADAPTER

    torch.set_num_threads(1)
    slots = max(batches)
    cache = tempfile.mkdtemp(prefix="vox-ws-compile-cache-")
    started = {}
    if starts:
        started = {"eager_s": start_seconds(model_dir, slots, "off", None, device),
                   "compiled_first_s": start_seconds(model_dir, slots, "on", cache, device, buckets),
                   "compiled_second_s": start_seconds(model_dir, slots, "on", cache, device, buckets)}
    engines = {"eager": _engine(model_dir, slots, "off", None, device),
               "compiled": _engine(model_dir, slots, "on", cache, device, buckets)}
    if whole:     # the compiled step's pieces and, beside them, the whole step as one graph
        engines["whole"] = _engine(model_dir, slots, "on", cache, device, buckets)
    for name, engine in engines.items():
        engine.load()
        decode_inline(engine, slots)
        if name == "whole":
            engine.runner.compile_whole(engine.runner.compiled)
    samples: dict[tuple[str, int], list[tuple[float, float]]] = {}
    try:
        for _ in range(repeats):
            for batch in batches:
                for name, engine in engines.items():
                    samples.setdefault((name, batch), []).append(
                        time_steps(engine, TEXT, [NO_ADAPTER] * batch, steps, warm_up=2))
    finally:
        for engine in engines.values():
            engine.close()
    table = []
    for batch in batches:
        eager = [statistics.median(s[k] for s in samples[("eager", batch)]) for k in (0, 1)]
        compiled = [statistics.median(s[k] for s in samples[("compiled", batch)]) for k in (0, 1)]
        table.append({"batch": batch, "eager_ms": round(eager[0], 2), "compiled_ms": round(compiled[0], 2),
                      "compiled_vs_eager": round(compiled[0] / eager[0], 3),
                      "eager_generate_ms": round(eager[1], 2), "compiled_generate_ms": round(compiled[1], 2),
                      "generate_compiled_vs_eager": round(compiled[1] / eager[1], 3)})
        if whole:
            whole_ms = statistics.median(s[0] for s in samples[("whole", batch)])
            table[-1].update(whole_ms=round(whole_ms, 2), whole_vs_eager=round(whole_ms / eager[0], 3))
    result = {"device": device, "steps": steps, "repeats": repeats, "steps_ms": table, "starts": {}}
    if started:
        result["starts"] = {**{k: round(v, 1) for k, v in started.items()},
                            "second_vs_eager": round(started["compiled_second_s"] / started["eager_s"], 2)}
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--batches", default="1,8,16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--no-starts", action="store_true", help="time the steps only")
    ap.add_argument("--buckets", help="batch sizes to compile for (default: 1, 2, 4, ... up to the largest batch)")
    ap.add_argument("--whole", action="store_true",
                    help="also the whole step compiled as one graph per bucket (`whole_step.py`)")
    args = ap.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from vox_ws.testing.tiny_voxcpm import build

        model_dir = str(build(tempfile.mkdtemp(prefix="vox-ws-tiny-"), stop="never"))
    result = run(model_dir, [int(b) for b in args.batches.split(",")], args.steps, args.repeats, args.device,
                 starts=not args.no_starts, buckets=parse_buckets(args.buckets) if args.buckets else None,
                 whole=args.whole)
    print(f"one step, median of {result['repeats']} interleaved runs of {result['steps']} steps (VAE inline):")
    print(f"{'B':>4}{'eager ms':>10}{'compiled ms':>13}{'compiled/eager':>16}{'generation: eager':>19}"
          f"{'compiled':>10}{'ratio':>7}")
    for row in result["steps_ms"]:
        print(f"{row['batch']:>4}{row['eager_ms']:>10.2f}{row['compiled_ms']:>13.2f}{row['compiled_vs_eager']:>16.3f}"
              f"{row['eager_generate_ms']:>19.2f}{row['compiled_generate_ms']:>10.2f}"
              f"{row['generate_compiled_vs_eager']:>7.3f}"
              + (f"   whole step {row['whole_ms']:.2f} ms ({row['whole_vs_eager']:.3f}x)" if "whole_ms" in row else ""))
    s = result["starts"]
    if s:
        print(f"start: eager {s['eager_s']} s; compiled, first (empty cache) {s['compiled_first_s']} s, second "
              f"{s['compiled_second_s']} s ({s['second_vs_eager']}x eager)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
