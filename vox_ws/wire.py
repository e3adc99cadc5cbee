"""Protocol v1's shared vocabulary, for both sides of the socket: the error and close codes, the
frames a client sends, and the one frame encoding (a msgpack map per binary frame).

It imports nothing of the server, so a client (`client.py`, the framework integrations, the
benchmarks) loads this and no stream service, engine loop or engine; the server's door
(`transports/protocol.py`) takes its codes from here and adds what only a server does (parsing
and checking a client's frames, its own replies). docs/PROTOCOL.md is the reference.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import msgpack

# Error codes (the `code` of an `error` message).
BAD_FRAME = "bad_frame"
BAD_REQUEST = "bad_request"
UNKNOWN_STREAM = "unknown_stream"
DUPLICATE_STREAM = "duplicate_stream"
TOO_LARGE = "too_large"
TOO_MANY_STREAMS = "too_many_streams"
BUSY = "busy"
NOT_READY = "not_ready"
TIMEOUT = "timeout"
INTERNAL = "internal"
SLOW_CONSUMER = "slow_consumer"
UNSUPPORTED = "unsupported"
UNAUTHORIZED = "unauthorized"
RATE_LIMITED = "rate_limited"
GOING_AWAY = "going_away"
UNAVAILABLE = "unavailable"
ERROR_CODES = (
    BAD_FRAME, BAD_REQUEST, UNKNOWN_STREAM, DUPLICATE_STREAM, TOO_LARGE, TOO_MANY_STREAMS,
    BUSY, NOT_READY, TIMEOUT, INTERNAL, SLOW_CONSUMER, UNSUPPORTED, UNAUTHORIZED, RATE_LIMITED, GOING_AWAY,
    UNAVAILABLE,
)
# The codes an `error` marks `retryable`: the same request may succeed later, or elsewhere.
RETRYABLE = frozenset({BUSY, NOT_READY, TIMEOUT, SLOW_CONSUMER, GOING_AWAY, RATE_LIMITED, UNAVAILABLE})

# WebSocket close codes used by the server.
CLOSE_SERVICE_RESTART = 1012     # the server is draining (shutting down): reconnect, elsewhere
CLOSE_POLICY = 1008              # policy violation: flooding, or not reading while sending
CLOSE_INTERNAL = 1011            # the engine died
CLOSE_TRY_AGAIN_LATER = 1013     # server at its connection limit, or full: reconnect, elsewhere or later
CLOSE_IDLE = 4000                # idle timeout: no open stream and no message
CLOSE_UNAUTHORIZED = 4001        # no valid token presented
CLOSE_TOO_MANY_FROM_ADDRESS = 4029  # too many connections from this client address

MAX_ID_CHARS = 128

# A `lora` message's operations.
LORA_OPS = ("load", "unload", "enable", "disable")


def encode(message: dict[str, Any]) -> bytes:
    """One message as one binary frame; bytes (audio) stay msgpack `bin`."""
    return msgpack.packb(message, use_bin_type=True)


def decode(data: bytes) -> Any:
    """One frame's message (a map, from a server that keeps to the protocol)."""
    return msgpack.unpackb(data, raw=False)


# --------------------------------------------------------------------------- a client's frames


@dataclass(frozen=True)
class Speech:
    """How a stream is to be spoken: every `start` field but its id, its text and `stream_input`
    (PROTOCOL.md's `start` table), at the protocol's defaults. A client takes one, or its fields
    by name: a field added here is a field of every client method."""

    voice: str | None = None
    speaker: str | None = None
    format: str = "f32"
    sample_rate: int | None = None
    speed: float = 1.0
    volume: float = 1.0
    language: str | None = None
    instructions: str | None = None
    markup: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    pronunciations: list[dict[str, Any]] = field(default_factory=list)
    lora: str | None = None
    lookahead_s: float | None = None
    segment_events: bool = False
    word_timestamps: bool = False
    phoneme_timestamps: bool = False

    @classmethod
    def of(cls, speech: "Speech | None", fields: dict[str, Any]) -> "Speech":
        """`speech` (or the defaults) with `fields` set; a name that is no field is a TypeError
        naming it."""
        unknown = set(fields) - {f.name for f in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"not a field of a stream's start: {', '.join(sorted(unknown))}")
        return dataclasses.replace(speech or cls(), **fields)

    def start_fields(self) -> dict[str, Any]:
        """The `start` fields that differ from the protocol's defaults (and the format, always)."""
        fields = {}
        for item in dataclasses.fields(self):
            value = getattr(self, item.name)
            default = item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default
            if value != default or item.name == "format":
                fields[item.name] = value
        return fields



def start_frame(sid: str, **fields: Any) -> dict[str, Any]:
    """`start`: open stream `sid`; `fields` as PROTOCOL.md's table (text, voice, format, ...),
    those given as None left out."""
    return {"type": "start", "id": sid, **{name: value for name, value in fields.items() if value is not None}}


def text_frame(sid: str, text: str) -> dict[str, Any]:
    """`chunk`: more text for a stream opened with `stream_input`."""
    return {"type": "chunk", "id": sid, "text": text}


def flush_frame(sid: str) -> dict[str, Any]:
    """`flush`: speak what was sent so far now; answered `flushed` once it is spoken."""
    return {"type": "flush", "id": sid}


def end_frame(sid: str) -> dict[str, Any]:
    """`end`: no more text; the stream ends once it is all spoken."""
    return {"type": "end", "id": sid}


def cancel_frame(sid: str) -> dict[str, Any]:
    """`cancel`: barge-in; the stream ends at once with `end` (`reason: cancelled`, `heard`)."""
    return {"type": "cancel", "id": sid}
