"""Protocol v1's shared vocabulary, for both sides of the socket: the error and close codes, the
messages a client sends, and the one frame encoding (a msgpack map per binary frame).

It imports nothing of the server, so a client (`vox_ws/clients/v1.py`, the framework integrations,
the benchmarks) loads this and no stream service, engine loop or engine; the server's door
(`transports/protocol.py`) takes its codes and messages from here and adds what only a server
does (checking a client's messages against its limits, its own replies). docs/PROTOCOL.md is the
reference.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, TypeVar, Union

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
# Close codes a client sees without the server choosing them (the peer went away; no close frame).
CLOSE_GOING_AWAY = 1001
CLOSE_ABNORMAL = 1006
# The closes after which connecting again (elsewhere, or later) may work.
RECONNECT_CLOSE_CODES = frozenset({CLOSE_GOING_AWAY, CLOSE_ABNORMAL, CLOSE_INTERNAL, CLOSE_SERVICE_RESTART,
                                   CLOSE_TRY_AGAIN_LATER})

MAX_ID_CHARS = 128

# A `lora` message's operations, and a `voice_admin` message's.
LORA_OPS = ("load", "unload", "enable", "disable")
VOICE_ADMIN_OPS = ("list", "delete")


def encode(message: Any) -> bytes:
    """One message (one of this module's, or any msgpack value: a test's malformed frame) as one
    binary frame; bytes (audio) stay msgpack `bin`."""
    to_map = getattr(message, "to_map", None)
    return msgpack.packb(to_map() if to_map else message, use_bin_type=True)


# What one frame from a server may cost a client to decode, a frame past them a protocol
# violation: one 8 MB frame of empty arrays took `vox-ws say` from 45 to 611 MB (Hardening VII,
# 4). The largest frame a server sends is a chunk of 4 s of f32 at 48 kHz (768 KB: 1 s of the
# engine's audio at speed 0.25), or of 1 s at speed 1 (192 KB); a `voice_admin`
# list of 256 voices, or an `end` of a long stream's hundreds of segments, some tens of KB.
MAX_SERVER_FRAME_BYTES = 1 << 20
MAX_SERVER_CONTAINERS = 16384          # maps and arrays in one frame, and entries in one
# The most audio one chunk carries (docs/PROTOCOL.md, `chunk`): 1 s of the engine's, which at the
# slowest speed (`codecs.MIN_SPEED`; an alias's speed times the request's is kept within it) is 4 s
# of the stream's output.
MAX_CHUNK_S = 1.0
SLOWEST_SPEED = 0.25
# Bytes one sample of a format takes at most: PCM's own; no codec makes more of a second than
# 16-bit PCM does (FLAC's verbatim frames are 16-bit PCM and a header).
_CHUNK_BYTES_PER_SAMPLE = {"f32": 4, "mulaw": 1}


class ContainerBudget:
    """A msgpack hook that refuses a frame once it has built more than `limit` maps and arrays,
    so decoding stops early instead of building them all (ValueError)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.left = limit

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {self.limit} maps or arrays")
        return container


def decode(data: bytes) -> Any:
    """One frame's message (a map, from a server that keeps to the protocol); ValueError for a
    frame past what a server's may cost (MAX_SERVER_FRAME_BYTES, MAX_SERVER_CONTAINERS)."""
    if len(data) > MAX_SERVER_FRAME_BYTES:
        raise ValueError(f"a frame of {len(data)} bytes, over the {MAX_SERVER_FRAME_BYTES} a server's "
                         "may have")
    budget = ContainerBudget(MAX_SERVER_CONTAINERS)
    return msgpack.unpackb(data, raw=False, max_array_len=MAX_SERVER_CONTAINERS,
                           max_map_len=MAX_SERVER_CONTAINERS, list_hook=budget, object_hook=budget)


def max_chunk_seconds() -> float:
    """The most seconds of a stream's output one chunk carries: MAX_CHUNK_S of the engine's audio
    at the slowest speed."""
    return MAX_CHUNK_S / SLOWEST_SPEED


def max_chunk_bytes(fmt: str, sample_rate: int) -> int:
    """The most bytes a chunk of a stream of `fmt` at `sample_rate` carries: `max_chunk_seconds`
    of its audio, a tenth more (resampling's and a codec's few milliseconds: an encoder's last
    frames come with the last chunk) and 8 KiB (a file's header)."""
    per_sample = _CHUNK_BYTES_PER_SAMPLE.get(fmt, 2)
    return int(per_sample * sample_rate * max_chunk_seconds() * 1.1) + 8192


def chunk_problem(chunk: "AudioChunk", fmt: str, sample_rate: int) -> str | None:
    """What protocol v1 forbids in a server's chunk of a stream of `fmt` at `sample_rate`, if
    anything: audio that is not bytes, or more than `max_chunk_bytes`."""
    audio = chunk.audio if chunk.audio is not None else b""
    packets = chunk.packets or []
    if not isinstance(audio, bytes) or not isinstance(packets, list) \
            or not all(isinstance(p, bytes) for p in packets):
        return "audio that is not bytes"
    size = len(audio) + sum(len(p) for p in packets)
    if size > max_chunk_bytes(fmt, sample_rate):
        return (f"{size} bytes of audio, more than {max_chunk_seconds():g} s of {fmt} at {sample_rate} Hz "
                f"({MAX_CHUNK_S:g} s of the engine's audio at the slowest speed)")
    return None


# --------------------------------------------------------------------------- a client's messages


_Message = TypeVar("_Message", bound="_ClientMessage")


class _ClientMessage:
    """What every message a client sends does: make its map, and read one back.

    The map leaves out a field that is None or at its default, as clients have always sent them
    (the server reads a field left out as its default); `_ALWAYS` names those sent even so, and
    `_LEADING` those that come first, after `type`. Reading is the other way round and checks
    nothing: a field absent or None is its default (a required one None), unknown fields are
    skipped. Limits and types are the server's to check (`transports/protocol.py`)."""

    TYPE: ClassVar[str]
    _ALWAYS: ClassVar[tuple[str, ...]] = ()
    _LEADING: ClassVar[tuple[str, ...]] = ()

    def to_map(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.TYPE}
        fields = sorted(dataclasses.fields(self), key=lambda item: item.name not in self._LEADING)  # stable
        for item in fields:
            value = getattr(self, item.name)
            if value is not None and (item.name in self._ALWAYS or value != _default(item)):
                message[item.name] = value
        return message

    @classmethod
    def from_map(cls: type[_Message], obj: Mapping[str, Any]) -> _Message:
        values: dict[str, Any] = {}
        for item in dataclasses.fields(cls):
            value = obj.get(item.name)
            if value is not None or _default(item) is dataclasses.MISSING:
                values[item.name] = value
        return cls(**values)


def _default(item: dataclasses.Field) -> Any:
    """A field's default (MISSING for a required one)."""
    if item.default_factory is not dataclasses.MISSING:
        return item.default_factory()
    return item.default


@dataclass(frozen=True)
class Speech:
    """How a stream is to be spoken: every `start` field but its id, its text and `stream_input`
    (PROTOCOL.md's `start` table), at the protocol's defaults. A client takes one, or its fields
    by name: a field added here is a field of every client method, and of `Start`."""

    voice: str | None = None
    speaker: str | int | None = None        # by its name, or by its number as Piper takes it
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
    def of(cls: type[_Speech], speech: "Speech | None", fields: dict[str, Any]) -> _Speech:
        """One of this class with `speech`'s fields (or the defaults), and `fields` set; a name
        that is no field is a TypeError naming it."""
        unknown = set(fields) - {item.name for item in dataclasses.fields(cls)}
        if unknown:
            raise TypeError(f"not a field of a stream's start: {', '.join(sorted(unknown))}")
        names = [item.name for item in dataclasses.fields(Speech)]
        kept = {name: getattr(speech, name) for name in names} if speech else {}
        return cls(**{**kept, **fields})


_Speech = TypeVar("_Speech", bound=Speech)


@dataclass(frozen=True)
class Start(Speech, _ClientMessage):
    """`start`: open a stream. `id` None: the server names it (`s1`, ...); `text` None: none yet
    (with `stream_input`, the text comes in `Chunk`s). The format is always sent."""

    TYPE: ClassVar[str] = "start"
    _ALWAYS: ClassVar[tuple[str, ...]] = ("format",)
    _LEADING: ClassVar[tuple[str, ...]] = ("id", "text", "stream_input")

    id: str | None = None
    text: str | None = None
    stream_input: bool = False

    @classmethod
    def from_map(cls, obj: Mapping[str, Any]) -> "Start":
        if "language" not in obj and "lang_code" in obj:         # the name some clients give it
            obj = {**obj, "language": obj["lang_code"]}
        return super().from_map(obj)


@dataclass(frozen=True)
class Chunk(_ClientMessage):
    """`chunk`: more text for a stream opened with `stream_input`."""

    TYPE: ClassVar[str] = "chunk"
    id: str
    text: str


@dataclass(frozen=True)
class Flush(_ClientMessage):
    """`flush`: speak what was sent so far now; answered `flushed` once it is spoken."""

    TYPE: ClassVar[str] = "flush"
    id: str


@dataclass(frozen=True)
class End(_ClientMessage):
    """`end`: no more text; the stream ends once it is all spoken."""

    TYPE: ClassVar[str] = "end"
    id: str


@dataclass(frozen=True)
class Cancel(_ClientMessage):
    """`cancel`: barge-in; the stream ends at once with `end` (`reason: cancelled`, `heard`)."""

    TYPE: ClassVar[str] = "cancel"
    id: str


# The requests that belong to no stream carry an optional `id`, echoed in their answer; it is
# their last field, as clients have always sent it.


@dataclass(frozen=True)
class Voice(_ClientMessage):
    """`voice`: register a voice from reference audio (WAV, FLAC or OGG bytes), optionally with
    its transcript; `mode` None: the server's default for the transcript given; `name`: what the
    owner will call it (unique per owner); `public`: spoken by its name by anyone served, and
    listed to them (needs a name)."""

    TYPE: ClassVar[str] = "voice"
    audio: bytes
    name: str | None = None
    public: bool = False
    transcript: str | None = None
    mode: str | None = None
    id: str | None = None


@dataclass(frozen=True)
class VoiceDelete(_ClientMessage):
    """`voice_delete`: delete a voice of the caller's, by its id or its name."""

    TYPE: ClassVar[str] = "voice_delete"
    voice: str
    id: str | None = None


@dataclass(frozen=True)
class VoiceUpdate(_ClientMessage):
    """`voice_update`: make a voice of the caller's (by its id or name) public, or private again."""

    TYPE: ClassVar[str] = "voice_update"
    voice: str
    public: bool
    id: str | None = None


@dataclass(frozen=True)
class VoiceAdmin(_ClientMessage):
    """`voice_admin` (admin): `list` every owner's voices (or one owner's, where named), or
    `delete` one owner's. The owner is its key as listed, or a token-less client's address."""

    TYPE: ClassVar[str] = "voice_admin"
    op: str
    owner: str | None = None
    address: str | None = None
    id: str | None = None


@dataclass(frozen=True)
class Lora(_ClientMessage):
    """`lora` (admin): `load`, `unload`, `enable` or `disable` the LoRA adapter `name`."""

    TYPE: ClassVar[str] = "lora"
    op: str
    name: str | None = None
    id: str | None = None


ClientMessage = Start | Chunk | Flush | End | Cancel | Voice | VoiceDelete | VoiceUpdate | VoiceAdmin | Lora

# Every message a client may send, by its `type`.
CLIENT_MESSAGES: dict[str, type[ClientMessage]] = {
    kind.TYPE: kind
    for kind in (Start, Chunk, Flush, End, Cancel, Voice, VoiceDelete, VoiceUpdate, VoiceAdmin, Lora)
}


# --------------------------------------------------------------------------- the server's messages
# Every message the server sends, as PROTOCOL.md's "Server → client" tables name its fields. A
# field marked `_absent_when_none` is left out of the map while it is None (an optional field, as
# the server sends it); every other field is always sent, None as nil. A field's place in its
# class is its place in the map, so the bytes are those the server has always sent.


def _absent_when_none(default: Any = None) -> Any:
    return field(default=default, metadata={"optional": True})


@functools.cache
def _map_plan(cls: type) -> tuple[tuple[str, bool], ...]:
    """Each field of a server message's class and whether it is left out while None: worked out
    once per class, as every audio chunk's frame is made from it (`dataclasses.fields` each time
    made a chunk's frame 4x as costly as the map written out, 3.8 against 0.9 us)."""
    return tuple((item.name, bool(item.metadata.get("optional"))) for item in dataclasses.fields(cls))


class _ServerMessage:
    """What every server message does: its map, and itself read back from one."""

    TYPE: ClassVar[str]

    def to_map(self) -> dict[str, Any]:
        message: dict[str, Any] = {"type": self.TYPE}
        for name, optional in _map_plan(type(self)):
            value = getattr(self, name)
            if value is not None or not optional:
                message[name] = value
        return message

    @classmethod
    def from_map(cls, obj: Mapping[str, Any]) -> Any:
        """The message a map carries; a field it lacks is its default (None where it has none),
        a field it has that the class does not is ignored (a newer server's)."""
        values = {}
        for item in dataclasses.fields(cls):  # type: ignore[arg-type]
            if item.name in obj:
                values[item.name] = obj[item.name]
            elif item.default is dataclasses.MISSING and item.default_factory is dataclasses.MISSING:
                values[item.name] = None
        return cls(**values)


@dataclass(frozen=True, kw_only=True)
class Hello(_ServerMessage):
    """Sent once, first: what the server and its engine offer. Every client reads it here
    (`Hello.read`)."""

    TYPE: ClassVar[str] = "hello"
    protocol: int = 1
    server: str = ""
    status: str = ""
    engine: str = ""
    model: str | None = None
    sample_rate: int = 0
    formats: list[str] = field(default_factory=list)
    voices: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    languages: list[str] = field(default_factory=list)
    options: list[str] = field(default_factory=list)
    slots: int = 0
    step_rows: int = 0
    features: list[str] = field(default_factory=list)
    limits: dict[str, Any] = field(default_factory=dict)
    notice: str | None = _absent_when_none()

    @classmethod
    def read(cls, data: Any) -> "Hello":
        """The server's first frame as its hello; ValueError, saying what came, for anything else."""
        try:
            obj = decode(data) if isinstance(data, bytes) else data
        except Exception:  # noqa: BLE001 - whatever msgpack makes of garbage
            obj = data
        if not isinstance(obj, dict) or obj.get("type") != cls.TYPE:
            raise ValueError(f"expected the server's hello, got {obj!r:.80}")
        return cls.from_map(obj)


@dataclass(frozen=True, kw_only=True)
class Started(_ServerMessage):
    """The answer to a client's `start`, before any of the stream's chunks."""

    TYPE: ClassVar[str] = "start"
    id: str
    sample_rate: int
    format: str
    channels: int = 1
    queued: int | None = _absent_when_none()            # its place in the queue, while it waits
    ignored_options: list[str] | None = _absent_when_none()


@dataclass(frozen=True, kw_only=True)
class AudioChunk(_ServerMessage):
    """A piece of a stream's audio: `audio`, or for `opus_packets` the packets, their durations
    and, on the first chunk, the codec's description and pre-skip."""

    TYPE: ClassVar[str] = "chunk"
    id: str
    seq: int
    audio: bytes | None = _absent_when_none()
    packets: list[bytes] | None = _absent_when_none()
    durations_us: list[int] | None = _absent_when_none()
    description: bytes | None = _absent_when_none()
    pre_skip: int | None = _absent_when_none()


@dataclass(frozen=True, kw_only=True)
class Segment(_ServerMessage):
    """A segment of the text has all been sent (streams with `segment_events`)."""

    TYPE: ClassVar[str] = "segment"
    id: str
    index: int
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True, kw_only=True)
class Words(_ServerMessage):
    """Words and their times, `{word, start_s, end_s, estimated?}` each (streams with
    `word_timestamps`)."""

    TYPE: ClassVar[str] = "words"
    id: str
    words: list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Phonemes(_ServerMessage):
    """Phonemes and their times, `{phoneme, start_s, end_s}` each (streams with
    `phoneme_timestamps`)."""

    TYPE: ClassVar[str] = "phonemes"
    id: str
    phonemes: list[dict[str, Any]]


@dataclass(frozen=True, kw_only=True)
class Flushed(_ServerMessage):
    """The audio of the text sent before a `flush` has all been sent."""

    TYPE: ClassVar[str] = "flushed"
    id: str
    audio_s: float


@dataclass(frozen=True, kw_only=True)
class Ended(_ServerMessage):
    """A stream's last message when it ended normally or was cancelled, with its figures."""

    TYPE: ClassVar[str] = "end"
    id: str
    reason: str
    segments: list[dict[str, Any]] = field(default_factory=list)
    usage: dict[str, Any] = field(default_factory=dict)
    heard: dict[str, Any] | None = _absent_when_none()    # after a cancel: what was sent before it
    chunks: int | None = None
    audio_s: float | None = None
    ttfa_ms: float | None = None
    rtf: float | None = None
    rewrites: list[list[Any]] | None = _absent_when_none()  # flac, wav: [offset, bytes] to write over


@dataclass(frozen=True, kw_only=True)
class Error(_ServerMessage):
    """A refusal: a stream's last message, a request's answer, or the connection's. `retryable`
    is the code's (`RETRYABLE`) unless given."""

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    retryable: bool | None = None        # None: the code's (always a bool once made)
    id: str | None = _absent_when_none()
    retry_after_s: float | None = _absent_when_none()

    def __post_init__(self) -> None:
        if self.retryable is None:
            object.__setattr__(self, "retryable", self.code in RETRYABLE)


@dataclass(frozen=True, kw_only=True)
class VoiceRegistered(_ServerMessage):
    """The answer to `voice`: the voice's id, how it was cloned, its reference's length."""

    TYPE: ClassVar[str] = "voice"
    voice: str
    mode: str
    audio_s: float
    name: str | None = _absent_when_none()
    public: bool = False
    id: str | None = _absent_when_none()


@dataclass(frozen=True, kw_only=True)
class VoiceDeleted(_ServerMessage):
    """The answer to `voice_delete`."""

    TYPE: ClassVar[str] = "voice_delete"
    voice: str
    deleted: bool
    id: str | None = _absent_when_none()


@dataclass(frozen=True, kw_only=True)
class VoiceUpdated(_ServerMessage):
    """The answer to `voice_update`: `name` and `public` only where it `updated` (the name nil
    for a voice without one)."""

    TYPE: ClassVar[str] = "voice_update"
    voice: str
    name: str | None = None
    public: bool | None = None
    updated: bool
    id: str | None = _absent_when_none()

    def to_map(self) -> dict[str, Any]:
        message = super().to_map()
        if not self.updated:
            del message["name"], message["public"]
        return message


@dataclass(frozen=True, kw_only=True)
class VoiceAdminReply(_ServerMessage):
    """The answer to `voice_admin`: `list` gives `voices` and `usage`, `delete` the `owner` and
    the voices `deleted`."""

    TYPE: ClassVar[str] = "voice_admin"
    op: str
    owner: str | None = _absent_when_none()
    deleted: list[str] | None = _absent_when_none()
    voices: list[dict[str, Any]] | None = _absent_when_none()
    usage: dict[str, Any] | None = _absent_when_none()
    id: str | None = _absent_when_none()


@dataclass(frozen=True, kw_only=True)
class LoraReply(_ServerMessage):
    """The answer to `lora`: what the operation did (`load`: the adapter's slot and keys;
    `unload`: whether its slot is free; `enable`/`disable`: the `default`, nil for none), and
    the adapters after it (`lora`)."""

    TYPE: ClassVar[str] = "lora"
    op: str
    name: str | None = _absent_when_none()
    slot: int | None = _absent_when_none()
    rank: int | None = _absent_when_none()
    scaling: float | None = _absent_when_none()
    loaded: int | None = _absent_when_none()
    skipped: int | None = _absent_when_none()
    skipped_keys: list[str] | None = _absent_when_none()
    unloaded: bool | None = _absent_when_none()
    streams_using: int | None = _absent_when_none()
    default: str | None = None
    lora: dict[str, Any] = field(default_factory=dict)
    id: str | None = _absent_when_none()

    def to_map(self) -> dict[str, Any]:
        message = super().to_map()
        if self.op not in ("enable", "disable"):      # only those answer with the default
            del message["default"]
        return message


@dataclass(frozen=True)
class Unknown:
    """A message of a type this client does not know (a newer server's): skip it."""

    type: str
    fields: dict[str, Any]


ServerMessage = Union[Hello, Started, AudioChunk, Segment, Words, Phonemes, Flushed, Ended, Error,
                      VoiceRegistered, VoiceDeleted, VoiceUpdated, VoiceAdminReply, LoraReply, Unknown]

SERVER_MESSAGES: dict[str, type] = {cls.TYPE: cls for cls in (
    Hello, Started, AudioChunk, Segment, Words, Phonemes, Flushed, Ended, Error,
    VoiceRegistered, VoiceDeleted, VoiceUpdated, VoiceAdminReply, LoraReply)}


def server_message(obj: Any) -> ServerMessage:
    """A decoded frame as the server message its `type` names (`Unknown` for a type not known);
    ValueError for one that is no v1 message (not a map, or one without a string `type`)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("type"), str):
        raise ValueError(f"a frame that is no protocol v1 message: {obj!r:.60}")
    kind = obj["type"]
    cls = SERVER_MESSAGES.get(kind)
    if cls is None:
        return Unknown(kind, {name: value for name, value in obj.items() if name != "type"})
    return cls.from_map(obj)


def read(data: bytes) -> ServerMessage:
    """One frame from the server as its message; ValueError for a frame that is no v1 message."""
    return server_message(decode(data))
