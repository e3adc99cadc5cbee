"""One WebSocket connection's life: receive loop, its streams, its send path, its timers.

Threading: the scheduler thread calls a stream's `deliver`/`finish`/`fail` (see stream.py),
which hand finished frames to the loop with `call_soon_threadsafe`. Everything here runs on the
event loop.

One writer task per connection sends frames in FIFO order, so a stream's `start` precedes its
chunks, which precede its `end`. Egress is bounded twice: per stream in audio seconds (the
scheduler skips stepping a stream whose client has not read enough), and per connection in
queued frames (a client that floods requests without reading answers is disconnected).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable

from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from . import protocol as p
from .audio import StreamEncoder, decode_audio_file
from .engine import Engine, GenerationRequest, Scheduler
from .metrics import Metrics
from .stream import Stream

log = logging.getLogger("vox_ws.session")
stream_log = logging.getLogger("vox_ws.stream")

# Frames (mostly control replies) a connection may have queued before it is judged not to read.
MAX_QUEUED_FRAMES = 1024
# Seconds a closing session waits for its queued frames to be sent.
CLOSE_FLUSH_TIMEOUT_S = 2.0
# Messages over the rate limit in a row after which the connection is closed (1008).
RATE_LIMIT_CLOSE_AFTER = 200
# Input streaming: buffered text with no sentence or clause end yet is spoken once the input has
# paused this long (whole words only), so a reply without punctuation still starts promptly.
SEGMENT_DELAY_S = 0.4


class TokenBucket:
    """`rate` messages per second on average, bursts up to `burst`."""

    def __init__(self, rate: float, burst: float) -> None:
        self.rate = rate
        self.burst = burst
        self._tokens = burst
        self._at = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens >= 1.0:
            self._tokens -= 1.0
            return True
        return False


@dataclass
class _Outgoing:
    frame: bytes
    stream: "Stream | None" = None
    audio_s: float = 0.0     # audio carried by this frame (0 for control frames)


class Session:
    """Serves one connection until it closes, is reaped, or the server shuts down."""

    _ids = itertools.count(1)

    def __init__(self, ws: ServerConnection, scheduler: Scheduler, limits: p.Limits,
                 hello: dict[str, Any], is_admin: bool = False, metrics: Metrics | None = None,
                 accepting: Callable[[], bool] = lambda: True) -> None:
        self.ws = ws
        self.scheduler = scheduler
        self.engine: Engine = scheduler.engine
        self.limits = limits
        self.hello = hello
        self.number = next(self._ids)
        self.streams: dict[str, Stream] = {}
        self.last_activity = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._outbox: asyncio.Queue[_Outgoing] = asyncio.Queue()
        self._auto_ids = itertools.count(1)
        self._closing = False
        self.is_admin = is_admin
        self.metrics = metrics or Metrics()
        self._accepting = accepting
        self._requests: set[asyncio.Task] = set()   # voice / lora requests in flight
        self._voice_task: asyncio.Task | None = None
        self._bucket = TokenBucket(limits.max_messages_per_s, burst=max(1.0, 2 * limits.max_messages_per_s))
        self._refused_in_a_row = 0

    # -------------------------------------------------------------- life

    async def run(self) -> None:
        self._send(p.encode(self.hello))
        writer = asyncio.create_task(self._write_loop(), name=f"session-{self.number}-writer")
        watchdog = asyncio.create_task(self._watchdog(), name=f"session-{self.number}-watchdog")
        try:
            async for message in self.ws:
                self.last_activity = time.monotonic()
                if self._bucket.take():
                    self._refused_in_a_row = 0
                    self._handle(message)
                else:
                    self._rate_limited()
        except ConnectionClosed:
            pass
        finally:
            self._closing = True
            for stream in list(self.streams.values()):
                self._close_stream(stream)      # the client is gone: free the slot, send nothing
            watchdog.cancel()
            for task in self._requests:
                task.cancel()
            # The socket is closed: nothing queued can be sent any more.
            writer.cancel()
            await asyncio.gather(writer, watchdog, return_exceptions=True)

    async def close(self, code: int, reason: str) -> None:
        """Close after sending what is already queued (e.g. the `going_away` errors of a shutdown),
        waiting at most a few seconds for a slow reader."""
        self._closing = True
        try:
            await asyncio.wait_for(self._outbox.join(), CLOSE_FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        await self.ws.close(code, reason)

    def call_soon(self, callback: Any, *args: Any) -> None:
        """Thread-safe hand-off from the scheduler thread; dropped once the loop is gone."""
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # loop closed: the server is exiting

    # -------------------------------------------------------------- receiving

    def _rate_limited(self) -> None:
        self._refused_in_a_row += 1
        if self._refused_in_a_row > RATE_LIMIT_CLOSE_AFTER:
            self._close_for_policy("message rate limit exceeded")
            return
        self._error(p.ProtocolError(p.RATE_LIMITED, f"more than {self.limits.max_messages_per_s:g} messages per "
                                                   "second: message dropped"))

    def _error(self, err: p.ProtocolError) -> None:
        self.metrics.errors.labels(err.code).inc()
        self._send(p.encode(p.error_message(err)))

    def abort_streams(self, code: str, message: str) -> None:
        """End every open stream with an error (server shutdown)."""
        for stream in list(self.streams.values()):
            self.stream_failed(stream, code, message)

    def _handle(self, data: bytes | str) -> None:
        try:
            obj = p.decode_frame(data, self.limits)
            message = p.parse_message(obj, self.limits)
            if isinstance(message, p.Start):
                self._on_start(message)
            elif isinstance(message, p.Cancel):
                self._on_cancel(message)
            elif isinstance(message, (p.Voice, p.VoiceDelete, p.Lora)):
                self._on_request(message)
            else:
                self._on_input(message, obj["type"])
        except p.ProtocolError as err:
            self._error(err)

    def _stream(self, sid: str) -> Stream:
        stream = self.streams.get(sid)
        if stream is None:
            raise p.ProtocolError(p.UNKNOWN_STREAM, f"no open stream with id {sid!r}", sid)
        return stream

    def _on_start(self, start: p.Start) -> None:
        sid = start.id
        if sid is None:
            sid = f"s{next(self._auto_ids)}"
            while sid in self.streams:
                sid = f"s{next(self._auto_ids)}"
        if sid in self.streams:
            raise p.ProtocolError(p.DUPLICATE_STREAM, f"stream {sid!r} is already open on this connection", sid)
        if len(self.streams) >= self.limits.max_streams:
            raise p.ProtocolError(
                p.TOO_MANY_STREAMS, f"{len(self.streams)} streams open, max_streams={self.limits.max_streams}", sid
            )
        if not self._accepting():
            raise p.ProtocolError(p.GOING_AWAY, "server shutting down: no new streams", sid)
        if self.scheduler.status != "ready":
            raise p.ProtocolError(p.NOT_READY, f"engine is {self.scheduler.status}", sid)
        rate = start.sample_rate or self.engine.sample_rate
        stream = Stream(self, sid, start, StreamEncoder(self.engine.sample_rate, rate, start.format))
        position = 0
        if start.stream_input:
            # Refuse an unknown voice now, not at the first segment.
            try:
                self.engine.check_voice(start.voice)
            except p.ProtocolError as err:
                err.stream_id = sid
                raise
            stream.pending.extend(stream.segmenter.push(start.text))
        else:
            position = self._submit(stream, start.text)
        self.streams[sid] = stream
        reply: dict[str, Any] = {"type": "start", "id": sid, "sample_rate": rate, "format": start.format,
                                 "channels": 1}
        if position:
            reply["queued"] = position
        ignored = sorted(set(start.options) - self.engine.supported_options)
        if ignored:
            reply["ignored_options"] = ignored
        # Queued before any chunk: chunks reach the loop through call_soon, after this returns.
        self._send(p.encode(reply))
        if start.stream_input:
            self._pump(stream)

    def _submit(self, stream: Stream, text: str) -> int:
        """Queue a generation request for (the next segment of) a stream; its queue position."""
        request = GenerationRequest(text=text, sink=stream, voice=stream.start.voice,
                                    options=dict(stream.start.options), context=stream.context,
                                    keep_continuation=stream.start.stream_input)
        try:
            self.engine.check(request)
            position = self.scheduler.submit(request)
        except p.ProtocolError as err:
            err.stream_id = stream.id
            raise
        stream.request = request
        stream.segment_start_s = stream.audio_s
        return position

    # -------------------------------------------------------------- input streaming

    def _on_input(self, message: p.Chunk | p.End | p.Flush, kind: str) -> None:
        stream = self._stream(message.id)
        if not stream.start.stream_input:
            raise p.ProtocolError(p.BAD_REQUEST, f"'{kind}' needs a stream started with stream_input: true",
                                  message.id)
        if stream.input_closed:
            raise p.ProtocolError(p.BAD_REQUEST, f"the input of stream {message.id!r} has already ended", message.id)
        stream.last_input_at = time.monotonic()
        if isinstance(message, p.Chunk):
            buffered = len(stream.segmenter.buffer) + sum(len(t) for t in stream.pending)
            if buffered + len(message.text) > self.limits.max_text_chars:
                raise p.ProtocolError(p.TOO_LARGE, f"more than max_text_chars={self.limits.max_text_chars} "
                                                   "characters waiting to be spoken", message.id)
            stream.pending.extend(stream.segmenter.push(message.text))
            self._arm_delay(stream)
        elif isinstance(message, p.Flush):
            stream.pending.extend(stream.segmenter.flush_all())
            stream.flush_marks.append(len(stream.segments) + len(stream.pending) + (stream.request is not None))
        else:
            stream.pending.extend(stream.segmenter.flush_all())
            stream.input_closed = True
        self._pump(stream)

    def _arm_delay(self, stream: Stream) -> None:
        """Text with no boundary yet is spoken anyway once the input pauses (whole words only)."""
        if stream.delay_timer is not None:
            stream.delay_timer.cancel()
        if stream.segmenter.buffer.strip():
            stream.delay_timer = self._loop.call_later(SEGMENT_DELAY_S, self._delay_elapsed, stream)

    def _delay_elapsed(self, stream: Stream) -> None:
        stream.delay_timer = None
        if not stream.closed:
            stream.pending.extend(stream.segmenter.flush_words())
            self._pump(stream)

    def _pump(self, stream: Stream) -> None:
        """Start the next segment when none is generating; acknowledge flushes; end when done."""
        if stream.closed:
            return
        while stream.flush_marks and stream.flush_marks[0] <= len(stream.segments):
            stream.flush_marks.popleft()
            self._send(p.encode({"type": "flushed", "id": stream.id, "audio_s": round(stream.audio_s, 4)}))
        if stream.request is not None:
            return
        if stream.pending:
            try:
                self._submit(stream, stream.pending.popleft())
            except p.ProtocolError as err:
                self.stream_failed(stream, err.code, err.message)
        elif stream.input_closed:
            self._end(stream, p.END_MAX_LEN if stream.capped else p.END_DONE)

    def _on_cancel(self, cancel: p.Cancel) -> None:
        stream = self._stream(cancel.id)
        self._end(stream, p.END_CANCELLED)

    def _on_request(self, message: p.Voice | p.VoiceDelete | p.Lora) -> None:
        """Requests that run on the engine thread between steps and answer later."""
        if isinstance(message, p.Voice):
            if not self.engine.supports_voices:
                raise p.ProtocolError(p.UNSUPPORTED, f"engine {self.engine.name} cannot clone voices", message.id)
            if self._voice_task is not None and not self._voice_task.done():
                raise p.ProtocolError(p.BUSY, "one voice registration at a time per connection", message.id)
            work = self._register_voice(message)
        elif isinstance(message, p.VoiceDelete):
            work = self._engine_call(message.id, "voice_delete",
                                     lambda: {"voice": message.voice, "deleted": self.engine.delete_voice(message.voice)})
        else:
            if not self.is_admin:
                raise p.ProtocolError(p.UNAUTHORIZED, "LoRA operations need a connection opened with the admin token",
                                      message.id)
            work = self._lora(message)
        task = asyncio.ensure_future(work)
        if isinstance(message, p.Voice):
            self._voice_task = task
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _register_voice(self, message: p.Voice) -> None:
        try:
            # Decoding a file is CPU work: never on the event loop.
            audio, rate = await asyncio.to_thread(decode_audio_file, message.audio)
        except ValueError as exc:
            self._error(p.ProtocolError(p.BAD_REQUEST, f"field 'audio': {exc}", message.id))
            return
        seconds = len(audio) / rate
        if seconds > self.limits.max_voice_audio_s:
            self._error(p.ProtocolError(p.TOO_LARGE, f"reference audio is {seconds:.1f}s, over max_voice_audio_s="
                                                     f"{self.limits.max_voice_audio_s:g}", message.id))
            return
        if seconds < 0.2:
            self._error(p.ProtocolError(p.BAD_REQUEST, f"reference audio is {seconds:.2f}s; at least 0.2s is needed",
                                        message.id))
            return
        await self._engine_call(message.id, "voice",
                                lambda: self.engine.register_voice(audio, rate, message.transcript, message.mode))

    async def _lora(self, message: p.Lora) -> None:
        active = self.scheduler.stats()["active"]
        await self._engine_call(message.id, "lora",
                                lambda: {**self.engine.lora_op(message.op, message.name), "streams_in_flight": active})

    async def _engine_call(self, request_id: str | None, kind: str, fn: Any) -> None:
        try:
            result = await asyncio.wrap_future(self.scheduler.call(fn))
        except p.ProtocolError as err:
            err.stream_id = request_id
            self._error(err)
            return
        except Exception as exc:  # noqa: BLE001 - report, keep the session
            log.exception("%s request failed", kind)
            self._error(p.ProtocolError(p.INTERNAL, f"{kind} failed: {type(exc).__name__}: {exc}", request_id))
            return
        reply = {"type": kind, **result}
        if request_id is not None:
            reply["id"] = request_id
        self._send(p.encode(reply))

    # -------------------------------------------------------------- from the scheduler

    def stream_audio(self, stream: Stream, frame: bytes, audio_s: float) -> None:
        if stream.closed:
            return
        now = time.monotonic()
        if stream.first_audio_at is None:
            stream.first_audio_at = now
            self.metrics.first_audio.observe(now - stream.started_at)
        else:
            self.metrics.chunk_gap.observe(now - stream.last_chunk_at)
        stream.last_chunk_at = now
        self.metrics.audio_seconds.inc(audio_s)
        stream.chunks += 1
        stream.audio_s += audio_s
        stream.buffered_s += audio_s
        if stream.backlogged() and stream.backlog_since is None:
            stream.backlog_since = now
        self._send(frame, stream, audio_s)

    def request_finished(self, stream: Stream, request: GenerationRequest | None, reason: str) -> None:
        if stream.closed or request is not stream.request:
            return
        stream.request = None
        if reason == p.END_CANCELLED:
            self._end(stream, reason)
            return
        segment = {"text": request.text, "start_s": round(stream.segment_start_s, 4),
                   "end_s": round(stream.audio_s, 4)}
        stream.segments.append(segment)
        stream.capped |= reason == p.END_MAX_LEN
        if stream.start.stream_input:
            stream.context = request.continuation
            if stream.start.segment_events:
                self._send(p.encode({"type": "segment", "id": stream.id, "index": len(stream.segments) - 1,
                                     **segment}))
            self._pump(stream)
        else:
            self._end(stream, reason)

    def stream_failed(self, stream: Stream, code: str, message: str) -> None:
        if stream.closed:
            return
        self._close_stream(stream)
        self._error(p.ProtocolError(code, message, stream.id))
        self.metrics.streams.labels(code).inc()
        self._log_stream(stream, {"error": code, "message": message})

    # -------------------------------------------------------------- stream endings

    def _end(self, stream: Stream, reason: str) -> None:
        if reason != p.END_CANCELLED:
            tail = stream.tail_frame()
            if tail is not None:
                self.stream_audio(stream, *tail)
        self._close_stream(stream)
        if reason == p.END_CANCELLED:
            self._drop_queued_audio(stream)
        stats = stream.end_stats()
        self._send(p.encode({"type": "end", "id": stream.id, "reason": reason, **stats}))
        self.metrics.streams.labels(reason).inc()
        if reason == p.END_CANCELLED:
            self.metrics.cancellations.inc()
        self._log_stream(stream, {"reason": reason, **stats})

    def _log_stream(self, stream: Stream, outcome: dict[str, Any]) -> None:
        """One structured line per stream, for log pipelines."""
        outcome = {k: v for k, v in outcome.items() if k != "segments"}
        record = {"event": "stream", "session": self.number, "id": stream.id, "engine": self.engine.name,
                  "voice": stream.start.voice, "format": stream.start.format, "input": stream.start.stream_input,
                  "sample_rate": stream.encoder.out_rate, "segments": len(stream.segments),
                  "text_chars": sum(len(s["text"]) for s in stream.segments) or len(stream.start.text), **outcome}
        stream_log.info(json.dumps(record, separators=(",", ":")))

    def _close_stream(self, stream: Stream) -> None:
        stream.closed = True
        self.streams.pop(stream.id, None)
        self.last_activity = time.monotonic()
        if stream.delay_timer is not None:
            stream.delay_timer.cancel()
        stream.pending.clear()
        if stream.request is not None and not stream.request.cancelled:
            self.scheduler.cancel(stream.request)

    def _drop_queued_audio(self, stream: Stream) -> None:
        """Barge-in: audio of a cancelled stream that is still queued is never sent."""
        kept: list[_Outgoing] = []
        while not self._outbox.empty():
            item = self._outbox.get_nowait()
            self._outbox.task_done()
            if item.stream is stream:
                stream.chunks -= 1
                stream.audio_s -= item.audio_s
            else:
                kept.append(item)
        for item in kept:
            self._outbox.put_nowait(item)
        stream.buffered_s = 0.0

    # -------------------------------------------------------------- sending

    def _send(self, frame: bytes, stream: Stream | None = None, audio_s: float = 0.0) -> None:
        if self._closing:
            return
        if self._outbox.qsize() >= MAX_QUEUED_FRAMES:
            self._close_for_policy("client is not reading")
            return
        self._outbox.put_nowait(_Outgoing(frame, stream, audio_s))

    def _close_for_policy(self, reason: str) -> None:
        """Close at once with 1008, without flushing: the client is misbehaving."""
        if not self._closing:
            log.warning("session %d: %s; closing", self.number, reason)
            self._closing = True
            asyncio.ensure_future(self.ws.close(p.CLOSE_POLICY, reason))

    async def _write_loop(self) -> None:
        while True:
            item = await self._outbox.get()
            try:
                await self.ws.send(item.frame)
            except ConnectionClosed:
                return
            finally:
                self._outbox.task_done()
            if item.stream is not None:
                stream = item.stream
                stream.buffered_s = max(0.0, stream.buffered_s - item.audio_s)
                if not stream.backlogged() and stream.backlog_since is not None:
                    stream.backlog_since = None
                    self.scheduler.wake()

    # -------------------------------------------------------------- timers

    async def _watchdog(self) -> None:
        """Reaps the idle connection and cancels streams whose client stopped reading."""
        tick = min(1.0, self.limits.idle_timeout_s / 4, self.limits.write_stall_timeout_s / 4,
                   self.limits.stream_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for stream in list(self.streams.values()):
                if stream.backlog_since is not None and now - stream.backlog_since > self.limits.write_stall_timeout_s:
                    self.stream_failed(stream, p.SLOW_CONSUMER,
                                       f"client read no audio for {self.limits.write_stall_timeout_s:g}s")
                elif (not stream.input_closed and stream.request is None and not stream.pending
                      and now - stream.last_input_at > self.limits.stream_timeout_s):
                    self.stream_failed(stream, p.TIMEOUT, f"no input for {self.limits.stream_timeout_s:g}s and "
                                                          "no `end`: the stream is closed")
            if not self.streams and now - self.last_activity > self.limits.idle_timeout_s:
                log.info("session %d idle for %.0fs: closing", self.number, self.limits.idle_timeout_s)
                self.metrics.reaped.inc()
                await self.close(p.CLOSE_IDLE, "idle timeout")
                return
