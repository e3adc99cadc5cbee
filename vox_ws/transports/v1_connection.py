"""Protocol v1 over one WebSocket: the asyncio driver of a session (`vox_ws/session.py`).

The session holds the connection's rules and no socket; this holds the socket and no rule. Its
receive loop decodes and checks each frame (`protocol.py`) and hands the message to the session
(`deliver`), performs what the session asks of the stream service, and sends what it answers;
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
from typing import Any, Awaitable, Mapping

from starlette.websockets import WebSocket, WebSocketDisconnect

from .. import wire
from ..config import Limits
from ..engine import ErrorKind, OptionSpec, Refused
from ..service import Ended, Failed, Segment, Stream
from ..service.voices.store import owner_key
from ..session import (
    CancelStream,
    CloseConnection,
    EndInput,
    FlushInput,
    OpenStream,
    Output,
    RunRequest,
    SendError,
    SendText,
    Session,
    StreamAction,
)
from . import protocol as p
from .auth import address_owner
from .connections import asgi_send
from .proxies import parse_host
from .rate import BUDGET_EXTENSION, MessageBudget
from .state import ServerState
from .voices_api import admin_described

log = logging.getLogger("vox_ws.session")

# Control replies a connection may have queued before it is judged not to read.
MAX_QUEUED_FRAMES = 1024
# Seconds a closing connection waits for what is already queued to be sent.
CLOSE_FLUSH_TIMEOUT_S = 2.0
# Errors a closed socket raises on send.
_SEND_CLOSED = (WebSocketDisconnect, RuntimeError, OSError)


class _OpenStream:
    """A stream as this connection holds it: the service's stream, its pump, what it asked."""

    __slots__ = ("sid", "stream", "segment_events", "input_streaming", "pump")

    def __init__(self, sid: str, stream: Stream, segment_events: bool, input_streaming: bool) -> None:
        self.sid = sid
        self.stream = stream
        self.segment_events = segment_events
        self.input_streaming = input_streaming
        self.pump: asyncio.Task | None = None

    @property
    def done(self) -> bool:
        return self.stream.done

    @property
    def input_closed(self) -> bool:
        return self.stream.input_closed


def deliver(session: Session, message: wire.ClientMessage) -> list[Output]:
    """A parsed message to the session's verb for it: the one place that reads a start's
    request."""
    if isinstance(message, wire.Start):
        return session.start(message.id, p.stream_request(message), message.segment_events)
    if isinstance(message, wire.Chunk):
        return session.send_text(message.id, message.text)
    if isinstance(message, wire.Flush):
        return session.flush(message.id)
    if isinstance(message, wire.End):
        return session.end_input(message.id)
    if isinstance(message, wire.Cancel):
        return session.cancel(message.id)
    return session.request(message)


def frame_in(session: Session, budget: MessageBudget, data: bytes | str, limits: Limits,
             options: Mapping[str, OptionSpec]) -> list[Output]:
    """One frame to the session: within the connection's message budget, decoded and checked
    (`protocol.py`), then the session's verb for it; what the session answers."""
    if not budget.take():
        return session.over_budget(budget.exhausted)
    try:
        obj = p.decode_frame(data, limits)
        message = p.parse_message(obj, limits, options)
    except p.ProtocolError as err:
        return session.refused(SendError(err.code, err.message, err.stream_id, err.retry_after_s))
    return deliver(session, message)


class V1Connection:
    """Serves one connection until it closes, is reaped, or the server shuts down."""

    _numbers = itertools.count(1)

    def __init__(self, ws: WebSocket, state: ServerState, is_admin: bool = False, owner: str = "") -> None:
        self.ws = ws
        self.state = state
        self.service = state.service
        self.limits = state.limits
        self.metrics = state.metrics
        self.number = next(self._numbers)
        # Whom this connection acts for (a token or an address): owns its voices, and shares
        # the slot queue's slots fairly with other clients, as does the connection itself.
        self.owner = owner or f"connection:{self.number}"
        self._owners = (self.owner, f"connection:{self.number}")
        self.session = Session(self.limits, self._perform,
                               lambda: self.service.voices.registrations.retry_after_s(), is_admin=is_admin)
        self._outbox: asyncio.Queue[bytes] = asyncio.Queue()
        self._closing = False
        self._requests: set[asyncio.Task] = set()   # voice / lora requests in flight
        # Shared with the WebSocket protocol, which draws pings from it.
        extensions = ws.scope.get("extensions") or {}
        self._budget: MessageBudget = extensions.get(BUDGET_EXTENSION) or MessageBudget(
            self.limits.max_messages_per_s)
        self.close_code: int | None = None
        self._asgi_send = asgi_send(ws)

    # -------------------------------------------------------------- life

    async def run(self) -> None:
        self._queue(p.encode(p.hello_message(self.state)))
        writer = asyncio.create_task(self._write_loop(), name=f"session-{self.number}-writer")
        watchdog = asyncio.create_task(self._watchdog(), name=f"session-{self.number}-watchdog")
        try:
            while True:
                message = await self.ws.receive()
                if message["type"] == "websocket.disconnect":
                    self.close_code = self.close_code or message.get("code")
                    break
                data = message.get("bytes")
                frame = data if data is not None else message.get("text", "")
                self._apply(frame_in(self.session, self._budget, frame, self.limits, self.state.option_specs))
        except (WebSocketDisconnect, RuntimeError):
            pass
        finally:
            self._closing = True
            for entry in list(self.session.streams.values()):
                entry.stream.close()           # the client is gone: free the slot, send nothing
            self.session.streams.clear()
            watchdog.cancel()
            writer.cancel()
            for task in self._requests:
                task.cancel()
            await asyncio.gather(writer, watchdog, return_exceptions=True)

    async def close(self, code: int, reason: str, flush: bool = True) -> None:
        """Close after sending what is already queued (e.g. the `going_away` errors of a shutdown),
        waiting at most a few seconds for a slow reader; at once, `flush` false."""
        if flush:
            pumps = [e.pump for e in self.session.streams.values() if e.pump is not None]
            try:
                await asyncio.wait_for(asyncio.gather(self._outbox.join(), *pumps, return_exceptions=True),
                                       CLOSE_FLUSH_TIMEOUT_S)
            except asyncio.TimeoutError:
                pass
        self._closing = True
        if self.close_code is None:
            self.close_code = code
        try:
            await self.ws.close(code, reason)
        except _SEND_CLOSED:
            pass

    # -------------------------------------------------------------- the session's side

    def _perform(self, action: StreamAction) -> _OpenStream | None:
        """What the session asks of the stream service, at once (raises `Refused`)."""
        if isinstance(action, OpenStream):
            sid = action.id
            stream = self.service.open_stream(action.request, owners=self._owners,
                                              log_fields={"session": self.number, "id": sid})
            entry = _OpenStream(sid, stream, action.segment_events, action.request.input_streaming)
            reply = p.encode(p.start_message(sid, stream.sample_rate, stream.format, stream.queued,
                                             stream.ignored_options))
            entry.pump = asyncio.create_task(self._pump(entry, reply), name=f"session-{self.number}-{sid}")
            return entry
        stream = self.session.streams[action.id].stream
        if isinstance(action, SendText):
            stream.send_text(action.text)
        elif isinstance(action, FlushInput):
            stream.flush()
        elif isinstance(action, EndInput):
            stream.end_input()
        else:
            assert isinstance(action, CancelStream), action
            stream.cancel()
        return None

    def _apply(self, outputs: list[Output]) -> None:
        """Sends, starts and closes what the session answered, in order."""
        for output in outputs:
            if isinstance(output, SendError):
                self.metrics.errors.labels(output.code).inc()
                self._queue(p.encode(p.error_message(
                    p.ProtocolError(output.code, output.message, output.id, output.retry_after_s))))
            elif isinstance(output, RunRequest):
                work = _request_work(self.state, self.owner, output)
                task = asyncio.ensure_future(self._answer(output, work))
                self._requests.add(task)
                task.add_done_callback(self._requests.discard)
            elif not self._closing:
                assert isinstance(output, CloseConnection), output
                # At once with 1008, without flushing: the client is misbehaving.
                log.warning("session %d: %s; closing", self.number, output.reason)
                self._closing = True
                asyncio.ensure_future(self.close(output.code, output.reason, flush=False))

    async def _answer(self, request: RunRequest, work: Awaitable[dict[str, Any]]) -> None:
        """Every request is answered: its reply, or an error (a failure nobody foresaw too)."""
        kind = request.kind
        try:
            result = await work
        except Refused as err:
            if err.kind == ErrorKind.INTERNAL:
                log.warning("%s request failed: %s", kind, err.message)
                err.message = f"{kind} failed: {err.message}"
            self._apply([SendError.from_refused(err, request.id)])
            return
        except Exception as exc:
            log.error("%s request failed: %s: %s", kind, type(exc).__name__, exc)
            self._apply([SendError.from_refused(
                Refused(ErrorKind.INTERNAL, f"{kind} failed: {type(exc).__name__}"), request.id)])
            return
        finally:
            self.session.answered(kind)
        self._queue(p.encode(p.reply_message(kind, result, request.id)))

    # -------------------------------------------------------------- frames

    async def _pump(self, entry: _OpenStream, start_reply: bytes) -> None:
        """Sends one stream's frames in order: its `start`, its events, its `end` or `error`.
        It takes the next event only once the previous frame is written."""
        sid = entry.sid
        try:
            if not await self._write(start_reply):
                return
            async for event in entry.stream:
                if isinstance(event, Segment) and not entry.segment_events:
                    continue
                if isinstance(event, (Ended, Failed)):
                    self.session.stream_ended(sid, entry, by_its_end=True)
                    if isinstance(event, Failed):
                        self.metrics.errors.labels(p.code_for(event.kind)).inc()
                frame = p.encode(p.event_message(sid, event))
                if not await self._write(frame):
                    return
        finally:
            self.session.stream_ended(sid, entry, by_its_end=False)
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

    def _queue(self, frame: bytes) -> None:
        """A control reply, for the writer to send in order."""
        if self._closing:
            return
        if self._outbox.qsize() >= MAX_QUEUED_FRAMES:
            self._apply([CloseConnection(p.CLOSE_POLICY, "client is not reading")])
            return
        self._outbox.put_nowait(frame)

    async def _write_loop(self) -> None:
        while True:
            frame = await self._outbox.get()
            try:
                if not await self._write(frame):
                    return
            finally:
                self._outbox.task_done()

    async def _watchdog(self) -> None:
        """Reaps the connection once it has had no stream and no message for the idle time."""
        tick = min(1.0, self.limits.idle_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            if self.session.idle():
                log.info("session %d idle for %.0fs: closing", self.number, self.limits.idle_timeout_s)
                self.metrics.reaped.inc()
                await self.close(p.CLOSE_IDLE, "idle timeout")
                return


# ------------------------------------------------------------------ requests' work


def _request_work(state: ServerState, owner: str, request: RunRequest) -> Awaitable[dict[str, Any]]:
    """A request's work, as the stream service's verb for it (not started: the caller awaits it)."""
    service = state.service
    message = request.message
    if isinstance(message, wire.Voice):
        return service.voices.register(message.audio, message.transcript, message.mode, owner=owner,
                                       name=message.name, public=message.public)
    if isinstance(message, wire.VoiceDelete):
        return _deleted(state, message.voice, owner)
    if isinstance(message, wire.VoiceUpdate):
        return _voice_updated(state, message, owner)
    if isinstance(message, wire.VoiceAdmin):
        return _voice_admin(state, message)
    return _lora_operation(state, message)


async def _deleted(state: ServerState, voice: str, owner: str) -> dict[str, Any]:
    return {"voice": voice, "deleted": await state.service.voices.delete(voice, owner=owner)}


async def _voice_updated(state: ServerState, message: wire.VoiceUpdate, owner: str) -> dict[str, Any]:
    """`voice_update`: a voice of `owner`'s made public, or private again."""
    changed = await state.service.voices.sharing.set_public(message.voice, owner, message.public)
    if changed is None:
        return {"voice": message.voice, "updated": False}
    return {"voice": changed.id, "name": changed.name, "public": changed.public, "updated": True}


async def _voice_admin(state: ServerState, message: wire.VoiceAdmin) -> dict[str, Any]:
    """`voice_admin`: every owner's voices listed (one owner's, where named), or one's deleted."""
    voices = state.service.voices
    selected = message.owner
    if message.address is not None:
        address = parse_host(message.address)
        if address is None:
            raise Refused(ErrorKind.INVALID, f"{message.address[:64]!r} is not an IP address",
                          field="address")
        selected = owner_key(address_owner(address, state.config.ipv6_prefix))
    if message.op == "delete":
        assert selected is not None                     # the parser's rule
        return {"op": "delete", "owner": selected, "deleted": await voices.delete_owned(selected)}
    listed = await voices.every(selected)
    return {"op": "list", "voices": [admin_described(v) for v in listed], "usage": await voices.store.usage()}


def _lora_operation(state: ServerState, message: wire.Lora) -> Awaitable[dict[str, Any]]:
    """A `lora` message's operation, as the service's verb for it."""
    loras = state.service.loras
    if message.op == "load":
        return loras.load(message.name)
    if message.op == "unload":
        return loras.unload(message.name)
    if message.op == "enable":
        return loras.set_default(message.name)
    return loras.clear_default()
