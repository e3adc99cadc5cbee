"""Transport benchmark: what the server adds between the engine and the client.

A real server runs in a child process on a tone engine (`vox_ws.testing.tone`) that paces its
steps like a model and stamps every chunk with the wall-clock time at which it handed it over.
N WebSocket clients (one process, asyncio) each speak streams back to back for `--duration`
seconds and record, per chunk, hand-off -> receipt (the scheduler's hand-off, the encoder, the
event loop, the session's writer, the socket, the client's read), first audio per stream, and
the server's CPU seconds (all threads, from /proc) per second of audio delivered.

    python -m benchmarks.transport --concurrency 1,16,64,128 --duration 15 --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from vox_ws import wire
from vox_ws.testing.tone import STAMP_SAMPLES, read_stamp

from . import ROOT, module_command

TEXT = "A stream of tone that lasts for a few seconds, paced like a model would pace it."   # 81 chars


@dataclass
class Level:
    concurrency: int
    handoff_ms: list[float] = field(default_factory=list)
    first_audio_ms: list[float] = field(default_factory=list)
    streams: int = 0
    audio_s: float = 0.0
    errors: int = 0
    cpu_s: float = 0.0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        def pct(values: list[float], q: float) -> float | None:
            return round(float(np.percentile(values, q)), 3) if values else None

        return {
            "concurrency": self.concurrency,
            "streams": self.streams,
            "chunks": len(self.handoff_ms),
            "handoff_to_receipt_ms": {"p50": pct(self.handoff_ms, 50), "p99": pct(self.handoff_ms, 99),
                                      "max": pct(self.handoff_ms, 100)},
            "first_audio_ms": {"p50": pct(self.first_audio_ms, 50), "p95": pct(self.first_audio_ms, 95)},
            "audio_s": round(self.audio_s, 2),
            "server_cpu_s_per_audio_s": round(self.cpu_s / self.audio_s, 5) if self.audio_s else None,
            "errors": self.errors,
        }


def _cpu_seconds(pid: int) -> float:
    if not pid:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _client(url: str, level: Level, until: float, measuring: list[bool]) -> None:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, compression=None) as ws:
        wire.Hello.read(await ws.recv())
        n = 0
        while time.monotonic() < until:
            n += 1
            sid = f"s{n}"
            sent = time.monotonic()
            await ws.send(wire.encode(wire.Start(id=sid, text=TEXT, format="f32")))
            first = True
            while True:
                message = wire.read(await ws.recv())
                now_ns = time.time_ns()
                if isinstance(message, wire.AudioChunk):
                    audio = message.audio
                    if measuring[0]:
                        stamp = read_stamp(np.frombuffer(audio, dtype="<f4", count=STAMP_SAMPLES))
                        if stamp is not None:
                            level.handoff_ms.append((now_ns - stamp) / 1e6)
                        if first:
                            level.first_audio_ms.append((time.monotonic() - sent) * 1000)
                        level.audio_s += len(audio) / 4 / 24000
                    first = False
                elif isinstance(message, wire.Ended):
                    level.streams += measuring[0]
                    break
                elif isinstance(message, wire.Error):
                    level.errors += 1
                    break


async def _run_level(url: str, pid: int, concurrency: int, duration: float, warm_up: float) -> Level:
    level = Level(concurrency)
    measuring = [False]
    until = time.monotonic() + warm_up + duration
    tasks = [asyncio.create_task(_client(url, level, until, measuring)) for _ in range(concurrency)]
    await asyncio.sleep(warm_up)
    measuring[0] = True
    cpu0, wall0 = _cpu_seconds(pid), time.monotonic()
    await asyncio.sleep(duration)
    level.cpu_s, level.wall_s = _cpu_seconds(pid) - cpu0, time.monotonic() - wall0
    measuring[0] = False
    await asyncio.gather(*tasks)
    return level


def serve(port: int, chunk_s: float, interval_s: float) -> None:
    """The server child: a real vox-ws server on the tone engine."""
    from vox_ws.testing.tone import ToneEngine

    from ._transport_server import run_server

    engine = ToneEngine(sample_rate=24000, slots=512, chunk_s=chunk_s, step_interval_s=interval_s, stamp=True)
    run_server(engine, port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,16,64,128")
    parser.add_argument("--duration", type=float, default=15.0, help="measured seconds per level")
    parser.add_argument("--warm-up", type=float, default=3.0)
    parser.add_argument("--chunk", type=float, default=0.08, help="seconds of audio per chunk")
    parser.add_argument("--interval", type=float, default=0.08, help="seconds between engine steps")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--url", help="measure a server already running on the tone engine (stamped chunks)")
    parser.add_argument("--pid", type=int, help="with --url: the server's process id, for its CPU time")
    parser.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve is not None:
        serve(args.serve, args.chunk, args.interval)
        return 0
    proc = None
    if args.url:
        url, pid = args.url, args.pid or 0
    else:
        proc = subprocess.Popen(module_command("transport", "--serve", "0", "--chunk", str(args.chunk),
                                                "--interval", str(args.interval)),
                                 stdout=subprocess.PIPE, text=True, cwd=ROOT)
        line = proc.stdout.readline()
        url, pid = f"ws://127.0.0.1:{int(line.split()[1])}/v1/stream", proc.pid
    try:
        results = []
        for n in (int(x) for x in args.concurrency.split(",")):
            level = _loop_run(_run_level(url, pid, n, args.duration, args.warm_up))
            summary = level.summary()
            results.append(summary)
            h, f = summary["handoff_to_receipt_ms"], summary["first_audio_ms"]
            print(f"N={n:4d}  hand-off->receipt p50 {h['p50']} ms p99 {h['p99']} ms max {h['max']} ms  "
                  f"first audio p50 {f['p50']} ms p95 {f['p95']} ms  "
                  f"CPU {summary['server_cpu_s_per_audio_s']} s/audio s  streams {summary['streams']}  "
                  f"errors {summary['errors']}", flush=True)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"chunk_s": args.chunk, "interval_s": args.interval, "levels": results}, out, indent=1)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


def _loop_run(coro):
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    raise SystemExit(main())
