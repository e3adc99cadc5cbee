"""The runner's batched step on the tiny VoxCPM2, timed alone: no scheduler, no server.

    python -m benchmarks.step_time [--batches 1,8] [--repeats 6] [--steps 12]

For each batch size B: B rows prefilled, `--steps` steps timed, released, `--repeats` times;
prints the median step in ms. For comparing two versions of the code on one machine, one after
the other (run it from each checkout: `python -m` imports the checkout it is run from).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--repeats", type=int, default=6)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)

    import torch

    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput
    from vox_ws.testing.tiny_voxcpm import build

    torch.set_num_threads(1)
    batches = [int(b) for b in args.batches.split(",")]
    with tempfile.TemporaryDirectory() as folder:
        build(Path(folder))
        model = import_voxcpm().VoxCPM.from_pretrained(folder, load_denoiser=False, optimize=False,
                                                       device="cpu").tts_model
    runner = BatchedVoxCPM2(model, slots=max(batches), decode_process=False)
    prompt = build_prompt(model, "A sentence for timing the step of the runner.", None)
    medians = {}
    for batch in batches:
        times = []
        for _ in range(args.repeats):
            rows = [runner.prefill(PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                max_len=4096)) for i in range(batch)]
            for _ in range(args.steps):
                started = time.perf_counter()
                runner.step(rows)
                times.append(time.perf_counter() - started)
            for row in rows:
                runner.release(row)
        medians[batch] = round(statistics.median(times) * 1000, 2)
    runner.close()
    print(json.dumps({"step_ms_median": medians}))


if __name__ == "__main__":
    main()
