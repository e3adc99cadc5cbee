"""What whole responses (`stream: false`) cost the server's memory: four at once, at 48 kHz and
speed 0.25 (about 13 MB each), against the same four streamed and read whole.

A `vox-ws serve --engine piper` process (its defaults, a memory voice store) takes one warm-up
request, then the four; the figure is the growth of its peak resident memory (VmHWM) over its
resident memory before them. With `--tree DIR` the server runs that checkout's code (an
earlier commit's, for the figure before).

    python -m benchmarks.whole_memory [--streamed] [--tree DIR]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import subprocess
import sys
import time

import httpx

from . import free_port, stop_server

TEXT = "The quick brown fox jumps over the lazy dog while the evening light fades slowly over the hills. " * 6


def _memory_kb(pid: int) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as status:
        return {line.split(":")[0]: int(line.split()[1]) for line in status if line.startswith(("VmRSS", "VmHWM"))}


def measure(streamed: bool, tree: str | None) -> dict:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": tree} if tree else None
    server = subprocess.Popen([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", str(port),
                               "--voice-store", "memory"], env=env, cwd=tree, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        fields = {"voice": "alloy", "response_format": "wav", "stream": streamed}
        httpx.post(base + "/v1/audio/speech", json={**fields, "input": "Warm up."}, timeout=120)
        before = _memory_kb(server.pid)

        def one(_: int) -> tuple[int, int]:
            reply = httpx.post(base + "/v1/audio/speech", timeout=600,
                               json={**fields, "input": TEXT, "speed": 0.25, "sample_rate": 48000})
            return reply.status_code, len(reply.content)

        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            replies = list(pool.map(one, range(4)))
        after = _memory_kb(server.pid)
    finally:
        stop_server(server)
    return {"streamed": streamed, "replies": replies, "rss_before_mb": before["VmRSS"] >> 10,
            "peak_growth_mb": (after["VmHWM"] - before["VmRSS"]) >> 10}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streamed", action="store_true", help="the four streamed, read whole, instead")
    parser.add_argument("--tree", help="a checkout whose vox_ws the server runs")
    args = parser.parse_args()
    result = measure(args.streamed, args.tree)
    print(f"{'streamed' if args.streamed else 'whole'}: replies {result['replies']}; resident before "
          f"{result['rss_before_mb']} MB, peak growth {result['peak_growth_mb']} MB")


if __name__ == "__main__":
    main()
