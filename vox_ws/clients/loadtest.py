"""`vox-ws bench`: load a running server with N concurrent streaming clients and report what a
user would feel: first audio, real-time factor, playback underruns, errors.

For each concurrency level, N clients send requests back to back for `--duration` seconds. With
`--stream-input` each request's text is streamed in word by word at `--words-per-second` (as an
LLM would produce it), and first audio counts from the first word sent. Results are printed as a
table and can be written as JSON and as a PNG chart of first audio against concurrency.

With `--rate` the load is open-loop instead (`vox_ws.clients.capacity`): listeners arrive at random at
each rate, whatever the server is doing, and the capacity is the highest rate it holds.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import numpy as np

from ..audio import bytes_per_sample
from .playback import count_underruns
from .v1 import VoxError, connect

TEXTS = [
    "Sure, I can help with that.",
    "Your appointment is confirmed for Tuesday at ten in the morning.",
    "Let me check the latest status of your order, one moment please.",
    "The weather tomorrow looks sunny, with a high of twenty two degrees.",
    "Thanks for calling, and have a wonderful day!",
]


@dataclass
class Level:
    concurrency: int
    first_audio_ms: list[float] = field(default_factory=list)
    rtf: list[float] = field(default_factory=list)
    underruns: list[int] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    audio_s: float = 0.0
    wall_s: float = 0.0

    def summary(self) -> dict[str, Any]:
        first = np.array(self.first_audio_ms) if self.first_audio_ms else np.array([np.nan])
        return {
            "concurrency": self.concurrency,
            "streams": len(self.rtf),
            "first_audio_ms": {f"p{q}": round(float(np.percentile(first, q)), 1) for q in (50, 95, 99)},
            "rtf_mean": round(float(np.mean(self.rtf)), 4) if self.rtf else None,
            "underruns_per_stream": round(float(np.mean(self.underruns)), 3) if self.underruns else None,
            "streams_with_underruns": int(sum(1 for u in self.underruns if u)),
            "audio_s_per_s": round(self.audio_s / self.wall_s, 3) if self.wall_s else None,
            "errors": dict(self.errors),
        }


@dataclass(frozen=True)
class Traffic:
    """What each simulated user sends, request after request: whole texts, or texts streamed in
    word by word at `words_per_second`; audio in `format`; its random choices from `seed`."""

    stream_input: bool = False
    words_per_second: float = 12.0
    format: str = "s16"
    seed: int = 0


async def one_request(client, text: str, traffic: Traffic, level: Level) -> None:
    started = time.monotonic()
    arrivals: list[tuple[float, float]] = []
    fmt, words_per_second = traffic.format, traffic.words_per_second
    width = bytes_per_sample(fmt)
    if traffic.stream_input:
        stream = await client.open_stream(format=fmt)
        started = time.monotonic()

        async def produce() -> None:
            for word in text.split(" "):
                await stream.send_text(word + " ")
                await asyncio.sleep(1.0 / words_per_second)
            await stream.end()

        producer = asyncio.create_task(produce())
        try:
            async for chunk in stream:
                arrivals.append((time.monotonic(), len(chunk) / width / stream.sample_rate))
        finally:
            producer.cancel()
    else:
        stream_rate = client.sample_rate
        async for chunk in client.stream(text, format=fmt):
            arrivals.append((time.monotonic(), len(chunk) / width / stream_rate))
    audio = sum(s for _, s in arrivals)
    if not arrivals or audio <= 0:
        return
    level.first_audio_ms.append((arrivals[0][0] - started) * 1000)
    level.rtf.append((arrivals[-1][0] - started) / audio)
    level.underruns.append(count_underruns(arrivals))
    level.audio_s += audio


async def run_level(url: str, token: str | None, n: int, duration: float, traffic: Traffic) -> Level:
    level = Level(n)
    deadline = time.monotonic() + duration
    started = time.monotonic()

    async def user(i: int) -> None:
        rng = random.Random(traffic.seed * 1000 + i)
        await asyncio.sleep(rng.uniform(0, min(1.0, duration / 4)))
        async with connect(url, token=token, open_timeout=30) as client:
            while time.monotonic() < deadline:
                try:
                    await one_request(client, rng.choice(TEXTS), traffic, level)
                except VoxError as err:
                    level.errors[err.code] += 1
                    if err.code == "connection_lost":
                        return
                    await asyncio.sleep(0.2)

    results = await asyncio.gather(*(user(i) for i in range(n)), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            level.errors[type(result).__name__] += 1
    level.wall_s = time.monotonic() - started
    return level


def chart(levels: list[dict[str, Any]], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [lv["concurrency"] for lv in levels]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for q, style in (("p50", "o-"), ("p95", "s--"), ("p99", "^:")):
        ax.plot(xs, [lv["first_audio_ms"][q] for lv in levels], style, label=f"first audio {q}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("first audio (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default=os.environ.get("VOX_WS_URL", "ws://127.0.0.1:8765/v1/stream"))
    ap.add_argument("--token")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma-separated levels")
    ap.add_argument("--rate", help="open-loop instead: listeners arriving at these rates a second "
                                   "(comma-separated), each a real-time player; prints the capacity")
    ap.add_argument("--label", help="the configuration's name in the --rate chart")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level")
    ap.add_argument("--stream-input", action="store_true", help="stream each text in word by word")
    ap.add_argument("--words-per-second", type=float, default=12.0)
    ap.add_argument("--format", default="s16", choices=["f32", "s16", "mulaw"])
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--chart", help="write a PNG chart of first audio against concurrency here (needs "
                                    "matplotlib: the `bench` extra, pip install '.[bench]' in a checkout)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--allow-remote", action="store_true", help="allow a target that is not on this machine")


def main(args: argparse.Namespace) -> int:
    if args.chart:
        try:
            import matplotlib  # noqa: F401 - asked for before the run, not after it
        except ImportError:
            raise SystemExit("vox-ws bench --chart draws with matplotlib: pip install matplotlib (the `bench` "
                             "extra; in a checkout: pip install '.[bench]')") from None
    host = urlsplit(args.url).hostname or ""
    local = host == "localhost" or _is_loopback(host)
    if not local and not args.allow_remote:
        raise SystemExit(f"{host} is not a loopback address; pass --allow-remote to load a server you run there")
    if args.rate:
        from . import capacity

        return capacity.main(args)
    levels = []
    print(f"{'N':>4} {'streams':>8} {'first p50':>10} {'p95':>8} {'p99':>8} {'RTF':>7} {'underruns':>10} "
          f"{'audio s/s':>10}  errors")
    for n in [int(x) for x in args.concurrency.split(",")]:
        level = asyncio.run(run_level(args.url, args.token, n, args.duration,
                                      Traffic(args.stream_input, args.words_per_second, args.format, args.seed)))
        s = level.summary()
        levels.append(s)
        f = s["first_audio_ms"]
        print(f"{n:>4} {s['streams']:>8} {f['p50']:>8.0f}ms {f['p95']:>6.0f}ms {f['p99']:>6.0f}ms "
              f"{s['rtf_mean'] if s['rtf_mean'] is not None else float('nan'):>7.3f} "
              f"{s['underruns_per_stream'] if s['underruns_per_stream'] is not None else float('nan'):>10.2f} "
              f"{s['audio_s_per_s'] or 0:>10.2f}  {s['errors'] or ''}", flush=True)
    report = {"url": args.url, "stream_input": args.stream_input, "duration_s": args.duration,
              "format": args.format, "levels": levels}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.chart:
        chart(levels, args.chart, f"vox-ws first audio ({'text streamed in' if args.stream_input else 'whole text'})")
    return 0


def _is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
