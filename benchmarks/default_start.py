"""Benchmark: what a default `vox-ws serve --engine voxcpm` gives from the moment it is ready,
against `--compile off` and (with `--before-tree`) an earlier commit's default, in one run, on
a quiet machine or beside a CPU-heavy neighbour (`--neighbour`).

Each configuration is a server process of its own on a fresh compile cache, with the defaults
(`--slots auto` included) but for its arguments:
- `off`: `--compile off`, eager from start to end;
- `default`: no argument: ready once loaded, the step compiling in a background process. It is
  measured twice: from the moment `/readyz` answers 200, while the compile runs (each rate says
  whether it was still running), then once the compile is done;
- `before` (with `--before-tree DIR`, a checkout of an earlier commit): that tree's default;
  `before-off` with `--before-off`: that tree with `--compile off`, to set against `off`.

Per configuration: the seconds to ready, open-loop capacity (`vox_ws.clients.capacity.run_rate`:
listeners arriving at each rate for `--seconds`, each a real-time player; a rate is held when
first audio p95 <= 300 ms and 99% of streams play without a gap) and the first audio p95 at
each rate.

    python -m benchmarks.default_start [--model DIR] [--rates 6,8,10,12] [--compiled-rates R] [--seconds 20]
        [--neighbour] [--before-tree DIR [--before-off]] [--only default] [--json FILE]

Without --model it builds the tiny random-weight VoxCPM2 in a temporary directory. The
neighbour is one process spinning a core at normal priority for the whole run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from vox_ws.clients import capacity

from . import free_port, stop_server

ROOT = Path(__file__).resolve().parent.parent


def _get(port: int, path: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except (OSError, ValueError):
        return 0, {}


def _background(port: int) -> dict[str, Any]:
    return _get(port, "/v1/info")[1].get("compile", {}).get("background", {})


def _rates(port: int, rates: list[float], seconds: float, label: str) -> list[dict[str, Any]]:
    """Each rate in turn, with the background compile's state when it ended."""
    url = f"ws://127.0.0.1:{port}/v1/stream"
    steps = asyncio.run(capacity.steps_per_second(url))
    summaries = []
    for rate in rates:
        summary = asyncio.run(capacity.run_rate(url, rate, seconds, steps_per_s=steps)).summary()
        background = _background(port)
        summary["compile"] = background.get("status", "none")
        summary["adopted"] = background.get("adopted", [])
        summaries.append(summary)
        print(f"{label:>18} {rate:>5g}/s  first audio p95 {summary['first_audio_ms']['p95']:>7.0f} ms  gap-free "
              f"{100 * (summary['gap_free_share'] or 0):5.1f}%  held {capacity.held(summary)!s:>5}  "
              f"compile {summary['compile']} {summary['adopted']}", flush=True)
    return summaries


def run(label: str, args: list[str], model: str, rates: tuple[list[float], list[float]], seconds: float,
        bound_s: float, tree: Path = ROOT) -> dict[str, Any]:
    """One configuration's server: `rates` from ready, and (where it compiles in the background)
    once compiled."""
    port = free_port()
    cache = tempfile.mkdtemp(prefix="vox-ws-default-start-")
    started = time.monotonic()
    # `python -m` puts the working directory first on the path: `tree`'s vox_ws is the one served.
    server = subprocess.Popen([sys.executable, "-m", "vox_ws", "serve", "--engine", "voxcpm", "--model", model,
                               "--device", "cpu", "--port", str(port), "--compile-cache",
                               os.path.join(cache, "compile"), *args],
                              cwd=tree, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(tree)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    result: dict[str, Any] = {"args": args, "tree": str(tree)}
    try:
        while _get(port, "/readyz")[0] != 200:
            if server.poll() is not None or time.monotonic() - started > bound_s:
                raise RuntimeError(f"{label}: the server never got ready")
            time.sleep(0.1)
        result["ready_s"] = round(time.monotonic() - started, 1)
        info = _get(port, "/v1/info")[1]
        result["slots"], result["step_rows"] = info.get("slots"), info.get("step_rows")
        phases = {"ready": _rates(port, rates[0], seconds, f"{label}, from ready")}
        if _background(port):
            while _background(port).get("status") == "compiling":
                if time.monotonic() - started > bound_s:
                    raise RuntimeError(f"{label}: the background compile did not end")
                time.sleep(1)
            result["background_done_s"] = round(time.monotonic() - started, 1)
            phases["compiled"] = _rates(port, rates[1], seconds, f"{label}, compiled")
        result["compile"] = _get(port, "/v1/info")[1].get("compile", {})
        result["phases"] = {name: {"rates": summaries, "capacity": capacity.capacity(summaries)}
                            for name, summaries in phases.items()}
    finally:
        stop_server(server)
    return result


def _neighbour() -> subprocess.Popen:
    """One core spun at normal priority: the machine's other work."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--rates", default="6,8,10,12")
    ap.add_argument("--compiled-rates", help="the rates once compiled (default: --rates)")
    ap.add_argument("--only", help="these configurations alone (before or before-off, off, default; comma-separated)")
    ap.add_argument("--seconds", type=float, default=20.0, help="arrivals per rate, in seconds")
    ap.add_argument("--neighbour", action="store_true", help="beside a process spinning one core")
    ap.add_argument("--before-tree", help="a checkout of an earlier commit: its default start is measured too")
    ap.add_argument("--before-off", action="store_true",
                    help="the earlier commit with --compile off (against this tree's `off`) instead of its default")
    ap.add_argument("--bound", type=float, default=1800.0, help="seconds a start and its compile may take")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    model = args.model
    if model is None:
        from vox_ws.testing.tiny_voxcpm import build

        model = str(build(tempfile.mkdtemp(prefix="vox-ws-bench-")))
    rates = ([float(r) for r in args.rates.split(",")],
             [float(r) for r in (args.compiled_rates or args.rates).split(",")])
    configurations: list[tuple[str, list[str], Path]] = []
    if args.before_tree:
        configurations.append(("before-off" if args.before_off else "before",
                               ["--compile", "off"] if args.before_off else [], Path(args.before_tree).resolve()))
    configurations += [("off", ["--compile", "off"], ROOT), ("default", [], ROOT)]
    if args.only:
        configurations = [c for c in configurations if c[0] in args.only.split(",")]
    neighbour = _neighbour() if args.neighbour else None
    results: dict[str, Any] = {"rates": rates[0], "compiled_rates": rates[1], "seconds": args.seconds,
                               "neighbour": args.neighbour, "configurations": {}}
    try:
        for label, extra, tree in configurations:
            results["configurations"][label] = run(label, extra, model, rates, args.seconds, args.bound, tree)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    print()
    for label, r in results["configurations"].items():
        for phase, measured in r["phases"].items():
            held = measured["capacity"]
            p95 = ", ".join(f"{s['rate_per_s']:g}/s {s['first_audio_ms']['p95']:.0f} ms" for s in measured["rates"])
            print(f"{label:>8} {phase:>9}: ready {r['ready_s']} s, {r['slots']} slots; capacity "
                  + (f"{held['rate_per_s']:g} arrivals/s, {held['concurrent_listeners']:.1f} listeners" if held
                     else "none of these rates") + f"; first audio p95 {p95}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
