"""The two ends of the boundary's socket (`messages.py`'s frames): the engine process's, read by
one thread and written by another, and the server's, read and written by its event loop (no
thread per engine process).

    engine process                                      server process (event loop)
    reader thread   ◀── recv_into ── socket ◀── writelines ── ChannelProtocol.send
    writer thread   ── sendmsg ──▶ socket ── get_buffer/buffer_updated ──▶ on_message(message)

A frame's payload is read straight into a buffer of its own size (the event loop's
`BufferedProtocol`, the engine's `recv_into`): a step's audio is copied once, from the socket.
The engine's writer queues at most `MAX_QUEUED_BYTES`: a server that stops reading holds the
engine's next turn, rather than its memory growing without end.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections import deque
from typing import Callable

from .messages import PREFIX, BoundaryError, Message, decode, frame, read_prefix

log = logging.getLogger("vox_ws.engine_process")

# What the engine's writer may hold unsent before `send` waits (about 20 steps of 64 rows of
# 160 ms of 48 kHz audio).
MAX_QUEUED_BYTES = 64 << 20


class BlockingChannel:
    """The engine process's end: `receive` on one thread, `send` from any (queued for a writer
    thread, in order)."""

    def __init__(self, sock: socket.socket, max_queued_bytes: int = MAX_QUEUED_BYTES) -> None:
        sock.setblocking(True)
        self._sock = sock
        self._max_queued = max_queued_bytes
        self._queue: deque[list] = deque()
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closed = False
        self.broken: BaseException | None = None        # why the writer stopped, if it did
        self._writer = threading.Thread(target=self._write, name="vox-ws-channel-writer", daemon=True)
        self._writer.start()

    def receive(self) -> Message | None:
        """The next message; None once the other end has closed (or the socket is shut)."""
        prefix = self._exactly(PREFIX.size)
        if prefix is None:
            return None
        header_length, payload_length = read_prefix(prefix)
        header = self._exactly(header_length)
        payload = self._exactly(payload_length) if payload_length else b""
        if header is None or payload is None:
            return None
        return decode(header, payload)

    def _exactly(self, size: int) -> bytearray | None:
        buffer = bytearray(size)
        view = memoryview(buffer)
        got = 0
        while got < size:
            try:
                n = self._sock.recv_into(view[got:])
            except OSError:
                return None
            if n == 0:
                return None
            got += n
        return buffer

    def send(self, message: Message) -> None:
        """Queue a message; waits while the queue holds `max_queued_bytes` (the server is not
        reading). Dropped once the channel is closed or broken."""
        pieces = frame(message)
        size = sum(len(p) for p in pieces)
        with self._cond:
            while (not self._closed and self._queue and self._queued_bytes + size > self._max_queued):
                self._cond.wait()
            if self._closed:
                return
            self._queue.append(pieces)
            self._queued_bytes += size
            self._cond.notify_all()

    def _write(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                pieces = self._queue[0]
            try:
                _send_all(self._sock, pieces)
            except OSError as exc:
                with self._cond:
                    self.broken = exc
                    self._closed = True
                    self._queue.clear()
                    self._cond.notify_all()
                return
            with self._cond:
                if self._queue and self._queue[0] is pieces:       # not dropped by `close` meanwhile
                    self._queue.popleft()
                    self._queued_bytes -= sum(len(p) for p in pieces)
                self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Until everything queued has been written (True), or `timeout` passed."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue or self._closed, timeout)

    def close(self) -> None:
        """Stop: what is queued is dropped, the socket shut (the other end reads its end)."""
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()


def _send_all(sock: socket.socket, pieces: list) -> None:
    views = [memoryview(p).cast("B") for p in pieces if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while views and sent >= len(views[0]):
            sent -= len(views[0])
            views.pop(0)
        if views and sent:
            views[0] = views[0][sent:]


class ChannelProtocol(asyncio.BufferedProtocol):
    """The server's end, on its event loop: every message read goes to `on_message`, in order;
    `on_closed(why)` once, when the channel ends (the engine process's end closed, or a frame
    that does not decode: `why` is then the error)."""

    def __init__(self, on_message: Callable[[Message], None],
                 on_closed: Callable[[BaseException | None], None]) -> None:
        self._on_message = on_message
        self._on_closed = on_closed
        self.transport: asyncio.Transport | None = None
        self._prefix = bytearray(PREFIX.size)
        self._buffer = memoryview(self._prefix)
        self._got = 0
        self._header_length = 0
        self._payload_length = 0
        self._stage = "prefix"
        self._closed = False
        self._error: BaseException | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer[self._got:]

    def buffer_updated(self, nbytes: int) -> None:
        self._got += nbytes
        try:
            while self._got == len(self._buffer):
                self._next_stage()
        except BoundaryError as exc:
            log.error("engine channel: %s", exc)
            self._error = exc
            if self.transport is not None:
                self.transport.close()

    def _next_stage(self) -> None:
        if self._stage == "prefix":
            self._header_length, self._payload_length = read_prefix(self._prefix)
            self._stage, self._buffer = "header", memoryview(bytearray(self._header_length))
        elif self._stage == "header":
            self._header = self._buffer
            if self._payload_length:
                self._stage, self._buffer = "payload", memoryview(bytearray(self._payload_length))
            else:
                self._deliver(b"")
        else:
            self._deliver(self._buffer)
        self._got = 0

    def _deliver(self, payload: bytes | memoryview) -> None:
        message = decode(self._header, payload)
        self._stage, self._buffer = "prefix", memoryview(self._prefix)
        self._got = 0
        self._on_message(message)

    def send(self, message: Message) -> None:
        """Write a message (the event loop's thread only); dropped once the channel has ended."""
        if self.transport is None or self.transport.is_closing():
            return
        self.transport.writelines(frame(message))

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_closed(self._error or exc)

    def eof_received(self) -> bool:
        return False
