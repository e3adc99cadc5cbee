"""Protocol v1's server side: decoding and checking a client's frames, the server's replies
(the codes and the encoding both sides share are `vox_ws.wire`'s).

Pure functions and plain data only (no sockets, no asyncio), so that every rule here can be
tested exhaustively and cheaply. ``docs/PROTOCOL.md`` is the prose version of this module;
the two must agree. Generation options are validated against the specs the served engine
declares, by the rule every front door shares (`vox_ws.service.validation`), not a list kept here.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import msgpack

from ..codecs import OUTPUT_FORMATS
from ..config import Limits
from ..engine import VOICE_MODES, ErrorKind, OptionSpec, Refused, type_name
from ..service.lexicon import request_entries
from ..service import AudioOutput, StreamRequest
from ..service.events import Audio, Ended, Event, Failed, Flushed, Phonemes, Segment, Words
from ..service.validation import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, check_length, check_options
from ..service.voice_names import with_speaker
from ..service.voice_store import check_voice_name, nameless_public
# The vocabulary both sides share, under this module's names too (`p.BUSY`, `p.encode`).
from ..wire import (BAD_FRAME, BAD_REQUEST, BUSY, CLOSE_IDLE, CLOSE_INTERNAL, CLOSE_POLICY,  # noqa: F401
                    CLOSE_SERVICE_RESTART, CLOSE_TOO_MANY_FROM_ADDRESS, CLOSE_TRY_AGAIN_LATER, CLOSE_UNAUTHORIZED,
                    DUPLICATE_STREAM, ERROR_CODES, GOING_AWAY, INTERNAL, LORA_OPS, MAX_ID_CHARS, NOT_READY,
                    RATE_LIMITED, RETRYABLE, SLOW_CONSUMER, TIMEOUT, TOO_LARGE, TOO_MANY_STREAMS, UNAUTHORIZED,
                    UNKNOWN_STREAM, UNSUPPORTED, encode)
from .state import ServerState

PROTOCOL_VERSION = 1

class ProtocolError(Exception):
    """A request the server refuses; becomes one `error` message on the wire."""

    def __init__(self, code: str, message: str, stream_id: str | None = None,
                 retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.stream_id = stream_id
        self.retry_after_s = retry_after_s

    @property
    def retryable(self) -> bool:
        return self.code in RETRYABLE

    @classmethod
    def from_refused(cls, err: Refused, stream_id: str | None = None) -> "ProtocolError":
        return cls(code_for(err.kind), err.message, stream_id, err.retry_after_s)


def code_for(kind: ErrorKind) -> str:
    """The wire code of an engine or stream-service error kind."""
    return BAD_REQUEST if kind == ErrorKind.INVALID else kind.value


# A client may retry these later with the same request and expect it to work: the service's
# retryable kinds (`ErrorKind.retryable`, the one table), and this door's own flood refusal.


# --------------------------------------------------------------------------- messages


@dataclass(frozen=True)
class Start:
    """A `start`: the stream's id on this connection (None: the server names it), whether it
    wants `segment` events, and the stream's request for the service."""

    id: str | None
    request: StreamRequest
    segment_events: bool = False


@dataclass(frozen=True)
class Chunk:
    id: str
    text: str


@dataclass(frozen=True)
class End:
    id: str


@dataclass(frozen=True)
class Flush:
    id: str


@dataclass(frozen=True)
class Cancel:
    id: str


@dataclass(frozen=True)
class Voice:
    """Register a voice from reference audio (WAV or FLAC bytes), optionally with its transcript."""

    id: str | None
    audio: bytes
    transcript: str | None
    mode: str | None          # None: the server's default for the transcript given
    name: str | None = None   # what the owner will call it (unique per owner)
    public: bool = False      # spoken by its name by anyone served, and listed to them (needs a name)


@dataclass(frozen=True)
class VoiceDelete:
    id: str | None
    voice: str


@dataclass(frozen=True)
class VoiceUpdate:
    """Make a voice of the caller's (by its id or name) public, or private again."""

    id: str | None
    voice: str
    public: bool


@dataclass(frozen=True)
class VoiceAdmin:
    """An admin's view of every owner's voices: `list` them (of one owner, where named), or
    `delete` one owner's. The owner is its key as listed, or a token-less client's address."""

    id: str | None
    op: str
    owner: str | None
    address: str | None


VOICE_ADMIN_OPS = ("list", "delete")


@dataclass(frozen=True)
class Lora:
    id: str | None
    op: str
    name: str | None


ClientMessage = Start | Chunk | End | Flush | Cancel | Voice | VoiceDelete | VoiceUpdate | VoiceAdmin | Lora


# --------------------------------------------------------------------------- decoding


# What one frame may cost to decode. No client message needs more: a `start` has about ten
# fields, its options fewer than ten, and nothing nests deeper than the options map. Without
# these bounds a 2 MiB frame of two million empty maps took 130-200 ms of the event loop.
MAX_CONTAINER_LEN = 64       # entries in one map or array
MAX_CONTAINERS = 64          # maps and arrays in one frame


class _ContainerBudget:
    """A msgpack hook that refuses a frame once it has built more than MAX_CONTAINERS maps and
    arrays (of each kind), so decoding stops early instead of building them all."""

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def __call__(self, container: Any) -> Any:
        self.left -= 1
        if self.left < 0:
            raise ValueError(f"more than {MAX_CONTAINERS} maps or arrays")
        return container


def decode_frame(data: bytes | str, limits: Limits) -> dict[str, Any]:
    """Turn one WebSocket message into a msgpack map with a string `type`.

    Raises ProtocolError(bad_frame | too_large).
    """
    if isinstance(data, str):
        raise ProtocolError(BAD_FRAME, "text frames are not accepted: send one msgpack map per binary frame")
    if len(data) > limits.max_frame_bytes:
        raise ProtocolError(TOO_LARGE, f"frame of {len(data)} bytes exceeds max_frame_bytes={limits.max_frame_bytes}")
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=True, max_array_len=MAX_CONTAINER_LEN,
                              max_map_len=MAX_CONTAINER_LEN, list_hook=_ContainerBudget(),
                              object_hook=_ContainerBudget())
    except Exception as exc:  # msgpack raises many unrelated types (ValueError, StackError, ...)
        why = f": {exc}" if isinstance(exc, ValueError) else ""
        raise ProtocolError(BAD_FRAME, f"not a msgpack message of this protocol: {type(exc).__name__}{why}"[:200]) \
            from None
    if not isinstance(obj, dict):
        raise ProtocolError(BAD_FRAME, f"a message must be a msgpack map, got {_kind(obj)}")
    kind = obj.get("type")
    if not isinstance(kind, str):
        raise ProtocolError(BAD_REQUEST, "field 'type' must be a string")
    return obj


def parse_message(obj: dict[str, Any], limits: Limits, options: Mapping[str, OptionSpec]) -> ClientMessage:
    """Validate a decoded map into a typed client message; `options` are the generation options
    known to the server. Raises ProtocolError(bad_request)."""
    kind = obj["type"]
    raw_id = obj.get("id")
    # Echo the id on errors only when it is a valid id, so clients can route the error.
    sid = raw_id if isinstance(raw_id, str) and 0 < len(raw_id) <= MAX_ID_CHARS else None
    try:
        if kind == "start":
            return _parse_start(obj, limits, options)
        if kind == "chunk":
            return Chunk(id=_stream_id(obj), text=_chunk_text(obj, limits))
        if kind == "end":
            return End(id=_stream_id(obj))
        if kind == "flush":
            return Flush(id=_stream_id(obj))
        if kind == "cancel":
            return Cancel(id=_stream_id(obj))
        if kind == "voice":
            return _parse_voice(obj, limits)
        if kind == "voice_delete":
            return VoiceDelete(id=_request_id(obj), voice=_required_str(obj, "voice"))
        if kind == "voice_update":
            public = obj.get("public")
            if not isinstance(public, bool):
                raise ProtocolError(BAD_REQUEST, f"field 'public' must be true or false, got {_kind(public)}")
            return VoiceUpdate(id=_request_id(obj), voice=_required_str(obj, "voice"), public=public)
        if kind == "voice_admin":
            op = _required_str(obj, "op")
            if op not in VOICE_ADMIN_OPS:
                raise ProtocolError(BAD_REQUEST, f"field 'op' must be one of {list(VOICE_ADMIN_OPS)}, got {op!r}")
            admin = VoiceAdmin(id=_request_id(obj), op=op, owner=_optional(obj, "owner", str, None),
                               address=_optional(obj, "address", str, None))
            if admin.owner is not None and admin.address is not None:
                raise ProtocolError(BAD_REQUEST, "name one owner: 'owner' (its key) or 'address'")
            if op == "delete" and admin.owner is None and admin.address is None:
                raise ProtocolError(BAD_REQUEST, "name the owner whose voices to delete: 'owner' or 'address'")
            return admin
        if kind == "lora":
            op = _required_str(obj, "op")
            if op not in LORA_OPS:
                raise ProtocolError(BAD_REQUEST, f"field 'op' must be one of {list(LORA_OPS)}, got {op!r}")
            return Lora(id=_request_id(obj), op=op, name=_optional(obj, "name", str, None))
    except ProtocolError as err:
        err.stream_id = err.stream_id or sid
        raise
    raise ProtocolError(BAD_REQUEST, f"unknown message type {kind!r}", sid)


def _parse_start(obj: dict[str, Any], limits: Limits, specs: Mapping[str, OptionSpec]) -> Start:
    sid = _stream_id(obj) if obj.get("id") is not None else None
    stream_input = _optional(obj, "stream_input", bool, False)
    # With input streaming the text arrives in `chunk` messages; an initial `text` is optional.
    # Its type here; whether there is anything to say, and how long it may be, is the service's rule.
    text = obj.get("text")
    if not isinstance(text, str) and (text is not None or not stream_input):
        raise ProtocolError(BAD_REQUEST, f"field 'text' must be a string, got {_kind(text)}", sid)
    voice = _optional(obj, "voice", str, None)
    try:
        voice = with_speaker(voice, obj.get("speaker"))
    except Refused as err:
        raise ProtocolError.from_refused(err, sid) from None
    fmt = _optional(obj, "format", str, "f32")
    if fmt not in OUTPUT_FORMATS:
        raise ProtocolError(BAD_REQUEST, f"field 'format' must be one of {list(OUTPUT_FORMATS)}, got {fmt!r}", sid)
    rate = _optional(obj, "sample_rate", int, None)
    if rate is not None and not MIN_SAMPLE_RATE <= rate <= MAX_SAMPLE_RATE:
        raise ProtocolError(
            BAD_REQUEST, f"field 'sample_rate' must be in [{MIN_SAMPLE_RATE}, {MAX_SAMPLE_RATE}], got {rate}", sid
        )
    # Numbers here; their ranges, the instructions' length and the language tag's shape are the
    # stream service's rules, checked once as it opens the stream.
    speed = _number(obj, "speed", 1.0, sid)
    lookahead = _number(obj, "lookahead_s", None, sid)
    volume = _number(obj, "volume", 1.0, sid)
    instructions = _optional(obj, "instructions", str, None)
    language = obj.get("language", obj.get("lang_code"))
    try:
        options = check_options(obj.get("options"), specs)       # typed by the engine's own specs
    except Refused as err:
        raise ProtocolError.from_refused(err, sid) from None
    segment_events = _optional(obj, "segment_events", bool, False)
    word_timestamps = _optional(obj, "word_timestamps", bool, False)
    phoneme_timestamps = _optional(obj, "phoneme_timestamps", bool, False)
    try:
        pronunciations = request_entries(obj.get("pronunciations"))
    except Refused as err:
        raise ProtocolError.from_refused(err, sid) from None
    markup = _optional(obj, "markup", str, None)
    if markup is not None and markup not in ("ssml", "none"):
        raise ProtocolError(BAD_REQUEST, f"field 'markup' must be 'ssml' or 'none', got {markup!r}", sid)
    lora = _optional(obj, "lora", str, None)
    if lora == "":
        raise ProtocolError(BAD_REQUEST, "field 'lora' must name a loaded LoRA adapter", sid)
    output = AudioOutput(fmt, rate, speed, lookahead, volume)
    request = StreamRequest(text if (text or not stream_input) else None, voice=voice, options=options, output=output,
                            input_streaming=stream_input, instructions=instructions or None,
                            word_timestamps=word_timestamps, phoneme_timestamps=phoneme_timestamps, markup=markup,
                            pronunciations=pronunciations, lora=lora, language=language)
    return Start(id=sid, request=request, segment_events=segment_events)


def _parse_voice(obj: dict[str, Any], limits: Limits) -> Voice:
    audio = obj.get("audio")
    if not isinstance(audio, bytes) or not audio:
        raise ProtocolError(BAD_REQUEST, f"field 'audio' must be non-empty binary (WAV or FLAC), got {_kind(audio)}")
    transcript = _optional(obj, "transcript", str, None)
    mode = _optional(obj, "mode", str, None)
    if mode is not None and mode not in VOICE_MODES:
        raise ProtocolError(BAD_REQUEST, f"field 'mode' must be one of {list(VOICE_MODES)}, got {mode!r}")
    name = obj.get("name")
    public = _optional(obj, "public", bool, False)
    try:
        if name is not None:
            check_voice_name(name)
        elif public:
            raise nameless_public()
    except Refused as err:
        raise ProtocolError.from_refused(err) from None
    return Voice(id=_request_id(obj), audio=audio, transcript=transcript, mode=mode, name=name, public=public)


def _stream_id(obj: dict[str, Any]) -> str:
    value = obj.get("id")
    if not isinstance(value, str) or not value:
        raise ProtocolError(BAD_REQUEST, f"field 'id' must be a non-empty string, got {_kind(value)}")
    if len(value) > MAX_ID_CHARS:
        raise ProtocolError(BAD_REQUEST, f"field 'id' must be at most {MAX_ID_CHARS} characters")
    return value


def _request_id(obj: dict[str, Any]) -> str | None:
    """The optional id of a non-stream request, echoed in its reply."""
    return _stream_id(obj) if obj.get("id") is not None else None


def _required_str(obj: dict[str, Any], name: str) -> str:
    value = obj.get(name)
    if not isinstance(value, str) or not value:
        raise ProtocolError(BAD_REQUEST, f"field '{name}' must be a non-empty string, got {_kind(value)}")
    return value


def _chunk_text(obj: dict[str, Any], limits: Limits) -> str:
    """A `chunk`'s text: a string (empty is fine), within the text limit."""
    value = obj.get("text")
    if not isinstance(value, str):
        raise ProtocolError(BAD_REQUEST, f"field 'text' must be a string, got {_kind(value)}")
    try:
        check_length(value, limits.max_text_chars)
    except Refused as err:
        raise ProtocolError.from_refused(err) from None
    return value


def _number(obj: dict[str, Any], name: str, default: float | None, sid: str | None) -> float | None:
    """An optional number (not a boolean), as a float."""
    value = obj.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ProtocolError(BAD_REQUEST, f"field '{name}' must be a number, got {_kind(value)}", sid)
    return float(value)


def _optional(obj: dict[str, Any], name: str, kind: type, default: Any) -> Any:
    value = obj.get(name)
    if value is None:
        return default
    if kind is int and isinstance(value, bool) or not isinstance(value, kind):
        raise ProtocolError(BAD_REQUEST, f"field '{name}' must be {kind.__name__}, got {_kind(value)}")
    return value


_kind = type_name


# --------------------------------------------------------------------------- encoding


def chunk_message(sid: str, audio: Audio) -> dict[str, Any]:
    """A `chunk`: the audio bytes, or for `opus_packets` the packets, their durations (µs) and,
    on the first chunk, the codec description and pre-skip."""
    if not audio.packets:
        return {"type": "chunk", "id": sid, "seq": audio.seq, "audio": audio.data}
    message = {"type": "chunk", "id": sid, "seq": audio.seq, "packets": list(audio.packets),
               "durations_us": list(audio.durations_us)}
    if audio.description is not None:
        message["description"] = audio.description
        message["pre_skip"] = audio.pre_skip
    return message


def error_message(err: ProtocolError) -> dict[str, Any]:
    msg: dict[str, Any] = {"type": "error", "code": err.code, "message": err.message, "retryable": err.retryable}
    if err.stream_id is not None:
        msg["id"] = err.stream_id
    if err.retry_after_s is not None:
        msg["retry_after_s"] = err.retry_after_s
    return msg


def start_message(sid: str, sample_rate: int, audio_format: str, queued: int, ignored: list[str]) -> dict[str, Any]:
    """The reply to `start`: the stream's audio, its place in the queue, what it ignores."""
    message: dict[str, Any] = {"type": "start", "id": sid, "sample_rate": sample_rate, "format": audio_format,
                               "channels": 1}
    if queued:
        message["queued"] = queued
    if ignored:
        message["ignored_options"] = ignored
    return message


def reply_message(kind: str, result: dict[str, Any], request_id: str | None) -> dict[str, Any]:
    """The answer to a request that belongs to no stream (`voice`, `voice_delete`, `voice_update`,
    `voice_admin`, `lora`), carrying the request's `id` where it had one."""
    message = {"type": kind, **result}
    if request_id is not None:
        message["id"] = request_id
    return message


def timed_words(event: Words) -> list[dict[str, Any]]:
    """A `words` message's words; `estimated` only on a word the aligner placed between its
    neighbours rather than heard."""
    return [{"word": w.word, "start_s": w.start_s, "end_s": w.end_s, **({"estimated": True} if w.estimated else {})}
            for w in event.words]


def event_message(sid: str, event: Event) -> dict[str, Any]:
    """One stream event as its frame: `chunk`, `segment`, `words`, `phonemes`, `flushed`, `end`
    or `error`."""
    if isinstance(event, Audio):
        return chunk_message(sid, event)
    if isinstance(event, Segment):
        return {"type": "segment", "id": sid, "index": event.index, "text": event.text, "start_s": event.start_s,
                "end_s": event.end_s}
    if isinstance(event, Words):
        return {"type": "words", "id": sid, "words": timed_words(event)}
    if isinstance(event, Phonemes):
        return {"type": "phonemes", "id": sid, "phonemes": [
            {"phoneme": ph.phoneme, "start_s": ph.start_s, "end_s": ph.end_s} for ph in event.phonemes]}
    if isinstance(event, Flushed):
        return {"type": "flushed", "id": sid, "audio_s": event.audio_s}
    if isinstance(event, Ended):
        end = {"type": "end", "id": sid, "reason": event.reason.value, **event.stats}
        if event.rewrites:                    # `flac`, `wav`: the header, now the length is known
            end["rewrites"] = [[offset, data] for offset, data in event.rewrites]
        return end
    assert isinstance(event, Failed), event
    return error_message(ProtocolError(code_for(event.kind), event.message, sid, event.retry_after_s))


_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


@functools.lru_cache(maxsize=16)                 # asked on each request; one stat, once
def model_id(model: str | None) -> str | None:
    """The served model as clients name it: a hub id as it is (`openbmb/VoxCPM2`), a checkpoint
    served from a directory by the directory's name (`--model /srv/models/VoxCPM2`: `VoxCPM2`; a
    hub cache's snapshot by its repository's id), never the path, which says where the server's
    files lie and changes with the machine."""
    if not model or _HUB_ID.fullmatch(model) or not Path(model).expanduser().is_dir():
        return model
    path = Path(model).expanduser().resolve()
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name or model


def hello_message(state: ServerState) -> dict[str, Any]:
    """The `hello` a connection is greeted with: what this server and its engine offer."""
    service = state.service
    engine = service.engine
    return {
        "type": "hello",
        "protocol": PROTOCOL_VERSION,
        "server": state.server_name,
        "status": service.devices.status,
        "engine": engine.name,
        "model": model_id(engine.model),
        "sample_rate": engine.sample_rate,
        "formats": list(OUTPUT_FORMATS),
        "voices": service.voices.listed(),
        "aliases": sorted(service.voices.aliases()),
        "languages": list(engine.languages),
        "options": sorted(engine.honoured_options),
        "slots": service.devices.slots,
        "step_rows": service.devices.step_rows,
        "features": state.features(),
        "limits": state.limits.as_dict(),
        **({"notice": engine.notice} if engine.notice else {}),
    }
