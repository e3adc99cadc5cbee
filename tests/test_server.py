"""`server.py`: how the server stops: draining on SIGTERM (a real `vox-ws serve` process), a
shutdown bounded when clients do not read, and the exit status when the engine thread dies."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from attackers import closed_with
from conftest import connect_client, start_serve, wait_until
from helpers import LONG
from vox_ws.engines.piper import PiperEngine


def _paused_writers(server) -> list:
    """The server's WebSocket connections whose writes wait on a client that reads nothing."""
    from vox_ws.transports.connections import WebSocketProtocol

    return [c for c in server.server._uvicorn.server_state.connections
            if isinstance(c, WebSocketProtocol) and not c.writable.is_set()]


@pytest.mark.hardening
async def test_shutdown_is_bounded_when_clients_do_not_read(start_server):
    from vox_ws.server import CLOSE_GRACE_S
    from vox_ws.transports.connections import SHUTDOWN_ABORT_S

    server = start_server(PiperEngine(), drain_timeout=1.0, ping_interval=60.0, ping_timeout=120.0)
    socks = []
    for n in range(3):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        ws = await connect(server.url, sock=sock, max_queue=1, max_size=None).__aenter__()
        await ws.recv()
        await ws.send(msgpack.packb({"type": "start", "id": "s", "text": LONG * 3, "format": "f32"}))
        socks.append(ws)
    # Their buffers fill, nobody reads: the server's writes to all three wait.
    await wait_until(lambda: len(_paused_writers(server)) == 3)
    started = time.monotonic()
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.server.shutdown(1.0), server.loop))
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + CLOSE_GRACE_S + SHUTDOWN_ABORT_S + 2.0, elapsed
    for ws in socks:
        ws.transport.abort()


async def read_until_closed(client, timeout=20):
    with pytest.raises(ConnectionClosed):
        for _ in range(100_000):
            await client.recv(timeout=timeout)


class EngineCrash(BaseException):
    """Not an Exception: escapes the per-step handler, as a dying engine thread would."""


class CrashingPiper(PiperEngine):
    def step(self, batch):
        if "#crash" in batch[0].text:
            raise EngineCrash("the engine thread dies")
        return super().step(batch)


@pytest.mark.hardening
async def test_engine_thread_death_tells_everyone_and_stops_with_exit_code_3(start_server):
    server = start_server(CrashingPiper(), slots=4)
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "victim", "text": LONG})
        await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "victim")
        await c.send({"type": "start", "id": "bomb", "text": "Now #crash the engine."})
        errors = {}
        with pytest.raises(ConnectionClosed):
            while True:
                m = await c.recv(timeout=20)
                if m["type"] == "error":
                    errors[m["id"]] = m["code"]
        assert errors == {"victim": "internal", "bomb": "internal"}
        assert c.ws.close_code == 1011
    assert server.devices.status == "failed"
    assert server.server.exit_code == 3
    await asyncio.wait_for(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(
        server.server.wait_stopped(), server.loop)), 10)


def _spawn(tmp_path, *args):
    return start_serve([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0", *args],
                       tmp_path / "server.log", env={**os.environ, "PYTHONUNBUFFERED": "1"})


def _get(port, path):
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.hardening
async def test_sigterm_drains_streams_in_flight_then_exits_0(tmp_path):
    proc, port = _spawn(tmp_path, "--drain-timeout", "30")
    try:
        url = f"ws://127.0.0.1:{port}/v1/stream"

        class S:
            pass
        server = S()
        server.url = url
        async with connect_client(server) as c:
            await c.send({"type": "start", "id": "inflight", "text": LONG[:400]})
            await c.recv_where(lambda m: m["type"] == "chunk")
            proc.send_signal(signal.SIGTERM)
            await wait_until(lambda: _get(port, "/readyz") == 503)
            assert _get(port, "/healthz") == 200
            await closed_with(server, 1012)                         # no new connections: elsewhere
            await c.send({"type": "start", "id": "late", "text": "Too late."})
            assert (await c.error("late"))["code"] == "going_away"
            result = await c.collect("inflight")                    # the stream in flight finishes
            assert result.end["reason"] == "done"
            await read_until_closed(c)
            assert c.ws.close_code == 1012
        assert proc.wait(30) == 0
    finally:
        proc.kill()


@pytest.mark.hardening
async def test_sigterm_after_drain_timeout_tells_streams_going_away(tmp_path):
    proc, port = _spawn(tmp_path, "--drain-timeout", "0.5")
    try:
        class S:
            url = f"ws://127.0.0.1:{port}/v1/stream"
        async with connect_client(S()) as c:
            await c.send({"type": "start", "id": "endless", "text": LONG * 5})
            await c.recv_where(lambda m: m["type"] == "chunk")
            proc.send_signal(signal.SIGINT)
            err = await c.recv_where(lambda m: m["type"] in ("end", "error"), timeout=20)
            assert err["type"] == "error" and err["code"] == "going_away" and err["retryable"] is True
            await read_until_closed(c)
            assert c.ws.close_code == 1012
        assert proc.wait(30) == 0
    finally:
        proc.kill()
