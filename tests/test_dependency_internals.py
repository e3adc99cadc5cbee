"""The private parts of other packages that vox-ws builds on, each named: an upgrade that
removes or changes one fails here, with the name, rather than in a user's server.

pyproject.toml bounds these packages at the tested minor version; a new version is taken by
raising the bound, running this file, and mending what it names.
"""

from __future__ import annotations

import asyncio
import inspect
import socket

import pytest

from conftest import connect_client, wait_until
from vox_ws.testing.tone import ToneEngine

# Methods vox_ws/transports/connections.py overrides or calls, with the parameters it passes:
# an override of a method the base class no longer calls is silently dead.
UVICORN_HTTP_METHODS = {
    "connection_made": ["self", "transport"],
    "on_message_begin": ["self"],
    "on_headers_complete": ["self"],
    "on_body": ["self", "body"],
    "on_message_complete": ["self"],
    "on_response_complete": ["self"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
    "shutdown": ["self"],
    "connection_lost": ["self", "exc"],
}
UVICORN_WS_METHODS = {
    "connection_made": ["self", "transport"],
    "connection_lost": ["self", "exc"],
    "handle_connect": ["self", "event"],
    "handle_ping": ["self"],
    "handle_parser_exception": ["self"],
    "pause_writing": ["self"],
    "resume_writing": ["self"],
    "send_keepalive_ping": ["self"],
    "keepalive_timeout": ["self"],
    "stop_keepalive": ["self"],
    "shutdown": ["self"],
}
# Attributes of a live connection that connections.py reads or sets.
UVICORN_HTTP_ATTRIBUTES = ["client", "transport", "loop", "app", "headers", "flow", "cycle"]
# ... and of its request-response cycle (a request's), read or set there.
UVICORN_CYCLE_ATTRIBUTES = ["keep_alive", "response_started", "on_response", "disconnected",
                            "message_event"]
UVICORN_WS_ATTRIBUTES = ["client", "transport", "loop", "conn", "queue", "scope", "writable", "close_sent",
                         "close_timeout", "close_timer", "ping_timeout", "pong_timer", "read_paused"]


def _check_methods(cls: type, wanted: dict[str, list[str]]) -> list[str]:
    problems = []
    for name, params in wanted.items():
        method = getattr(cls, name, None)
        if method is None:
            problems.append(f"{cls.__module__}.{cls.__qualname__}.{name} is gone")
            continue
        found = list(inspect.signature(method).parameters)
        if found != params:
            problems.append(f"{cls.__module__}.{cls.__qualname__}.{name}{tuple(found)} now takes other "
                            f"parameters than {tuple(params)}")
    return problems


def test_uvicorns_protocol_methods_that_vox_ws_overrides_are_there():
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

    problems = _check_methods(HttpToolsProtocol, UVICORN_HTTP_METHODS)
    problems += _check_methods(WebSocketsSansIOProtocol, UVICORN_WS_METHODS)
    assert not problems, "uvicorn changed what vox_ws/transports/connections.py builds on:\n" + "\n".join(problems)


@pytest.fixture(scope="module")
def tone_server(start_server):
    return start_server(ToneEngine(slots=4))


def _live_connections(server) -> list:
    return list(server.server._uvicorn.server_state.connections)


async def test_a_live_uvicorn_connection_has_the_attributes_vox_ws_uses(tone_server):
    from vox_ws.transports.connections import HttpProtocol, WebSocketProtocol

    problems = []
    # An HTTP connection with its headers half sent: the protocol object is live, and waiting.
    sock = socket.create_connection(("127.0.0.1", tone_server.port))
    sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")
    # And one whose request waits for its body: it has a request-response cycle.
    waiting = socket.create_connection(("127.0.0.1", tone_server.port))
    waiting.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                    b"Content-Length: 100\r\n\r\n{")
    try:
        def waits_for_a_body() -> bool:
            """the server has read the waiting request's headers"""
            return any(getattr(c, "cycle", None) is not None for c in _live_connections(tone_server))

        async with connect_client(tone_server):
            await wait_until(waits_for_a_body)       # a failure here: uvicorn's cycle is gone
            live = _live_connections(tone_server)
            http = [c for c in live if isinstance(c, HttpProtocol)]
            ws = [c for c in live if isinstance(c, WebSocketProtocol)]
            assert http and ws, live
            for name in UVICORN_HTTP_ATTRIBUTES:
                if not hasattr(http[0], name):
                    problems.append(f"uvicorn's HttpToolsProtocol instances no longer have .{name}")
            cycles = [c.cycle for c in http if getattr(c, "cycle", None) is not None]
            assert cycles, "no HTTP request waiting for its body"
            for name in UVICORN_CYCLE_ATTRIBUTES:
                if not hasattr(cycles[0], name):
                    problems.append(f"uvicorn's RequestResponseCycle instances no longer have .{name}")
            for name in UVICORN_WS_ATTRIBUTES:
                if not hasattr(ws[0], name):
                    problems.append(f"uvicorn's WebSocketsSansIOProtocol instances no longer have .{name}")
            if not isinstance(getattr(ws[0], "writable", None), asyncio.Event):
                problems.append("uvicorn's WebSocketsSansIOProtocol.writable is no longer an asyncio.Event")
            if not callable(getattr(getattr(ws[0], "conn", None), "data_to_send", None)):
                problems.append("uvicorn's WebSocketsSansIOProtocol.conn is no longer a websockets sans-I/O protocol")
    finally:
        sock.close()
        waiting.close()
    assert not problems, "uvicorn changed what vox_ws/transports/connections.py builds on:\n" + "\n".join(problems)


def test_starlettes_websocket_keeps_its_asgi_send_as_send():
    """vox_ws/transports/v1_connection.py writes frames through `WebSocket._send` (reached by
    `connections.asgi_send`), the ASGI send callable, so that a frame is queued without awaiting
    Starlette's state checks on every chunk."""
    from starlette.websockets import WebSocket

    async def receive():
        return {"type": "websocket.connect"}

    async def send(message):
        return None

    ws = WebSocket({"type": "websocket", "path": "/", "headers": []}, receive, send)
    assert getattr(ws, "_send", None) is send, "starlette.websockets.WebSocket no longer keeps the ASGI send " \
                                               "callable as ._send (vox_ws/transports/connections.py uses it)"


async def test_wyomings_async_server_keeps_its_listening_server_as_server():
    """vox_ws/transports/wyoming.py reads the port listened on from `AsyncServer._server`."""
    from vox_ws.transports.wyoming import WyomingServer

    server = WyomingServer("tcp://127.0.0.1:0", service=None)
    await server.start()
    try:
        inner = getattr(server._server, "_server", None)
        assert isinstance(inner, asyncio.AbstractServer), \
            "wyoming's AsyncTcpServer no longer keeps its asyncio server as ._server (vox_ws/transports/wyoming.py)"
        assert server.port and server.port > 0
    finally:
        await server.stop()
