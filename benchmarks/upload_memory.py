"""What concurrent voice uploads do to the server's memory, and whether it comes back down.

A server (the tiny VoxCPM2, `python -m benchmarks.attacks`' own) takes 60 concurrent uploads of
30 s references over HTTP from one address (`attacks.upload_flood`: each sent again after its
refusal's `Retry-After`) for SECONDS; its resident memory (with its worker processes) is
sampled before, over the attack, and SETTLE seconds after it.

    python -m benchmarks.upload_memory [--seconds 30] [--settle 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import threading
import time

from .attacks import Server, _process_tree, _rss_mb, upload_flood


def tree_mb(pid: int) -> float:
    return sum(_rss_mb(p) for p in _process_tree(pid))


def measure(seconds: float, settle: float) -> dict:
    server = Server("voxcpm")
    try:
        time.sleep(2.0)
        before = tree_mb(server.proc.pid)
        samples: list[float] = []
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                samples.append(tree_mb(server.proc.pid))
                time.sleep(0.25)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        asyncio.run(upload_flood(server.port, time.monotonic() + seconds))
        done.set()
        sampler.join()
        time.sleep(settle)
        after = tree_mb(server.proc.pid)
    finally:
        server.stop()
    return {"uploads": 60, "reference_s": 30, "seconds": seconds, "rss_mb_before": round(before, 1),
            "rss_mb_peak": round(max(samples), 1), "rss_mb_after": round(after, 1),
            "grew_mb": round(max(samples) - before, 1), "kept_mb": round(after - before, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--settle", type=float, default=10.0)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    row = measure(args.seconds, args.settle)
    print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
