"""The server's connections below the ASGI app: uvicorn's HTTP and WebSocket protocols, with the
limits a server exposed to hostile clients needs.

HTTP (httptools):
- A connection that has not finished sending its first request's headers is *half-open*.
  Half-open connections are bounded per address and in total, and one whose headers take
  longer than `REQUEST_HEADER_TIMEOUT_S` is closed (any later request on a keep-alive
  connection gets the same time for its headers), so unfinished requests cannot use up the
  server's descriptors.

WebSocket (websockets' sans-I/O core):
- What a connection has waiting to be sent is bounded: the transport pauses the app's sends
  above `WRITE_BUFFER_HIGH` bytes, the kernel keeps at most `KERNEL_UNSENT_BYTES` not yet sent
  (TCP_NOTSENT_LOWAT), so audio for a slow reader waits in the stream service, where pacing
  and back-pressure see it, and never seconds of it sit in front of a control frame.
- While a client reads nothing, pings are not answered one by one (pongs would pile up
  without limit): the latest is answered once it reads again. A connection that stays over the
  bound with no reading progress (no data acknowledged by the client's TCP stack) for the write
  stall time-out plus the ping time-out is aborted; so is one that fails its keepalive or is
  closed with data it will never read.
- Pings draw from the connection's message budget (`rate.MessageBudget`), shared with protocol
  v1's messages; a flood closes the connection with 1008.
- Keepalive: a client that has not answered the server's ping in time is still alive if its
  TCP stack acknowledged data since the ping, or if data waits for it and it acknowledged some
  within the write stall time-out plus the ping time-out (a paced reader behind its own
  buffers, which it reads in bursts); the connection is closed (1011) otherwise.
- On a protocol error the server half-closes, so a client still sending reads the close code
  (1009 for a frame too big) instead of a reset, as websockets' own servers do.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import termios
from collections import Counter
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

from ..config import Limits
from .rate import BUDGET_EXTENSION, MessageBudget

log = logging.getLogger("vox_ws.connections")

# Seconds a client has to send a request's headers.
REQUEST_HEADER_TIMEOUT_S = 10.0
# A WebSocket's application-level write buffer: sends wait above HIGH until it is below LOW.
WRITE_BUFFER_HIGH = 32 * 1024
WRITE_BUFFER_LOW = 8 * 1024
# Bytes the kernel may hold not yet sent on a WebSocket (TCP_NOTSENT_LOWAT).
KERNEL_UNSENT_BYTES = 16 * 1024
# After shutdown starts, seconds a connection with unsent data has before it is aborted.
SHUTDOWN_ABORT_S = 1.0

_PONG = 0x0A
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is the u64 at offset 120 (Linux >= 4.1).
_TCP_INFO_BYTES_ACKED = 120


class ConnectionGuard:
    """Counts half-open connections per address and in total, for every protocol of a server."""

    def __init__(self, limits: Limits) -> None:
        self.per_address_limit = limits.max_connections_per_address
        self.total_limit = limits.max_connections
        self._pending: dict[Any, str] = {}       # transport -> address
        self._per_address: Counter[str] = Counter()
        self.refused = 0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def admit(self, transport: asyncio.BaseTransport, address: str) -> bool:
        if len(self._pending) >= self.total_limit or self._per_address[address] >= self.per_address_limit:
            self.refused += 1
            return False
        self._pending[transport] = address
        self._per_address[address] += 1
        return True

    def settle(self, transport: asyncio.BaseTransport) -> None:
        """The connection sent a whole request's headers, or is gone."""
        address = self._pending.pop(transport, None)
        if address is not None:
            self._per_address[address] -= 1
            if self._per_address[address] <= 0:
                del self._per_address[address]


class HttpProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        address = self.client[0] if self.client else "unknown"
        if not self.guard.admit(transport, address):
            log.warning("too many unfinished connections (from %s or in all): closing a new one", address)
            transport.abort()
            return
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        self._disarm_header_timer()
        self.guard.settle(self.transport)
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_timer()
        self.guard.settle(self.transport)
        super().connection_lost(exc)

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(REQUEST_HEADER_TIMEOUT_S, self._headers_too_slow)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_too_slow(self) -> None:
        self._header_timer = None
        log.info("%s: no complete request headers in %.0fs: closing", self.client, REQUEST_HEADER_TIMEOUT_S)
        self.guard.settle(self.transport)
        self.transport.abort()


class WebSocketProtocol(WebSocketsSansIOProtocol):
    def __init__(self, *args: Any, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.budget = MessageBudget(limits.max_messages_per_s)
        self.stall_timeout_s = limits.write_stall_timeout_s + (self.ping_timeout or 0.0)
        self._acked_at_pause: int | None = None
        self._owed_pong: bytes | None = None
        self._stall_timer: asyncio.TimerHandle | None = None
        self._acked_at_ping: int | None = None
        self._progress_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self.transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_LOW)
        sock = transport.get_extra_info("socket")
        if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, KERNEL_UNSENT_BYTES)
            except OSError:
                pass                      # not TCP (a Unix socket): nothing to bound

    def handle_connect(self, event: Any) -> None:
        super().handle_connect(event)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][BUDGET_EXTENSION] = self.budget

    # ---------------------------------------------------------------- writing

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall_timer is None:
            self._acked_at_pause = _bytes_acked(self.transport)
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._write_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        if self._owed_pong is not None and not self.transport.is_closing():
            self.transport.write(self._owed_pong)
        self._owed_pong = None

    def _write_stalled(self) -> None:
        self._stall_timer = None
        acked = _bytes_acked(self.transport)
        if acked is not None and self._acked_at_pause is not None and acked > self._acked_at_pause:
            self._acked_at_pause = acked        # reading, slowly: wait on
            self._stall_timer = self.loop.call_later(self.stall_timeout_s, self._write_stalled)
            return
        log.warning("%s: read nothing for %.0fs with %d bytes waiting: aborting the connection", self.client,
                    self.stall_timeout_s, self.transport.get_write_buffer_size())
        self.transport.abort()

    def handle_ping(self) -> None:
        # websockets wrote a pong for every ping of the data just read; one answers them all
        # (RFC 6455 5.5.3 allows answering only the latest ping).
        frames = self.conn.data_to_send()
        if self.close_sent:
            return
        pongs = [f for f in frames if _is_pong(f)]
        frames = [f for f in frames if not _is_pong(f)]
        if not self.budget.take():
            if self.budget.exhausted:
                self._fail(1008, "message rate limit exceeded")
                return
        elif pongs and not self.writable.is_set():
            self._owed_pong = pongs[-1]             # sent once the client reads again
        elif pongs:
            frames.append(pongs[-1])
        if frames:
            self.transport.write(b"".join(frames))

    def _fail(self, code: int, reason: str) -> None:
        log.warning("%s: %s: closing (%d)", self.client, reason, code)
        self.conn.fail(code, reason)
        self.queue.put_nowait({"type": "websocket.disconnect", "code": code, "reason": reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        self.close_sent = True
        self.stop_keepalive()
        self.transport.pause_reading()             # what a flooder still sends stays with it
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)
        self._abort_if_unsent(self.close_timeout)

    # ---------------------------------------------------------------- keepalive

    def send_keepalive_ping(self) -> None:
        self._note_progress()
        super().send_keepalive_ping()

    def keepalive_timeout(self) -> None:
        progressed = self._note_progress()
        if progressed is None:
            super().keepalive_timeout()           # no TCP_INFO here: plain ping/pong
            self._abort_if_unsent()
            return
        waiting_for_it = self.transport.get_write_buffer_size() > 0 or _kernel_unacked(self.transport) > 0
        if progressed or (waiting_for_it and self.loop.time() - self._progress_at < self.stall_timeout_s):
            # No pong yet, but the client is reading (its TCP stack took data since the ping),
            # or it has data waiting for it and read some lately: the ping is behind what it has
            # not read yet, as with a client that plays as it reads. Wait on.
            self.pong_timer = self.loop.call_later(self.ping_timeout, self.keepalive_timeout)
            return
        super().keepalive_timeout()
        self._abort_if_unsent()

    def _note_progress(self) -> bool | None:
        """Whether the client's TCP stack acknowledged data since last asked (None: unknown)."""
        acked = _bytes_acked(self.transport)
        if acked is None:
            return None
        if self._acked_at_ping is None or acked > self._acked_at_ping:
            self._acked_at_ping = acked
            self._progress_at = self.loop.time()
            return True
        return False

    # ---------------------------------------------------------------- closing

    def handle_parser_exception(self) -> None:
        if self.close_sent:
            return                      # what the client still sends is discarded
        assert self.conn.close_sent is not None
        self.queue.put_nowait({"type": "websocket.disconnect", "code": self.conn.close_sent.code,
                               "reason": self.conn.close_sent.reason})
        self.transport.write(b"".join(self.conn.data_to_send()))
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.close_sent = True
        if self.read_paused:
            self.read_paused = False
            self.transport.resume_reading()
        self.close_timer = self.loop.call_later(self.close_timeout, self.transport.close)

    def shutdown(self) -> None:
        super().shutdown()
        self._abort_if_unsent(SHUTDOWN_ABORT_S)

    def _abort_if_unsent(self, delay: float = 0.0) -> None:
        """A transport closed with data still to send stays open until the client reads it,
        which a dead or hostile client never does: abort it (after `delay` for a live one)."""
        if self.transport.get_write_buffer_size():
            self.loop.call_later(delay, self._abort_if_still_unsent)

    def _abort_if_still_unsent(self) -> None:
        if self.transport.get_write_buffer_size():
            self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stall_timer is not None:
            self._stall_timer.cancel()
            self._stall_timer = None
        super().connection_lost(exc)


def _is_pong(frame: bytes) -> bool:
    return bool(frame) and frame[0] & 0x0F == _PONG


def _kernel_unacked(transport: asyncio.BaseTransport) -> int:
    """Bytes the kernel holds for this connection, sent but not acknowledged or not sent yet."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0"))[0]
    except OSError:
        return 0


def _bytes_acked(transport: asyncio.BaseTransport) -> int | None:
    """Bytes of this connection the peer's TCP stack has acknowledged (None where not known)."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except OSError:
        return None
    if len(info) < _TCP_INFO_BYTES_ACKED + 8:
        return None
    return struct.unpack_from("=Q", info, _TCP_INFO_BYTES_ACKED)[0]
