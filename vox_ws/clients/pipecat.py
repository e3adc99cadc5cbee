"""vox-ws as a Pipecat TTS service (the `pipecat` extra: `pip install '.[pipecat]'` in a checkout).

    from vox_ws.clients.pipecat import VoxWSTTSService

    tts = VoxWSTTSService(url="ws://127.0.0.1:8765/v1/stream", voice="joe",
                          speech=wire.Speech(speed=1.1, word_timestamps=True))
    pipeline = Pipeline([transport.input(), stt, user_agg, llm, tts, transport.output(), bot_agg])

Built on Pipecat's `WebsocketTTSService`, as its Cartesia and ElevenLabs services are: one
protocol v1 connection, and on it one input-streaming vox-ws stream per Pipecat audio context
(Pipecat's context id is the stream id, so several contexts share the socket).

    run_tts(text, ctx)          -> `start` {stream_input} once per context, then `chunk` {text}
    flush_audio(ctx)            -> `flush`, then `end`: Pipecat flushes a context once its turn
                                   has no more text
    interruption                -> `cancel` of every live context; Pipecat drops their queued
                                   audio at once, and audio still arriving for them is ignored
    server `chunk`              -> TTSAudioRawFrame (s16 at the pipeline's output rate)
    server `words`              -> add_word_timestamps (only engines with true word timings)
    server `end`                -> TTSStoppedFrame; after a cancel, `on_heard` with what was sent
    socket dropped              -> the base class reconnects with back-off; contexts open on the
                                   lost socket end with an error frame

Without word timings (VoxCPM2) Pipecat's own sentence text frames stand for what was spoken.
The server closes a connection that has no stream and sends nothing for its idle time-out
(`hello.limits.idle_timeout_s`, 60 s by default); the service then connects again, as Pipecat's
Cartesia service does after Cartesia's idle time-out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from loguru import logger
from pipecat.frames.frames import ErrorFrame, Frame, TTSAudioRawFrame, TTSStoppedFrame
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import WebsocketTTSService
from websockets.protocol import State

from .. import wire

# How long the server's `hello` may take after the handshake.
HELLO_TIMEOUT_S = 10.0


class VoxWSTTSService(WebsocketTTSService):
    """Streams text to a vox-ws server and audio back, one vox-ws stream per audio context.

    Settings: `url` (ws://HOST:PORT/v1/stream), `token`, `voice` (a built-in or registered voice
    id; None: the engine's default; Pipecat's own setting, so a settings update changes it),
    `sample_rate` (None: the pipeline's output rate), and `speech` (`vox_ws.wire.Speech`: every
    other field of a v1 `start`, as the Python client takes it: `options` (engine options, e.g.
    {"cfg_value": 2.0} for VoxCPM2), `speed`, `instructions`, `language`, `volume`,
    `pronunciations`, `word_timestamps` (word timings where the server's engine has true ones),
    ...; default: `Speech(word_timestamps=True)`). The rest goes to Pipecat's base class.

    Event handlers (besides the base class's): `on_heard(service, context_id, heard)`, after
    an interruption: the server's account of what was sent before the cancel took effect
    (`heard` in protocol v1's `end`: audio_s, text, segments, partial).
    """

    def __init__(self, *, url: str = "ws://127.0.0.1:8765/v1/stream", token: str | None = None,
                 voice: str | None = None, sample_rate: int | None = None, speech: wire.Speech | None = None,
                 **kwargs: Any) -> None:
        # Pipecat hands over sentences without the space after them; vox-ws streams text in,
        # so "Hello!" + "How are you?" would run together and the first sentence's end go
        # unseen until more text came. (Tokens, in token aggregation mode, keep their own spaces.)
        kwargs.setdefault("append_trailing_space", True)
        super().__init__(push_text_frames=True, push_start_frame=True, pause_frame_processing=False,
                         sample_rate=sample_rate, settings=TTSSettings(model="vox-ws", voice=voice, language=None),
                         **kwargs)
        self._url = url
        self._token = token
        self._speech = speech if speech is not None else wire.Speech(word_timestamps=True)
        self.hello: wire.Hello | None = None       # what the server offers, once connected
        self._words = False                       # this server's engine gives true word timings
        self._open: set[str] = set()              # contexts with a live stream on this socket
        self._receive_task: asyncio.Task | None = None
        self._register_event_handler("on_heard")

    def can_generate_metrics(self) -> bool:
        return True

    @property
    def word_timestamps(self) -> bool:
        """Whether word timings are asked for and given (known once connected)."""
        return self._words

    # ------------------------------------------------------------------ connection

    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        await self._connect()

    async def _connect(self) -> None:
        await super()._connect()
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
        try:
            if self._websocket and self._websocket.state is State.OPEN:
                return
            headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
            websocket = await self._websocket_connect(self._url, additional_headers=headers,
                                                      max_size=wire.MAX_SERVER_FRAME_BYTES)
            try:
                hello = wire.Hello.read(await asyncio.wait_for(websocket.recv(), HELLO_TIMEOUT_S))
            except ValueError as exc:
                await websocket.close()
                raise ConnectionError(str(exc)) from None
            self._websocket = websocket
            self.hello = hello
            self._words = self._speech.word_timestamps and "word_timestamps" in hello.features
            # With true word timings, Pipecat builds the spoken text from them; without, from
            # its own sentence text frames.
            self._push_text_frames = not self._words
            await self._call_event_handler("on_connected")
        except Exception as e:  # noqa: BLE001 - Pipecat's convention: report it, the receive loop retries
            self._websocket = None
            await self.push_error(error_msg=f"vox-ws: cannot connect to {self._url}: {e}", exception=e)
            await self._call_event_handler("on_connection_error", f"{e}")

    async def _disconnect_websocket(self) -> None:
        try:
            await self.stop_all_metrics()
            if self._websocket:
                await self._websocket.close()
        except Exception as e:  # noqa: BLE001
            await self.push_error(error_msg=f"vox-ws: error while closing: {e}", exception=e)
        finally:
            self._websocket = None
            await self._end_lost_contexts()
            await self._call_event_handler("on_disconnected")

    async def _receive_messages(self) -> None:
        if self._websocket is None:
            await self._connect_websocket()
            if self._websocket is None:
                raise ConnectionError(f"cannot connect to {self._url}")
        try:
            async for data in self._websocket:
                await self._handle_message(await self._checked(data))
        finally:
            await self._end_lost_contexts()

    async def _checked(self, data: bytes) -> wire.ServerMessage:
        """A frame's message; a frame protocol v1 forbids (past what a server's may cost to
        decode, a chunk of more than a second of audio) closes the connection (1002) and raises,
        and the base class connects again."""
        try:
            message = wire.read(data)
            problem = wire.chunk_problem(message, "s16", self.sample_rate) \
                if isinstance(message, wire.AudioChunk) else None
        except ValueError as exc:
            problem = str(exc)
        if problem is None:
            return message
        if self._websocket is not None:
            await self._websocket.close(1002, "protocol error")
        raise ConnectionError(f"vox-ws: protocol violation: the server sent {problem}"[:300])

    async def _end_lost_contexts(self) -> None:
        """Streams die with their socket: their contexts end now, not after Pipecat's
        quiet time-out."""
        for context_id in list(self._open):
            self._open.discard(context_id)
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, ErrorFrame(error="vox-ws: connection lost"))
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)

    async def _send(self, message: wire.ClientMessage) -> None:
        if not self._websocket or self._websocket.state is not State.OPEN:
            raise ConnectionError("not connected")
        await self._websocket.send(wire.encode(message))

    # ------------------------------------------------------------------ server -> Pipecat

    async def _handle_message(self, message: wire.ServerMessage) -> None:
        context_id = getattr(message, "id", None)
        if isinstance(message, wire.AudioChunk):
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, TTSAudioRawFrame(
                    audio=message.audio, sample_rate=self.sample_rate,
                    num_channels=1, context_id=context_id))
        elif isinstance(message, wire.Words):
            if self.audio_context_available(context_id):
                await self.add_word_timestamps([(w["word"], w["start_s"]) for w in message.words], context_id)
        elif isinstance(message, wire.Ended):
            self._open.discard(context_id)
            if message.reason == "cancelled":
                await self._call_event_handler("on_heard", context_id, message.heard)
            if self.audio_context_available(context_id):
                await self.stop_ttfb_metrics()
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
        elif isinstance(message, wire.Error):
            if context_id in self._open or self.audio_context_available(context_id):
                self._open.discard(context_id)
                error = _describe_error(message)
                if self.audio_context_available(context_id):
                    await self.append_to_audio_context(context_id, ErrorFrame(error=error))
                    await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                    await self.remove_audio_context(context_id)
                else:
                    await self.push_error(error_msg=error)
            else:
                await self.push_error(error_msg=_describe_error(message))
        # start, segment, flushed: nothing for Pipecat

    # ------------------------------------------------------------------ Pipecat -> server

    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        try:
            if not self._websocket or self._websocket.state is not State.OPEN:
                await self._connect()
            if context_id not in self._open:
                await self._send(self._start_message(context_id))
                self._open.add(context_id)
            await self._send(wire.Chunk(context_id, text))
            await self.start_tts_usage_metrics(text)
            yield None
        except Exception as e:  # noqa: BLE001 - Pipecat's convention: an error frame, then stop
            logger.warning(f"{self}: cannot send to vox-ws: {e}")
            self._open.discard(context_id)
            yield ErrorFrame(error=f"vox-ws: {e}")
            yield TTSStoppedFrame(context_id=context_id)

    def _start_message(self, context_id: str) -> wire.Start:
        voice = self._settings.voice
        return wire.Start.of(self._speech, {
            "id": context_id, "stream_input": True, "format": "s16", "sample_rate": self.sample_rate,
            "voice": voice if isinstance(voice, str) and voice else self._speech.voice,
            "word_timestamps": bool(self._words)})

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn has no more text: speak what is buffered now and close the stream."""
        flush_id = context_id or self.get_active_audio_context_id()
        if not flush_id or flush_id not in self._open:
            return
        try:
            await self._send(wire.Flush(flush_id))
            await self._send(wire.End(flush_id))
        except (ConnectionError, OSError) as e:
            logger.warning(f"{self}: cannot flush {flush_id}: {e}")

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: the server stops generating before its next step and frees the slot."""
        await self.stop_all_metrics()
        if context_id in self._open:
            try:
                await self._send(wire.Cancel(context_id))
            except (ConnectionError, OSError) as e:
                logger.warning(f"{self}: cannot cancel {context_id}: {e}")
        await super().on_audio_context_interrupted(context_id)


def _describe_error(message: wire.Error) -> str:
    hint = message.retry_after_s
    return f"vox-ws {message.code}: {message.message}" + (f" (retry after {hint:g}s)" if hint else "")
