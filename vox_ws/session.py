"""One protocol v1 connection's rules, with no socket: every connection is a session.

Sans-I/O, as websockets' `Protocol` is: no asyncio, no socket, no clock of its own beyond the
one it is given. Its driver (`transports/v1_connection.py`) reads frames, decodes and parses
them (`transports/protocol.py`) and tells the session what each one asks; the session applies
the connection's rules (stream ids and auto ids, duplicates, `max_streams`, input to a stream
that takes none, admin-only requests, one voice registration at a time, refused messages in a
row, the message budget, idleness) and answers with what to do:

- what the stream service is asked at once (`OpenStream`, `SendText`, `FlushInput`, `EndInput`,
  `CancelStream`) goes through the driver's `perform`, while the message is handled, because
  the service may refuse it there (`Refused`) and that refusal is this message's error;
- what to send and what to start is returned, in order: `SendError` (one `error` frame),
  `RunRequest` (a voice or LoRA request, answered later by the driver with a reply of its
  kind), `CloseConnection` (close now, without flushing: the client misbehaves).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from . import wire
from .config import Limits
from .engine import ErrorKind, Refused
from .service import StreamRequest
from .wire import (
    BAD_REQUEST,
    BUSY,
    CLOSE_POLICY,
    DUPLICATE_STREAM,
    RATE_LIMITED,
    TOO_MANY_STREAMS,
    UNAUTHORIZED,
    UNKNOWN_STREAM,
)

# Refused messages in a row (bad frames, unknown streams...) after which the connection is
# closed (1008): a client that only sends errors is broken or hostile.
MAX_ERRORS_IN_A_ROW = 50

# Requests only a connection opened with the admin token may make, and what the others are told.
ADMIN_ONLY = {wire.VoiceAdmin.TYPE: "voice_admin needs a connection opened with the admin token",
              wire.Lora.TYPE: "LoRA operations need a connection opened with the admin token"}
# The request that may run once at a time per connection (a registration holds the service's
# encoder; a second waits its turn elsewhere).
ONE_AT_A_TIME = wire.Voice.TYPE


# The messages that belong to no stream: answered by a reply of their type, carrying their `id`.
Request = wire.Voice | wire.VoiceDelete | wire.VoiceUpdate | wire.VoiceAdmin | wire.Lora


class StreamHandle(Protocol):
    """An open stream as the driver holds it; the session reads its state, never its events."""

    @property
    def done(self) -> bool: ...

    @property
    def input_closed(self) -> bool: ...

    @property
    def input_streaming(self) -> bool: ...


# ------------------------------------------------------------------ what the session asks for


@dataclass(frozen=True)
class OpenStream:
    """Open a stream under `id` for `request`; the driver answers with its `StreamHandle` and
    sends its frames (`segment` events only where asked)."""

    id: str
    request: StreamRequest
    segment_events: bool


@dataclass(frozen=True)
class SendText:
    id: str
    text: str


@dataclass(frozen=True)
class FlushInput:
    id: str


@dataclass(frozen=True)
class EndInput:
    id: str


@dataclass(frozen=True)
class CancelStream:
    id: str


StreamAction = OpenStream | SendText | FlushInput | EndInput | CancelStream


@dataclass(frozen=True)
class SendError:
    """Send one `error` frame."""

    code: str
    message: str
    id: str | None = None
    retry_after_s: float | None = None

    @classmethod
    def from_refused(cls, err: Refused, id: str | None = None) -> "SendError":
        return cls(code_for(err.kind), err.message, id, err.retry_after_s)


@dataclass(frozen=True)
class RunRequest:
    """Run a request that belongs to no stream (a `voice`, `voice_delete`, `voice_update`,
    `voice_admin` or `lora` message) and answer it, with its reply or an error, while the
    streams go on."""

    message: Request

    @property
    def kind(self) -> str:
        """The message's type, which its reply carries."""
        return self.message.TYPE

    @property
    def id(self) -> str | None:
        return self.message.id


@dataclass(frozen=True)
class CloseConnection:
    """Close now with `code`, sending nothing more."""

    code: int
    reason: str


Output = SendError | RunRequest | CloseConnection


def code_for(kind: ErrorKind) -> str:
    """The wire code of an engine or stream-service error kind (every door's: v1, HTTP, Wyoming)."""
    return BAD_REQUEST if kind == ErrorKind.INVALID else kind.value


class _Refusal(Exception):
    """A message this session refuses: its error frame."""

    def __init__(self, error: SendError) -> None:
        super().__init__(error.message)
        self.error = error


def _counted(verb: Callable[..., list[Output]]) -> Callable[..., list[Output]]:
    """A message's verb, with the connection's accounting: a refused message counts toward the
    errors in a row; only a message that did something is activity (a client that sends
    nothing but errors is reaped like an idle one)."""

    @functools.wraps(verb)
    def counted(self: "Session", *args: Any) -> list[Output]:
        try:
            outputs = verb(self, *args)
        except _Refusal as refusal:
            return self.refused(refusal.error)
        self._errors_in_a_row = 0
        self.last_activity = self._clock()
        return outputs

    return counted


class Session:
    """The rules of one protocol v1 connection, from its first message to its last."""

    def __init__(self, limits: Limits, perform: Callable[[StreamAction], StreamHandle | None],
                 busy_retry_after: Callable[[], float | None] = lambda: None, is_admin: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.is_admin = is_admin
        self.streams: dict[str, StreamHandle] = {}
        self._perform = perform
        self._busy_retry_after = busy_retry_after
        self._clock = clock
        self.last_activity = clock()
        self._auto_ids = itertools.count(1)
        self._errors_in_a_row = 0
        self._running: set[str] = set()        # requests of the one-at-a-time kind in flight

    # -------------------------------------------------------------- what a message asks

    @_counted
    def start(self, sid: str | None, request: StreamRequest, segment_events: bool) -> list[Output]:
        if sid is None:
            sid = f"s{next(self._auto_ids)}"
            while sid in self.streams:
                sid = f"s{next(self._auto_ids)}"
        if sid in self.streams:
            raise _Refusal(SendError(DUPLICATE_STREAM, f"stream {sid!r} is already open on this connection",
                                     sid))
        if len(self.streams) >= self.limits.max_streams:
            raise _Refusal(SendError(TOO_MANY_STREAMS, f"{len(self.streams)} streams open, "
                                                       f"max_streams={self.limits.max_streams}", sid))
        handle = self._service(OpenStream(sid, request, segment_events), sid)
        assert handle is not None
        self.streams[sid] = handle
        return []

    @_counted
    def send_text(self, sid: str, text: str) -> list[Output]:
        self._service(SendText(sid, text), self._input_open(sid, wire.Chunk.TYPE))
        return []

    @_counted
    def flush(self, sid: str) -> list[Output]:
        self._service(FlushInput(sid), self._input_open(sid, wire.Flush.TYPE))
        return []

    @_counted
    def end_input(self, sid: str) -> list[Output]:
        self._service(EndInput(sid), self._input_open(sid, wire.End.TYPE))
        return []

    @_counted
    def cancel(self, sid: str) -> list[Output]:
        self._open(sid)
        self._service(CancelStream(sid), sid)
        return []

    @_counted
    def request(self, message: Request) -> list[Output]:
        """A request answered later, while the connection's streams go on: voice registration,
        deletion and sharing (the stream service's work, beside the engine's steps), an admin's
        view of every owner's voices, LoRA operations (on each engine thread, between steps)."""
        kind, request_id = message.TYPE, message.id
        if kind == ONE_AT_A_TIME and kind in self._running:
            raise _Refusal(SendError(BUSY, "one voice registration at a time per connection", request_id,
                                     self._busy_retry_after()))
        if kind in ADMIN_ONLY and not self.is_admin:
            raise _Refusal(SendError(UNAUTHORIZED, ADMIN_ONLY[kind], request_id))
        if kind == ONE_AT_A_TIME:
            self._running.add(kind)
        return [RunRequest(message)]

    def refused(self, error: SendError) -> list[Output]:
        """A message refused (by the driver's decoding, or here): its error, and the connection
        closed once too many come in a row."""
        self._errors_in_a_row += 1
        if self._errors_in_a_row >= MAX_ERRORS_IN_A_ROW:
            return [error, CloseConnection(CLOSE_POLICY, f"{MAX_ERRORS_IN_A_ROW} refused messages in a row")]
        return [error]

    def over_budget(self, exhausted: bool) -> list[Output]:
        """A message over the connection's message budget: dropped, and told so; once the budget
        is exhausted (a flood), the connection is closed."""
        if exhausted:
            return [CloseConnection(CLOSE_POLICY, "message rate limit exceeded")]
        return [SendError(RATE_LIMITED, f"more than {self.limits.max_messages_per_s:g} messages per second: "
                                        "message dropped")]

    # -------------------------------------------------------------- what the driver reports

    def stream_ended(self, sid: str, handle: StreamHandle, by_its_end: bool) -> None:
        """A stream's frames are over: by its `end` or `error` (activity: the client got an
        answer), or its pump stopped (the connection is closing)."""
        if self.streams.get(sid) is handle:
            del self.streams[sid]
        if by_its_end:
            self.last_activity = self._clock()

    def answered(self, kind: str) -> None:
        """A request of `kind` has been answered (or abandoned)."""
        self._running.discard(kind)

    def idle(self) -> bool:
        """No stream and no message for the idle time: the connection is to be reaped."""
        return not self.streams and self._clock() - self.last_activity > self.limits.idle_timeout_s

    # -------------------------------------------------------------- rules

    def _open(self, sid: str) -> StreamHandle:
        handle = self.streams.get(sid)
        if handle is None or handle.done:
            raise _Refusal(SendError(UNKNOWN_STREAM, f"no open stream with id {sid!r}", sid))
        return handle

    def _input_open(self, sid: str, kind: str) -> str:
        """`sid`, once it is an open stream that takes text and whose input has not ended."""
        handle = self._open(sid)
        if not handle.input_streaming:
            raise _Refusal(SendError(BAD_REQUEST, f"'{kind}' needs a stream started with stream_input: true",
                                     sid))
        if handle.input_closed:
            raise _Refusal(SendError(BAD_REQUEST, f"the input of stream {sid!r} has already ended", sid))
        return sid

    def _service(self, action: StreamAction, sid: str) -> StreamHandle | None:
        try:
            return self._perform(action)
        except Refused as err:
            raise _Refusal(SendError.from_refused(err, sid)) from None
