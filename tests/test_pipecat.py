"""vox-ws in a real Pipecat pipeline (Pipecat's own PipelineWorker and WorkerRunner, an LLM-like
text source, a frame-collecting sink) against a real vox-ws server with the Piper voice."""

from __future__ import annotations

import asyncio
import socket
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import pytest
from pipecat.frames.frames import (
    EndFrame,
    ErrorFrame,
    Frame,
    InterruptionFrame,
    LLMFullResponseEndFrame,
    LLMFullResponseStartFrame,
    LLMTextFrame,
    TTSAudioRawFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.pipeline.pipeline import Pipeline
from pipecat.pipeline.worker import PipelineParams, PipelineWorker
from pipecat.processors.frame_processor import FrameDirection, FrameProcessor
from pipecat.workers.runner import WorkerRunner

from conftest import wait_idle, wait_until
from vox_ws.clients.pipecat import VoxWSTTSService
from vox_ws.engines.piper import PiperEngine
from vox_ws.wire import Speech

pytestmark = pytest.mark.frameworks

RATE = 24_000
WAIT_S = 60.0


class Sink(FrameProcessor):
    """The end of the pipeline: every frame that reaches it, with when it did."""

    def __init__(self) -> None:
        super().__init__()
        self.frames: list[tuple[float, Frame]] = []
        self._arrived = asyncio.Event()

    async def process_frame(self, frame: Frame, direction: FrameDirection) -> None:
        await super().process_frame(frame, direction)
        if direction == FrameDirection.DOWNSTREAM:
            self.frames.append((time.monotonic(), frame))
            self._arrived.set()
        await self.push_frame(frame, direction)

    def of(self, kind: type, context_id: str | None = None) -> list[Frame]:
        return [f for _, f in self.frames if isinstance(f, kind)
                and (context_id is None or getattr(f, "context_id", None) == context_id)]

    async def wait_for(self, test, timeout: float = WAIT_S) -> Frame:
        deadline = time.monotonic() + timeout
        while True:
            for _, frame in self.frames:
                if test(frame):
                    return frame
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                kinds = [type(f).__name__ for _, f in self.frames][-20:]
                raise AssertionError(f"no such frame in {timeout}s; last frames: {kinds}")
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), remaining)
            except asyncio.TimeoutError:
                pass


@asynccontextmanager
async def pipeline(url: str, **settings: Any) -> AsyncIterator[tuple[PipelineWorker, VoxWSTTSService, Sink]]:
    tts = VoxWSTTSService(url=url, reconnect_backoff_min_wait=0.2, reconnect_backoff_max_wait=0.5, **settings)
    sink = Sink()
    worker = PipelineWorker(Pipeline([tts, sink]), params=PipelineParams(audio_out_sample_rate=RATE),
                            cancel_on_idle_timeout=False)
    started = asyncio.Event()

    @worker.event_handler("on_pipeline_started")
    async def _started(worker, frame):
        started.set()

    runner = WorkerRunner(handle_sigint=False)
    await runner.add_workers(worker)
    running = asyncio.create_task(runner.run())
    await asyncio.wait_for(started.wait(), WAIT_S)
    try:
        yield worker, tts, sink
    finally:
        await worker.queue_frame(EndFrame())
        try:
            await asyncio.wait_for(running, 20)
        except asyncio.TimeoutError:
            await runner.cancel()


async def say(worker: PipelineWorker, words: list[str], pause_s: float = 0.0) -> None:
    """One LLM turn, its text token by token."""
    await worker.queue_frame(LLMFullResponseStartFrame())
    for word in words:
        await worker.queue_frame(LLMTextFrame(word))
        if pause_s:
            await asyncio.sleep(pause_s)
    await worker.queue_frame(LLMFullResponseEndFrame())


def audio_s(frames: list[Frame]) -> float:
    return sum(len(f.audio) // 2 for f in frames) / RATE


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(PiperEngine(), slots=2)


TURN = "Hello from a Pipecat pipeline. The first sentence is spoken while the rest still streams in. ".split(" ")


async def test_audio_arrives_before_the_last_text_is_sent(server):
    async with pipeline(server.url) as (worker, tts, sink):
        await worker.queue_frame(LLMFullResponseStartFrame())
        # The turn's last words are held back until audio has come: it must come without them.
        *first_words, last_word = TURN
        for word in first_words:
            await worker.queue_frame(LLMTextFrame(word + " "))
        await sink.wait_for(lambda f: isinstance(f, TTSAudioRawFrame))
        await worker.queue_frame(LLMTextFrame(last_word + " "))
        await worker.queue_frame(LLMFullResponseEndFrame())
        stopped = await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame))
        audio = sink.of(TTSAudioRawFrame, stopped.context_id)
        assert all(f.sample_rate == RATE and f.num_channels == 1 for f in audio)
        assert 3.0 < audio_s(audio) < 12.0
        # Piper gives true word times: Pipecat's spoken text is built from them, word by word.
        assert tts.word_timestamps
        spoken = [f.text.strip() for f in sink.of(TTSTextFrame)]
        assert spoken == [w for w in TURN if w]
        assert not sink.of(ErrorFrame)
    assert (await wait_idle(server))["streams_open"] == 0


async def test_an_interruption_stops_the_audio_cancels_the_stream_and_the_next_turn_speaks(server):
    heard: list[tuple[str, dict]] = []
    long_turn = ("This reply is long enough to be interrupted half way. " * 6).split(" ")
    async with pipeline(server.url) as (worker, tts, sink):

        @tts.event_handler("on_heard")
        async def _heard(service, context_id, report):
            heard.append((context_id, report))

        await say(worker, [w + " " for w in long_turn])
        first = await sink.wait_for(lambda f: isinstance(f, TTSAudioRawFrame))
        interrupted = first.context_id
        await worker.queue_frame(InterruptionFrame())
        await sink.wait_for(lambda f: isinstance(f, InterruptionFrame))
        count_at_interruption = len(sink.of(TTSAudioRawFrame, interrupted))
        # The server stream is cancelled and its slot freed.
        info = await wait_idle(server)
        assert info["streams_open"] == 0 and info["active"] == 0, info
        await wait_until(lambda: heard)
        ((heard_id, report),) = heard
        assert heard_id == interrupted and report["audio_s"] > 0
        # The next turn speaks, and nothing more of the interrupted one reaches the sink.
        await say(worker, ["And ", "now ", "the ", "next ", "turn."])
        stopped = await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame) and f.context_id != interrupted)
        assert audio_s(sink.of(TTSAudioRawFrame, stopped.context_id)) > 0.5
        assert len(sink.of(TTSAudioRawFrame, interrupted)) == count_at_interruption


async def test_two_turns_in_a_row_share_one_socket(server):
    async with pipeline(server.url) as (worker, tts, sink):
        socket_before = None
        contexts = []
        # Each turn's text in one piece, two sentences: Pipecat hands them over one by one,
        # and they are spoken as two sentences, not run together ("turn.It").
        for text in ("The first turn. It has two sentences.", "The second turn."):
            await say(worker, [text])
            stopped = await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame) and f.context_id not in contexts)
            contexts.append(stopped.context_id)
            socket_before = socket_before or tts._websocket
            assert tts._websocket is socket_before
            assert audio_s(sink.of(TTSAudioRawFrame, stopped.context_id)) > 0.3
            words = [f.text.strip() for f in sink.of(TTSTextFrame) if f.context_id == stopped.context_id]
            assert words == text.split()
        assert len(set(contexts)) == 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_server_restart_is_survived_by_reconnecting(start_server):
    port = free_port()
    first = start_server(PiperEngine(), port=port)
    async with pipeline(first.url) as (worker, tts, sink):
        await say(worker, ["Before the restart."])
        before = await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame))
        await asyncio.to_thread(first.stop)
        second = start_server(PiperEngine(), port=port)
        await wait_until(lambda: tts._websocket is not None and tts._websocket.state.name == "OPEN")
        await say(worker, ["After the restart."])
        after = await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame) and f.context_id != before.context_id)
        assert audio_s(sink.of(TTSAudioRawFrame, after.context_id)) > 0.3
        assert second.server.metrics is not None


async def test_pronunciations_reach_the_server_and_the_spoken_text_keeps_the_words_sent(server):
    speech = Speech(word_timestamps=True, pronunciations=[{"match": "New York", "say": "Noo Yawk"}])
    async with pipeline(server.url, speech=speech) as (worker, tts, sink):
        await say(worker, ["I ", "love ", "New ", "York. "])
        await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame))
        assert [f.text.strip() for f in sink.of(TTSTextFrame)] == ["I", "love", "New York."]
        assert not sink.of(ErrorFrame)


@pytest.mark.hardening
async def test_a_server_chunk_past_a_second_of_audio_is_a_protocol_violation(server):
    """Hardening VII, 4: the Pipecat service connected with no frame bound and took whatever
    the server sent. Its socket is now bounded (`wire.MAX_SERVER_FRAME_BYTES`), its decode too
    (`wire.decode`), and a chunk of more than 1 s of the engine's audio can make (4 s at the
    slowest speed; a real WebSocket server on loopback sending 5 s) closes the connection as a
    protocol violation: the turn ends, with
    none of that audio (the error goes upstream, as Pipecat's errors do). A real server then speaks."""
    import msgpack

    from attackers import hostile_server
    from vox_ws import wire

    async def answer(ws) -> None:
        await ws.send(msgpack.packb({"type": "hello", "protocol": 1, "sample_rate": RATE, "features": [],
                                     "limits": {}}))
        while (start := msgpack.unpackb(await ws.recv()))["type"] != "start":
            pass
        sid = start["id"]
        await ws.send(msgpack.packb({"type": "start", "id": sid, "sample_rate": RATE, "format": "s16"}))
        await ws.send(msgpack.packb({"type": "chunk", "id": sid, "seq": 0, "audio": bytes(5 * 2 * RATE)}))
        await ws.wait_closed()

    with hostile_server(answer) as url:
        async with pipeline(url) as (worker, tts, sink):
            await wait_until(lambda: tts._websocket is not None)
            assert tts._websocket.protocol.max_message_size == wire.MAX_SERVER_FRAME_BYTES
            await say(worker, ["Hello."])
            await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame))       # ended (its error upstream)
            assert not [f for _, f in sink.frames if isinstance(f, TTSAudioRawFrame)]
    async with pipeline(server.url) as (worker, tts, sink):
        await say(worker, ["Hello again."])
        done = await sink.wait_for(lambda f: isinstance(f, TTSStoppedFrame))
        assert audio_s(sink.of(TTSAudioRawFrame, done.context_id)) > 0.3
