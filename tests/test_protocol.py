"""The pure protocol module: every rule of decoding and validation, without a socket."""

import msgpack
import pytest

from vox_ws.engines import option_vocabulary
from vox_ws.service import AudioOutput, StreamRequest
from vox_ws.transports import protocol as p

LIMITS = p.Limits(max_frame_bytes=1000, max_text_chars=50)
OPTIONS = option_vocabulary()


def parse(obj):
    return p.parse_message(p.decode_frame(msgpack.packb(obj), LIMITS), LIMITS, OPTIONS)


def refused(obj_or_bytes) -> p.ProtocolError:
    with pytest.raises(p.ProtocolError) as info:
        if isinstance(obj_or_bytes, (bytes, str)):
            p.parse_message(p.decode_frame(obj_or_bytes, LIMITS), LIMITS, OPTIONS)
        else:
            parse(obj_or_bytes)
    return info.value


def test_start_defaults():
    start = parse({"type": "start", "text": "hi"})
    assert start == p.Start(text="hi")
    assert p.stream_request(start) == StreamRequest("hi", voice=None, options={},
                                                    output=AudioOutput("f32", sample_rate=None))


def test_start_with_everything():
    start = parse({"type": "start", "id": "a", "text": "hi", "voice": "joe", "format": "s16", "sample_rate": 8000,
                   "options": {"cfg_value": 2, "inference_timesteps": 10.0, "seed": 7, "normalize": True}})
    request = p.stream_request(start)
    assert start.options == request.options == {"cfg_value": 2.0, "inference_timesteps": 10, "seed": 7,
                                                "normalize": True}
    assert isinstance(start.options["cfg_value"], float)
    assert isinstance(start.options["inference_timesteps"], int)
    assert request.voice == "joe" and request.output == AudioOutput("s16", 8000)


def test_a_start_is_read_for_the_service():
    """`stream_request` is the server's reading of a start: the speaker joined to the voice,
    an empty text of streamed input none, empty instructions none, pronunciations as entries."""
    start = parse({"type": "start", "id": "a", "text": "", "stream_input": True, "voice": "joe", "speaker": 1,
                   "instructions": "", "lang_code": "de",
                   "pronunciations": [{"match": "SQL", "say": "sequel"}]})
    assert (start.speaker, start.language, start.text) == (1, "de", "")
    request = p.stream_request(start)
    assert (request.voice, request.text, request.instructions) == ("joe:1", None, None)
    assert request.language == "de"
    assert [entry.say for entry in request.pronunciations] == ["sequel"]


@pytest.mark.parametrize("frame, code", [
    ("text frame", p.BAD_FRAME),
    (b"\xc1", p.BAD_FRAME),                          # reserved msgpack byte
    (msgpack.packb([1, 2]), p.BAD_FRAME),            # not a map
    (msgpack.packb({"a": 1}) + b"\x00", p.BAD_FRAME),  # trailing data
    (msgpack.packb({1: "int key"}), p.BAD_FRAME),
    (b"\x92" * 2000, p.TOO_LARGE),
    (msgpack.packb({"type": 3}), p.BAD_REQUEST),
    (msgpack.packb({"no": "type"}), p.BAD_REQUEST),
])
def test_bad_frames(frame, code):
    assert refused(frame).code == code


@pytest.mark.parametrize("message, field", [
    ({"type": "nope"}, "unknown message type"),
    ({"type": "start"}, "'text'"),
    ({"type": "start", "text": 5}, "'text'"),
    ({"type": "start", "text": "hi", "id": 5}, "'id'"),
    ({"type": "start", "text": "hi", "id": ""}, "'id'"),
    ({"type": "start", "text": "hi", "id": "x" * 200}, "'id'"),
    ({"type": "start", "text": "hi", "format": "ogg"}, "'format'"),
    ({"type": "start", "text": "hi", "speed": "2"}, "'speed'"),
    ({"type": "start", "text": "hi", "speed": True}, "'speed'"),
    ({"type": "start", "text": "hi", "volume": "loud"}, "'volume'"),
    ({"type": "start", "text": "hi", "lookahead_s": "soon"}, "'lookahead_s'"),
    ({"type": "start", "text": "hi", "sample_rate": 7999}, "'sample_rate'"),
    ({"type": "start", "text": "hi", "sample_rate": 44100.5}, "'sample_rate'"),
    ({"type": "start", "text": "hi", "sample_rate": True}, "'sample_rate'"),
    ({"type": "start", "text": "hi", "voice": 1}, "'voice'"),
    ({"type": "start", "text": "hi", "stream_input": "yes"}, "'stream_input'"),
    ({"type": "start", "text": "hi", "options": [1]}, "'options'"),
    ({"type": "start", "text": "hi", "options": {"bogus": 1}}, "options.bogus"),
    ({"type": "start", "text": "hi", "options": {"cfg_value": 11}}, "options.cfg_value"),
    ({"type": "start", "text": "hi", "options": {"cfg_value": float("nan")}}, "options.cfg_value"),
    ({"type": "start", "text": "hi", "options": {"cfg_value": "2"}}, "options.cfg_value"),
    ({"type": "start", "text": "hi", "options": {"inference_timesteps": 0}}, "options.inference_timesteps"),
    ({"type": "start", "text": "hi", "options": {"inference_timesteps": 2.5}}, "options.inference_timesteps"),
    ({"type": "start", "text": "hi", "options": {"max_len": True}}, "options.max_len"),
    ({"type": "start", "text": "hi", "options": {"min_len": 9, "max_len": 3}}, "options.min_len"),
    ({"type": "start", "text": "hi", "options": {"normalize": 1}}, "options.normalize"),
    ({"type": "start", "text": "hi", "options": {"seed": -1}}, "options.seed"),
    ({"type": "cancel"}, "'id'"),
    ({"type": "chunk", "id": "a"}, "'text'"),
])
def test_bad_requests_name_the_field(message, field):
    err = refused(message)
    assert err.code == p.BAD_REQUEST
    assert field in err.message


def test_a_chunk_over_the_text_limit_is_too_large():
    err = refused({"type": "chunk", "id": "a", "text": "x" * 51})
    assert err.code == p.TOO_LARGE


def test_errors_carry_a_valid_stream_id_only():
    assert refused({"type": "start", "id": "a", "text": 1}).stream_id == "a"
    assert refused({"type": "start", "id": 7, "text": 1}).stream_id is None


def test_stream_input_start_needs_no_text():
    start = parse({"type": "start", "id": "a", "stream_input": True})
    request = p.stream_request(start)
    assert start.stream_input and request.input_streaming and request.text is None


def test_other_messages():
    assert parse({"type": "cancel", "id": "a"}) == p.Cancel("a")
    assert parse({"type": "end", "id": "a"}) == p.End("a")
    assert parse({"type": "flush", "id": "a"}) == p.Flush("a")
    assert parse({"type": "chunk", "id": "a", "text": "more"}) == p.Chunk("a", "more")


def test_error_message_shape():
    msg = p.error_message(p.ProtocolError(p.BUSY, "full", "a"))
    assert msg == {"type": "error", "code": "busy", "message": "full", "retryable": True, "id": "a"}
    assert "id" not in p.error_message(p.ProtocolError(p.BAD_FRAME, "x"))
    assert msgpack.unpackb(p.encode({"type": "chunk", "audio": b"\x00\x01"}))["audio"] == b"\x00\x01"


def test_protocol_md_lists_every_limit_hello_publishes():
    import re
    from pathlib import Path

    from vox_ws.config import Limits

    doc = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()
    row = next(line for line in doc.splitlines() if line.startswith("| `limits` | map |"))
    listed = re.findall(r"`(\w+)`", row.split("| map |", 1)[1].split("(", 1)[0])
    assert sorted(listed) == sorted(Limits().as_dict()), set(listed) ^ set(Limits().as_dict())


def test_option_refusals_name_their_field_for_every_door():
    from vox_ws.engine import ErrorKind, Refused
    from vox_ws.service.validation import check_options

    assert check_options({"cfg_value": 2}, OPTIONS) == {"cfg_value": 2.0}
    for raw, field in (([1], "options"), ({"nope": 1}, "options.nope"), ({"cfg_value": "x"}, "options.cfg_value"),
                       ({"min_len": 9, "max_len": 3}, "options.min_len")):
        with pytest.raises(Refused) as shared:
            check_options(raw, OPTIONS)
        assert shared.value.kind == ErrorKind.INVALID and shared.value.field == field
        # Protocol v1 says the same as a bad_request of the stream.
        v1 = refused({"type": "start", "id": "s", "text": "Hi.", "options": raw})
        assert v1.code == p.BAD_REQUEST and v1.message == shared.value.message and v1.stream_id == "s"


# ------------------------------------------------------------------------------ the vocabulary both sides share


def test_the_client_loads_the_wire_and_no_server_module():
    """`vox_ws.clients.v1` (and so every client built on it) loads the shared vocabulary, not
    the stream service, the engine loop or an engine; its first name, `vox_ws.client`, too."""
    import subprocess
    import sys

    def loaded(module: str) -> list[str]:
        return subprocess.run([sys.executable, "-c", f"import sys, {module}; "
                               "print(' '.join(sorted(m for m in sys.modules if m.startswith('vox_ws'))))"],
                              capture_output=True, text=True, check=True).stdout.split()
    client = ["vox_ws", "vox_ws.audio", "vox_ws.clients", "vox_ws.clients.v1", "vox_ws.wire"]
    assert loaded("vox_ws.clients.v1") == client
    assert loaded("vox_ws.client") == sorted([*client, "vox_ws.client"])
    from vox_ws import client, clients

    assert client.connect is clients.v1.connect and client.BadRequest is clients.v1.BadRequest


def test_the_wire_imports_nothing_of_the_server_and_the_server_keeps_its_codes():
    import ast
    from pathlib import Path

    from vox_ws import wire
    from vox_ws.engine import ErrorKind

    tree = ast.parse(Path(wire.__file__).read_text())
    assert not [node for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level > 0]
    # Retryable on the wire is what the service says is retryable, and a client's flooding.
    assert wire.RETRYABLE == {p.code_for(kind) for kind in ErrorKind if kind.retryable} | {wire.RATE_LIMITED}
    assert set(wire.ERROR_CODES) >= {p.code_for(kind) for kind in ErrorKind}
    # The messages a client sends are the ones the server reads (every one: tests/test_wire.py).
    from vox_ws.config import Limits

    for message in (wire.Start(id="s", text="Hi.", voice=None, format="s16"), wire.Chunk("s", "more"),
                    wire.Flush("s"), wire.End("s"), wire.Cancel("s")):
        assert p.decode_frame(wire.encode(message), Limits()) == message.to_map()
        assert p.parse_message(message.to_map(), Limits(), {}) == message
    assert "voice" not in wire.Start(id="s", voice=None).to_map()
