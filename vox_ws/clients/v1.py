"""An asyncio client for vox-ws.

    from vox_ws.clients.v1 import connect

    async with connect("ws://127.0.0.1:8765/v1/stream", token="...") as c:
        async for pcm in c.stream("Hello!", format="s16"):      # bytes, as they are generated
            play(pcm)

        wav = await c.synthesize("Hello again.")                # a whole WAV file

        s = await c.open_stream(format="mulaw", sample_rate=8000)   # text streamed in (an LLM's tokens)
        await s.send_text("Hello ")
        await s.send_text("there.")
        await s.end()
        async for pcm in s:
            forward_to_phone_line(pcm)

One connection carries any number of streams at once; every protocol error arrives as a typed
exception (`Busy`, `BadRequest`, ...), all subclasses of `VoxError`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import math
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from types import TracebackType
from typing import Any, Awaitable, TypeVar

from websockets.asyncio.client import ClientConnection
from websockets.asyncio.client import connect as ws_connect
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.frames import CloseCode

from .. import wire
from ..audio import bytes_to_pcm, wav_bytes


class VoxError(Exception):
    """A protocol error from the server. `code` is the protocol's error code; `retry_after_s`
    the server's estimate of when the same request may pass (`busy`, `not_ready`), if any."""

    code = "error"

    def __init__(self, message: str, stream_id: str | None = None, retryable: bool = False,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.stream_id = stream_id
        self.retryable = retryable
        self.retry_after_s = retry_after_s


def _error_class(code: str) -> type[VoxError]:
    name = "".join(part.capitalize() for part in code.split("_"))
    return type(name, (VoxError,), {"code": code, "__doc__": f"The server answered `{code}`."})


# One exception class per protocol error code: BadFrame, BadRequest, UnknownStream, ...
ERRORS: dict[str, type[VoxError]] = {code: _error_class(code) for code in wire.ERROR_CODES}
BadFrame = ERRORS[wire.BAD_FRAME]
BadRequest = ERRORS[wire.BAD_REQUEST]
UnknownStream = ERRORS[wire.UNKNOWN_STREAM]
DuplicateStream = ERRORS[wire.DUPLICATE_STREAM]
TooLarge = ERRORS[wire.TOO_LARGE]
TooManyStreams = ERRORS[wire.TOO_MANY_STREAMS]
Busy = ERRORS[wire.BUSY]
NotReady = ERRORS[wire.NOT_READY]
Timeout = ERRORS[wire.TIMEOUT]
Internal = ERRORS[wire.INTERNAL]
SlowConsumer = ERRORS[wire.SLOW_CONSUMER]
Unsupported = ERRORS[wire.UNSUPPORTED]
Unauthorized = ERRORS[wire.UNAUTHORIZED]
RateLimited = ERRORS[wire.RATE_LIMITED]
GoingAway = ERRORS[wire.GOING_AWAY]
Unavailable = ERRORS[wire.UNAVAILABLE]


class ConnectionLost(VoxError):
    """The connection closed while a request was waiting for its answer (`close_code`: the
    WebSocket close code, 1006 when the connection just broke)."""

    code = "connection_lost"

    def __init__(self, message: str, stream_id: str | None = None, retryable: bool = True,
                 close_code: int | None = None) -> None:
        super().__init__(message, stream_id, retryable)
        self.close_code = close_code


class ProtocolViolation(VoxError):
    """The server sent what protocol v1 does not allow (a time that is no finite number of seconds
    at or after 0, times out of order, a sample rate outside 8,000-48,000 Hz, a frame that is no
    message): nothing more from it is believed, and the connection is closed (1002)."""

    code = "protocol_violation"


class ServerSilent(VoxError):
    """The server said nothing for the client's `silence_timeout_s` while the client waited on it
    (its `hello`, a reply, a stream's next message)."""

    code = "server_silent"


# Seconds the server may say nothing while a client waits on it. An honest server is never that
# quiet: a queued stream waits at most `max_queue_wait_s` (30 s), an input stream that gets no
# text ends after `stream_timeout_s` (30 s), and audio comes a chunk at a time.
SILENCE_TIMEOUT_S = 60.0
# The sample rates protocol v1's `start` may name (docs/PROTOCOL.md).
SAMPLE_RATES = (8000, 48000)

_T = TypeVar("_T")


@dataclass(frozen=True, kw_only=True)
class _Lost(wire.Error):
    """The `error` a client gives itself for what its server no longer says: the connection
    closed (`close_code`), or the server broke the protocol."""

    close_code: int | None = None


def error_from(message: wire.Error) -> VoxError:
    """An `error` as the exception of its code."""
    text, retryable = message.message or "", bool(message.retryable)
    if isinstance(message, _Lost) and message.code == ConnectionLost.code:
        return ConnectionLost(text, message.id, retryable, close_code=message.close_code)
    cls = ERRORS.get(message.code or "", VoxError)
    return cls(text, message.id, retryable, message.retry_after_s)


class Stream:
    """One stream's audio as it arrives. Iterate for the audio bytes (in the stream's format; for
    `opus_packets`, one raw Opus packet at a time, the OpusHead in `started`'s first chunk is
    `description`); `ended` holds the server's `end` message once the stream is over."""

    def __init__(self, client: "Client", stream_id: str) -> None:
        self.client = client
        self.id = stream_id
        self.started: dict[str, Any] | None = None
        self.ended: dict[str, Any] | None = None
        self.finished = False                         # its `end` or `error` has arrived
        self.segments: list[dict[str, Any]] = []
        self.words: list[dict[str, Any]] = []       # with word_timestamps: {word, start_s, end_s, estimated?}
        self.description: bytes | None = None       # opus_packets: the OpusHead
        self._queue: asyncio.Queue[wire.ServerMessage] = asyncio.Queue()
        self._start_reply: asyncio.Future = asyncio.get_running_loop().create_future()
        self._flushed: list[asyncio.Future] = []

    @property
    def sample_rate(self) -> int:
        return self.started["sample_rate"] if self.started else 0

    @property
    def format(self) -> str:
        return self.started["format"] if self.started else "f32"

    # -------------------------------------------------------------- input streaming

    async def send_text(self, text: str) -> None:
        await self.client._send(wire.Chunk(self.id, text))

    async def flush(self, wait: bool = True) -> dict[str, Any] | None:
        """Speak what is buffered now; returns when that audio has been generated (`flushed`),
        or at once with `wait=False` (the `flushed` message then comes among `events()`)."""
        if not wait:
            await self.client._send(wire.Flush(self.id))
            return None
        done = asyncio.get_running_loop().create_future()
        self._flushed.append(done)
        await self.client._send(wire.Flush(self.id))
        return await self.client._heard(done)

    async def end(self) -> None:
        """No more text: the stream ends once everything sent has been spoken."""
        await self.client._send(wire.End(self.id))

    async def cancel(self) -> None:
        """Barge-in: stop now. Iteration ends once the server confirms."""
        if not self.finished:
            await self.client._send(wire.Cancel(self.id))

    # -------------------------------------------------------------- audio

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._audio()

    async def _audio(self) -> AsyncIterator[bytes]:
        while True:
            message = await self.client._heard(self._queue.get())
            if isinstance(message, wire.AudioChunk):
                if message.packets is not None:
                    if message.description is not None:
                        self.description = message.description
                    for packet in message.packets:
                        yield packet
                else:
                    yield message.audio
            elif isinstance(message, wire.Ended):
                return
            elif isinstance(message, wire.Error):
                raise error_from(message)

    async def events(self) -> AsyncIterator[wire.ServerMessage]:
        """Every message of the stream after `start`, in order, as `wire`'s classes to dispatch
        on (`wire.AudioChunk`, `wire.Words`, `wire.Segment`, `wire.Flushed`, then `wire.Ended`;
        `wire.Unknown` for a type this client does not know); an `error` is raised. Use either
        this or iteration for the audio, not both."""
        while True:
            message = await self.client._heard(self._queue.get())
            if isinstance(message, wire.Error):
                raise error_from(message)
            yield message
            if isinstance(message, wire.Ended):
                return

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def _deliver(self, message: wire.ServerMessage, sent: dict[str, Any]) -> None:
        """`message` (the map `sent`) for this stream, as it arrived."""
        if isinstance(message, wire.Started):
            self.started = sent
            if not self._start_reply.done():
                self._start_reply.set_result(sent)
            return
        if isinstance(message, wire.Segment):
            self.segments.append(sent)
        elif isinstance(message, wire.Words):
            self.words.extend(message.words)
        elif isinstance(message, wire.Flushed):
            if self._flushed:
                self._flushed.pop(0).set_result(sent)
        elif isinstance(message, wire.Ended):
            self.ended = sent
        if isinstance(message, wire.Error) and not self._start_reply.done():
            self._start_reply.set_exception(error_from(message))
        if isinstance(message, (wire.Ended, wire.Error)):
            self.finished = True
            for waiter in self._flushed:
                if not waiter.done():
                    waiter.set_exception(
                        error_from(message) if isinstance(message, wire.Error) else
                        ConnectionLost("the stream ended before the flush completed", self.id))
        self._queue.put_nowait(message)


# The messages that belong to no stream, answered by a reply carrying their `id`.
_Request = wire.Voice | wire.VoiceDelete | wire.VoiceUpdate | wire.VoiceAdmin | wire.Lora


class Client:
    """One connection. Use `connect()` to make one."""

    def __init__(self, ws: ClientConnection, hello: wire.Hello,
                 silence_timeout_s: float | None = SILENCE_TIMEOUT_S) -> None:
        self.ws = ws
        self.hello = hello                        # what the server offers (`wire.Hello.read`)
        self.silence_timeout_s = silence_timeout_s
        self._heard_at = asyncio.get_running_loop().time()     # the server's last message
        self._violation: str | None = None                      # what the server sent that v1 forbids
        self._closing: asyncio.Future | None = None              # the close after a violation
        self._streams: dict[str, Stream] = {}
        self._requests: dict[str, asyncio.Future] = {}
        self._ids = itertools.count(1)
        self._reader = asyncio.create_task(self._read())

    @property
    def sample_rate(self) -> int:
        return self.hello.sample_rate

    # Every way to speak takes a `wire.Speech` and/or its fields by name (voice, format,
    # sample_rate, speed, volume, language, instructions, markup, options, pronunciations,
    # lora, lookahead_s, segment_events, word_timestamps, phoneme_timestamps, speaker).

    async def stream(self, text: str, speech: wire.Speech | None = None, **fields: Any) -> AsyncIterator[bytes]:
        """Speak `text`; yields audio bytes in its `format` (raw PCM, or a codec's file piece by
        piece) as they are generated. Leaving the loop early cancels the stream on the server.
        A player that reads as it plays passes `lookahead_s` (the server then sends at most
        that far ahead of real time); without it the audio comes as fast as it is read."""
        s = await self.start_stream(text, speech, **fields)
        try:
            async for chunk in s:
                yield chunk
        finally:
            if s.ended is None and not self.ws.close_code:
                await s.cancel()

    async def start_stream(self, text: str, speech: wire.Speech | None = None, **fields: Any) -> Stream:
        """Speak `text` on a stream of its own: iterate it for the audio, or `events()`."""
        return await self._start(wire.Speech.of(speech, fields), text=text)

    async def open_stream(self, speech: wire.Speech | None = None, **fields: Any) -> Stream:
        """A stream whose text arrives piece by piece (`send_text`, `flush`, `end`)."""
        return await self._start(wire.Speech.of(speech, fields), stream_input=True)

    async def synthesize(self, text: str, speech: wire.Speech | None = None, **fields: Any) -> bytes:
        """The whole utterance as a 16-bit WAV file (whatever `format` says)."""
        s = await self._start(wire.Speech.of(speech, {**fields, "format": "f32"}), text=text)
        pcm = bytes_to_pcm(await s.read_all(), "f32")
        return wav_bytes(pcm, s.sample_rate)

    async def register_voice(self, audio: bytes, transcript: str | None = None, mode: str | None = None,
                             name: str | None = None, public: bool = False) -> str:
        """Clone a voice from WAV/FLAC bytes; returns its id for `voice=` (with a `name`, the
        voice may also be named by it; `public`, by anyone the server serves, who is shown it)."""
        message = wire.Voice(audio, name=name or None, public=public, transcript=transcript or None,
                             mode=mode or None)
        return (await self._request(message))["voice"]

    async def delete_voice(self, voice: str) -> bool:
        return (await self._request(wire.VoiceDelete(voice)))["deleted"]

    async def set_voice_public(self, voice: str, public: bool) -> bool:
        """Make a voice of yours (its id or name) public, or private again; False where you have
        none by that id or name."""
        return (await self._request(wire.VoiceUpdate(voice, public)))["updated"]

    async def lora(self, op: str, name: str | None = None) -> dict[str, Any]:
        """Admin (needs the admin token): `load` an adapter from the server's LoRA directory into a
        free slot, `unload` it (streams using it finish first), `enable` it as the adapter of
        streams that name none, `disable` that default."""
        return await self._request(wire.Lora(op, name=name or None))

    async def close(self) -> None:
        await self.ws.close()
        self._reader.cancel()

    # -------------------------------------------------------------- internals

    async def _start(self, speech: wire.Speech, **start: Any) -> Stream:
        sid = f"c{next(self._ids)}"
        stream = Stream(self, sid)
        self._streams[sid] = stream
        await self._send(wire.Start.of(speech, {"id": sid, **start}))
        await self._heard(stream._start_reply)
        return stream

    async def _request(self, message: _Request) -> dict[str, Any]:
        rid = f"r{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._requests[rid] = future
        await self._send(replace(message, id=rid))
        return await self._heard(future)

    async def _heard(self, waited: Awaitable[_T]) -> _T:
        """`waited`, unless the server says nothing at all (on any stream) for `silence_timeout_s`
        while it is awaited: then ServerSilent."""
        if self.silence_timeout_s is None:
            return await waited
        loop = asyncio.get_running_loop()
        future = asyncio.ensure_future(waited)
        began = loop.time()
        try:
            while True:
                quiet_until = max(self._heard_at, began) + self.silence_timeout_s
                if loop.time() >= quiet_until:
                    raise ServerSilent(f"the server said nothing for {self.silence_timeout_s:g} s")
                await asyncio.wait({future}, timeout=quiet_until - loop.time())
                if future.done():
                    return future.result()
        finally:
            if future is not waited and not future.done():      # ours (a coroutine's task): not the caller's
                future.cancel()

    async def _send(self, message: wire.ClientMessage) -> None:
        try:
            await self.ws.send(wire.encode(message))
        except ConnectionClosed as exc:
            raise ConnectionLost(f"connection closed ({exc.rcvd.code if exc.rcvd else 'no close frame'})") from None

    async def _read(self) -> None:
        try:
            async for data in self.ws:
                self._heard_at = asyncio.get_running_loop().time()
                message, sent, self._violation = _checked(data, self._streams)
                if self._violation is not None:
                    # Nothing more it says is believed: every waiter is told what it sent now,
                    # not after a close handshake such a server may never finish.
                    self._closing = asyncio.ensure_future(self.ws.close(1002, "protocol error"))
                    break
                target = sent.get("id")
                if target in self._requests:
                    future = self._requests.pop(target)
                    if isinstance(message, wire.Error):
                        future.set_exception(error_from(message))
                    else:
                        future.set_result(sent)
                elif target in self._streams:
                    stream = self._streams[target]
                    stream._deliver(message, sent)
                    if isinstance(message, (wire.Ended, wire.Error)):
                        del self._streams[target]
        finally:
            if self._violation is None and _sent_too_big(self.ws):
                self._violation = (f"the server sent a frame over {self.ws.protocol.max_message_size} bytes "
                                   f"(a chunk holds at most {wire.max_chunk_seconds():g} s of audio)")
            code = self.ws.close_code or wire.CLOSE_ABNORMAL
            lost = _Lost(code=ConnectionLost.code, retryable=code in RECONNECT_CLOSE_CODES,
                         message=f"connection closed ({code} {self.ws.close_reason or ''})".rstrip(),
                         close_code=code)
            if self._violation is not None:
                lost = _Lost(code=ProtocolViolation.code, retryable=False, message=self._violation)
            for stream in self._streams.values():
                stream_lost = dataclasses.replace(lost, id=stream.id)
                stream._deliver(stream_lost, stream_lost.to_map())
            for future in self._requests.values():
                if not future.done():
                    future.set_exception(error_from(lost))


ERRORS["connection_lost"] = ConnectionLost
ERRORS[ProtocolViolation.code] = ProtocolViolation
ERRORS[ServerSilent.code] = ServerSilent


def _checked(data: Any, streams: dict[str, Stream]) -> tuple[Any, dict[str, Any], str | None]:
    """A frame's message (as its class, and as the map sent), and what in it protocol v1
    forbids, if anything (the numbers a client computes with: times, sample rates, audio), said
    as what the server sent."""
    try:
        sent = wire.decode(data) if isinstance(data, bytes) else None
        message = wire.server_message(sent)
    except Exception as exc:  # noqa: BLE001 - whatever msgpack makes of garbage, or no v1 message
        why = f" ({str(exc)[:120]})" if isinstance(exc, ValueError) else ""
        return None, {}, f"the server sent a frame that is no protocol v1 message{why}: {data!r:.60}"
    stream = streams.get(sent.get("id")) if isinstance(sent.get("id"), str) else None
    if stream is None:
        return message, sent, None
    problem = None
    if isinstance(message, wire.Started):
        rate = message.sample_rate
        if not _int(rate) or not SAMPLE_RATES[0] <= rate <= SAMPLE_RATES[1]:
            problem = "a sample rate of %r Hz, outside the protocol's %d-%d" % (rate, *SAMPLE_RATES)
    elif isinstance(message, wire.AudioChunk):
        # Before its `start` a stream's rate is not known: the protocol's highest bounds it.
        problem = wire.chunk_problem(message, stream.format, stream.sample_rate or SAMPLE_RATES[1])
    elif isinstance(message, wire.Segment):
        before = stream.segments[-1]["start_s"] if stream.segments else 0.0
        text = message.text
        problem = _times_problem(sent, before) if isinstance(text, str) else f"a text of {text!r:.40}"
    elif isinstance(message, wire.Words):
        words = message.words
        if not isinstance(words, list):
            problem = f"words of {words!r:.40}"
        else:
            before = stream.words[-1]["start_s"] if stream.words else 0.0
            for word in words:
                problem = (None if isinstance(word, dict) and isinstance(word.get("word"), str)
                           else f"a word of {word!r:.40}") or _times_problem(word, before)
                if problem:
                    break
                before = word["start_s"]
    elif isinstance(message, wire.Ended) and "audio_s" in sent:
        audio_s = message.audio_s
        if not _seconds(audio_s):
            problem = f"audio_s {audio_s!r}, not a time in seconds (finite, at least 0)"
    if problem is None:
        return message, sent, None
    return message, sent, f"the server's {sent['type']} for stream {stream.id} has {problem}"


def _sent_too_big(ws: ClientConnection) -> bool:
    """Whether this side closed the connection for a frame over its `max_size` (1009)."""
    sent = ws.protocol.close_sent
    return sent is not None and sent.code == CloseCode.MESSAGE_TOO_BIG


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _seconds(value: Any) -> bool:
    """A time in seconds: a finite number, at least 0."""
    return (_int(value) or isinstance(value, float)) and math.isfinite(value) and value >= 0


def _times_problem(item: dict[str, Any], not_before: float) -> str | None:
    """What is wrong with an item's `start_s` and `end_s` (a segment's, a word's), if anything:
    each a time in seconds, the start not after the end nor before the previous item's start."""
    start, end = item.get("start_s"), item.get("end_s")
    for name, value in (("start_s", start), ("end_s", end)):
        if not _seconds(value):
            return f"{name} {value!r}, not a time in seconds (finite, at least 0)"
    if start > end:
        return f"start_s {start!r} after its end_s {end!r}"
    if start < not_before:
        return f"start_s {start!r} before the previous one's {not_before!r}"
    return None


# Close codes (and handshake statuses) that mean "this server cannot serve you now: connect
# again", which behind a balancer lands on another server: going away, abnormal closure (the
# server died), the engine failed, service restart (draining), try again later (full).
RECONNECT_CLOSE_CODES = wire.RECONNECT_CLOSE_CODES
RECONNECT_STATUSES = frozenset({502, 503, 504})
# The longest wait before a retry, whatever the server asks.
MAX_RETRY_WAIT_S = 30.0
# A retry waits up to this much longer, at random: clients turned away together do not all come
# back at the same instant.
RETRY_JITTER = 0.25


def retry_delay(backoff: float, retry_after_s: float | None = None, rng: random.Random | None = None) -> float:
    """Seconds to wait before a retry: what the server said (`retry_after_s`, a `Retry-After`
    header) where it said it, else the doubling `backoff`; with jitter; at most MAX_RETRY_WAIT_S."""
    base = retry_after_s if retry_after_s is not None and retry_after_s >= 0 else backoff
    return min(MAX_RETRY_WAIT_S, base * (1 + RETRY_JITTER * (rng or random).random()))


def _retry_after(headers: Any) -> float | None:
    try:
        return float(headers.get("Retry-After"))
    except (TypeError, ValueError):
        return None


class connect:
    """`async with connect(url, token=...) as client:`; `token` goes in an Authorization header.

    `retries`: how many more times to connect when the server refuses for now (handshake 502,
    503, 504; closed with a reconnect code before its `hello`; connection refused), waiting as
    the server's `Retry-After` says, else `retry_wait` seconds doubled each time (`retry_delay`).
    Behind a balancer each try may land elsewhere."""

    def __init__(self, url: str = "ws://127.0.0.1:8765/v1/stream", *, token: str | None = None,
                 retries: int = 0, retry_wait: float = 0.2,
                 silence_timeout_s: float | None = SILENCE_TIMEOUT_S, **kwargs: Any) -> None:
        self._url, self._token, self._kwargs = url, token, kwargs
        self._retries, self._retry_wait = retries, retry_wait
        self._silence_timeout_s = silence_timeout_s
        self.client: Client | None = None

    async def __aenter__(self) -> Client:
        self.client = await open_client(self._url, token=self._token, retries=self._retries,
                                        retry_wait=self._retry_wait,
                                        silence_timeout_s=self._silence_timeout_s, **self._kwargs)
        return self.client

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self.client is not None:
            await self.client.close()


async def open_client(url: str = "ws://127.0.0.1:8765/v1/stream", *, token: str | None = None,
                      retries: int = 0, retry_wait: float = 0.2,
                      silence_timeout_s: float | None = SILENCE_TIMEOUT_S, **kwargs: Any) -> Client:
    """A connected client to keep (a connection pool's); `await client.close()` when done.
    `retries` and `retry_wait` as for `connect`; `silence_timeout_s`: how long the server may say
    nothing while the client waits on it (the handshake, its `hello`, a reply, a stream's next
    message) before ServerSilent (None: for ever)."""
    if silence_timeout_s is not None:
        kwargs.setdefault("open_timeout", silence_timeout_s)
    # A frame past it closes the connection (1009), a protocol violation: `wire.decode` bounds
    # what one within it may cost.
    kwargs.setdefault("max_size", wire.MAX_SERVER_FRAME_BYTES)
    headers = dict(kwargs.pop("additional_headers", {}) or {})
    if token:
        headers["Authorization"] = f"Bearer {token}"
    wait = retry_wait
    for attempt in range(retries + 1):
        asked: float | None = None
        try:
            ws = await ws_connect(url, additional_headers=headers, **kwargs)
        except InvalidStatus as exc:
            if exc.response.status_code not in RECONNECT_STATUSES or attempt == retries:
                raise
            asked = _retry_after(exc.response.headers)
        except OSError:
            if attempt == retries:
                raise
        else:
            try:
                return await _greeted(ws, silence_timeout_s)
            except ConnectionClosed as exc:
                code = exc.rcvd.code if exc.rcvd else wire.CLOSE_ABNORMAL
                if code not in RECONNECT_CLOSE_CODES or attempt == retries:
                    raise ConnectionLost(f"closed before hello ({code} {exc.rcvd.reason if exc.rcvd else ''})",
                                         retryable=code in RECONNECT_CLOSE_CODES, close_code=code) from None
            except BaseException:
                await ws.close()
                raise
        await asyncio.sleep(retry_delay(wait, asked))
        wait *= 2
    raise AssertionError("unreachable")


async def _greeted(ws: ClientConnection, silence_timeout_s: float | None = SILENCE_TIMEOUT_S) -> Client:
    """The server speaks first: its `hello`."""
    try:
        data = await asyncio.wait_for(ws.recv(), silence_timeout_s)
    except asyncio.TimeoutError:
        raise ServerSilent(f"the server accepted the connection and said nothing for {silence_timeout_s:g} s "
                           "(no hello)") from None
    except ConnectionClosed:
        if _sent_too_big(ws):
            raise ProtocolViolation(f"the server's hello is over {ws.protocol.max_message_size} "
                                    "bytes") from None
        raise
    try:
        hello = wire.Hello.read(data)
    except ValueError as exc:
        raise ProtocolViolation(str(exc)) from None
    return Client(ws, hello, silence_timeout_s)


async def speak(url: str, text: str, *, token: str | None = None, retries: int = 3, retry_wait: float = 0.2,
                **fields: Any) -> bytes:
    """Say `text` and return all its audio (`fields` as for `Client.start_stream`: voice, format,
    ...), connecting again and starting over when the server goes away mid-stream or refuses
    for now (`busy`, `not_ready`, `going_away`, `unavailable`, a lost connection): behind a
    balancer the retry lands on another server. It waits as the refusal's `retry_after_s` says, else `retry_wait`
    seconds doubled each time (`retry_delay`). Other errors are raised at once."""
    wait = retry_wait
    for attempt in range(retries + 1):
        asked: float | None = None
        try:
            async with connect(url, token=token, retries=retries, retry_wait=retry_wait) as client:
                stream = await client.start_stream(text, **fields)
                return await stream.read_all()
        except VoxError as err:
            if not err.retryable or attempt == retries:
                raise
            asked = err.retry_after_s
        except OSError:
            if attempt == retries:
                raise
        await asyncio.sleep(retry_delay(wait, asked))
        wait *= 2
    raise AssertionError("unreachable")
