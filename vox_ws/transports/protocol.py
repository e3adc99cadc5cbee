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
from pathlib import Path
from typing import Any, Mapping

import msgpack

from .. import wire
from ..codecs import OUTPUT_FORMATS
from ..config import Limits
from ..engine import VOICE_MODES, OptionSpec, Refused, type_name
from ..engines.lexicon import request_entries
from ..service import AudioOutput, StreamRequest
from ..service.events import Audio, Ended, Event, Failed, Flushed, Phonemes, Segment, Words
from ..service.validation import MAX_SAMPLE_RATE, MIN_SAMPLE_RATE, check_length, check_options
from ..service.voices.names import with_speaker
from ..service.voices.store import check_voice_name, nameless_public
from ..session import code_for

# Re-exported, hence the noqa: the vocabulary both sides share, under this module's names too
# (`p.BUSY`, `p.encode`), and a client's messages, as this door reads them (`p.Start`, ...):
# both declared once, in `vox_ws.wire`.
from ..wire import (  # noqa: F401
    BAD_FRAME,
    BAD_REQUEST,
    BUSY,
    CLOSE_IDLE,
    CLOSE_INTERNAL,
    CLOSE_POLICY,
    CLOSE_SERVICE_RESTART,
    CLOSE_TOO_MANY_FROM_ADDRESS,
    CLOSE_TRY_AGAIN_LATER,
    CLOSE_UNAUTHORIZED,
    DUPLICATE_STREAM,
    ERROR_CODES,
    GOING_AWAY,
    INTERNAL,
    LORA_OPS,
    MAX_ID_CHARS,
    NOT_READY,
    RATE_LIMITED,
    RETRYABLE,
    SLOW_CONSUMER,
    TIMEOUT,
    TOO_LARGE,
    TOO_MANY_STREAMS,
    UNAUTHORIZED,
    UNKNOWN_STREAM,
    UNSUPPORTED,
    VOICE_ADMIN_OPS,
    Cancel,
    Chunk,
    ClientMessage,
    ContainerBudget,
    End,
    Flush,
    Lora,
    Start,
    Voice,
    VoiceAdmin,
    VoiceDelete,
    VoiceUpdate,
    encode,
)
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


# --------------------------------------------------------------------------- decoding


# What one frame may cost to decode. No client message needs more: a `start` has about ten
# fields, its options fewer than ten, and nothing nests deeper than the options map. Without
# these bounds a 2 MiB frame of two million empty maps took 130-200 ms of the event loop.
MAX_CONTAINER_LEN = 64       # entries in one map or array
MAX_CONTAINERS = 64          # maps and arrays in one frame


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
                              max_map_len=MAX_CONTAINER_LEN, list_hook=ContainerBudget(MAX_CONTAINERS),
                              object_hook=ContainerBudget(MAX_CONTAINERS))
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
        if kind == Start.TYPE:
            return _parse_start(obj, limits, options)
        if kind == Chunk.TYPE:
            return Chunk(id=_stream_id(obj), text=_chunk_text(obj, limits))
        if kind == End.TYPE:
            return End(id=_stream_id(obj))
        if kind == Flush.TYPE:
            return Flush(id=_stream_id(obj))
        if kind == Cancel.TYPE:
            return Cancel(id=_stream_id(obj))
        if kind == Voice.TYPE:
            return _parse_voice(obj, limits)
        if kind == VoiceDelete.TYPE:
            return VoiceDelete(id=_request_id(obj), voice=_required_str(obj, "voice"))
        if kind == VoiceUpdate.TYPE:
            public = obj.get("public")
            if not isinstance(public, bool):
                raise ProtocolError(BAD_REQUEST, f"field 'public' must be true or false, got {_kind(public)}")
            return VoiceUpdate(id=_request_id(obj), voice=_required_str(obj, "voice"), public=public)
        if kind == VoiceAdmin.TYPE:
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
        if kind == Lora.TYPE:
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
    speaker = obj.get("speaker")
    try:
        with_speaker(voice, speaker)                    # checked here; `stream_request` joins them
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
    pronunciations = obj.get("pronunciations")
    try:
        request_entries(pronunciations)                 # checked here; `stream_request` reads them
    except Refused as err:
        raise ProtocolError.from_refused(err, sid) from None
    markup = _optional(obj, "markup", str, None)
    if markup is not None and markup not in ("ssml", "none"):
        raise ProtocolError(BAD_REQUEST, f"field 'markup' must be 'ssml' or 'none', got {markup!r}", sid)
    lora = _optional(obj, "lora", str, None)
    if lora == "":
        raise ProtocolError(BAD_REQUEST, "field 'lora' must name a loaded LoRA adapter", sid)
    # The fields as sent, checked (the options typed by their specs); `stream_request` reads them.
    return Start(id=sid, text=text, stream_input=stream_input, voice=voice, speaker=speaker, format=fmt,
                 sample_rate=rate, speed=speed, volume=volume, language=language, instructions=instructions,
                 markup=markup, options=options, pronunciations=pronunciations or [], lora=lora,
                 lookahead_s=lookahead, segment_events=segment_events, word_timestamps=word_timestamps,
                 phoneme_timestamps=phoneme_timestamps)


def stream_request(start: Start) -> StreamRequest:
    """What the stream service is asked for by a `start` that `parse_message` has checked (so
    nothing here refuses): the voice with its speaker, the audio's output, the text (none yet
    for streamed input), the pronunciations as entries."""
    output = AudioOutput(start.format, start.sample_rate, start.speed, start.lookahead_s, start.volume)
    text = start.text if (start.text or not start.stream_input) else None
    return StreamRequest(text, voice=with_speaker(start.voice, start.speaker), options=start.options,
                         output=output, input_streaming=start.stream_input, instructions=start.instructions or None,
                         word_timestamps=start.word_timestamps, phoneme_timestamps=start.phoneme_timestamps,
                         markup=start.markup, pronunciations=request_entries(start.pronunciations or None),
                         lora=start.lora, language=start.language)


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
        return wire.AudioChunk(id=sid, seq=audio.seq, audio=audio.data).to_map()
    first = audio.description is not None
    return wire.AudioChunk(id=sid, seq=audio.seq, packets=list(audio.packets),
                           durations_us=list(audio.durations_us), description=audio.description,
                           pre_skip=audio.pre_skip if first else None).to_map()


def error_message(err: ProtocolError) -> dict[str, Any]:
    return wire.Error(code=err.code, message=err.message, retryable=err.retryable, id=err.stream_id,
                      retry_after_s=err.retry_after_s).to_map()


def start_message(sid: str, sample_rate: int, audio_format: str, queued: int,
                  ignored: list[str]) -> dict[str, Any]:
    """The reply to `start`: the stream's audio, its place in the queue, what it ignores."""
    return wire.Started(id=sid, sample_rate=sample_rate, format=audio_format, queued=queued or None,
                        ignored_options=ignored or None).to_map()


def reply_message(kind: str, result: dict[str, Any], request_id: str | None) -> dict[str, Any]:
    """The answer to a request that belongs to no stream (`voice`, `voice_delete`, `voice_update`,
    `voice_admin`, `lora`), carrying the request's `id` where it had one. A result's field the
    reply's class lacks is a TypeError: the class and PROTOCOL.md name every field."""
    return wire.SERVER_MESSAGES[kind](**result, id=request_id).to_map()


def timed_words(event: Words) -> list[dict[str, Any]]:
    """A `words` message's words; `estimated` only on a word the aligner placed between its
    neighbours rather than heard."""
    return [{"word": w.word, "start_s": w.start_s, "end_s": w.end_s,
             **({"estimated": True} if w.estimated else {})} for w in event.words]


def event_message(sid: str, event: Event) -> dict[str, Any]:
    """One stream event as its frame: `chunk`, `segment`, `words`, `phonemes`, `flushed`, `end`
    or `error`."""
    if isinstance(event, Audio):
        return chunk_message(sid, event)
    if isinstance(event, Segment):
        return wire.Segment(id=sid, index=event.index, text=event.text, start_s=event.start_s,
                            end_s=event.end_s).to_map()
    if isinstance(event, Words):
        return wire.Words(id=sid, words=timed_words(event)).to_map()
    if isinstance(event, Phonemes):
        phonemes = [{"phoneme": ph.phoneme, "start_s": ph.start_s, "end_s": ph.end_s}
                    for ph in event.phonemes]
        return wire.Phonemes(id=sid, phonemes=phonemes).to_map()
    if isinstance(event, Flushed):
        return wire.Flushed(id=sid, audio_s=event.audio_s).to_map()
    if isinstance(event, Ended):
        # `flac`, `wav`: the header's rewrites, now the length is known
        rewrites = [[offset, data] for offset, data in event.rewrites] or None
        return wire.Ended(id=sid, reason=event.reason.value, **event.stats, rewrites=rewrites).to_map()
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
    return wire.Hello(
        protocol=PROTOCOL_VERSION,
        server=state.server_name,
        status=service.devices.status,
        engine=engine.name,
        model=model_id(engine.model),
        sample_rate=engine.sample_rate,
        formats=list(OUTPUT_FORMATS),
        voices=service.voices.listed(),
        aliases=sorted(service.voices.aliases()),
        languages=list(engine.languages),
        options=sorted(engine.honoured_options),
        slots=service.devices.slots,
        step_rows=service.devices.step_rows,
        features=state.features(),
        limits=state.limits.as_dict(),
        notice=engine.notice or None,
    ).to_map()
