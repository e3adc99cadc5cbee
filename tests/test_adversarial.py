"""Attacks an adversarial client made, each kept here with what must hold (issue: Hardening II)."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import msgpack
import pytest
from conftest import assert_good_stream, connect_client
from test_server_piper import SENTENCE
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, Opcode
from websockets.uri import parse_uri

from vox_ws.engines.piper import PiperEngine
from vox_ws.transports.connections import WRITE_BUFFER_HIGH

STORY = ("The harbour was quiet that morning, and the boats rocked gently against the pier. "
         "An old fisherman mended his nets, humming a song his father had taught him, while gulls "
         "circled overhead and the tide crept slowly back toward the sea wall.")


async def test_frames_that_are_cheap_to_send_and_costly_to_decode_are_refused_at_once(piper_server):
    two_million_maps = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000
    wide_and_deep = msgpack.packb([[{} for _ in range(60)] for _ in range(60)])
    deep = b"\x91" * 3000 + b"\xc0"
    async with connect_client(piper_server) as c:
        for frame in (two_million_maps, wide_and_deep, deep):
            started = time.monotonic()
            await c.send(frame)
            error = await c.error()
            assert error["code"] == "bad_frame", error
        # Ten of the first kind, back to back: the session answers each and goes on serving.
        for _ in range(10):
            await c.send(two_million_maps)
        for _ in range(10):
            assert (await c.error())["code"] == "bad_frame"
        assert time.monotonic() - started < 60
        assert_good_stream(await c.speak(SENTENCE, "after"))


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


@pytest.fixture(scope="module")
def guarded(start_server):
    return start_server(PiperEngine(), tokens=["alpha", "beta"])


async def test_two_authorization_headers_are_refused_quietly(guarded, caplog):
    headers = [("Authorization", "Bearer alpha"), ("Authorization", "Bearer beta")]
    async with connect(guarded.url, additional_headers=headers) as ws:
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 4001
    assert not [r for r in caplog.records if r.exc_info]
    async with connect_client(guarded, additional_headers={"Authorization": "Bearer beta"}) as c:
        assert_good_stream(await c.speak(SENTENCE, "ok"))


# ------------------------------------------------------------------ pings and paced readers


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


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


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
    started = time.monotonic()
    sent, code = await asyncio.to_thread(flood)
    assert code == 1008                          # closed as a flood, and told so
    assert sent < 2_000_000 and time.monotonic() - started < 30
    assert _rss_mb() - before < 50
    async with connect_client(piper_server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


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


async def test_paced_readers_get_a_three_minute_text_whole(start_server):
    """Clients that play as they read (a phone bridge at mulaw 8 kHz, a player at s16 22 kHz):
    a chunk, a sleep of its duration, the next. Audio waits in the server until they read it;
    neither the stall timer nor the keepalive may cut them off."""
    server = start_server(PiperEngine(), ping_interval=10.0, ping_timeout=20.0)
    text = " ".join([STORY] * 15)

    async def paced(fmt: str, rate: int) -> tuple[dict, float]:
        async with connect(server.url, max_size=None, ping_interval=None) as ws:
            await ws.recv()                                   # hello
            await ws.send(msgpack.packb({"type": "start", "id": "p", "text": text, "format": fmt,
                                         "sample_rate": rate}))
            received = 0
            while True:
                message = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))
                if message["type"] == "chunk":
                    samples = len(message["audio"]) // {"s16": 2, "mulaw": 1}[fmt]
                    received += samples
                    await asyncio.sleep(samples / rate)
                elif message["type"] in ("end", "error"):
                    return message, received / rate

    results = await asyncio.gather(paced("mulaw", 8000), paced("s16", 22050))
    for end, seconds in results:
        assert end["type"] == "end" and end["reason"] == "done", end
        assert end["audio_s"] >= 170 and abs(seconds - end["audio_s"]) < 0.01, (end, seconds)
