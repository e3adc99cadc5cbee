"""Benchmark: first audio under a burst of arrivals, the prompts prefilled one at a time against
together (`BatchedVoxCPM2.prefill_many`), on one runner, in one run.

`running` streams are mid-generation when `burst` requests arrive at once. The turn that admits
them prefills their prompts, then steps every row (each newcomer's first patch is decoded at
once): the time from the burst to that step's end is every newcomer's first audio, and the
running streams' gap between two chunks. Each figure is the median of `--repeats` bursts.

    python -m benchmarks.prefill_burst [--model DIR] [--device cpu] [--bursts 1,8,32] [--running 8]

Without --model it builds the tiny random-weight VoxCPM2 in a temporary directory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

TEXTS = ["Hello there, how can I help you today?", "The weather is fine.",
         "Please hold on while I look that up for you, it will only take a moment.", "Yes.",
         "Your order has shipped and should arrive on Tuesday."]


def burst_ms(runner, model, burst: int, running: int, together: bool, repeats: int) -> float:
    """The median time from a burst of `burst` arrivals to the end of the step that gives each
    its first audio, with `running` streams generating meanwhile."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import PrefillInput

    def inputs(count: int, offset: int) -> list:
        return [PrefillInput(build_prompt(model, TEXTS[(offset + i) % len(TEXTS)], None), seed=offset + i,
                             cfg_value=2.0, timesteps=10, min_len=2, max_len=4096) for i in range(count)]

    timings = []
    for repeat in range(repeats + 1):                       # the first is a warm-up
        base = runner.prefill_many(inputs(running, 1000))
        runner.step(base)
        arriving = inputs(burst, repeat * burst)
        started = time.perf_counter()
        if together:
            fresh = runner.prefill_many(arriving)
        else:
            fresh = [runner.prefill_many([one])[0] for one in arriving]
        runner.step(base + fresh)
        if repeat:
            timings.append((time.perf_counter() - started) * 1000)
        for row in base + fresh:
            runner.release(row)
    return statistics.median(timings)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--bursts", default="1,8,32")
    ap.add_argument("--running", type=int, default=8, help="streams generating when the burst arrives")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json", help="write the results to this file")
    args = ap.parse_args(argv)

    import torch

    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    torch.set_num_threads(args.threads)
    model_dir = args.model
    if model_dir is None:
        from vox_ws.testing.tiny_voxcpm import build

        model_dir = str(build(tempfile.mkdtemp(prefix="vox-ws-bench-")))
    model = import_voxcpm().VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False,
                                                   device=args.device).tts_model
    bursts = [int(b) for b in args.bursts.split(",")]
    runner = BatchedVoxCPM2(model, slots=args.running + max(bursts), decode_process=False)
    print(f"# first audio under a burst: {model_dir} on {args.device}, {args.threads} thread(s), "
          f"{args.running} streams running, median of {args.repeats}")
    print(f"{'burst':>5} {'one at a time ms':>17} {'together ms':>12} {'together/alone':>15}")
    results = []
    for burst in bursts:
        alone = burst_ms(runner, model, burst, args.running, False, args.repeats)
        together = burst_ms(runner, model, burst, args.running, True, args.repeats)
        results.append({"burst": burst, "running": args.running, "one_at_a_time_ms": round(alone, 1),
                        "together_ms": round(together, 1), "ratio": round(together / alone, 3)})
        print(f"{burst:>5} {alone:>17.1f} {together:>12.1f} {together / alone:>15.3f}", flush=True)
    runner.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": model_dir, "device": args.device, "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
