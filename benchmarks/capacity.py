"""Benchmark: open-loop capacity (`vox_ws.clients.capacity`) of each configuration, in one run.

For every configuration a fresh server is started (the attack benchmark's: eight slots, or 32
with eight rows a step for `voxcpm-deadline`; on a GPU 32, and 64 with 32 rows; default
limits), listeners arrive at each rate of `--rates` (Poisson, 3-15 s of speech
each, every one a real-time player), and per rate the table of `vox-ws bench --rate` is
printed; then each configuration's capacity, and one PNG of first-audio p95 and the gap-free
share against the rate, a line per configuration.

    python -m benchmarks.capacity [--configurations piper,voxcpm,voxcpm-deadline] [--rates 0.5,1,2,4]
        [--seconds 30] [--model DIR] [--device cpu|cuda]
        [--json out.json] [--chart docs/capacity.png]

`voxcpm` is the tiny random-weight VoxCPM2 (built), the CPU's stand-in for the real model's
step; `--model` serves another checkpoint (the device check's real-size one) on `--device`.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from vox_ws.clients import capacity

from .attacks import Server

# label -> the server it runs: Piper; the tiny VoxCPM2 with eight slots, each step carrying every
# runnable one (today's policy); with 32 slots, eight rows a step picked by slack (deadline-aware).
# `-compiled`: the same with the step compiled (`--compile on`).
CONFIGURATIONS = {name: name for name in ("piper", "voxcpm", "voxcpm-deadline", "voxcpm-compiled",
                                          "voxcpm-deadline-compiled")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configurations", default=",".join(CONFIGURATIONS))
    ap.add_argument("--rates", default="0.5,1,2,4", help="arrivals per second, comma-separated")
    ap.add_argument("--seconds", type=float, default=30.0, help="of arrivals per rate")
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json")
    ap.add_argument("--chart")
    args = ap.parse_args(argv)
    rates = [float(x) for x in args.rates.split(",")]
    reports = {}
    for label in args.configurations.split(","):
        server = Server(CONFIGURATIONS[label], args.model, args.device)
        try:
            print(f"\n{label}:", flush=True)
            reports[label] = asyncio.run(capacity.measure(f"ws://127.0.0.1:{server.port}/v1/stream", rates,
                                                          args.seconds))
        finally:
            server.stop()
    print()
    for label, report in reports.items():
        held = report["capacity"]
        print(f"{label}: capacity " + (f"{held['rate_per_s']:g} arrivals/s, {held['concurrent_listeners']:.1f} "
                                       "concurrent listeners" if held else "none of the rates held"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(reports, f, indent=2)
    if args.chart:
        capacity.chart({label: r["rates"] for label, r in reports.items()}, args.chart,
                       "vox-ws open-loop capacity (" + ("2-core CPU" if args.device == "cpu" else args.device) + ")")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
