"""`vox-ws bench --rate`: how many real-time listeners a server holds, measured open-loop.

A closed-loop load (N clients, each sending its next request when the last has ended) slows
down with the server and so never sees a queue build up. Here listeners arrive as users do,
at random (a Poisson process) at a given rate whatever the server is doing, each on a
connection of its own with the `websockets` client's default settings, each asking for a text
of 3-15 s of speech. Every listener plays from its first chunk at 1x; whenever its buffer runs
dry before the next chunk arrives it has a gap.

Per rate: first audio p50/p95/p99, the share of streams with no gap over 100 ms (the
continuity criterion of sglang-omni's benchmark), audio seconds per second, and the server's
slot and queue occupancy (sampled from `/v1/load`). The **capacity** is the highest rate with
first audio p95 <= 300 ms and >= 99 % of streams gap-free, and the listeners it gives at once
(on average, each from its arrival until its player has played the last of its audio).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import numpy as np

from .. import wire
from ..audio import bytes_per_sample
from .playback import playback_gaps

SENTENCES = [
    "Sure, I can help with that.",
    "Your appointment is confirmed for Tuesday at ten in the morning.",
    "Let me check the latest status of your order, one moment please.",
    "The weather tomorrow looks sunny, with a high of twenty two degrees.",
    "Thanks for calling, and have a wonderful day!",
    "The train to the city leaves from platform four every twenty minutes.",
    "I have moved your meeting to Thursday afternoon and told the others.",
    "Your balance is three hundred and twelve dollars and forty cents.",
]
# English speech runs at about fifteen characters a second: texts are sized by it.
CHARS_PER_SECOND = 15.0
GAP_S = 0.1                    # a gap longer than this breaks a stream's continuity
TARGET_P95_S = 0.3             # first audio p95 within this ...
TARGET_GAP_FREE = 0.99         # ... and this share of streams gap-free: the rate is held
LOAD_SAMPLE_S = 0.25
LISTENER_TIMEOUT_S = 300.0


def text_of(rng: random.Random, seconds: float) -> str:
    """Sentences until the text is about `seconds` of speech."""
    words: list[str] = []
    while sum(map(len, words)) < seconds * CHARS_PER_SECOND:
        words.append(rng.choice(SENTENCES))
    return " ".join(words)


@dataclass
class Listener:
    started: float
    speech_s: float                   # the length asked for
    first_audio_s: float | None = None
    audio_s: float = 0.0
    longest_gap_s: float = 0.0
    ended: float | None = None
    played_until: float | None = None     # when its player has played the last of it
    error: str | None = None


@dataclass(frozen=True)
class Target:
    """The server measured: its protocol v1 URL, the token it wants, the audio format asked for."""

    url: str
    token: str | None = None
    format: str = "s16"

    @classmethod
    def of(cls, target: "Target | str") -> "Target":
        return target if isinstance(target, Target) else cls(target)

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.token}"} if self.token else None


async def listen(target: Target, listener: Listener, text: str, options: dict[str, Any], source: str | None) -> None:
    """One listener: connect (default client settings), ask for `text`, read to the end."""
    from websockets.asyncio.client import connect

    kwargs: dict[str, Any] = {"local_addr": (source, 0)} if source else {}
    arrivals: list[tuple[float, float]] = []
    try:
        async with connect(target.url, additional_headers=target.headers, **kwargs) as ws:
            hello = wire.Hello.read(await ws.recv())
            width, rate = bytes_per_sample(target.format), hello.sample_rate
            await ws.send(wire.encode(wire.Start(text=text, format=target.format, options=options)))
            async for frame in ws:
                message = wire.read(frame)
                if isinstance(message, wire.AudioChunk):
                    arrivals.append((time.monotonic(), len(message.audio or b"") / width / rate))
                elif isinstance(message, wire.Started) and message.sample_rate:
                    rate = message.sample_rate
                elif isinstance(message, wire.Error):
                    listener.error = message.code
                    break
                elif isinstance(message, wire.Ended):
                    break
    except Exception as exc:  # noqa: BLE001 - counted against the rate, the run goes on
        listener.error = listener.error or type(exc).__name__
    listener.ended = time.monotonic()
    if arrivals:
        gaps = playback_gaps(arrivals)
        listener.first_audio_s = arrivals[0][0] - listener.started
        listener.audio_s = sum(s for _, s in arrivals)
        listener.longest_gap_s = max(gaps, default=0.0)
        listener.played_until = arrivals[0][0] + listener.audio_s + sum(gaps)


@dataclass
class RateResult:
    rate: float
    listeners: list[Listener] = field(default_factory=list)
    load: list[dict[str, Any]] = field(default_factory=list)
    served_s: float = 0.0          # from the first arrival until the server had ended every stream
    wall_s: float = 0.0            # ... until every player had played the last of its audio

    def summary(self) -> dict[str, Any]:
        heard = [x for x in self.listeners if x.first_audio_s is not None and x.error is None]
        first = np.array([x.first_audio_s for x in heard]) * 1000 if heard else np.array([np.nan])
        errors: dict[str, int] = {}
        for x in self.listeners:
            if x.error:
                errors[x.error] = errors.get(x.error, 0) + 1
        gap_free = sum(1 for x in heard if x.longest_gap_s <= GAP_S)
        served = len(self.listeners)
        slots = [s["slots"] for s in self.load if s.get("slots")]
        return {
            "rate_per_s": self.rate,
            "streams": served,
            "first_audio_ms": {f"p{q}": round(float(np.percentile(first, q)), 1) for q in (50, 95, 99)},
            # A failed stream is not gap-free: the share is of every stream that arrived.
            "gap_free_share": round(gap_free / served, 4) if served else None,
            "longest_gap_ms_p99": round(float(np.percentile([x.longest_gap_s for x in heard], 99)) * 1000, 1)
                                  if heard else None,
            "audio_s_per_s": round(sum(x.audio_s for x in heard) / self.served_s, 3) if self.served_s else None,
            "concurrent_listeners": round(self._concurrent(), 2),
            "slots": max(slots) if slots else None,
            "slot_occupancy": round(float(np.mean([s["active"] / s["slots"] for s in self.load if s.get("slots")])), 3)
                              if slots else None,
            "queued_mean": round(float(np.mean([s["queued"] for s in self.load])), 2) if self.load else None,
            "errors": errors,
        }

    def _concurrent(self) -> float:
        """Listeners on average over the run, each from its arrival until its player has played
        the last of its audio (a server faster than real time ends the stream sooner)."""
        if not self.listeners or self.wall_s <= 0:
            return 0.0
        listening = sum(max(x.played_until or 0.0, x.ended or x.started) - x.started for x in self.listeners)
        return listening / self.wall_s


def held(summary: dict[str, Any]) -> bool:
    """Whether a rate's summary is within both targets: first audio p95 and the gap-free share."""
    return bool(summary["streams"] and summary["first_audio_ms"]["p95"] <= TARGET_P95_S * 1000
                and (summary["gap_free_share"] or 0.0) >= TARGET_GAP_FREE)


def capacity(summaries: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The highest rate that held, with the listeners it gave at once; None when none did."""
    held_rates = [s for s in summaries if held(s)]
    if not held_rates:
        return None
    best = max(held_rates, key=lambda s: s["rate_per_s"])
    return {"rate_per_s": best["rate_per_s"], "concurrent_listeners": best["concurrent_listeners"]}


def load_url(url: str) -> str:
    """The server's `/v1/load`, beside its WebSocket endpoint."""
    parts = urlsplit(url)
    return urlunsplit(("https" if parts.scheme == "wss" else "http", parts.netloc, "/v1/load", "", ""))


def _read_load(url: str) -> dict[str, Any] | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.loads(response.read())
    except (OSError, ValueError):
        return None


async def _sample_load(url: str, samples: list[dict[str, Any]], stop: asyncio.Event) -> None:
    while not stop.is_set():
        sample = await asyncio.to_thread(_read_load, url)
        if sample is not None:
            samples.append(sample)
        try:
            await asyncio.wait_for(stop.wait(), LOAD_SAMPLE_S)
        except asyncio.TimeoutError:
            pass


def source_addresses(url: str) -> list[str | None]:
    """On loopback, listeners connect from 127.0.0.2-127.0.0.254 in turn, as if from many
    machines (a server bounds connections per address); elsewhere from this machine's one."""
    host = urlsplit(url).hostname or ""
    if host in ("127.0.0.1", "localhost"):
        return [f"127.0.0.{n}" for n in range(2, 255)]
    return [None]


async def run_rate(target: Target | str, rate: float, duration: float, *, speech_s: tuple[float, float] = (3.0, 15.0),
                   steps_per_s: float | None = None, seed: int = 0) -> RateResult:
    """Listeners arriving at `rate` a second for `duration` seconds; waits for the last to end.
    `steps_per_s`: for an engine whose length is set in steps (VoxCPM2 with random weights
    speaks as long as it is let), each listener's length is set in steps too."""
    target = Target.of(target)
    rng = random.Random(seed)
    result = RateResult(rate)
    sources = source_addresses(target.url)
    arrivals, t = [], rng.expovariate(rate)
    while t < duration:
        arrivals.append(t)
        t += rng.expovariate(rate)
    stop = asyncio.Event()
    sampler = asyncio.create_task(_sample_load(load_url(target.url), result.load, stop))
    began = time.monotonic()
    tasks = []
    for n, at in enumerate(arrivals):
        await asyncio.sleep(max(0.0, began + at - time.monotonic()))
        seconds = rng.uniform(*speech_s)
        listener = Listener(started=time.monotonic(), speech_s=seconds)
        options = {"min_len": round(seconds * steps_per_s), "max_len": round(seconds * steps_per_s)} \
            if steps_per_s else {}
        result.listeners.append(listener)
        tasks.append(asyncio.create_task(asyncio.wait_for(
            listen(target, listener, text_of(rng, seconds), options, sources[n % len(sources)]),
            LISTENER_TIMEOUT_S)))
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)
    for listener, outcome in zip(result.listeners, outcomes):
        if isinstance(outcome, BaseException):
            listener.error = listener.error or type(outcome).__name__
            listener.ended = listener.ended or time.monotonic()
    result.served_s = time.monotonic() - began
    # Until the last player has finished: the listeners are there as long as that.
    result.wall_s = max([began + result.served_s] + [x.played_until or 0.0 for x in result.listeners]) - began
    stop.set()
    await sampler
    return result


async def steps_per_second(target: Target | str) -> float | None:
    """For an engine whose length is set in steps (`min_len` and `max_len`): how many steps make
    a second of audio, from one request of a known length. None for an engine without them."""
    from websockets.asyncio.client import connect

    target = Target.of(target)
    async with connect(target.url, additional_headers=target.headers) as ws:
        hello = wire.Hello.read(await ws.recv())
    if not {"min_len", "max_len"} <= set(hello.options):
        return None                                    # its text sets the length (Piper)
    steps = 20
    listener = Listener(started=time.monotonic(), speech_s=0.0)
    await listen(target, listener, "Measuring.", {"min_len": steps, "max_len": steps}, None)
    if listener.error or not listener.audio_s:
        raise RuntimeError(f"the measuring request failed: {listener.error}")
    return steps / listener.audio_s


def chart(configurations: dict[str, list[dict[str, Any]]], path: str, title: str) -> None:
    """First audio p95 and the gap-free share against the arrival rate, a line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (p95, smooth) = plt.subplots(1, 2, figsize=(10, 4.2), dpi=120)
    for label, summaries in configurations.items():
        rates = [s["rate_per_s"] for s in summaries]
        p95.plot(rates, [s["first_audio_ms"]["p95"] for s in summaries], "o-", label=label)
        smooth.plot(rates, [100 * (s["gap_free_share"] or 0) for s in summaries], "o-", label=label)
    p95.axhline(TARGET_P95_S * 1000, color="grey", linestyle=":", label="target")
    smooth.axhline(100 * TARGET_GAP_FREE, color="grey", linestyle=":", label="target")
    p95.set(xlabel="arrivals per second", ylabel="first audio p95 (ms)", yscale="log")
    smooth.set(xlabel="arrivals per second", ylabel=f"streams without a gap over {GAP_S * 1000:.0f} ms (%)",
               ylim=(0, 101))
    for ax in (p95, smooth):
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def print_header() -> None:
    print(f"{'rate/s':>7} {'streams':>8} {'first p50':>10} {'p95':>8} {'p99':>8} {'gap-free':>9} "
          f"{'listeners':>10} {'slots busy':>11} {'queued':>7} {'audio s/s':>10}  errors")


def print_summary(s: dict[str, Any]) -> None:
    f = s["first_audio_ms"]
    occupancy = "" if s["slot_occupancy"] is None else f"{100 * s['slot_occupancy']:.0f}%"
    print(f"{s['rate_per_s']:>7g} {s['streams']:>8} {f['p50']:>8.0f}ms {f['p95']:>6.0f}ms {f['p99']:>6.0f}ms "
          f"{100 * (s['gap_free_share'] or 0):>8.1f}% {s['concurrent_listeners']:>10.1f} {occupancy:>11} "
          f"{s['queued_mean'] if s['queued_mean'] is not None else float('nan'):>7.1f} "
          f"{s['audio_s_per_s'] or 0:>10.2f}  {s['errors'] or ''}", flush=True)


async def measure(target: Target | str, rates: list[float], duration: float, *, seed: int = 0,
                  quiet: bool = False) -> dict[str, Any]:
    """Every rate in turn against one server: the report (summaries and capacity)."""
    target = Target.of(target)
    steps = await steps_per_second(target)
    summaries = []
    if not quiet:
        print_header()
    for rate in rates:
        summary = (await run_rate(target, rate, duration, steps_per_s=steps, seed=seed)).summary()
        summaries.append(summary)
        if not quiet:
            print_summary(summary)
    return {"url": target.url, "duration_s": duration, "format": target.format, "steps_per_s": steps,
            "rates": summaries, "capacity": capacity(summaries)}


def main(args: argparse.Namespace) -> int:
    rates = [float(x) for x in args.rate.split(",")]
    report = asyncio.run(measure(Target(args.url, args.token, args.format), rates, args.duration, seed=args.seed))
    held = report["capacity"]
    print("capacity: " + (f"{held['rate_per_s']:g} arrivals/s, {held['concurrent_listeners']:.1f} concurrent "
                          f"listeners" if held else "no rate held") +
          f" (first audio p95 <= {TARGET_P95_S * 1000:.0f} ms, >= {100 * TARGET_GAP_FREE:.0f}% of streams gap-free)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    if args.chart:
        chart({args.label or args.url: report["rates"]}, args.chart, "vox-ws open-loop capacity")
    return 0
