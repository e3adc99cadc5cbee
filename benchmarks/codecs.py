"""Codec benchmark: what each output format costs in bytes, first audio and CPU.

1. Bytes and encoder CPU: one long real utterance (the Piper voice, fetched from the server as
   float32) goes through `codecs.OutputPipeline` in 160 ms chunks, as a VoxCPM2 stream would
   deliver it, at 48 kHz and 24 kHz: bytes per audio second and encoder CPU seconds (this
   thread's) per audio second, i.e. how many times faster than real time one stream encodes.
2. First audio: a real server in a child process; the same text as a protocol v1 stream in
   each format, rounds in shuffled order, time from `start` sent to the first `chunk` received;
   p50 per format and its difference from s16's.

    python -m benchmarks.codecs --engine piper --rounds 15 --json docs/bench-codecs.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import time
from typing import Any

import numpy as np

from vox_ws import wire
from vox_ws.codecs import CODECS, OutputPipeline

from . import ROOT, module_command
from ._transport_server import VOXCPM_CHUNK_S, bench_engine, run_server

FORMATS = ("s16", "opus", "opus_packets", "mp3", "aac", "flac", "wav")
RATES = (48_000, 24_000)
UTTERANCE = ("Speech on a phone over a mobile network needs few bytes. This long passage is read aloud once, "
             "then encoded in every format the server offers, chunk by chunk, as a stream would be. "
             "Numbers like these decide whether a page on the open internet can play a voice live.")
FIRST_AUDIO_TEXT = "Hello! How quickly does the first audio arrive in each format?"
CHUNK_S = VOXCPM_CHUNK_S          # encoded in the chunks a VoxCPM2 stream would bring


async def _speak(url: str, text: str, fmt: str,
                 rate: int | None) -> tuple[float, list[wire.AudioChunk], wire.Ended]:
    """(seconds to the first chunk, chunks, end) of one protocol v1 stream."""
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, compression=None) as ws:
        wire.Hello.read(await ws.recv())
        start = wire.Start(id="s", text=text, format=fmt, sample_rate=rate or None)
        sent = time.monotonic()
        await ws.send(wire.encode(start))
        first = None
        chunks = []
        while True:
            message = wire.read(await ws.recv())
            if isinstance(message, wire.AudioChunk):
                first = first if first is not None else time.monotonic() - sent
                chunks.append(message)
            elif isinstance(message, wire.Ended):
                return first, chunks, message
            elif isinstance(message, wire.Error):
                raise RuntimeError(message)


def encoding_costs(pcm: np.ndarray, rate: int) -> dict[str, dict[str, float]]:
    out = {}
    step = int(CHUNK_S * rate)
    seconds = pcm.size / rate
    for fmt in FORMATS:
        if fmt in CODECS:                       # the first encoder of a kind builds its tables
            warm = OutputPipeline(fmt, rate)
            warm.encode(pcm[:step])
            warm.finish()
        start = time.thread_time()
        pipeline = OutputPipeline(fmt, rate) if fmt in CODECS else None
        if pipeline is None:                    # raw s16: what the scheduler thread packs
            from vox_ws.audio import pcm_to_bytes

            size = sum(len(pcm_to_bytes(pcm[i:i + step], fmt)) for i in range(0, pcm.size, step))
        else:
            size = sum(len(pipeline.encode(pcm[i:i + step]).data) for i in range(0, pcm.size, step))
            size += len(pipeline.finish().data)
        cpu = time.thread_time() - start
        out[fmt] = {"bytes_per_audio_s": round(size / seconds), "kbit_s": round(size * 8 / seconds / 1000, 1),
                    "cpu_s_per_audio_s": round(cpu / seconds, 5), "x_real_time": round(seconds / cpu) if cpu else None}
    return out


async def first_audio(url: str, rate: int, rounds: int) -> dict[str, dict[str, float]]:
    times: dict[str, list[float]] = {fmt: [] for fmt in FORMATS}
    for _ in range(2):                                   # warm every path once
        for fmt in FORMATS:
            await _speak(url, FIRST_AUDIO_TEXT, fmt, rate)
    for _ in range(rounds):
        order = list(FORMATS)
        random.shuffle(order)
        for fmt in order:
            first, _, _ = await _speak(url, FIRST_AUDIO_TEXT, fmt, rate)
            times[fmt].append(first * 1000)
    base = float(np.median(times["s16"]))
    return {fmt: {"p50_ms": round(float(np.median(v)), 1), "over_s16_ms": round(float(np.median(v)) - base, 1)}
            for fmt, v in times.items()}


def serve(engine_name: str, port_file: str) -> None:
    run_server(bench_engine(engine_name), 0, port_file=port_file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("piper", "tone"), default="piper")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port-file", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port_file)
        return 0
    import os
    import tempfile

    port_file = os.path.join(tempfile.mkdtemp(), "port")
    proc = subprocess.Popen(module_command("codecs", "--serve", args.engine, "--port-file", port_file),
                            stdout=subprocess.DEVNULL, cwd=ROOT)
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(port_file) or not open(port_file).read():
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.2)
        url = f"ws://127.0.0.1:{open(port_file).read()}/v1/stream"
        results: dict[str, Any] = {"engine": args.engine, "rounds": args.rounds, "chunk_s": CHUNK_S, "rates": {}}
        for rate in RATES:
            _, chunks, _ = asyncio.run(_speak(url, UTTERANCE, "f32", rate))
            # Three readings of the utterance: long enough that timer noise does not count.
            pcm = np.tile(np.frombuffer(b"".join(c.audio for c in chunks), "<f4"), 3)
            figures = {"utterance_s": round(pcm.size / rate, 2), "encoding": encoding_costs(pcm, rate),
                       "first_audio": asyncio.run(first_audio(url, rate, args.rounds))}
            results["rates"][str(rate)] = figures
            _print(rate, figures)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=2)
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


def _print(rate: int, figures: dict[str, Any]) -> None:
    s16 = figures["encoding"]["s16"]["bytes_per_audio_s"]
    print(f"\n{rate} Hz ({figures['utterance_s']} s of speech)")
    print(f"{'format':14}{'kbit/s':>8}{'of s16':>8}{'encode x RT':>13}{'first p50':>11}{'vs s16':>9}")
    for fmt in FORMATS:
        enc, first = figures["encoding"][fmt], figures["first_audio"][fmt]
        print(f"{fmt:14}{enc['kbit_s']:>8}{enc['bytes_per_audio_s'] / s16:>8.3f}{enc['x_real_time'] or 0:>13}"
              f"{first['p50_ms']:>11}{first['over_s16_ms']:>+9}")


if __name__ == "__main__":
    raise SystemExit(main())
