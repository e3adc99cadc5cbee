"""One WebSocket connection's life under protocol v1: the front door of the msgpack protocol.

It moves validated messages between the socket and the stream service, nothing more: the
receive loop decodes and validates each frame (`transports/protocol.py`) and calls the service;
each open stream has a pump task that turns the stream's events into frames, in order; replies
that belong to no stream go through one control writer. Everything runs on the event loop.

Egress is bounded twice: per stream by the stream service (a pump takes the next event only
once its previous frame is written, so audio waits in the stream, where back-pressure sees it),
and per connection in queued control replies (a client that floods requests without reading
answers is disconnected, 1008).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any, Awaitable

from starlette.websockets import WebSocket, WebSocketDisconnect

from .engine import ErrorKind, Refused
from .service import Ended, Failed, Segment, Stream, StreamService
from .service.voices.store import owner_key
from .transports import protocol as p
from .transports.auth import address_owner
from .transports.connections import asgi_send
from .transports.proxies import parse_host
from .transports.rate import BUDGET_EXTENSION, MessageBudget
from .transports.state import ServerState
from .transports.voices_api import admin_described

log = logging.getLogger("vox_ws.session")

# Control replies a connection may have queued before it is judged not to read.
MAX_QUEUED_FRAMES = 1024
# Seconds a closing session waits for what is already queued to be sent.
CLOSE_FLUSH_TIMEOUT_S = 2.0
# Refused messages in a row (bad frames, unknown streams...) after which the connection is
# closed (1008): a client that only sends errors is broken or hostile.
MAX_ERRORS_IN_A_ROW = 50
# Errors a closed socket raises on send.
_SEND_CLOSED = (WebSocketDisconnect, RuntimeError, OSError)


class _OpenStream:
    """A stream as this connection knows it: its id, its `start`, its pump."""

    __slots__ = ("sid", "start", "stream", "pump")

    def __init__(self, sid: str, start: p.Start, stream: Stream) -> None:
        self.sid = sid
        self.start = start
        self.stream = stream
        self.pump: asyncio.Task | None = None


class Session:
    """Serves one connection until it closes, is reaped, or the server shuts down."""

    _numbers = itertools.count(1)

    def __init__(self, ws: WebSocket, state: ServerState, is_admin: bool = False, owner: str = "") -> None:
        self.ws = ws
        self.state = state
        self.service = state.service
        self.limits = state.limits
        self.metrics = state.metrics
        self.is_admin = is_admin
        self.number = next(self._numbers)
        # Whom this connection acts for (a token or an address): owns its voices, and shares
        # the slot queue's slots fairly with other clients, as does the connection itself.
        self.owner = owner or f"connection:{self.number}"
        self._owners = (self.owner, f"connection:{self.number}")
        self.streams: dict[str, _OpenStream] = {}
        self.last_activity = time.monotonic()
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._auto_ids = itertools.count(1)
        self._closing = False
        self._requests: set[asyncio.Task] = set()   # voice / lora requests in flight
        self._voice_task: asyncio.Task | None = None
        # Shared with the WebSocket protocol, which draws pings from it.
        self._budget: MessageBudget = (ws.scope.get("extensions") or {}).get(BUDGET_EXTENSION) or MessageBudget(
            self.limits.max_messages_per_s)
        self._errors_in_a_row = 0
        self.close_code: int | None = None
        self._asgi_send = asgi_send(ws)

    # -------------------------------------------------------------- life

    async def run(self) -> None:
        self._send(p.encode(p.hello_message(self.state)))
        writer = asyncio.create_task(self._write_loop(), name=f"session-{self.number}-writer")
        watchdog = asyncio.create_task(self._watchdog(), name=f"session-{self.number}-watchdog")
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    self.close_code = self.close_code or message.get("code")
                    break
                if self._budget.take():
                    data = message.get("bytes")
                    if self._handle(data if data is not None else message.get("text", "")):
                        # Only a message that did something counts as activity: a client that
                        # sends nothing but errors is reaped like an idle one.
                        self.last_activity = time.monotonic()
                else:
                    self._rate_limited()
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            self._closing = True
            for entry in list(self.streams.values()):
                entry.stream.close()           # the client is gone: free the slot, send nothing
            self.streams.clear()
            watchdog.cancel()
            writer.cancel()
            for task in self._requests:
                task.cancel()
            await asyncio.gather(writer, watchdog, return_exceptions=True)

    async def close(self, code: int, reason: str) -> None:
        """Close after sending what is already queued (e.g. the `going_away` errors of a shutdown),
        waiting at most a few seconds for a slow reader."""
        pumps = [e.pump for e in self.streams.values() if e.pump is not None]
        try:
            await asyncio.wait_for(asyncio.gather(self._outbox.join(), *pumps, return_exceptions=True),
                                   CLOSE_FLUSH_TIMEOUT_S)
        except asyncio.TimeoutError:
            pass
        await self._close_now(code, reason)

    async def _close_now(self, code: int, reason: str) -> None:
        self._closing = True
        if self.close_code is None:
            self.close_code = code
        try:
            await self.ws.close(code, reason)
        except _SEND_CLOSED:
            pass

    # -------------------------------------------------------------- receiving

    def _rate_limited(self) -> None:
        if self._budget.exhausted:
            self._close_for_policy("message rate limit exceeded")
            return
        self._error(p.ProtocolError(p.RATE_LIMITED, f"more than {self.limits.max_messages_per_s:g} messages per "
                                                   "second: message dropped"))

    def _error(self, err: p.ProtocolError) -> None:
        self.metrics.errors.labels(err.code).inc()
        self._send(p.encode(p.error_message(err)))

    def _handle(self, data: bytes | str) -> bool:
        """Act on one message; False if it was refused."""
        try:
            obj = p.decode_frame(data, self.limits)
            message = p.parse_message(obj, self.limits, self.state.option_specs)
            if isinstance(message, p.Start):
                self._on_start(message)
            elif isinstance(message, p.Cancel):
                self._open(message.id).stream.cancel()
            elif isinstance(message, (p.Voice, p.VoiceDelete, p.VoiceUpdate, p.VoiceAdmin, p.Lora)):
                self._on_request(message)
            else:
                self._on_input(message, obj["type"])
        except p.ProtocolError as err:
            self._error(err)
            self._errors_in_a_row += 1
            if self._errors_in_a_row >= MAX_ERRORS_IN_A_ROW:
                self._close_for_policy(f"{MAX_ERRORS_IN_A_ROW} refused messages in a row")
            return False
        self._errors_in_a_row = 0
        return True

    def _open(self, sid: str) -> _OpenStream:
        entry = self.streams.get(sid)
        if entry is None or entry.stream.done:
            raise p.ProtocolError(p.UNKNOWN_STREAM, f"no open stream with id {sid!r}", sid)
        return entry

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
        try:
            stream = self.service.open_stream(p.stream_request(start), owners=self._owners,
                                              log_fields={"session": self.number, "id": sid})
        except Refused as err:
            raise p.ProtocolError.from_refused(err, sid) from None
        entry = _OpenStream(sid, start, stream)
        self.streams[sid] = entry
        reply = p.encode(p.start_message(sid, stream.sample_rate, stream.format, stream.queued, stream.ignored_options))
        entry.pump = asyncio.create_task(self._pump(entry, reply), name=f"session-{self.number}-{sid}")

    def _on_input(self, message: p.Chunk | p.End | p.Flush, kind: str) -> None:
        entry = self._open(message.id)
        if not entry.start.stream_input:
            raise p.ProtocolError(p.BAD_REQUEST, f"'{kind}' needs a stream started with stream_input: true",
                                  message.id)
        if entry.stream.input_closed:
            raise p.ProtocolError(p.BAD_REQUEST, f"the input of stream {message.id!r} has already ended", message.id)
        try:
            if isinstance(message, p.Chunk):
                entry.stream.send_text(message.text)
            elif isinstance(message, p.Flush):
                entry.stream.flush()
            else:
                entry.stream.end_input()
        except Refused as err:
            raise p.ProtocolError.from_refused(err, message.id) from None

    def _on_request(self, message: p.Voice | p.VoiceDelete | p.VoiceUpdate | p.VoiceAdmin | p.Lora) -> None:
        """Requests answered later, while the connection's streams go on: voice registration
        and deletion (the stream service's work, beside the engine's steps) and LoRA operations
        (on each engine thread, between two steps)."""
        if isinstance(message, p.Voice):
            if self._voice_task is not None and not self._voice_task.done():
                raise p.ProtocolError(p.BUSY, "one voice registration at a time per connection", message.id,
                                      self.service.voices.registrations.retry_after_s())
            work = self.service.voices.register(message.audio, message.transcript, message.mode, owner=self.owner,
                                               name=message.name, public=message.public)
            kind = "voice"
        elif isinstance(message, p.VoiceDelete):
            work = self._deleted(message.voice)
            kind = "voice_delete"
        elif isinstance(message, p.VoiceUpdate):
            work = _voice_updated(self.service, message, self.owner)
            kind = "voice_update"
        elif isinstance(message, p.VoiceAdmin):
            if not self.is_admin:
                raise p.ProtocolError(p.UNAUTHORIZED, "voice_admin needs a connection opened with the admin token",
                                      message.id)
            work = self._voice_admin(message)
            kind = "voice_admin"
        else:
            if not self.is_admin:
                raise p.ProtocolError(p.UNAUTHORIZED, "LoRA operations need a connection opened with the admin token",
                                      message.id)
            work = _lora_operation(self.service, message)
            kind = "lora"
        task = asyncio.ensure_future(self._answer(message.id, kind, work))
        if isinstance(message, p.Voice):
            self._voice_task = task
        self._requests.add(task)
        task.add_done_callback(self._requests.discard)

    async def _voice_admin(self, message: p.VoiceAdmin) -> dict[str, Any]:
        selected = message.owner
        if message.address is not None:
            address = parse_host(message.address)
            if address is None:
                raise Refused(ErrorKind.INVALID, f"{message.address[:64]!r} is not an IP address", field="address")
            selected = owner_key(address_owner(address, self.state.config.ipv6_prefix))
        if message.op == "delete":
            assert selected is not None                     # the parser's rule
            return {"op": "delete", "owner": selected, "deleted": await self.service.voices.delete_owned(selected)}
        voices = await self.service.voices.every(selected)
        return {"op": "list", "voices": [admin_described(v) for v in voices], "usage": await self.service.voices.store.usage()}

    async def _deleted(self, voice: str) -> dict[str, Any]:
        return {"voice": voice, "deleted": await self.service.voices.delete(voice, owner=self.owner)}

    async def _answer(self, request_id: str | None, kind: str, work: Any) -> None:
        """Every request is answered: its reply, or an error (a failure nobody foresaw too)."""
        try:
            result = await work
        except Refused as err:
            if err.kind == ErrorKind.INTERNAL:
                log.warning("%s request failed: %s", kind, err.message)
                err.message = f"{kind} failed: {err.message}"
            self._error(p.ProtocolError.from_refused(err, request_id))
            return
        except Exception as exc:
            log.error("%s request failed: %s: %s", kind, type(exc).__name__, exc)
            self._error(p.ProtocolError.from_refused(
                Refused(ErrorKind.INTERNAL, f"{kind} failed: {type(exc).__name__}"), request_id))
            return
        self._send(p.encode(p.reply_message(kind, result, request_id)))

    # -------------------------------------------------------------- a stream's frames

    async def _pump(self, entry: _OpenStream, start_reply: bytes) -> None:
        """Sends one stream's frames in order: its `start`, its events, its `end` or `error`.
        It takes the next event only once the previous frame is written."""
        sid = entry.sid
        segment_events = entry.start.segment_events
        try:
            if not await self._write(start_reply):
                return
            async for event in entry.stream:
                if isinstance(event, Segment) and not segment_events:
                    continue
                if isinstance(event, (Ended, Failed)):
                    self.streams.pop(sid, None)
                    self.last_activity = time.monotonic()
                    if isinstance(event, Failed):
                        self.metrics.errors.labels(p.code_for(event.kind)).inc()
                frame = p.encode(p.event_message(sid, event))
                if not await self._write(frame):
                    return
        finally:
            if self.streams.get(sid) is entry:
                self.streams.pop(sid, None)
            entry.stream.close()

    async def _write(self, frame: bytes) -> bool:
        if self._closing:
            return False
        try:
            await self._asgi_send({"type": "websocket.send", "bytes": frame})
            return True
        except _SEND_CLOSED:
            self._closing = True
            return False

    # -------------------------------------------------------------- control replies

    def _send(self, frame: bytes) -> None:
        if self._closing:
            return
        if self._outbox.qsize() >= MAX_QUEUED_FRAMES:
            self._close_for_policy("client is not reading")
            return
        self._outbox.put_nowait(frame)

    def _close_for_policy(self, reason: str) -> None:
        """Close at once with 1008, without flushing: the client is misbehaving."""
        if not self._closing:
            log.warning("session %d: %s; closing", self.number, reason)
            self._closing = True
            asyncio.ensure_future(self._close_now(p.CLOSE_POLICY, reason))

    async def _write_loop(self) -> None:
        while True:
            frame = await self._outbox.get()
            try:
                if not await self._write(frame):
                    return
            finally:
                self._outbox.task_done()

    # -------------------------------------------------------------- timers

    async def _watchdog(self) -> None:
        """Reaps the connection once it has had no stream and no message for the idle time."""
        tick = min(1.0, self.limits.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            if not self.streams and time.monotonic() - self.last_activity > self.limits.idle_timeout_s:
                log.info("session %d idle for %.0fs: closing", self.number, self.limits.idle_timeout_s)
                self.metrics.reaped.inc()
                await self.close(p.CLOSE_IDLE, "idle timeout")
                return


async def _voice_updated(service: StreamService, message: p.VoiceUpdate, owner: str) -> dict[str, Any]:
    """`voice_update`: a voice of `owner`'s made public, or private again."""
    changed = await service.voices.sharing.set_public(message.voice, owner, message.public)
    if changed is None:
        return {"voice": message.voice, "updated": False}
    return {"voice": changed.id, "name": changed.name, "public": changed.public, "updated": True}


def _lora_operation(service: StreamService, message: p.Lora) -> Awaitable[dict[str, Any]]:
    """A `lora` message's operation, as the service's verb for it."""
    loras = service.loras
    if message.op == "load":
        return loras.load(message.name)
    if message.op == "unload":
        return loras.unload(message.name)
    if message.op == "enable":
        return loras.set_default(message.name)
    return loras.clear_default()
