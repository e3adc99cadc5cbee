"""Soak test: hundreds of concurrent sessions against a vox-ws server on loopback, for minutes.

Each session repeatedly connects and does one of: a normal stream read to the end; a stream
cancelled after a few chunks (barge-in); a disconnect mid-stream; a slow reader that pauses
between chunks; a burst of bad frames followed by a good stream. It reports streams completed,
sequence gaps (must be 0), errors by code, server memory at start and end, and first-audio
percentiles.

    python -m benchmarks.soak [--url ws://127.0.0.1:8765/v1/stream] [--sessions 200] [--duration 180]

Without --url it starts its own server (Piper voice) on a free loopback port and stops it at the
end. Only loopback targets are accepted: this is a load generator.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import re
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from urllib.parse import urlsplit

import msgpack
import numpy as np
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake

from vox_ws import wire

TEXTS = [
    "Hello there.",
    "Your table is ready.",
    "Please hold, I am checking that for you.",
    "The train leaves at six fifteen from platform two.",
    "Thanks, goodbye!",
]
# Cancel and slow readers need streams of several chunks (Piper sends one per sentence or clause).
LONG_TEXT = ("Thank you for calling, your request is being processed. It may take a moment, "
             "so please stay on the line. We will be right with you, and we appreciate your patience.")
BEHAVIOURS = ["normal", "normal", "normal", "cancel", "disconnect", "slow", "garbage"]


class Tally:
    def __init__(self) -> None:
        self.outcomes: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.closes: Counter[str] = Counter()
        self.seq_gaps = 0
        self.first_audio_ms: list[float] = []
        self.audio_bytes = 0


async def one_stream(url: str, behaviour: str, rng: random.Random, tally: Tally) -> None:
    async with connect(url, max_size=None, open_timeout=30) as ws:
        wire.Hello.read(await asyncio.wait_for(ws.recv(), 30))
        if behaviour == "garbage":
            not_an_id = wire.encode({**wire.Start().to_map(), "id": 5})      # a start whose id is no string
            for frame in (b"\xc1", "text", msgpack.packb([1]), not_an_id):
                await ws.send(frame)
                reply = wire.read(await asyncio.wait_for(ws.recv(), 30))
                tally.errors[reply.code if isinstance(reply, wire.Error) else "?"] += 1
        sent = time.monotonic()
        text = LONG_TEXT if behaviour in ("cancel", "slow") else rng.choice(TEXTS)
        await ws.send(wire.encode(wire.Start(id="s", text=text, format="s16")))
        expected_seq = 0
        while True:
            message = wire.read(await asyncio.wait_for(ws.recv(), 300))
            if isinstance(message, wire.AudioChunk):
                if message.seq != expected_seq:
                    tally.seq_gaps += 1
                expected_seq = message.seq + 1
                tally.audio_bytes += len(message.audio)
                if expected_seq == 1:
                    tally.first_audio_ms.append((time.monotonic() - sent) * 1000)
                    if behaviour == "cancel":
                        await ws.send(wire.encode(wire.Cancel("s")))
                    elif behaviour == "disconnect":
                        tally.outcomes["disconnected"] += 1
                        return
                if behaviour == "slow":
                    await asyncio.sleep(rng.uniform(0.2, 1.0))
            elif isinstance(message, wire.Ended):
                tally.outcomes[message.reason] += 1
                return
            elif isinstance(message, wire.Error):
                tally.errors[message.code] += 1
                tally.outcomes["error"] += 1
                return


async def session_loop(url: str, deadline: float, seed: int, tally: Tally) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, 5))     # staggered arrivals
    while time.monotonic() < deadline:
        behaviour = rng.choice(BEHAVIOURS)
        try:
            await one_stream(url, behaviour, rng, tally)
        except ConnectionClosed as exc:
            tally.closes[str(exc.rcvd.code if exc.rcvd else "none")] += 1
        except (InvalidHandshake, OSError, asyncio.TimeoutError) as exc:
            tally.closes[type(exc).__name__] += 1
            await asyncio.sleep(1.0)
        await asyncio.sleep(rng.uniform(0, 1.0))


def info(http: str) -> dict:
    with urllib.request.urlopen(http + "/v1/info", timeout=10) as response:
        return json.load(response)


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    n = str(args.sessions * 2)
    proc = subprocess.Popen(
        [sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0", "--max-queue", n,
         "--max-connections", n, "--max-connections-per-address", n, "--slots", "8",
         # The queue is deep by design here: every stream waits its turn, none gives up.
         "--max-queue-wait", "3600"],
        stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    port = None
    while time.monotonic() < deadline and port is None:
        line = proc.stderr.readline()
        match = re.search(r"listening on ws://127\.0\.0\.1:(\d+)", line)
        if match:
            port = int(match.group(1))
    if port is None:
        proc.kill()
        raise SystemExit("server did not start")
    # Drain its stderr so it never blocks on a full pipe.
    asyncio.get_event_loop().run_in_executor(None, lambda: [None for _ in proc.stderr])
    url = f"ws://127.0.0.1:{port}/v1/stream"
    http = f"http://127.0.0.1:{port}"
    while info(http)["status"] != "ready":
        time.sleep(0.2)
    return proc, url


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", help="a running server (loopback only); default: start one")
    ap.add_argument("--sessions", type=int, default=200)
    ap.add_argument("--duration", type=float, default=180.0, help="seconds")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    return asyncio.run(run(args))


async def run(args: argparse.Namespace) -> int:
    proc = None
    if args.url:
        host = urlsplit(args.url).hostname or ""
        if host != "localhost" and not ipaddress.ip_address(host).is_loopback:
            raise SystemExit(f"refusing to load {host}: only loopback targets are allowed")
        url = args.url
    else:
        proc, url = start_server(args)
    http = "http" + url[2:].split("/v1/")[0]
    before = info(http)
    tally = Tally()
    started = time.monotonic()
    deadline = started + args.duration
    tasks = [asyncio.create_task(session_loop(url, deadline, args.seed * 100_000 + i, tally))
             for i in range(args.sessions)]
    await asyncio.wait(tasks, timeout=args.duration + 320)
    for task in tasks:
        task.cancel()
    wall = time.monotonic() - started
    await asyncio.sleep(2)
    after = info(http)
    first = np.array(tally.first_audio_ms) if tally.first_audio_ms else np.zeros(1)
    report = {
        "sessions": args.sessions,
        "duration_s": round(wall, 1),
        "outcomes": dict(tally.outcomes),
        "streams_completed": tally.outcomes["done"],
        "sequence_gaps": tally.seq_gaps,
        "errors_by_code": dict(tally.errors),
        "closes": dict(tally.closes),
        "audio_s_received": round(tally.audio_bytes / 2 / 22050, 1),
        "first_audio_ms": {q: round(float(np.percentile(first, q)), 1) for q in (50, 90, 95, 99)},
        "server_rss_mb": {"start": before.get("rss_mb"), "end": after.get("rss_mb")},
        "server_after": {k: after[k] for k in ("status", "sessions", "streams_open", "active", "queued")},
    }
    print(json.dumps(report, indent=2))
    if proc is not None:
        proc.terminate()
        proc.wait(30)
    return 0 if tally.seq_gaps == 0 and after["status"] == "ready" else 1


if __name__ == "__main__":
    raise SystemExit(main())
