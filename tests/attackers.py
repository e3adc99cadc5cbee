"""What a hostile client does at the socket (the attacker connects from 127.0.0.2, the victim from
127.0.0.1, as in the outside run), and checks shared by the test files of the modules it attacks."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Callable

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


# ------------------------------------------------------------------------------ a hostile hub


@dataclass
class HubFile:
    """One file of the hostile hub's rhasspy/piper-voices: its bytes, what its HEAD says of its
    size (`said`; None: its own), and how its GET goes: `whole`; `stall` (its `stall_after` first
    bytes, then nothing until the hub is released); `oversend` (`oversend` bytes, the length
    `declared` or none, until the reader hangs up); `drip` (a byte at a time, `on_byte` called
    after each). `stall_head`: its HEAD answered only once the hub is released."""

    body: bytes = b""
    said: int | None = None
    get: str = "whole"
    stall_after: int = 0
    oversend: int = 0
    declared: int | None = None
    on_byte: Callable[[], None] | None = None
    stall_head: bool = False


class HostileHub:
    """A Hugging Face hub on loopback, as far as vox-ws asks one (`HEAD` and `GET` of
    `/rhasspy/piper-voices/resolve/REVISION/PATH`), serving `files` as each `HubFile` says. It
    keeps what it was asked (`asked`: "HEAD path", "GET path"), the bytes each GET sent (`sent`),
    an event per path set once a stalled answer stalls (`stalled`) and one set once a GET's
    answer has ended (`answered`: its sender sends no more). `stop()` releases every stalled
    answer, then stops the server and joins its threads."""

    PREFIX = "/rhasspy/piper-voices/resolve/"
    COMMIT = "0123456789abcdef0123456789abcdef01234567"

    def __init__(self, files: dict[str, HubFile]) -> None:
        self.files = files
        self.asked: list[str] = []
        self.sent: dict[str, int] = {}
        self.stalled = {path: threading.Event() for path in files}
        self.answered = {path: threading.Event() for path in files}
        self.released = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _hub_handler(self))
        self._server.daemon_threads = False                # server_close() joins every answer
        self._thread = threading.Thread(target=self._server.serve_forever, name="hostile-hub")
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def release(self) -> None:
        self.released.set()

    def stop(self) -> None:
        self.release()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> HostileHub:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()


def _hub_handler(hub: HostileHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def _file(self) -> tuple[str, HubFile | None]:
            path = self.path.split("?", 1)[0]
            path = path[len(HostileHub.PREFIX):].split("/", 1)[-1] if path.startswith(HostileHub.PREFIX) else ""
            hub.asked.append(f"{self.command} {path}")
            return path, hub.files.get(path)

        def _head(self, path: str, file: HubFile | None, length: int | None) -> None:
            # Every answer closes its connection, and says so: none is taken up again by a client
            # that would find it closed.
            self.close_connection = True
            if file is None:
                self.send_response(404)
                self.send_header("X-Error-Code", "EntryNotFound")
                self.send_header("Content-Length", "0")
            else:
                self.send_response(200)
                self.send_header("X-Repo-Commit", HostileHub.COMMIT)
                self.send_header("ETag", f'"{hashlib.sha1(file.body).hexdigest()}"')
                if length is not None:
                    self.send_header("Content-Length", str(length))
            self.send_header("Connection", "close")
            self.end_headers()

        def do_HEAD(self) -> None:  # noqa: N802 - http.server's name
            self.connection.settimeout(WAIT_TIMEOUT)
            path, file = self._file()
            if file is not None and file.stall_head:
                hub.stalled[path].set()
                hub.released.wait(WAIT_TIMEOUT)
                self.close_connection = True             # hangs up unanswered
                return
            self._head(path, file, None if file is None else (file.said if file.said is not None
                                                              else len(file.body)))

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.connection.settimeout(WAIT_TIMEOUT)
            path, file = self._file()
            try:
                self._answer(path, file)
            finally:
                if file is not None:
                    hub.answered[path].set()

        def _answer(self, path: str, file: HubFile | None) -> None:
            if file is None or file.get == "whole":
                self._head(path, file, None if file is None else len(file.body))
                self._send(path, b"" if file is None else file.body)
            elif file.get == "stall":
                self._head(path, file, len(file.body))
                self._send(path, file.body[:file.stall_after])
                hub.stalled[path].set()
                hub.released.wait(WAIT_TIMEOUT)
            elif file.get == "oversend":
                self._head(path, file, file.declared)
                piece = b"\0" * 65536
                while hub.sent.get(path, 0) < file.oversend and self._send(path, piece):
                    pass
            elif file.get == "drip":
                self._head(path, file, len(file.body))
                for byte in file.body:
                    if not self._send(path, bytes([byte])):
                        break
                    assert file.on_byte is not None
                    file.on_byte()

        def _send(self, path: str, data: bytes) -> bool:
            """False once the reader has hung up."""
            try:
                self.wfile.write(data)
                self.wfile.flush()
            except OSError:
                return False
            hub.sent[path] = hub.sent.get(path, 0) + len(data)
            return True

    return Handler


def kernel_buffers_bytes() -> int:
    """The most a TCP connection's kernel buffers hold, both ends (the receive buffer's ceiling
    and the send buffer's): what a sender may have sent past what its reader read."""
    return sum(int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2]) for name in ("tcp_rmem", "tcp_wmem"))
