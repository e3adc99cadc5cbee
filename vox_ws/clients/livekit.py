"""vox-ws as a LiveKit Agents TTS (the `livekit` extra: `pip install '.[livekit]'` in a checkout).

    from vox_ws.clients import livekit as vox_ws

    session = AgentSession(stt=..., llm=..., tts=vox_ws.TTS(url="ws://127.0.0.1:8765/v1/stream"))

Built as LiveKit's current plugins are (Cartesia's is the model): pooled connections
(`utils.ConnectionPool`, one request on a connection at a time), `synthesize()` returning a
`ChunkedStream` (one vox-ws stream with the whole text) and `stream()` a `SynthesizeStream`
(one input-streaming vox-ws stream: `push_text` -> `chunk`; `flush` or `end_input` -> `end`, as
LiveKit 1.8 speaks one segment per stream; the stream's `end` closes the segment). Audio goes
through LiveKit's `AudioEmitter` as 16-bit PCM at the TTS's rate. `aclose()` (or LiveKit's
interruption) cancels the server stream:
its slot is freed before the next step. Word timings go to `push_timed_transcript` only where
the server's engine has true ones (`Speech(word_timestamps=True)` and the server says so in `hello`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from livekit.agents import APIConnectionError, APIConnectOptions, APIError, APITimeoutError, tts, utils
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, TimedString

from .. import wire
from .v1 import Client, ConnectionLost, VoxError, open_client

# A connection idle this long is not reused (the server closes idle connections itself).
MAX_IDLE_S = 50.0


@dataclass
class _Options:
    url: str
    token: str | None
    sample_rate: int
    speech: wire.Speech = field(default_factory=wire.Speech)

    def stream_fields(self, words: bool) -> wire.Speech:
        """The stream's `start`: 16-bit PCM at the TTS's rate; word timings where wanted and given."""
        return replace(self.speech, format="s16", sample_rate=self.sample_rate, word_timestamps=words)


class TTS(tts.TTS):
    """A vox-ws server as a LiveKit TTS.

    `url` (ws://HOST:PORT/v1/stream), `token`, `voice` (None: the engine's default),
    `sample_rate` (the server resamples), and `speech` (`vox_ws.wire.Speech`: every other field
    of a v1 `start`, as the Python client takes it: `options` (engine options), `speed` (0.25-4,
    pitch kept), `instructions` (VoxCPM2), `language`, `volume`, `pronunciations`,
    `word_timestamps` (aligned transcripts, where the server times words: Piper's own,
    VoxCPM2's by the aligner in English), ...).
    """

    def __init__(self, *, url: str = "ws://127.0.0.1:8765/v1/stream", token: str | None = None,
                 voice: str | None = None, sample_rate: int = 24000, speech: wire.Speech | None = None) -> None:
        speech = speech or wire.Speech()
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=speech.word_timestamps),
                         sample_rate=sample_rate, num_channels=1)
        self._opts = _Options(url=url, token=token, sample_rate=sample_rate,
                              speech=speech if voice is None else replace(speech, voice=voice))
        self._pool = utils.ConnectionPool[Client](connect_cb=self._connect, close_cb=self._close,
                                                 max_session_duration=MAX_IDLE_S, mark_refreshed_on_get=True)

    @property
    def model(self) -> str:
        return "vox-ws"

    @property
    def provider(self) -> str:
        return "vox-ws"

    async def _connect(self, timeout: float) -> Client:
        try:
            client = await asyncio.wait_for(open_client(self._opts.url, token=self._opts.token), timeout)
        except asyncio.TimeoutError:
            raise APITimeoutError() from None
        except (OSError, VoxError) as e:
            raise APIConnectionError(f"cannot connect to vox-ws: {e}") from None
        except Exception as e:  # noqa: BLE001 - a refused handshake (401, 503) and the like
            raise APIConnectionError(f"cannot connect to vox-ws: {type(e).__name__}: {e}") from None
        if self._opts.speech.word_timestamps and "word_timestamps" not in client.hello.features:
            # No true timings from this engine: no aligned transcript rather than invented times.
            self._capabilities.aligned_transcript = False
        return client

    async def _close(self, client: Client) -> None:
        await client.close()

    async def _acquire(self, timeout: float) -> Client:
        """A pooled connection that is still open."""
        while True:
            client = await self._pool.get(timeout=timeout)
            if client.ws.close_code is None:
                return client
            self._pool.remove(client)

    def prewarm(self) -> None:
        self._pool.prewarm()

    def update_options(self, *, voice: str | None = None, speed: float | None = None,
                       instructions: str | None = None, options: dict[str, Any] | None = None) -> None:
        changes = {"voice": voice, "speed": speed, "instructions": instructions,
                   "options": None if options is None else dict(options)}
        self._opts.speech = replace(self._opts.speech, **{k: v for k, v in changes.items() if v is not None})

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> "ChunkedStream":
        return ChunkedStream(tts=self, input_text=text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> "SynthesizeStream":
        return SynthesizeStream(tts=self, conn_options=conn_options)

    async def aclose(self) -> None:
        await self._pool.aclose()

    def _words_wanted(self, client: Client) -> bool:
        return self._opts.speech.word_timestamps and "word_timestamps" in client.hello.features


class ChunkedStream(tts.ChunkedStream):
    """One text, one vox-ws stream; audio as it is generated."""

    def __init__(self, *, tts: TTS, input_text: str, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, input_text=input_text, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._opts.sample_rate, num_channels=1,
                                  mime_type="audio/pcm")
        client = await self._tts._acquire(self._conn_options.timeout)
        stream = None
        try:
            with _api_errors():
                stream = await client.start_stream(self._input_text,
                                                   self._opts.stream_fields(self._tts._words_wanted(client)))
                async for message in stream.events():
                    _emit(output_emitter, message)
                output_emitter.flush()
        finally:
            await _release(self._tts, client, stream)


class SynthesizeStream(tts.SynthesizeStream):
    """Text pushed as it comes (an LLM's tokens) to one input-streaming vox-ws stream; the
    first `flush()` (or `end_input()`) ends the text, and the segment closes once its audio is out."""

    def __init__(self, *, tts: TTS, conn_options: APIConnectOptions) -> None:
        super().__init__(tts=tts, conn_options=conn_options)
        self._tts: TTS = tts
        self._opts = replace(tts._opts)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        output_emitter.initialize(request_id=utils.shortuuid(), sample_rate=self._opts.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=True)
        client = await self._tts._acquire(self._conn_options.timeout)
        stream = None
        try:
            with _api_errors():
                stream = await client.open_stream(self._opts.stream_fields(self._tts._words_wanted(client)))

                async def send_input() -> None:
                    # LiveKit 1.8 speaks one segment per SynthesizeStream and drops text pushed
                    # after a flush: its flush ends this stream's text (`end`, which speaks the rest).
                    async for data in self._input_ch:
                        if isinstance(data, self._FlushSentinel):
                            break
                        self._mark_started()
                        await stream.send_text(data)
                    await stream.end()

                async def receive() -> None:
                    started = False
                    async for message in stream.events():
                        if isinstance(message, (wire.AudioChunk, wire.Words)) and not started:
                            output_emitter.start_segment(segment_id=utils.shortuuid())
                            started = True
                        _emit(output_emitter, message)
                    if started:
                        output_emitter.end_segment()

                sender = asyncio.create_task(send_input())
                try:
                    await receive()
                    await sender
                finally:
                    await utils.aio.gracefully_cancel(sender)
        finally:
            await _release(self._tts, client, stream)


@contextlib.contextmanager
def _api_errors() -> Iterator[None]:
    """vox-ws's errors as LiveKit's: a lost connection is a connection error (LiveKit retries),
    the server's refusals an API error, retryable as the server says."""
    try:
        yield
    except (ConnectionLost, OSError) as e:
        raise APIConnectionError(f"vox-ws: {e}") from None
    except VoxError as e:
        hint = f" (retry after {e.retry_after_s:g}s)" if e.retry_after_s is not None else ""
        raise APIError(f"vox-ws {e.code}: {e.message}{hint}", retryable=e.retryable) from None


def _emit(output_emitter: tts.AudioEmitter, message: wire.ServerMessage) -> None:
    if isinstance(message, wire.AudioChunk):
        output_emitter.push(message.audio)
    elif isinstance(message, wire.Words):
        output_emitter.push_timed_transcript([TimedString(w["word"] + " ", start_time=w["start_s"], end_time=w["end_s"])
                                              for w in message.words])


async def _release(tts_: TTS, client: Client, stream: Any) -> None:
    """Back to the pool; a stream left early (aclose, an interruption, an error) is cancelled
    first, so the server frees its slot at once."""
    if stream is not None and not stream.finished and client.ws.close_code is None:
        try:
            await stream.cancel()
        except VoxError:
            pass
    if client.ws.close_code is None:
        tts_._pool.put(client)
    else:
        tts_._pool.remove(client)
