"""Benchmark: what a default `vox-ws serve --engine voxcpm` gives, against the default before the
background compile, in one run: the seconds to ready, the background compile's progress, and
open-loop capacity (`vox_ws.capacity`) once it is done.

`before`: `--compile-wait true`, as every start was: `--compile auto` compiled at load on CUDA
(ready only after it) and left a CPU eager. `now`: the defaults: ready once loaded, the step
compiled in a background process, each bucket taken in where it measures faster (a CPU) or
always (CUDA). Each server is a process of its own on a fresh compile cache.

    python -m benchmarks.default_start [--model DIR] [--device cpu] [--rates 4,8,16] [--seconds 20]
        [--slots 8] [--json FILE]

Without --model it builds the tiny random-weight VoxCPM2 in a temporary directory.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vox_ws import capacity

ROOT = Path(__file__).resolve().parent.parent
CONFIGURATIONS = {"before": ["--compile-wait", "true"], "now": []}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except OSError:
        return 0, {}


def run(label: str, model: str, device: str, max_batch: int, rates: list[float], seconds: float,
        bound_s: float) -> dict[str, Any]:
    port = _free_port()
    cache = tempfile.mkdtemp(prefix="vox-ws-default-start-")
    started = time.monotonic()
    server = subprocess.Popen([sys.executable, "-m", "vox_ws", "serve", "--engine", "voxcpm", "--model", model,
                               "--device", device, "--port", str(port), "--slots", str(max_batch),
                               "--compile-cache", os.path.join(cache, "compile"), *CONFIGURATIONS[label]],
                              cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        while _get(port, "/readyz")[0] != 200:
            if server.poll() is not None or time.monotonic() - started > bound_s:
                raise RuntimeError(f"{label}: the server never got ready")
            time.sleep(0.1)
        ready_s = time.monotonic() - started
        while True:
            compile_info = _get(port, "/v1/info")[1].get("compile", {})
            if compile_info.get("background", {}).get("status", "done") != "compiling":
                break
            if time.monotonic() - started > bound_s:
                raise RuntimeError(f"{label}: the background compile did not end")
            time.sleep(1)
        compiled_s = time.monotonic() - started
        # The first step of the measurement takes in what the background compile left.
        report = asyncio.run(capacity.measure(f"ws://127.0.0.1:{port}/v1/stream", rates, seconds))
        compile_info = _get(port, "/v1/info")[1].get("compile", {})
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
    return {"ready_s": round(ready_s, 1), "background_done_s": round(compiled_s, 1), "compile": compile_info,
            "capacity": report["capacity"], "rates": report["rates"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--rates", default="4,8,16")
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--bound", type=float, default=1800.0, help="seconds a start and its compile may take")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from vox_ws.testing.tiny_voxcpm import build

        model = str(build(tempfile.mkdtemp(prefix="vox-ws-bench-")))
    rates = [float(r) for r in args.rates.split(",")]
    results = {}
    for label in CONFIGURATIONS:
        print(f"\n{label}:", flush=True)
        results[label] = run(label, model, args.device, args.slots, rates, args.seconds, args.bound)
    print()
    for label, r in results.items():
        background = r["compile"].get("background", {})
        held = r["capacity"]
        print(f"{label:>6}: ready in {r['ready_s']} s; compiled buckets {r['compile'].get('buckets')} "
              f"(background: {background.get('status', 'none')}, done at {r['background_done_s']} s, "
              f"declined {background.get('declined', [])}); capacity "
              + (f"{held['rate_per_s']:g} arrivals/s, {held['concurrent_listeners']:.1f} listeners" if held
                 else "none of these rates"))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
