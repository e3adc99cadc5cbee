"""How long a VoxCPM2 checkpoint takes to load, in one or more checkouts, alternating.

    python -m vox_ws.testing.tiny_voxcpm /tmp/real --size real      # released shapes, ~9 GB
    git archive cfa36b0 | tar -x -C /tmp/vox-old                      # an older checkout to compare
    python -m benchmarks.load_time /tmp/real --trees /tmp/vox-old . --rounds 2

For each round and each checkout, in fresh processes (that checkout first on `PYTHONPATH`):
`engine`: the engine's `load()` with one slot and the step eager, on the CPU; `model`: the
model alone, as that checkout's engine loads it (its `loading.from_pretrained` where it has one,
else the package's `VoxCPM.from_pretrained`), and its weights checked (`verify_weights`). Prints
one line per measurement and the median per checkout. The checkouts alternate so that a busy
machine's slow minute falls on each alike; run it more than once on a shared machine.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

ENGINE = """
import sys, time
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
engine = VoxCPMEngine(model=sys.argv[1], device="cpu", slots=1, compile="off")
started = time.perf_counter()
engine.load()
print("SECONDS", time.perf_counter() - started, flush=True)
engine.close()
"""

MODEL = """
import sys, time
from pathlib import Path
from vox_ws.engines.voxcpm import loading
loading.import_voxcpm()
started = time.perf_counter()
load = getattr(loading, "from_pretrained", None) or loading.import_voxcpm().VoxCPM.from_pretrained
tts = load(sys.argv[1], load_denoiser=False, optimize=False, device="cpu")
loaded = time.perf_counter() - started
loading.verify_weights(tts.tts_model, Path(sys.argv[1]))
print("SECONDS", time.perf_counter() - started, loaded, flush=True)
"""


def measure(tree: Path, code: str, checkpoint: str) -> list[float]:
    env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TQDM_DISABLE": "1"}
    done = subprocess.run([sys.executable, "-c", code, checkpoint], env=env, cwd="/", capture_output=True,
                          text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("SECONDS")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
    return [float(x) for x in lines[-1].split()[1:]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--trees", nargs="+", default=["."], help="checkouts to compare (default: this one)")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args(argv)
    trees = [Path(t).resolve() for t in args.trees]
    seconds: dict[tuple[Path, str], list[float]] = {}
    for round_ in range(1, args.rounds + 1):
        for tree in trees:
            for name, code in (("engine", ENGINE), ("model", MODEL)):
                took = measure(tree, code, args.checkpoint)
                seconds.setdefault((tree, name), []).append(took[0])
                load = os.getloadavg()[0]
                extra = f" (loaded in {took[1]:.1f} s, then checked)" if len(took) > 1 else ""
                print(f"round {round_} {tree} {name}: {took[0]:.1f} s{extra}; load average {load:.1f}",
                      flush=True)
    for (tree, name), values in seconds.items():
        print(f"{tree} {name}: median {statistics.median(values):.1f} s of {[round(v, 1) for v in values]}")


if __name__ == "__main__":
    main()
