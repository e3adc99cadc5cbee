"""Benchmark: `--slots auto` on Piper started on a busy machine, and measured again once quiet.

A `vox-ws serve --engine piper` process (defaults: `--slots auto`) starts while `--hogs`
processes spin the CPU at normal priority (the neighbours: Home Assistant, Open WebUI loading);
once it is ready they stop. It reports the slots the start chose, how fast Piper spoke then and
with what share of the CPU it asked for, then waits for its measure again (the default back-off:
30 s after the start's, when the engine is idle) and reports the same. With `--hogs 0`: a quiet
start, for comparison (measured once: nothing to measure again).

    python -m benchmarks.busy_start [--hogs 2] [--wait-s 300] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from typing import Any

from . import ROOT, free_port, stop_server


def _info(port: int) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/info", timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


def _row(label: str, info: dict[str, Any], started: float) -> dict[str, Any]:
    measure = info["slots_measure"]
    return {"phase": label, "at_s": round(time.monotonic() - started, 1), "slots": info["slots"],
            "speed": measure["speed"], "cpu_share": measure["cpu_share"], "contended": measure["contended"],
            "remeasures": measure["remeasures"], "slots_reason": info["slots_reason"]}


def run(hogs: int, wait_s: float) -> list[dict[str, Any]]:
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(hogs)]
    port = free_port()
    started = time.monotonic()
    command = [sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", str(port)]
    server = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        while (info := _info(port)) is None or info["status"] != "ready":
            if server.poll() is not None or time.monotonic() - started > wait_s:
                raise RuntimeError("the server never got ready")
            time.sleep(0.2)
        rows.append(_row(f"start, beside {hogs} busy loops" if hogs else "start, quiet", info, started))
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        while info["slots_measure"]["next_at"] is not None and time.monotonic() - started < wait_s:
            time.sleep(1.0)
            info = _info(port) or info
            if info["slots_measure"]["remeasures"] > rows[-1]["remeasures"]:
                rows.append(_row(f"measured again ({info['slots_measure']['remeasures']})", info, started))
    finally:
        for spinner in spinners:
            spinner.kill()
            spinner.wait()
        stop_server(server)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hogs", type=int, default=2, help="busy-loop processes while the server starts")
    ap.add_argument("--wait-s", type=float, default=300.0, help="the most seconds to wait for it")
    ap.add_argument("--json", help="write the rows here too")
    args = ap.parse_args(argv)
    rows = run(args.hogs, args.wait_s)
    print(f"{'phase':32} {'at s':>6} {'slots':>5} {'speed':>6} {'CPU share':>9} {'busy':>5}")
    for row in rows:
        print(f"{row['phase']:32} {row['at_s']:6.1f} {row['slots']:5d} {row['speed']:5.1f}x "
              f"{row['cpu_share']:9.0%} {'yes' if row['contended'] else 'no':>5}")
    for row in rows:
        print(f"- {row['phase']}: {row['slots_reason']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
