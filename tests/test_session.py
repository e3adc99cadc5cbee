"""`session.py`: one protocol v1 connection's rules, tested with data alone (frames in, what the
session asks of the stream service and what it answers out, as websockets tests its sans-I/O
`Protocol`); then its driver (`transports/v1_connection.py`) on a real server, for the I/O itself:
frames costly to decode, texts that are not Unicode, pings, message floods, cancel and disconnect."""

from __future__ import annotations

import ast
import asyncio
import socket
from dataclasses import dataclass
from pathlib import Path

import msgpack
import pytest
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, Opcode
from websockets.uri import parse_uri

import vox_ws.session
from attackers import _rss_mb
from conftest import assert_good_stream, connect_client, wait_until
from helpers import LONG, SENTENCE
from vox_ws.config import Limits
from vox_ws.engine import ErrorKind, Refused
from vox_ws.engines import option_vocabulary
from vox_ws.engines.piper import PiperEngine
from vox_ws.session import (
    MAX_ERRORS_IN_A_ROW,
    CancelStream,
    CloseConnection,
    EndInput,
    FlushInput,
    OpenStream,
    RunRequest,
    SendError,
    SendText,
    Session,
)
from vox_ws.transports.connections import WRITE_BUFFER_HIGH
from vox_ws.transports.rate import CLOSE_AFTER_REFUSED, MessageBudget
from vox_ws.transports.v1_connection import frame_in

# ---------------------------------------------------------------------- the rules, with data alone

OPTIONS = option_vocabulary()


@dataclass
class StreamState:
    """An open stream's state as the session reads it (the driver's handle on a real stream)."""

    input_streaming: bool
    done: bool = False
    input_closed: bool = False


class StreamService:
    """The driver's side of `perform`, as data: what the session asked, in order; a stream's
    state for each stream opened; `refusal`, raised as the service would raise it."""

    def __init__(self) -> None:
        self.asked: list = []
        self.opened: dict[str, StreamState] = {}
        self.refusal: Refused | None = None

    def __call__(self, action):
        self.asked.append(action)
        if self.refusal is not None:
            raise self.refusal
        if isinstance(action, OpenStream):
            self.opened[action.id] = StreamState(action.request.input_streaming)
            return self.opened[action.id]
        return None


class Connection:
    """A session, the message budget its driver keeps, and a clock the test moves."""

    def __init__(self, is_admin: bool = False, rate: float = 1e9, **limits) -> None:
        self.limits = Limits(**limits)
        self.service = StreamService()
        self.now = 0.0
        self.session = Session(self.limits, self.service, lambda: 2.5, is_admin=is_admin,
                               clock=lambda: self.now)
        self.budget = MessageBudget(rate)

    def send(self, message: dict | bytes | str) -> list:
        """One frame in (a map is packed as a client packs it); what the session answers."""
        frame = msgpack.packb(message) if isinstance(message, dict) else message
        return frame_in(self.session, self.budget, frame, self.limits, OPTIONS)


def test_a_start_opens_a_stream_under_its_id():
    c = Connection()
    assert c.send({"type": "start", "id": "a", "text": "Hello.", "segment_events": True}) == []
    [opened] = c.service.asked
    assert opened.id == "a" and opened.request.text == "Hello." and opened.segment_events
    assert c.session.streams == {"a": c.service.opened["a"]}


def test_a_start_without_an_id_is_named_by_the_session_past_the_ids_taken():
    c = Connection()
    c.send({"type": "start", "id": "s1", "text": "x"})
    c.send({"type": "start", "text": "x"})
    c.send({"type": "start", "text": "x"})
    assert [action.id for action in c.service.asked] == ["s1", "s2", "s3"]


def test_a_stream_id_already_open_is_a_duplicate_even_once_its_stream_is_done():
    c = Connection()
    c.send({"type": "start", "id": "a", "text": "x"})
    assert c.send({"type": "start", "id": "a", "text": "y"}) == [
        SendError("duplicate_stream", "stream 'a' is already open on this connection", "a")]
    c.service.opened["a"].done = True          # its last frames not yet sent: still the connection's
    assert c.send({"type": "start", "id": "a", "text": "y"})[0].code == "duplicate_stream"
    assert len(c.service.asked) == 1


def test_a_stream_unknown_or_done_is_unknown_to_its_messages():
    c = Connection()
    assert c.send({"type": "cancel", "id": "nope"}) == [
        SendError("unknown_stream", "no open stream with id 'nope'", "nope")]
    c.send({"type": "start", "id": "a", "text": "x"})
    assert c.send({"type": "cancel", "id": "a"}) == []
    assert c.service.asked[-1] == CancelStream("a")
    c.service.opened["a"].done = True
    assert c.send({"type": "cancel", "id": "a"})[0].code == "unknown_stream"


def test_max_streams_open_at_once_and_a_stream_ended_frees_its_place():
    c = Connection(max_streams=2)
    c.send({"type": "start", "id": "a", "text": "x"})
    c.send({"type": "start", "id": "b", "text": "x"})
    assert c.send({"type": "start", "id": "c", "text": "x"}) == [
        SendError("too_many_streams", "2 streams open, max_streams=2", "c")]
    c.session.stream_ended("a", c.service.opened["a"], by_its_end=True)
    assert c.send({"type": "start", "id": "c", "text": "x"}) == []
    assert sorted(c.session.streams) == ["b", "c"]


def test_a_stream_ended_is_forgotten_only_if_it_is_still_the_one_under_its_id():
    c = Connection()
    c.send({"type": "start", "id": "a", "text": "x"})
    first = c.service.opened["a"]
    c.session.stream_ended("a", first, by_its_end=True)
    c.send({"type": "start", "id": "a", "text": "x"})
    c.session.stream_ended("a", first, by_its_end=False)     # the first one's pump, stopping late
    assert c.session.streams == {"a": c.service.opened["a"]} and c.service.opened["a"] is not first


def test_text_input_goes_to_a_stream_started_for_it_until_its_input_ends():
    c = Connection()
    c.send({"type": "start", "id": "whole", "text": "x"})
    assert c.send({"type": "chunk", "id": "whole", "text": "more"}) == [
        SendError("bad_request", "'chunk' needs a stream started with stream_input: true", "whole")]
    assert c.send({"type": "flush", "id": "whole"})[0].message.startswith("'flush' needs")
    c.send({"type": "start", "id": "in", "stream_input": True})
    assert c.send({"type": "chunk", "id": "in", "text": "Hello"}) == []
    assert c.send({"type": "flush", "id": "in"}) == []
    assert c.send({"type": "end", "id": "in"}) == []
    assert c.service.asked[-3:] == [SendText("in", "Hello"), FlushInput("in"), EndInput("in")]
    c.service.opened["in"].input_closed = True
    assert c.send({"type": "chunk", "id": "in", "text": "late"}) == [
        SendError("bad_request", "the input of stream 'in' has already ended", "in")]


def test_what_the_stream_service_refuses_is_the_messages_error_with_its_code_and_retry_hint():
    c = Connection()
    c.service.refusal = Refused(ErrorKind.BUSY, "every slot is busy", retry_after_s=1.5)
    assert c.send({"type": "start", "text": "x"}) == [SendError("busy", "every slot is busy", "s1", 1.5)]
    assert c.session.streams == {}
    c.service.refusal = None
    c.send({"type": "start", "id": "in", "stream_input": True})
    c.service.refusal = Refused(ErrorKind.INVALID, "text longer than 50 characters")
    assert c.send({"type": "chunk", "id": "in", "text": "x" * 60}) == [
        SendError("bad_request", "text longer than 50 characters", "in")]


def test_a_frame_the_driver_cannot_read_is_refused_with_its_code():
    c = Connection()
    assert c.send("text") == [SendError("bad_frame", "text frames are not accepted: send one msgpack map per "
                                                     "binary frame")]
    assert c.send({"type": "nonsense", "id": "a"}) == [
        SendError("bad_request", "unknown message type 'nonsense'", "a")]


def test_refused_messages_in_a_row_close_the_connection_and_one_good_message_resets_the_count():
    c = Connection()
    for _ in range(MAX_ERRORS_IN_A_ROW - 1):
        assert [type(o) for o in c.send({"type": "cancel", "id": "x"})] == [SendError]
    c.send({"type": "start", "id": "a", "text": "x"})
    for _ in range(MAX_ERRORS_IN_A_ROW - 1):
        assert [type(o) for o in c.send(b"\xc1")] == [SendError]
    assert c.send(b"\xc1")[1:] == [CloseConnection(1008, f"{MAX_ERRORS_IN_A_ROW} refused messages in a row")]


def test_messages_over_the_budget_are_dropped_then_a_flood_closes_the_connection():
    c = Connection(rate=1e-6)                  # one message, then none for days
    assert c.send({"type": "start", "id": "a", "text": "x"}) == []
    dropped = SendError("rate_limited", "more than 50 messages per second: message dropped")
    for _ in range(CLOSE_AFTER_REFUSED):
        assert c.send({"type": "start", "id": "b", "text": "x"}) == [dropped]
    assert c.send({"type": "start", "id": "b", "text": "x"}) == [
        CloseConnection(1008, "message rate limit exceeded")]
    assert len(c.service.asked) == 1           # nothing dropped reached the service


def test_voice_and_lora_requests_are_run_by_the_driver_and_answered_with_their_kind():
    c = Connection(is_admin=True)
    [voice] = c.send({"type": "voice", "id": "v", "audio": b"RIFF", "transcript": "Hi."})
    assert isinstance(voice, RunRequest) and (voice.kind, voice.id) == ("voice", "v")
    assert voice.message.audio == b"RIFF" and voice.message.transcript == "Hi."
    assert [(r.kind, r.id) for r in c.send({"type": "voice_delete", "voice": "joe"})
            + c.send({"type": "voice_update", "id": "u", "voice": "joe", "public": True})
            + c.send({"type": "voice_admin", "op": "list"})
            + c.send({"type": "lora", "id": "l", "op": "load", "name": "calm"})] == [
        ("voice_delete", None), ("voice_update", "u"), ("voice_admin", None), ("lora", "l")]
    assert c.service.asked == []               # none of them is the stream service's at once


def test_one_voice_registration_at_a_time_per_connection():
    c = Connection()
    c.send({"type": "voice", "audio": b"RIFF"})
    assert c.send({"type": "voice", "id": "second", "audio": b"RIFF"}) == [
        SendError("busy", "one voice registration at a time per connection", "second", 2.5)]
    assert isinstance(c.send({"type": "voice_delete", "voice": "joe"})[0], RunRequest)
    c.session.answered("voice")
    assert isinstance(c.send({"type": "voice", "audio": b"RIFF"})[0], RunRequest)


def test_voice_admin_and_lora_need_the_admin_token():
    c = Connection()
    assert c.send({"type": "voice_admin", "id": "a", "op": "list"}) == [
        SendError("unauthorized", "voice_admin needs a connection opened with the admin token", "a")]
    assert c.send({"type": "lora", "op": "disable"}) == [
        SendError("unauthorized", "LoRA operations need a connection opened with the admin token")]


def test_a_connection_is_idle_with_no_stream_and_no_message_that_did_something():
    c = Connection(idle_timeout_s=60.0)
    c.now = 59.0
    assert not c.session.idle()
    c.now = 61.0
    assert c.session.idle()
    c.send({"type": "cancel", "id": "x"})      # refused: not activity
    assert c.session.idle()
    c.send({"type": "start", "id": "a", "text": "x"})
    c.now = 200.0
    assert not c.session.idle()                # a stream is open
    c.session.stream_ended("a", c.service.opened["a"], by_its_end=True)
    c.now = 259.0
    assert not c.session.idle()                # its end was activity
    c.now = 261.0
    assert c.session.idle()


def test_the_session_imports_no_asyncio_no_web_framework_and_no_door():
    tree = ast.parse(Path(vox_ws.session.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = "." * node.level + (node.module or "")
            imported |= {base} | {f"{base}.{alias.name}" for alias in node.names}
    wrong = {name for name in imported
             if name.split(".")[0] in ("asyncio", "starlette", "uvicorn", "websockets", "socket")
             or "transports" in name.split(".")}
    assert not wrong, wrong


# ---------------------------------------------------------------------- the driver, on a real server


@pytest.mark.hardening
async def test_text_that_is_not_unicode_is_a_bad_request_over_v1(piper_server):
    import msgpack

    async with connect_client(piper_server) as c:
        # msgpack carries UTF-8: a surrogate's bytes (CESU-8) are not UTF-8, and the frame is bad.
        frame = msgpack.packb({"type": "start", "id": "s", "text": "x"}).replace(b"\xa1x", b"\xa3\xed\xa0\x80")
        await c.send(frame)
        assert (await c.error())["code"] == "bad_frame"
        assert_good_stream(await c.speak(SENTENCE, "after"))


@pytest.mark.hardening
async def test_frames_that_are_cheap_to_send_and_costly_to_decode_are_refused_at_once(piper_server):
    two_million_maps = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000
    wide_and_deep = msgpack.packb([[{} for _ in range(60)] for _ in range(60)])
    deep = b"\x91" * 3000 + b"\xc0"
    async with connect_client(piper_server) as c:
        for frame in (two_million_maps, wide_and_deep, deep):
            await c.send(frame)
            error = await c.error()
            assert error["code"] == "bad_frame", error
        # Ten of the first kind, back to back: the session answers each and goes on serving.
        for _ in range(10):
            await c.send(two_million_maps)
        for _ in range(10):
            assert (await c.error())["code"] == "bad_frame"
        assert_good_stream(await c.speak(SENTENCE, "after"))


@pytest.mark.hardening
async def test_nul_in_text_is_a_bad_request(piper_server):
    async with connect_client(piper_server) as c:
        result = await c.speak("Hello\x00there.", "nul")
        assert result.error["code"] == "bad_request" and "NUL" in result.error["message"]
        await c.send({"type": "start", "id": "in", "stream_input": True})
        await c.recv_where(lambda m: m.get("id") == "in" and m["type"] == "start")
        await c.send({"type": "chunk", "id": "in", "text": "more\x00"})
        assert (await c.error("in"))["code"] == "bad_request"
        await c.send({"type": "cancel", "id": "in"})
        assert_good_stream(await c.speak(SENTENCE, "after"))


def _raw_websocket(port: int) -> tuple[socket.socket, ClientProtocol]:
    """A WebSocket opened by hand, for a client that writes frames and never reads."""
    sock = socket.create_connection(("127.0.0.1", port))
    proto = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/stream"))
    proto.send_request(proto.connect())
    sock.sendall(b"".join(proto.data_to_send()))
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    proto.receive_data(received)
    return sock, proto


@pytest.mark.hardening
async def test_a_ping_flood_is_closed_as_a_message_flood_and_costs_no_memory(piper_server):
    def flood() -> tuple[int, int | None]:
        sock, proto = _raw_websocket(piper_server.port)
        proto.send_ping(b"p" * 125)
        ping = b"".join(proto.data_to_send())
        sock.settimeout(3.0)
        sent = 0
        try:
            while sent < 2_000_000:             # 250 MB of pings if nothing stopped them
                sock.sendall(ping * 100)
                sent += 100
        except OSError:                          # the server stopped reading, or closed
            pass
        code = None
        try:
            while code is None:
                data = sock.recv(65536)
                if not data:
                    break
                proto.receive_data(data)
                for event in proto.events_received():
                    if getattr(event, "opcode", None) == Opcode.CLOSE:
                        code = Close.parse(event.data).code
        except OSError:
            pass
        sock.close()
        return sent, code

    before = _rss_mb()
    sent, code = await asyncio.to_thread(flood)
    assert code == 1008                          # closed as a flood, and told so
    assert sent < 2_000_000
    assert _rss_mb() - before < 50
    async with connect_client(piper_server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


@pytest.mark.hardening
async def test_pings_while_not_reading_leave_one_pong_owed(start_server):
    """Pings within the rate from a client that reads nothing: what waits to be sent stays
    bounded (pongs are not queued one by one), and the client is answered once it reads."""
    server = start_server(PiperEngine(), max_messages_per_s=2000.0, ping_interval=60.0, ping_timeout=120.0)
    sock, proto = _raw_websocket(server.port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    proto.send_ping(b"p" * 125)
    ping = b"".join(proto.data_to_send())
    for _ in range(40):                           # 16,000 pings: 2 MB of pongs if all were queued
        await asyncio.to_thread(sock.sendall, ping * 400)
        await asyncio.sleep(0.2)
    connections = [c for c in server.server._uvicorn.server_state.connections if hasattr(c, "conn")]
    assert len(connections) == 1 and not connections[0].transport.is_closing()
    assert connections[0].transport.get_write_buffer_size() <= WRITE_BUFFER_HIGH + 256
    # Reading now, the client gets pongs again, and the connection still serves.
    sock.settimeout(2.0)
    pongs = 0
    try:
        while True:
            proto.receive_data(await asyncio.to_thread(sock.recv, 65536))
            pongs += sum(1 for e in proto.events_received() if getattr(e, "opcode", None) == Opcode.PONG)
    except TimeoutError:
        pass
    assert 1 <= pongs < 16_000 // 10
    sock.close()


@pytest.mark.hardening
async def test_message_rate_limit_then_flood_close(start_server):
    server = start_server(PiperEngine(), max_messages_per_s=5.0)
    async with connect_client(server) as c:
        for i in range(30):
            await c.send({"type": "cancel", "id": f"x{i}"})
        codes = [(await c.recv())["code"] for _ in range(30)]
        assert "rate_limited" in codes and codes.count("unknown_stream") >= 5
        await asyncio.sleep(1.0)            # the bucket refills
        assert_good_stream(await c.speak("After a pause.", "ok"))
    async with connect_client(server) as c:
        for _ in range(400):
            await c.send({"type": "cancel", "id": "y"})
        with pytest.raises(ConnectionClosed):
            for _ in range(1000):
                await c.recv(timeout=10)
        assert c.ws.close_code == 1008


class CountingPiper(PiperEngine):
    """The real voice, counting the steps each request gets."""

    def __init__(self):
        super().__init__()
        self.steps: dict[str, int] = {}

    def step(self, batch):
        self.steps[batch[0].text] = self.steps.get(batch[0].text, 0) + 1
        return super().step(batch)


@pytest.mark.hardening
async def test_cancel_and_disconnect_free_the_slot_before_the_next_step(start_server):
    engine = CountingPiper()
    server = start_server(engine, slots=4)
    long_a, long_b, other = LONG + " A.", LONG + " B.", LONG + " C."
    async with connect_client(server) as keeper:
        await keeper.send({"type": "start", "id": "keep", "text": other})
        async with connect_client(server) as c:
            await c.send({"type": "start", "id": "a", "text": long_a})
            await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "a")
            await c.send({"type": "cancel", "id": "a"})
            await c.recv_where(lambda m: m["type"] == "end" and m["id"] == "a")
            steps_at_cancel = engine.steps[long_a]
            await c.send({"type": "start", "id": "b", "text": long_b})
            await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "b")
        steps_at_disconnect = engine.steps[long_b]
        # The other stream keeps stepping; the cancelled and abandoned ones get at most the
        # step that was already running when the cancel arrived.
        before = engine.steps[other]
        await wait_until(lambda: engine.steps[other] >= before + 2)
        assert engine.steps[long_a] <= steps_at_cancel + 1
        assert engine.steps[long_b] <= steps_at_disconnect + 1
        assert server.devices.stats()["active"] == 1
        await keeper.send({"type": "cancel", "id": "keep"})
