"""Protocol v1's messages as `vox_ws.wire` declares them, once for both sides: every message a
client sends makes its map and reads it back, the server reads that map as the same message,
and docs/PROTOCOL.md names exactly each message's fields."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import msgpack
import pytest

from vox_ws import wire
from vox_ws.config import Limits
from vox_ws.engines import option_vocabulary
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
