"""What a hostile client does at the socket (the attacker connects from 127.0.0.2, the victim from
127.0.0.1, as in the outside run), and checks shared by the test files of the modules it attacks."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket

import httpx
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from conftest import WAIT_TIMEOUT
from helpers import SENTENCE

ATTACKER = "127.0.0.2"


def attacker_socket(port: int, rcvbuf: int | None = None, source: str = ATTACKER) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    sock.settimeout(WAIT_TIMEOUT)
    received = b""
    try:
        while piece := sock.recv(65536):
            received += piece
    except ConnectionResetError:
        pass
    return received


def speech_headers(length: int | None, chunked: bool = False) -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % length
    return (b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
            + framing + b"\r\n")


def assert_speaks(server) -> None:
    """A good speech request from the victim's address is served whole."""
    response = httpx.post(server.http + "/v1/audio/speech", json={"input": SENTENCE, "response_format": "pcm"},
                          timeout=WAIT_TIMEOUT)
    assert response.status_code == 200 and len(response.content) > 4800, response.text[:300]


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def closed_with(server, expect_code, **kwargs):
    """Connect and expect the server to close at once with `expect_code` (no hello)."""
    async with connect(server.url if "url" not in kwargs else kwargs.pop("url"), **kwargs) as ws:
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == expect_code, (ws.close_code, ws.close_reason)
        return ws.close_reason


@contextlib.contextmanager
def hostile_server(answer):
    """A real WebSocket server on loopback (its own thread and loop) whose every connection
    `answer(ws)` serves, as a hostile server would; yields its v1 URL. Stopped on leaving."""
    import asyncio
    import threading

    from websockets.asyncio.server import serve

    ready = threading.Event()
    running: dict = {}

    async def main() -> None:
        running["loop"], running["stop"] = asyncio.get_running_loop(), asyncio.Event()
        async with serve(answer, "127.0.0.1", 0) as server:
            running["port"] = server.sockets[0].getsockname()[1]
            ready.set()
            await running["stop"].wait()
            server.close(close_connections=False)
            for connection in list(server.connections):
                connection.transport.abort()

    thread = threading.Thread(target=asyncio.run, args=(main(),))
    thread.start()
    try:
        assert ready.wait(WAIT_TIMEOUT)
        yield f"ws://127.0.0.1:{running['port']}/v1/stream"
    finally:
        ready.wait(WAIT_TIMEOUT)
        running["loop"].call_soon_threadsafe(running["stop"].set)
        thread.join(WAIT_TIMEOUT)
