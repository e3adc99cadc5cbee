"""`session.py`: one protocol v1 connection's life on a real server: frames costly to decode,
texts that are not Unicode, pings, message floods, cancel and disconnect."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
from attackers import _rss_mb
from conftest import assert_good_stream, connect_client, wait_until
from helpers import LONG, SENTENCE
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, Opcode
from websockets.uri import parse_uri

from vox_ws.engines.piper import PiperEngine
from vox_ws.transports.connections import WRITE_BUFFER_HIGH


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
