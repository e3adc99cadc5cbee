"""Protocol v1's messages as `vox_ws.wire` declares them, once for both sides: every message a
client sends makes its map and reads it back, the server reads that map as the same message;
every message the server sends is made from a stream's events as the server always sent it (the
same map, the same bytes) and read back as its class; docs/PROTOCOL.md names exactly each
message's fields, both ways."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import pytest

from helpers import top_level_parts
from vox_ws import wire
from vox_ws.config import Limits
from vox_ws.engine import EndReason, ErrorKind
from vox_ws.engines import option_vocabulary
from vox_ws.service.events import Audio, Ended, Failed, Flushed, Phoneme, Phonemes, Segment, Word, Words
from vox_ws.transports import protocol as p

LIMITS = Limits()
OPTIONS = option_vocabulary()
PROTOCOL_MD = Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md"

# One of each message a client sends, every field away from its default (checked below), so
# that a round trip carries every field; each one the server accepts as it is.
EVERY_FIELD = [
    wire.Start(id="s1", text="Hi there.", stream_input=True, voice="joe", speaker="1", format="s16",
               sample_rate=16000, speed=1.5, volume=0.5, language="de", instructions="warmly", markup="none",
               options={"cfg_value": 2.5, "seed": 7}, pronunciations=[{"match": "SQL", "say": "sequel"}],
               lora="bright", lookahead_s=2.0, segment_events=True, word_timestamps=True,
               phoneme_timestamps=True),
    wire.Chunk("s1", "more text"),
    wire.Flush("s1"),
    wire.End("s1"),
    wire.Cancel("s1"),
    wire.Voice(b"RIFF....WAVE", name="Narrator", public=True, transcript="Hello.", mode="both", id="r1"),
    wire.VoiceDelete("Narrator", id="r2"),
    wire.VoiceUpdate("Narrator", True, id="r3"),
    wire.VoiceAdmin("delete", owner="k_0123", id="r4"),
    wire.VoiceAdmin("list", address="127.0.0.9", id="r5"),
    wire.Lora("load", name="bright", id="r6"),
]
# The least of each: every optional field left at its default.
LEAST = [wire.Start(text="Hi."), wire.Start(id="s", stream_input=True), wire.Voice(b"RIFF"),
         wire.VoiceDelete("v_x"), wire.VoiceUpdate("v_x", False), wire.VoiceAdmin("list"),
         wire.Lora("disable")]


def _default(item: dataclasses.Field):
    return item.default_factory() if item.default_factory is not dataclasses.MISSING else item.default


def _name(message) -> str:
    return f"{type(message).__name__}:{'/'.join(sorted(message.to_map()))}"


def test_every_client_message_is_declared_and_sampled():
    assert sorted(wire.CLIENT_MESSAGES) == sorted(["start", "chunk", "flush", "end", "cancel", "voice",
                                                   "voice_delete", "voice_update", "voice_admin", "lora"])
    assert all(kind.TYPE == name for name, kind in wire.CLIENT_MESSAGES.items())
    assert {type(message) for message in EVERY_FIELD} == set(wire.CLIENT_MESSAGES.values())
    for kind in wire.CLIENT_MESSAGES.values():
        covered = [message for message in EVERY_FIELD if type(message) is kind]
        for item in dataclasses.fields(kind):
            away = [message for message in covered if getattr(message, item.name) != _default(item)]
            assert away, f"no sample of {kind.__name__} sets {item.name}"


@pytest.mark.parametrize("message", EVERY_FIELD + LEAST, ids=_name)
def test_a_client_message_round_trips_and_the_server_reads_it_as_sent(message):
    mapped = message.to_map()
    assert mapped["type"] == message.TYPE
    assert type(message).from_map(mapped) == message
    assert wire.CLIENT_MESSAGES[mapped["type"]].from_map(wire.decode(wire.encode(message))) == message
    # Both sides agree: the server's checks pass it, and it reads the very same message.
    frame = p.decode_frame(wire.encode(message), LIMITS)
    assert frame == mapped
    assert p.parse_message(frame, LIMITS, OPTIONS) == message


def test_a_map_leaves_out_what_is_at_its_default_as_clients_always_sent_it():
    """The bytes are today's: the fields in their order, those at their default left out (a
    start's format always sent), a request's `id` last."""
    assert wire.encode(wire.Start(id="s", text="Hi.", format="s16")) == \
        msgpack.packb({"type": "start", "id": "s", "text": "Hi.", "format": "s16"})
    opened = wire.Start(id="c1", stream_input=True, voice="joe", speed=1.0, sample_rate=8000)
    assert opened.to_map() == {"type": "start", "id": "c1", "stream_input": True, "voice": "joe",
                               "format": "f32", "sample_rate": 8000}
    assert list(wire.Start(text="x", id="a", word_timestamps=True).to_map()) == \
        ["type", "id", "text", "format", "word_timestamps"]
    assert wire.encode(wire.Chunk("s", "more")) == msgpack.packb({"type": "chunk", "id": "s", "text": "more"})
    for kind in (wire.Flush, wire.End, wire.Cancel):
        assert wire.encode(kind("s")) == msgpack.packb({"type": kind.TYPE, "id": "s"})
    assert wire.encode(wire.Voice(b"RIFF", name="n", public=True, transcript="t", mode="both", id="r1")) == \
        msgpack.packb({"type": "voice", "audio": b"RIFF", "name": "n", "public": True, "transcript": "t",
                       "mode": "both", "id": "r1"})
    assert wire.VoiceUpdate("v", False).to_map() == {"type": "voice_update", "voice": "v", "public": False}
    assert wire.Lora("disable").to_map() == {"type": "lora", "op": "disable"}
    plain = {"type": "chunk", "audio": b"\x00"}                 # a plain map still encodes, bytes as bin
    assert wire.encode(plain) == msgpack.packb(plain, use_bin_type=True)


def test_reading_a_map_skips_what_it_does_not_know_and_checks_nothing():
    """`from_map` is a client's or a test's reading: unknown fields (a newer peer's) skipped, a
    field absent or None at its default, `lang_code` as `language`; refusing is the server's."""
    start = wire.Start.from_map({"type": "start", "id": "a", "text": "Hi.", "lang_code": "en", "speed": None,
                                 "added_in_v2": 1})
    assert start == wire.Start(id="a", text="Hi.", language="en")
    assert wire.Start.from_map({"language": "de", "lang_code": "en"}).language == "de"
    assert wire.Chunk.from_map({"type": "chunk", "id": "a"}) == wire.Chunk("a", None)
    assert wire.Start.from_map({"id": 5, "speed": "fast"}) == wire.Start(id=5, speed="fast")


def test_a_start_is_a_speech_with_an_id_a_text_and_stream_input():
    """`Start` declares only what `Speech` lacks, so a field added to a stream's start is added
    once, for every client method and for the server's reading alike."""
    speech_fields = [item.name for item in dataclasses.fields(wire.Speech)]
    start_fields = [item.name for item in dataclasses.fields(wire.Start)]
    assert start_fields == speech_fields + ["id", "text", "stream_input"]
    speech = wire.Speech(voice="joe", format="mulaw")
    assert wire.Start.of(speech, {"id": "c1", "text": "Hi."}) == wire.Start(id="c1", text="Hi.", voice="joe",
                                                                          format="mulaw")
    assert wire.Speech.of(wire.Start(id="x", voice="joe"), {"speed": 2.0}) == \
        wire.Speech(voice="joe", speed=2.0)
    with pytest.raises(TypeError, match="not a field of a stream's start: colour"):
        wire.Speech.of(None, {"colour": "red"})
    with pytest.raises(TypeError, match="id"):
        wire.Speech.of(speech, {"id": "c1"})


# ------------------------------------------------------------------------------ docs/PROTOCOL.md


def documented_client_fields() -> dict[str, set[str]]:
    """Each client message's fields as PROTOCOL.md's client -> server part names them: the
    field table under its own heading, else its bullet `- `chunk {id, text}``, else its first
    inline form `{type: "cancel", id}` (an answer's form comes after the request's)."""
    doc = PROTOCOL_MD.read_text()
    part = doc.split("\n## Client → server\n", 1)[1].split("\n## ", 1)[0]
    fields: dict[str, set[str]] = {}
    for section in re.split(r"\n(?=###)", part):
        heading, _, body = section.partition("\n")
        named = re.findall(r"`(\w+)`", heading)
        table = re.search(r"^\| field \|.*\n\|[-|]+\|\n((?:\|.*\n?)+)", body, re.MULTILINE)
        if heading.startswith("### ") and len(named) == 1 and table:
            fields[named[0]] = {re.match(r"\| `(\w+)`", row).group(1) for row in table.group(1).splitlines()}

    def names(listed: str) -> set[str]:
        return {re.match(r"\s*(\w+)", part).group(1) for part in listed.split(",")}

    for kind, listed in re.findall(r"^- `(\w+) \{([^}]*)\}`", part, re.MULTILINE):
        fields.setdefault(kind, names(listed))
    for kind, listed in re.findall(r'\{type: "(\w+)", ([^}]*)\}', part):
        fields.setdefault(kind, names(listed))
    return fields


def test_protocol_md_names_exactly_each_client_messages_fields():
    documented = documented_client_fields()
    for name, kind in wire.CLIENT_MESSAGES.items():
        assert name in documented, f"PROTOCOL.md documents no fields of `{name}`"
        declared = {item.name for item in dataclasses.fields(kind)}
        assert documented[name] == declared, (name, documented[name] ^ declared)
    assert set(documented) == set(wire.CLIENT_MESSAGES), set(documented) ^ set(wire.CLIENT_MESSAGES)


def test_protocol_md_heads_client_sections_by_client_messages_only():
    part = PROTOCOL_MD.read_text().split("\n## Client → server\n", 1)[1].split("\n## ", 1)[0]
    headings = re.findall(r"^###.*$", part, re.MULTILINE)
    headed = {name for heading in headings for name in re.findall(r"`(\w+)`", heading)}
    assert headed <= set(wire.CLIENT_MESSAGES), headed - set(wire.CLIENT_MESSAGES)


# --------------------------------------------------------------------------- the server's messages

SEGMENTS = [{"text": "Hi there.", "start_s": 0.0, "end_s": 0.8}]
FIGURES = {"chunks": 3, "audio_s": 0.8, "ttfa_ms": 41.5, "rtf": 0.12}
HEARD = {"audio_s": 0.4, "segments": [], "text": "", "partial": None}

# One stream's events of every kind, and the map the server has always sent for each (written
# out as the server built them before `wire` declared them, keys in its order).
EVENTS = [
    (Audio(b"\x01\x02", 0, 1, 0.1), {"type": "chunk", "id": "s", "seq": 0, "audio": b"\x01\x02"}),
    (Audio(b"", 0, 960, 0.02, packets=(b"p1", b"p2"), durations_us=(20000, 20000), description=b"OpusHead",
           pre_skip=312),
     {"type": "chunk", "id": "s", "seq": 0, "packets": [b"p1", b"p2"], "durations_us": [20000, 20000],
      "description": b"OpusHead", "pre_skip": 312}),
    (Audio(b"", 1, 960, 0.02, packets=(b"p3",), durations_us=(20000,)),
     {"type": "chunk", "id": "s", "seq": 1, "packets": [b"p3"], "durations_us": [20000]}),
    (Segment(0, "Hi there.", 0.0, 0.8),
     {"type": "segment", "id": "s", "index": 0, "text": "Hi there.", "start_s": 0.0, "end_s": 0.8}),
    (Words((Word("Hi", 0.0, 0.3), Word("there.", 0.3, 0.8, estimated=True))),
     {"type": "words", "id": "s", "words": [
         {"word": "Hi", "start_s": 0.0, "end_s": 0.3},
         {"word": "there.", "start_s": 0.3, "end_s": 0.8, "estimated": True}]}),
    (Phonemes((Phoneme("h", 0.0, 0.1), Phoneme("aɪ", 0.1, 0.3))),
     {"type": "phonemes", "id": "s", "phonemes": [{"phoneme": "h", "start_s": 0.0, "end_s": 0.1},
                                                  {"phoneme": "aɪ", "start_s": 0.1, "end_s": 0.3}]}),
    (Flushed(0.8), {"type": "flushed", "id": "s", "audio_s": 0.8}),
    (Ended(EndReason.DONE, {"segments": SEGMENTS, "usage": {"characters": 9, "audio_s": 0.8, "chunks": 3},
                            **FIGURES}, rewrites=((4, b"\x00\x01\x02\x03"),)),
     {"type": "end", "id": "s", "reason": "done", "segments": SEGMENTS,
      "usage": {"characters": 9, "audio_s": 0.8, "chunks": 3}, **FIGURES,
      "rewrites": [[4, b"\x00\x01\x02\x03"]]}),
    (Ended(EndReason.CANCELLED, {"segments": [], "usage": {"characters": 9}, "heard": HEARD, "chunks": 1,
                                 "audio_s": 0.4, "ttfa_ms": None, "rtf": None}),
     {"type": "end", "id": "s", "reason": "cancelled", "segments": [], "usage": {"characters": 9},
      "heard": HEARD, "chunks": 1, "audio_s": 0.4, "ttfa_ms": None, "rtf": None}),
    (Failed(ErrorKind.BUSY, "full", retry_after_s=2.5),
     {"type": "error", "code": "busy", "message": "full", "retryable": True, "id": "s",
      "retry_after_s": 2.5}),
    (Failed(ErrorKind.INVALID, "unknown voice 'x'"),
     {"type": "error", "code": "bad_request", "message": "unknown voice 'x'", "retryable": False, "id": "s"}),
]

LORA_STATE = {"configured": True, "rank": 8, "slots": 4, "slot_bytes": 1024, "layers": 2, "adapters": [],
              "default": None}

# A request's result as the service gives it, and the reply the server has always sent for it.
REPLIES = [
    ("voice", {"voice": "v_1", "mode": "reference", "audio_s": 3.2, "name": "Ann", "public": False},
     {"type": "voice", "voice": "v_1", "mode": "reference", "audio_s": 3.2, "name": "Ann", "public": False,
      "id": "r1"}),
    ("voice", {"voice": "v_1", "mode": "both", "audio_s": 3.2, "public": False},
     {"type": "voice", "voice": "v_1", "mode": "both", "audio_s": 3.2, "public": False, "id": "r1"}),
    ("voice_delete", {"voice": "v_1", "deleted": True},
     {"type": "voice_delete", "voice": "v_1", "deleted": True, "id": "r1"}),
    ("voice_update", {"voice": "v_1", "name": None, "public": False, "updated": True},
     {"type": "voice_update", "voice": "v_1", "name": None, "public": False, "updated": True, "id": "r1"}),
    ("voice_update", {"voice": "Ann", "updated": False},
     {"type": "voice_update", "voice": "Ann", "updated": False, "id": "r1"}),
    ("voice_admin", {"op": "delete", "owner": "k_1", "deleted": ["v_1"]},
     {"type": "voice_admin", "op": "delete", "owner": "k_1", "deleted": ["v_1"], "id": "r1"}),
    ("voice_admin", {"op": "list", "voices": [{"voice": "v_1", "owner": "k_1"}],
                     "usage": {"voices": 1, "bytes": 9}},
     {"type": "voice_admin", "op": "list", "voices": [{"voice": "v_1", "owner": "k_1"}],
      "usage": {"voices": 1, "bytes": 9}, "id": "r1"}),
    ("lora", {"op": "load", "name": "a", "slot": 0, "rank": 8, "scaling": 2.0, "loaded": 4, "skipped": 0,
              "skipped_keys": [], "lora": LORA_STATE},
     {"type": "lora", "op": "load", "name": "a", "slot": 0, "rank": 8, "scaling": 2.0, "loaded": 4,
      "skipped": 0, "skipped_keys": [], "lora": LORA_STATE, "id": "r1"}),
    ("lora", {"op": "unload", "name": "a", "unloaded": False, "streams_using": 2, "lora": LORA_STATE},
     {"type": "lora", "op": "unload", "name": "a", "unloaded": False, "streams_using": 2, "lora": LORA_STATE,
      "id": "r1"}),
    ("lora", {"op": "disable", "default": None, "lora": LORA_STATE},
     {"type": "lora", "op": "disable", "default": None, "lora": LORA_STATE, "id": "r1"}),
]


@pytest.mark.parametrize("event, expected", EVENTS, ids=[m["type"] for _, m in EVENTS])
def test_a_streams_event_is_the_map_and_bytes_it_always_was(event, expected):
    sent = p.event_message("s", event)
    assert sent == expected
    assert wire.encode(sent) == wire.encode(expected)           # the keys in their order too


@pytest.mark.parametrize("kind, result, expected", REPLIES, ids=[kind for kind, _, _ in REPLIES])
def test_a_requests_reply_is_the_map_and_bytes_it_always_was(kind, result, expected):
    sent = p.reply_message(kind, result, "r1")
    assert wire.encode(sent) == wire.encode(expected)
    without_id = {k: v for k, v in expected.items() if k != "id"}
    assert wire.encode(p.reply_message(kind, result, None)) == wire.encode(without_id)


def test_a_result_with_a_field_the_reply_lacks_is_refused():
    with pytest.raises(TypeError):
        p.reply_message("voice_delete", {"voice": "v_1", "deleted": True, "surprise": 1}, None)


def test_start_and_error_replies_are_the_maps_they_always_were():
    assert wire.encode(p.start_message("s", 24000, "s16", 0, [])) == wire.encode(
        {"type": "start", "id": "s", "sample_rate": 24000, "format": "s16", "channels": 1})
    assert wire.encode(p.start_message("s", 8000, "mulaw", 2, ["seed"])) == wire.encode(
        {"type": "start", "id": "s", "sample_rate": 8000, "format": "mulaw", "channels": 1, "queued": 2,
         "ignored_options": ["seed"]})
    assert wire.encode(p.error_message(p.ProtocolError(p.BAD_FRAME, "not msgpack"))) == wire.encode(
        {"type": "error", "code": "bad_frame", "message": "not msgpack", "retryable": False})


HELLO = {"type": "hello", "protocol": 1, "server": "vox-ws/0.1.0", "status": "ready", "engine": "piper",
         "model": None, "sample_rate": 22050, "formats": ["f32", "s16"], "voices": ["joe"],
         "aliases": ["alloy"], "languages": ["en_US"], "options": [], "slots": 2, "step_rows": 1,
         "features": ["speed"], "limits": {"max_streams": 8}}

# Every server message, as a map, for the round trips.
EVERY_MESSAGE = [HELLO, {**HELLO, "notice": "loading slowly"}] + [m for _, m in EVENTS] + [
    m for _, _, m in REPLIES] + [
    {"type": "start", "id": "s", "sample_rate": 8000, "format": "mulaw", "channels": 1, "queued": 2,
     "ignored_options": ["seed"]},
    {"type": "error", "code": "too_large", "message": "frame too large", "retryable": False}]


def test_every_server_message_has_a_class_and_each_class_is_a_message():
    kinds = {m["type"] for m in EVERY_MESSAGE}
    assert kinds == set(wire.SERVER_MESSAGES)
    for kind, cls in wire.SERVER_MESSAGES.items():
        assert cls.TYPE == kind and dataclasses.is_dataclass(cls)
        assert cls.__dataclass_params__.frozen


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=[m["type"] for m in EVERY_MESSAGE])
def test_every_server_message_round_trips(message):
    read = wire.read(wire.encode(message))
    assert type(read) is wire.SERVER_MESSAGES[message["type"]]
    assert read.to_map() == message and wire.encode(read.to_map()) == wire.encode(message)
    assert type(read).from_map(read.to_map()) == read


def test_read_tolerates_fields_it_does_not_know_and_types_it_does_not_know():
    newer = wire.read(wire.encode({"type": "flushed", "id": "s", "audio_s": 1.0, "latency_ms": 3}))
    assert newer == wire.Flushed(id="s", audio_s=1.0)
    unknown = wire.read(wire.encode({"type": "karaoke", "id": "s", "line": 3}))
    assert unknown == wire.Unknown("karaoke", {"id": "s", "line": 3})
    for garbage in (wire.encode([1, 2]), wire.encode({"id": "s"}), wire.encode({"type": 5})):
        with pytest.raises(ValueError):
            wire.read(garbage)


def test_an_errors_retryable_is_its_codes_unless_given():
    assert wire.Error(code=wire.BUSY, message="full").retryable is True
    assert wire.Error(code=wire.BAD_REQUEST, message="no").retryable is False
    assert wire.Error(code="connection_lost", message="gone", retryable=True).retryable is True


def test_hello_is_read_in_one_place():
    assert wire.Hello.read(wire.encode(HELLO)) == wire.Hello.from_map(HELLO)
    assert wire.Hello.read(wire.encode(HELLO)).features == ["speed"]
    for not_hello in (b"\xc1", wire.encode({"type": "start", "id": "s"}), "text"):
        with pytest.raises(ValueError, match="expected the server's hello"):
            wire.Hello.read(not_hello)


def test_reconnect_close_codes_are_the_servers_and_the_peers_goings():
    assert wire.RECONNECT_CLOSE_CODES == {1001, 1006, 1011, 1012, 1013}


# --------------------------------------------------------------------------- PROTOCOL.md


def _server_section() -> str:
    text = PROTOCOL_MD.read_text()
    return text[text.index("## Server → client"):text.index("## Client → server")]


def _documented_messages() -> dict[str, set[str]]:
    """Each server message's fields as docs/PROTOCOL.md names them: a `### `type`` heading's
    table (its first column), else the `{...}` shapes its prose gives (`{id, audio_s}`); a
    reply's shapes (`{type: "voice", id, ...}`, several for one type) wherever the document
    gives them."""
    fields: dict[str, set[str]] = {}
    for heading, body in re.findall(r"^### `(\w+)`\n(.*?)(?=^### |\Z)", _server_section(), re.M | re.S):
        rows = re.findall(r"^\| `(\w+)` \|", body, re.M)
        if rows:
            fields[heading] = set(rows)
        else:
            shape = re.search(r"`(\{id,.*?\})`", body, re.S)
            if shape:
                fields[heading] = _top_level_keys(shape.group(1))
    for kind, shape in _reply_shapes(PROTOCOL_MD.read_text()):
        fields.setdefault(kind, set()).update(_top_level_keys(shape) - {"type"})
    return fields


def _reply_shapes(text: str) -> list[tuple[str, str]]:
    """`{type: "KIND", ...}` after an arrow or "Answer:" (the server's replies, not the client's
    requests), and the `{…, ...}` continuations of the `lora` answers."""
    patterns = (r'(?:→|Answer:)\s+`(\{type: "(\w+)".*?\})`', r'`(\{type: "(\w+)", id, op: "list".*?\})`',
                r'`(\{type: "(\w+)", id, op: "delete".*?\})`')
    shapes = [(kind, whole) for pattern in patterns for whole, kind in re.findall(pattern, text, re.S)]
    shapes += [("lora", whole) for whole in re.findall(r"`(\{…,[^`]*\})`", text)]
    return shapes


def _top_level_keys(shape: str) -> set[str]:
    """The keys of a map written as PROTOCOL.md writes one: `{id, voice: "v_…", name?, ...}`."""
    keys = {part.split(":")[0].strip().rstrip("?") for part in top_level_parts(shape.strip()[1:-1])}
    return {key for key in keys if key and key != "…"}


def _class_fields(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_protocol_md_names_every_server_message():
    assert set(_documented_messages()) == set(wire.SERVER_MESSAGES)


@pytest.mark.parametrize("kind", sorted(wire.SERVER_MESSAGES))
def test_protocol_md_names_exactly_each_server_messages_fields(kind):
    assert _documented_messages()[kind] == _class_fields(wire.SERVER_MESSAGES[kind])


@pytest.mark.hardening
def test_a_clients_decode_is_bounded_as_the_servers_is():
    """Hardening VII, 4: `wire.decode` (every client's) decoded whatever came. A frame past
    MAX_SERVER_FRAME_BYTES, or building more than MAX_SERVER_CONTAINERS maps and arrays, is a
    ValueError, found before the frame is built; a chunk of more than 1 s of its stream's audio
    is a problem named; the largest real messages decode."""
    with pytest.raises(ValueError, match="over the"):
        wire.decode(b"\xdd" + (2 << 20).to_bytes(4, "big") + b"\x90" * (2 << 20))
    with pytest.raises(ValueError, match="more than 16384 maps or arrays"):
        wire.decode(msgpack.packb({"type": "words", "words": [[[]] * 16_000] * 30}))
    from vox_ws.codecs import MIN_SPEED

    assert wire.SLOWEST_SPEED == MIN_SPEED
    slowest = wire.AudioChunk(id="s", seq=0, audio=bytes(4 * 4 * 48_000))     # 1 s of audio at speed 0.25
    assert wire.chunk_problem(slowest, "f32", 48_000) is None
    assert wire.decode(wire.encode(slowest))["audio"] == bytes(4 * 4 * 48_000)
    assert "more than 4 s of s16 at 24000 Hz" in wire.chunk_problem(
        wire.AudioChunk(id="s", seq=0, audio=bytes(5 * 2 * 24_000)), "s16", 24_000)
    packets = wire.AudioChunk(id="s", seq=0, packets=[bytes(9000)] * 50 * 4)
    assert wire.chunk_problem(packets, "opus_packets", 48_000)
    text = wire.AudioChunk(id="s", seq=0, audio="text")
    assert wire.chunk_problem(text, "s16", 24_000) == "audio that is not bytes"
    ended = {"type": "end", "id": "s", "reason": "done",
             "segments": [{"text": "A sentence of some length.", "start_s": i, "end_s": i + 1}
                          for i in range(2000)]}
    assert len(wire.decode(wire.encode(ended))["segments"]) == 2000
