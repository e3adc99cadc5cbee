"""What the framework layers add: first audio through each integration against the raw protocol,
on one server and one text, and how quickly audio stops after an interruption.

A real server (Piper, or the tone engine) runs in a child process with the Wyoming door open.
Each round takes every path once, in shuffled order, one at a time:

    v1            protocol v1 `start` with the text            -> first `chunk`
    v1-input      protocol v1 input streaming (start, chunk, end) -> first `chunk`
    pipecat       a Pipecat pipeline (VoxWSTTSService -> sink): an LLM turn's text -> first TTSAudioRawFrame
    livekit       LiveKit's TTS.synthesize(text)                -> first SynthesizedAudio
    livekit-stream LiveKit's TTS.stream(): push_text, flush     -> first SynthesizedAudio
    wyoming       Wyoming `synthesize`                          -> first `audio-chunk`
    wyoming-stream Wyoming synthesize-start/chunk/stop          -> first `audio-chunk`

Interruption, on a long text once audio flows: Pipecat's InterruptionFrame -> the last audio frame
of that context at the sink, and -> the server's `end` (cancelled: the slot is free); LiveKit's
`aclose()` -> returned, and -> the server reports no open stream; raw v1 `cancel` -> `end`.

    python -m benchmarks.integrations --engine piper --rounds 10 --json docs/bench-integrations.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

from vox_ws import wire

from . import ROOT, free_port, module_command

TEXT = "Hello! This is the first sentence of the reply. A second one follows it."
LONG = "This reply is long enough to be interrupted while it is spoken, sentence after sentence. " * 6
RATE = 24_000


# ---------------------------------------------------------------------------- first audio


async def v1(url: str, stream_input: bool = False) -> float:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, compression=None) as ws:
        wire.Hello.read(await ws.recv())
        sent = time.monotonic()
        if stream_input:
            await ws.send(wire.encode(wire.Start(id="s", stream_input=True, format="s16", sample_rate=RATE)))
            await ws.send(wire.encode(wire.Chunk("s", TEXT)))
            await ws.send(wire.encode(wire.End("s")))
        else:
            await ws.send(wire.encode(wire.Start(id="s", text=TEXT, format="s16", sample_rate=RATE)))
        first = None
        while True:
            message = wire.read(await ws.recv())
            if isinstance(message, wire.AudioChunk) and first is None:
                first = time.monotonic() - sent
            elif isinstance(message, (wire.Ended, wire.Error)):
                return first


class _PipecatRun:
    """A Pipecat pipeline (the vox-ws service, then a sink that notes every frame's arrival)."""

    def __init__(self, url: str) -> None:
        from pipecat.frames.frames import Frame
        from pipecat.processors.frame_processor import FrameDirection, FrameProcessor

        from vox_ws.clients.pipecat import VoxWSTTSService

        run = self

        class Sink(FrameProcessor):
            async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
                await super().process_frame(frame, direction)
                if direction == FrameDirection.DOWNSTREAM:
                    run.frames.append((time.monotonic(), frame))
                await self.push_frame(frame, direction)

        self.frames: list[tuple[float, Any]] = []
        self.heard_at: float | None = None
        self.tts = VoxWSTTSService(url=url)
        self.sink = Sink()

        @self.tts.event_handler("on_heard")
        async def _heard(service, context_id, report):
            run.heard_at = time.monotonic()

    async def __aenter__(self) -> "_PipecatRun":
        from pipecat.pipeline.pipeline import Pipeline
        from pipecat.pipeline.worker import PipelineParams, PipelineWorker
        from pipecat.workers.runner import WorkerRunner

        self.worker = PipelineWorker(Pipeline([self.tts, self.sink]), params=PipelineParams(audio_out_sample_rate=RATE),
                                     cancel_on_idle_timeout=False)
        started = asyncio.Event()

        @self.worker.event_handler("on_pipeline_started")
        async def _started(worker, frame):
            started.set()

        self.runner = WorkerRunner(handle_sigint=False)
        await self.runner.add_workers(self.worker)
        self.running = asyncio.create_task(self.runner.run())
        await asyncio.wait_for(started.wait(), 60)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        from pipecat.frames.frames import EndFrame

        await self.worker.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(self.running, 20)
        except asyncio.TimeoutError:
            await self.runner.cancel()

    async def turn(self, text: str) -> float:
        from pipecat.frames.frames import LLMFullResponseEndFrame, LLMFullResponseStartFrame, LLMTextFrame

        self.frames.clear()
        sent = time.monotonic()
        await self.worker.queue_frame(LLMFullResponseStartFrame())
        await self.worker.queue_frame(LLMTextFrame(text))
        await self.worker.queue_frame(LLMFullResponseEndFrame())
        return sent

    async def first_audio_after(self, since: float, timeout: float = 60) -> tuple[float, Any]:
        from pipecat.frames.frames import TTSAudioRawFrame

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for at, frame in self.frames:
                if at >= since and isinstance(frame, TTSAudioRawFrame):
                    return at, frame
            await asyncio.sleep(0.002)
        raise TimeoutError("no audio from Pipecat")

    async def done(self, timeout: float = 60) -> None:
        from pipecat.frames.frames import TTSStoppedFrame

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not any(isinstance(f, TTSStoppedFrame) for _, f in self.frames):
            await asyncio.sleep(0.01)


async def pipecat_first(run: _PipecatRun) -> float:
    sent = await run.turn(TEXT)
    at, _ = await run.first_audio_after(sent)
    await run.done()
    return at - sent


async def livekit_first(url: str, streaming: bool) -> float:
    from vox_ws.clients.livekit import TTS

    voice = TTS(url=url, sample_rate=RATE)
    try:
        sent = time.monotonic()
        first = None
        if streaming:
            stream = voice.stream()
            stream.push_text(TEXT)
            stream.flush()
            stream.end_input()
        else:
            stream = voice.synthesize(TEXT)
        async for _ in stream:
            first = first if first is not None else time.monotonic() - sent
        await stream.aclose()
        return first
    finally:
        await voice.aclose()


async def wyoming_first(port: int, streaming: bool) -> float:
    from wyoming.audio import AudioChunk, AudioStop
    from wyoming.client import AsyncTcpClient
    from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart, SynthesizeStop, SynthesizeStopped

    async with AsyncTcpClient("127.0.0.1", port) as client:
        sent = time.monotonic()
        if streaming:
            await client.write_event(SynthesizeStart().event())
            await client.write_event(SynthesizeChunk(text=TEXT).event())
            await client.write_event(SynthesizeStop().event())
        else:
            await client.write_event(Synthesize(text=TEXT).event())
        first = None
        while True:
            event = await client.read_event()
            if AudioChunk.is_type(event.type) and first is None:
                first = time.monotonic() - sent
            if (SynthesizeStopped.is_type(event.type) if streaming else AudioStop.is_type(event.type)):
                return first


# ---------------------------------------------------------------------------- interruption


async def pipecat_interruption(run: _PipecatRun) -> dict[str, float]:
    from pipecat.frames.frames import InterruptionFrame, TTSAudioRawFrame

    sent = await run.turn(LONG)
    _, first = await run.first_audio_after(sent)
    await asyncio.sleep(0.3)
    run.heard_at = None
    interrupted_at = time.monotonic()
    await run.worker.queue_frame(InterruptionFrame())
    await asyncio.sleep(1.5)
    last = max((at for at, f in run.frames if isinstance(f, TTSAudioRawFrame) and f.context_id == first.context_id),
               default=interrupted_at)
    return {"last_audio_ms": max(0.0, (last - interrupted_at) * 1000),
            "server_end_ms": None if run.heard_at is None else (run.heard_at - interrupted_at) * 1000}


async def livekit_interruption(url: str, http: str) -> dict[str, float]:
    from vox_ws.clients.livekit import TTS

    voice = TTS(url=url, sample_rate=RATE)
    try:
        stream = voice.synthesize(LONG)
        async for _ in stream:
            break
        await asyncio.sleep(0.3)
        closing = time.monotonic()
        await stream.aclose()
        closed = time.monotonic()
        while _info(http)["streams_open"] and time.monotonic() - closing < 10:
            await asyncio.sleep(0.002)
        return {"aclose_ms": (closed - closing) * 1000, "server_free_ms": (time.monotonic() - closing) * 1000}
    finally:
        await voice.aclose()


async def v1_interruption(url: str) -> dict[str, float]:
    from websockets.asyncio.client import connect

    async with connect(url, max_size=None, compression=None) as ws:
        wire.Hello.read(await ws.recv())
        await ws.send(wire.encode(wire.Start(id="s", text=LONG, format="s16", sample_rate=RATE)))
        while not isinstance(wire.read(await ws.recv()), wire.AudioChunk):
            pass
        await asyncio.sleep(0.3)
        cancelled = time.monotonic()
        await ws.send(wire.encode(wire.Cancel("s")))
        last = cancelled
        while True:
            message = wire.read(await ws.recv())
            if isinstance(message, wire.AudioChunk):
                last = time.monotonic()
            if isinstance(message, (wire.Ended, wire.Error)):
                return {"last_audio_ms": (last - cancelled) * 1000,
                        "server_end_ms": (time.monotonic() - cancelled) * 1000}


def _info(http: str) -> dict[str, Any]:
    with urllib.request.urlopen(http + "/v1/info", timeout=5) as response:
        return json.loads(response.read())


# ---------------------------------------------------------------------------- the run


async def measure(url: str, http: str, wyoming_port: int, rounds: int) -> dict[str, Any]:
    first: dict[str, list[float]] = {}
    stops: dict[str, list[dict[str, float]]] = {"pipecat": [], "livekit": [], "v1": []}
    async with _PipecatRun(url) as run:
        paths = {
            "v1": lambda: v1(url),
            "v1-input": lambda: v1(url, stream_input=True),
            "pipecat": lambda: pipecat_first(run),
            "livekit": lambda: livekit_first(url, streaming=False),
            "livekit-stream": lambda: livekit_first(url, streaming=True),
            "wyoming": lambda: wyoming_first(wyoming_port, streaming=False),
            "wyoming-stream": lambda: wyoming_first(wyoming_port, streaming=True),
        }
        for name in paths:                     # warm every path once
            await paths[name]()
        for _ in range(rounds):
            order = list(paths)
            random.shuffle(order)
            for name in order:
                first.setdefault(name, []).append(await paths[name]())
            stops["pipecat"].append(await pipecat_interruption(run))
            stops["livekit"].append(await livekit_interruption(url, http))
            stops["v1"].append(await v1_interruption(url))
    raw = statistics.median(first["v1"])
    return {
        "first_audio_ms": {name: {"p50": round(statistics.median(v) * 1000, 1), "max": round(max(v) * 1000, 1),
                                  "over_v1_p50": round((statistics.median(v) - raw) * 1000, 1)}
                           for name, v in first.items()},
        "interruption_ms": {name: {key: round(statistics.median([r[key] for r in runs if r[key] is not None]), 1)
                                   for key in runs[0]} for name, runs in stops.items()},
    }


def serve(engine_name: str, port: int, wyoming_port: int) -> None:
    from vox_ws.config import Limits, ServerConfig

    from ._transport_server import bench_engine, run_server

    engine = bench_engine(engine_name)
    config = ServerConfig(port=port, slots=engine.max_step_batch, wyoming=f"tcp://127.0.0.1:{wyoming_port}",
                          limits=Limits(max_connections=4096, max_connections_per_address=4096))
    run_server(engine, port, config=config)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("piper", "tone"), default="piper")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--wyoming-port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.wyoming_port)
        return 0
    port, wyoming_port = free_port(), free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen(module_command("integrations", "--serve", args.engine,
                                           "--port", str(port), "--wyoming-port", str(wyoming_port)),
                            stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT)
    try:
        line = proc.stdout.readline()
        if not line.startswith("PORT"):
            log.seek(0)
            raise SystemExit(f"the server did not start: {log.read().decode()[-2000:]}")
        url, http = f"ws://127.0.0.1:{port}/v1/stream", f"http://127.0.0.1:{port}"
        from loguru import logger  # Pipecat logs every frame at debug level

        logger.remove()
        logger.add(sys.stderr, level="WARNING")
        figures = asyncio.run(measure(url, http, wyoming_port, args.rounds))
    finally:
        proc.terminate()
        proc.wait(30)
    results = {"engine": args.engine, "rounds": args.rounds, "text": TEXT, "cpus": os.cpu_count(), **figures}
    print(f"first audio, ms ({args.engine}, {args.rounds} rounds, p50 / max / p50 over raw v1):")
    for name, v in figures["first_audio_ms"].items():
        print(f"  {name:15s} {v['p50']:8.1f} {v['max']:8.1f} {v['over_v1_p50']:+8.1f}")
    print("interruption, ms (p50):")
    for name, v in figures["interruption_ms"].items():
        print(f"  {name:15s} " + "  ".join(f"{k} {x}" for k, x in v.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
