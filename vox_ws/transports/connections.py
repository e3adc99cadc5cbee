"""The server's connections below the ASGI app: uvicorn's HTTP and WebSocket protocols, with the
limits a server exposed to hostile clients needs.

HTTP (httptools):
- A connection that has not finished sending its first request's headers is *half-open*.
  Half-open connections are bounded per address and in total (a trusted balancer's count
  under the client its PROXY header names, as soon as it is read), and one whose headers take
  longer than `REQUEST_HEADER_TIMEOUT_S` is closed (any later request on a keep-alive
  connection gets the same time for its headers), so unfinished requests cannot use up the
  server's descriptors.
- A request is *in flight* from its headers to the end of its response. In-flight requests
  are bounded per address and in total (429 with `Retry-After` beyond), and a body must keep
  coming: it has `limits.body_timeout_s`, one more second for every `limits.body_min_rate`
  bytes received, and never more than `limits.body_max_s` in all; one that falls behind is
  answered 408 and its connection closed.
- An address that goes on sending requests the server refuses is not heard for a while: past
  `limits.refused_requests_per_s` refusals (in bursts of REFUSAL_BURST_S seconds' worth), its
  new connections are closed as they are accepted, before any HTTP is read, and a keep-alive
  connection of its is closed with the refusal that spends the budget, until the budget has
  refilled. A refusal is every answer that turns a request down for what its client sent or
  how much it asks: every HTTP 4xx, the app's (401, 403, 404, 413, 429...) and those written
  here (400 for a request httptools cannot read, 408, 431), and every WebSocket handshake
  refused (by websockets, here, or by the app before or just after accepting it: an origin,
  a missing token, too many connections, a full server). Not a 5xx, nor a server draining:
  those are the server's state, not the client's doing. A refused request costs the server its
  headers, its routing and its answer (a 401 used to cost a 64 KB query string's parse, 25-31
  ms); a connection closed at accept costs almost nothing, so a client that ignores
  `Retry-After` or keeps sending what is refused cannot keep the event loop busy with refusals.
- A request's headers are bounded as websockets' own parser bounds a handshake's
  (`MAX_HEADER_LINE_BYTES` a line, `MAX_HEADERS` lines, `MAX_REQUEST_HEADER_BYTES` in all,
  counted as they arrive): beyond, it is answered 431 and its connection closed, before the
  rest is read. A handshake websockets still refuses (a request line too long, a header it
  cannot read) is answered 400 and closed: no refused handshake is left hanging.
- Writes are bounded as a WebSocket's are (below): a response nobody reads is aborted once the
  client has acknowledged nothing for `limits.write_stall_timeout_s`, whether the app is
  still writing or the response is complete and waits in the buffers.

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
- An offer of subprotocols past `auth.MAX_SUBPROTOCOLS` or `auth.MAX_SUBPROTOCOL_BYTES` is
  dropped from the handshake before websockets reads it: websockets' `accept` parses every
  offered subprotocol (a 960 KB offer of one-letter ones: over 500 ms of the event loop), and
  the app takes none past those bounds anyway. The handshake goes on as if none was offered.
"""

from __future__ import annotations

import asyncio
import collections
import fcntl
import functools
import json
import logging
import socket
import struct
import termios
import time
from collections import Counter
from typing import Any, Awaitable, Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol
from websockets.exceptions import HeaderLineTooLong, TooManyHeaders
from websockets.http11 import MAX_LINE_LENGTH, MAX_NUM_HEADERS

from ..addresses import DEFAULT_IPV6_PREFIX, client_key
from ..config import Limits
from .auth import bounded_subprotocols
from .proxies import ProxyHeaderError, TrustedProxies, parse_proxy_header
from .rate import BUDGET_EXTENSION, MessageBudget, TokenBucket

log = logging.getLogger("vox_ws.connections")

# Seconds a client has to send a request's headers.
REQUEST_HEADER_TIMEOUT_S = 10.0
# A request's header lines: websockets' own bounds for a handshake (an upgrade within them is
# one websockets reads), for every request.
MAX_HEADER_LINE_BYTES = MAX_LINE_LENGTH
MAX_HEADERS = MAX_NUM_HEADERS
# Bytes of a request's headers the server holds before they are complete: every line at its
# longest, and the request line.
MAX_REQUEST_HEADER_BYTES = (MAX_HEADERS + 1) * MAX_HEADER_LINE_BYTES
# A WebSocket's application-level write buffer: sends wait above HIGH until it is below LOW.
WRITE_BUFFER_HIGH = 32 * 1024
WRITE_BUFFER_LOW = 8 * 1024
# Bytes the kernel may hold not yet sent on a WebSocket (TCP_NOTSENT_LOWAT).
KERNEL_UNSENT_BYTES = 16 * 1024
# After shutdown starts, seconds a connection with unsent data has before it is aborted.
SHUTDOWN_ABORT_S = 1.0
# Addresses whose budget for dropped bodies is kept (beyond, those with a full budget are forgotten).
DISCARD_BUDGETS_KEPT = 1024
# The burst of that budget, in `max_frame_bytes` bodies: a client's occasional refused upload,
# even one well over the limit, is read and dropped and its client reads the answer.
DISCARD_BURST_FRAMES = 4
# The burst of the refused-requests budget, in seconds of its rate.
REFUSAL_BURST_S = 5.0
# Addresses whose refusal budget is kept (beyond, those with a full budget are forgotten).
REFUSAL_BUDGETS_KEPT = 1024
REFUSAL_LOG_EVERY_S = 60.0
# The ASGI scope extension through which the app tells a WebSocket's guard that it refused the
# connection after accepting it (to send a close code the client can read): a callable.
REFUSAL_EXTENSION = "vox_ws.refused"
# The ASGI scope extension through which an HTTP response that cannot be finished (its stream
# failed after its first bytes, or its reader took it too slowly) ends its connection unfinished,
# so the client sees a truncated body: a callable. An app can only raise for that otherwise,
# which uvicorn logs as an ERROR with a traceback (Hardening VII, 7).
CUT_EXTENSION = "vox_ws.cut_response"

_PONG = 0x0A
# struct tcp_info (linux/tcp.h): tcpi_bytes_acked is the u64 at offset 120 (Linux >= 4.1).
_TCP_INFO_BYTES_ACKED = 120


class ConnectionGuard:
    """Counts half-open connections, and HTTP requests in flight, per address and in total,
    for every protocol of a server; and the requests refused per address, to stop hearing one
    that goes on after its refusals. A trusted proxy's address is not a client's: it carries
    many clients' connections and its own health checks, so no per-address bound applies to it
    and it is always heard (its clients are counted by their own addresses)."""

    def __init__(self, limits: Limits, clock: Callable[[], float] = time.monotonic,
                 proxies: TrustedProxies | None = None, ipv6_prefix: int = DEFAULT_IPV6_PREFIX) -> None:
        self._clock = clock
        self.proxies = proxies or TrustedProxies()
        self.ipv6_prefix = ipv6_prefix          # every count is by `client_key`: an IPv6 client's network
        self.per_address_limit = limits.max_connections_per_address
        self.total_limit = limits.max_connections
        self._discard_rate = limits.discard_bytes_per_s
        self._discard_burst = float(DISCARD_BURST_FRAMES * limits.max_frame_bytes)
        self._discards: dict[str, TokenBucket] = {}   # address -> what it may still have dropped
        self._pending: dict[Any, str] = {}       # transport -> address
        self._per_address: Counter[str] = Counter()
        self.refused = 0
        self._requests: Counter[str] = Counter()  # address -> HTTP requests in flight
        self.requests_refused = 0
        self._refusal_rate = limits.refused_requests_per_s
        self._refusals: dict[str, TokenBucket] = {}   # address -> refusals it may still get
        self._told: dict[str, float] = {}             # address -> when the log last said so
        self.unheard = 0                          # connections closed at accept for that

    @property
    def requests_in_flight(self) -> int:
        return sum(self._requests.values())

    def _key(self, address: str) -> str:
        return client_key(address, self.ipv6_prefix)

    def begin_request(self, address: str) -> bool:
        """One more HTTP request in flight from `address`, if within the bounds."""
        key = self._key(address)
        if self.requests_in_flight >= self.total_limit or (
                self._requests[key] >= self.per_address_limit and not self.proxies.trusts(address)):
            self.requests_refused += 1
            return False
        self._requests[key] += 1
        return True

    def end_request(self, address: str, count: int = 1) -> None:
        key = self._key(address)
        self._requests[key] -= count
        if self._requests[key] <= 0:
            del self._requests[key]

    def may_discard(self, address: str, size: int) -> bool:
        """Whether the server reads and drops `size` more bytes of a body it answered before
        reading (so that the connection can serve a next request): `discard_bytes_per_s` per
        address, in bursts of DISCARD_BURST_FRAMES `max_frame_bytes` bodies. Beyond, the
        connection is closed."""
        address = self._key(address)
        bucket = self._discards.get(address)
        if bucket is None:
            if len(self._discards) >= DISCARD_BUDGETS_KEPT:
                self._discards = {a: b for a, b in self._discards.items() if not b.full}
            bucket = self._discards[address] = TokenBucket(self._discard_rate, self._discard_burst, self._clock)
        return bucket.take(size)

    def refused_request(self, address: str) -> None:
        """A request of `address` was refused (any refusal: the module's docstring says which);
        past its budget, its next connections are not heard (with `refused_requests_per_s` 0,
        every address is always heard)."""
        if self._refusal_rate <= 0 or self.proxies.trusts(address):
            return
        address = self._key(address)
        bucket = self._refusals.get(address)
        if bucket is None:
            if len(self._refusals) >= REFUSAL_BUDGETS_KEPT:
                self._refusals = {a: b for a, b in self._refusals.items() if not b.full}
                self._told = {a: t for a, t in self._told.items() if a in self._refusals}
            burst = max(1.0, REFUSAL_BURST_S * self._refusal_rate)
            bucket = self._refusals[address] = TokenBucket(self._refusal_rate, burst, self._clock)
        if bucket.take() and bucket.tokens < 1.0:
            # Once a minute at the most: an address kept at its budget runs it out again and again.
            now = self._clock()
            if now - self._told.get(address, -REFUSAL_LOG_EVERY_S) >= REFUSAL_LOG_EVERY_S:
                self._told[address] = now
                log.warning("%s goes on sending requests after being refused: its new connections are "
                            "closed at accept while it does", address)

    def heard(self, address: str) -> bool:
        """Whether a new connection from `address` is read at all."""
        bucket = self._refusals.get(self._key(address))
        return bucket is None or bucket.tokens >= 1.0

    @property
    def pending(self) -> int:
        return len(self._pending)

    def pending_from(self, address: str) -> int:
        return self._per_address.get(self._key(address), 0)

    def admit(self, transport: asyncio.BaseTransport, address: str) -> str | None:
        """None if a new connection is admitted; else why not."""
        if not self.heard(address):
            self.unheard += 1
            return "its address goes on sending requests after being refused"
        key = self._key(address)
        if len(self._pending) >= self.total_limit or (
                self._per_address[key] >= self.per_address_limit and not self.proxies.trusts(address)):
            self.refused += 1
            return "too many unfinished connections (from its address or in all)"
        self._pending[transport] = key
        self._per_address[key] += 1
        return None

    def move(self, transport: asyncio.BaseTransport, address: str) -> str | None:
        """A half-open connection's client is `address` (a trusted peer's PROXY header named
        it): from now it counts there, within that address's bound, not the peer's. None if
        it may; else why not (the caller closes it)."""
        if transport not in self._pending:
            return None
        key = self._key(address)
        if self._per_address[key] >= self.per_address_limit and not self.proxies.trusts(address):
            self.refused += 1
            return "too many unfinished connections from its address"
        self.settle(transport)
        self._pending[transport] = key
        self._per_address[key] += 1
        return None

    def settle(self, transport: asyncio.BaseTransport) -> None:
        """The connection sent a whole request's headers, or is gone."""
        address = self._pending.pop(transport, None)
        if address is not None:
            self._per_address[address] -= 1
            if self._per_address[address] <= 0:
                del self._per_address[address]


class StallWatch:
    """Aborts a connection whose client takes nothing while data waits for it.

    Armed when writes back up (or a response is left in the buffers); when it fires, a client
    whose TCP stack acknowledged data since it was armed is reading, slowly, and gets the same
    time again; one that acknowledged nothing is aborted, which frees the buffers and wakes any
    writer waiting on them."""

    def __init__(self, protocol: asyncio.Protocol, timeout_s: float) -> None:
        self._protocol = protocol
        self.timeout_s = timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._acked: int | None = None

    def arm(self) -> None:
        if self._timer is None:
            self._acked = _bytes_acked(self._transport)
            self._timer = asyncio.get_running_loop().call_later(self.timeout_s, self._check)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def _transport(self) -> asyncio.Transport:
        return self._protocol.transport  # type: ignore[attr-defined]

    def _check(self) -> None:
        self._timer = None
        transport = self._transport
        if transport.is_closing() and not transport.get_write_buffer_size():
            return
        if not transport.get_write_buffer_size() and not getattr(self._protocol, "write_paused", False):
            return                              # it all went out
        acked = _bytes_acked(transport)
        if acked is not None and self._acked is not None and acked > self._acked:
            self.arm()                          # reading, slowly: wait on
            return
        log.warning("%s: read nothing for %.0fs with %d bytes waiting: aborting the connection",
                    getattr(self._protocol, "client", None), self.timeout_s, transport.get_write_buffer_size())
        transport.abort()


def bound_writes(transport: asyncio.BaseTransport) -> None:
    """Small buffers in the process and the kernel, so that what a client has not read waits
    where back-pressure sees it (the stream service), not in socket buffers."""
    transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_LOW)  # type: ignore[attr-defined]
    sock = transport.get_extra_info("socket")
    if sock is not None and hasattr(socket, "TCP_NOTSENT_LOWAT"):
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NOTSENT_LOWAT, KERNEL_UNSENT_BYTES)
        except OSError:
            pass                      # not TCP (a Unix socket): nothing to bound


class BodyClock:
    """When an HTTP request's body must have arrived: `body_timeout_s` from its headers, one
    second more for every `body_min_rate` bytes received, `body_max_s` at the most (the rule of
    Apache's mod_reqtimeout). Time the server itself is not reading (the app has not asked for
    more yet) does not count against the client."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.started = now
        self.received = 0

    def deadline(self) -> float:
        limits = self.limits
        earned = self.received / limits.body_min_rate if limits.body_min_rate > 0 else float("inf")
        return self.started + min(limits.body_max_s, limits.body_timeout_s + earned)


class HeaderWatch:
    """The time bound on a request's headers (`REQUEST_HEADER_TIMEOUT_S`): armed as a request
    begins, disarmed once its headers are read; past it, the connection is aborted."""

    def __init__(self, protocol: "HttpProtocol") -> None:
        self._protocol = protocol
        self._timer: asyncio.TimerHandle | None = None

    @property
    def armed(self) -> bool:
        return self._timer is not None

    def arm(self) -> None:
        if self._timer is None:
            self._timer = self._protocol.loop.call_later(REQUEST_HEADER_TIMEOUT_S, self._too_slow)

    def disarm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _too_slow(self) -> None:
        self._timer = None
        protocol = self._protocol
        log.info("%s: no complete request headers in %.0fs: closing", protocol.client, REQUEST_HEADER_TIMEOUT_S)
        protocol.guard.settle(protocol.transport)
        protocol.transport.abort()


class BodyWatch:
    """The time bound on a request's body (`BodyClock`): started once its headers are read,
    ended with the body; past it, the request is answered 408 and the connection closed."""

    def __init__(self, protocol: "HttpProtocol", limits: Limits) -> None:
        self._protocol = protocol
        self._limits = limits
        self.clock: BodyClock | None = None       # while a body is being read
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self.clock = BodyClock(self._limits, self._protocol.loop.time())
        self._arm()

    def end(self) -> None:
        self.clock = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _arm(self) -> None:
        assert self.clock is not None
        self._timer = self._protocol.loop.call_at(self.clock.deadline(), self._due)

    def _due(self) -> None:
        self._timer = None
        body, protocol = self.clock, self._protocol
        if body is None:
            return
        if protocol.flow.read_paused:
            # The app has not asked for more yet: the client is not the one behind, and the
            # time until the app reads again (checked each second) is not counted.
            body.started += 1.0
            self._timer = protocol.loop.call_later(1.0, self._due)
            return
        if protocol.loop.time() < body.deadline():
            self._arm()                          # it sent more since: a later deadline
            return
        log.warning("%s: request body too slow (%d bytes in %.0fs): closing", protocol.client, body.received,
                    protocol.loop.time() - body.started)
        self.end()
        cycle = protocol.cycle
        if cycle is not None and not cycle.response_started and not protocol.transport.is_closing():
            protocol.transport.write(_REQUEST_TIMEOUT)
            protocol.guard.refused_request(protocol._address)
        if cycle is not None:
            cycle.disconnected = True             # the app reads http.disconnect; its writes go nowhere
            cycle.message_event.set()
        protocol.transport.close()
        protocol.stall.arm()                      # the 408 goes out, or the connection is aborted


def _has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    for name, value in headers:
        if name == b"content-length":
            return value.strip() not in (b"", b"0")
        if name == b"transfer-encoding":
            return True
    return False


class _WatchedWrites:
    """Arms a protocol's `stall` watch while its transport's writes are paused."""

    stall: StallWatch

    def pause_writing(self) -> None:
        super().pause_writing()  # type: ignore[misc]
        self.stall.arm()

    def resume_writing(self) -> None:
        super().resume_writing()  # type: ignore[misc]
        self.stall.disarm()


class HttpProtocol(_WatchedWrites, HttpToolsProtocol):
    def __init__(self, *args: Any, guard: ConnectionGuard, limits: Limits, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.limits = limits
        self._headers = HeaderWatch(self)
        self._peer = "unknown"                    # the connection's own peer
        self._address = "unknown"                 # the client of the request being read
        self._proxied: str | None = None          # the client a trusted peer's PROXY header named
        self._unnamed = False                     # its PROXY header named no address
        self._preamble: bytearray | None = None   # a trusted peer's first bytes, until a PROXY header is told
        self._in_flight: collections.deque[str] = collections.deque()   # the guard's count, by client
        self._ws_class = self.ws_protocol_class
        self._body = BodyWatch(self, limits)
        self._trusted_peer = False                # its peer is a proxy this server trusts
        self._answered = False                    # the request's response is complete
        self._header_bytes = 0                    # of the request whose headers are being read
        self._headers_refused = False             # they were over a bound, and answered 431
        self.stall = StallWatch(self, limits.write_stall_timeout_s)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._peer = self._address = self.client[0] if self.client else "unknown"
        refused = self.guard.admit(transport, self._peer)
        if refused is not None:
            # Not heard: said once, when its budget ran out (a log line each would be a flood).
            if self.guard.heard(self._peer):
                log.warning("closing a new connection from %s: %s", self._peer, refused)
            transport.abort()
            return
        self._trusted_peer = self.guard.proxies.trusts(self._peer)
        if self._trusted_peer:
            self._preamble = bytearray()
        self.app = _RefusalWatch(self.app, self.guard)
        bound_writes(transport)
        self._headers.arm()

    def data_received(self, data: bytes) -> None:
        if self._headers_refused:
            return                                # answered: what follows is not read
        if self._preamble is not None:
            data = self._after_proxy_header(data)
            if not data:
                return
        super().data_received(data)
        if self._headers.armed and not self._headers_refused:
            # Still in a request's headers: all of this was headers (or the end of the
            # request before, at most one read's worth). httptools keeps an unfinished line
            # whole, so the bound is on what arrives, not on the lines it has told of.
            self._header_bytes += len(data)
            if self._header_bytes > MAX_REQUEST_HEADER_BYTES:
                self._refuse_headers(f"over {MAX_REQUEST_HEADER_BYTES} bytes of headers")

    def on_header(self, name: bytes, value: bytes) -> None:
        if len(name) + len(value) + 4 > MAX_HEADER_LINE_BYTES:
            self._refuse_headers(f"a header line over {MAX_HEADER_LINE_BYTES} bytes")
        elif len(self.headers) >= MAX_HEADERS:
            self._refuse_headers(f"over {MAX_HEADERS} header lines")
        if self._headers_refused:
            raise _HeadersRefused             # httptools stops reading; send_400_response answers
        super().on_header(name, value)

    def _refuse_headers(self, why: str) -> None:
        if self._headers_refused:
            return
        log.info("%s: %s: answered 431", self.client, why)
        self._headers_refused = True
        self.ws_protocol_class = None             # never upgraded
        self._headers.disarm()
        self.guard.settle(self.transport)
        if self.cycle is None or not self.cycle.response_started:
            self.transport.write(_response(431, "Request Header Fields Too Large", "too_large",
                                           f"the request's headers are too large: {why}"))
        self.guard.refused_request(self._unread_client)
        self.transport.close()
        self.stall.arm()                          # the answer goes out, or the connection is aborted

    def send_400_response(self, msg: str) -> None:
        if not self._headers_refused:             # else answered 431 already
            super().send_400_response(msg)
            self.guard.refused_request(self._unread_client)

    @property
    def _unread_client(self) -> str:
        """Whom a request refused before its headers were read counts under: the client a
        PROXY header named, else the peer (a trusted proxy's own address counts nowhere)."""
        return self._proxied or self._peer

    def _after_proxy_header(self, data: bytes) -> bytes:
        """What follows a trusted peer's PROXY header (all of it where it sent none); b"" while
        the header is incomplete, or when a malformed one closed the connection."""
        assert self._preamble is not None
        self._preamble += data
        try:
            header = parse_proxy_header(bytes(self._preamble))
        except ProxyHeaderError as exc:
            log.warning("%s: %s: closing", self._peer, exc)
            self._preamble = None
            self.transport.abort()
            return b""
        if header is None:
            return b""
        rest, self._preamble = bytes(self._preamble[header.length:]), None
        if header.source is not None:
            refused = self.guard.move(self.transport, header.source)
            if refused is not None:
                log.warning("closing a connection for %s (by %s): %s", header.source, self._peer, refused)
                self.transport.abort()
                return b""
            self._proxied = header.source
            self.client = (header.source, header.port)
        elif header.length:
            self._unnamed = True
        return rest

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_bytes = 0
        self._headers.arm()

    def on_headers_complete(self) -> None:
        self._headers.disarm()
        if self._headers_refused:
            return
        self.guard.settle(self.transport)
        if self._trusted_peer and not self._proxied_client_heard():
            return
        if self.parser.should_upgrade() and self._should_upgrade():
            if self._trusted_peer:
                self.ws_protocol_class = functools.partial(self._ws_class, client=self.client)
            super().on_headers_complete()         # a WebSocket: its own protocol's limits
            return
        if not self.guard.begin_request(self._address):
            log.warning("too many HTTP requests in flight (from %s or in all): refusing one", self._address)
            self.guard.refused_request(self._address)
            self._start_with(_too_many_requests)
            return
        self._in_flight.append(self._address)
        self._answered = False
        if _has_body(self.headers):
            self._body.start()
        super().on_headers_complete()
        self.cycle.on_response = self._counted_response_complete
        cut = functools.partial(_cut, self.transport, self.cycle)
        self.scope.setdefault("extensions", {})[CUT_EXTENSION] = cut

    def _proxied_client_heard(self) -> bool:
        """Takes the request's client from what the trusted peer said; false (and answered
        429) if that client goes on after its refusals. A client behind a balancer is not
        closed at accept, which would look to the balancer like a dead replica: it is answered,
        at the cost of its headers only."""
        if self._unnamed:
            # The PROXY header named no address (LOCAL, UNSPEC, a UNIX socket, UNKNOWN): the
            # connection is the balancer's own, or its client cannot be told; either way it is
            # its peer, and no forwarding header (the client's own, for all the server knows)
            # renames it.
            self._address = self._peer
        else:
            self._address = self.guard.proxies.client(self._peer, self._proxied, self.headers)
        self.client = (self._address, self.client[1] if self.client else 0)
        self.scope["client"] = self.client
        if self.guard.heard(self._address):
            return True
        self.guard.unheard += 1
        self.ws_protocol_class = None             # an upgrade too is answered 429, not upgraded
        self._start_with(_not_heard)
        return False

    def _unsupported_upgrade_warning(self) -> None:
        if self.ws_protocol_class is None and self._ws_class is not None:
            return                                # refused above, and said so once
        super()._unsupported_upgrade_warning()

    def _counted_response_complete(self) -> None:
        # A request answered before its body was read is in flight until the rest of its body
        # has been dropped (with the body's own time bound): it holds the connection that long.
        self._answered = True
        if self._body.clock is None:
            self._request_done()
        self.on_response_complete()

    def _request_done(self) -> None:
        if self._in_flight:
            self.guard.end_request(self._in_flight.popleft())

    def on_body(self, body: bytes) -> None:
        if self._body.clock is not None:
            self._body.clock.received += len(body)
        if self._answered and not self.guard.may_discard(self._address, len(body)):
            # Answered already: reading the rest only to drop it is free up to the address's
            # budget; beyond, the connection is closed and the kernel drops what follows.
            log.info("%s: dropping more of an answered request's body than its budget: closing", self.client)
            self._body.end()
            self.transport.close()
            return
        super().on_body(body)

    def on_message_complete(self) -> None:
        self._body.end()
        if self._answered:
            self._request_done()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        if self.transport.get_write_buffer_size():
            self.stall.arm()                      # the client must still take it
        super().on_response_complete()

    @property
    def write_paused(self) -> bool:
        return bool(self.flow is not None and self.flow.write_paused)

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers.disarm()
        self._body.end()
        self.stall.disarm()
        self.guard.settle(self.transport)
        while self._in_flight:
            self.guard.end_request(self._in_flight.popleft())
        super().connection_lost(exc)

    def _start_with(self, app: Any) -> None:
        """Runs this request through `app` instead of the server's (uvicorn's own way in)."""
        served, self.app = self.app, app
        try:
            super().on_headers_complete()
        finally:
            self.app = served
        self.cycle.keep_alive = False             # what the client still sends is not read


def _cut(transport: asyncio.BaseTransport, cycle: Any) -> None:
    """Ends `cycle`'s response unfinished: the connection is closed after what is written (no
    chunked terminator, fewer bytes than its Content-Length), and the cycle counts as
    disconnected, so uvicorn neither sends more nor reports the response left unfinished."""
    cycle.disconnected = True
    cycle.keep_alive = False
    transport.close()


class _HeadersRefused(Exception):
    """Raised in httptools' header callback to stop it reading a request answered 431."""


def _response(status: int, phrase: str, code: str, message: str) -> bytes:
    """A whole response written below the app (a JSON error, as the app's), closing the connection."""
    body = json.dumps({"error": {"code": code, "message": message}}).encode()
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\ncontent-length: %d\r\n\r\n%s"
            % (status, phrase.encode(), len(body), body))


_REQUEST_TIMEOUT = _response(408, "Request Timeout", "timeout", "the request body did not arrive in time")


class _RefusalWatch:
    """The connection's app, telling the guard of every request it refuses (4xx; by the
    request's client, which behind a trusted proxy changes from request to request). An answer
    to a client already gone (one that gave up on its request: the app read its disconnect)
    refuses nobody and is not counted. The refusal that spends the client's budget closes the
    connection: a keep-alive connection would otherwise go on carrying refused requests the
    budget is there to stop."""

    def __init__(self, app: Any, guard: ConnectionGuard) -> None:
        self.app, self.guard = app, guard

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        client = scope.get("client")
        address = client[0] if client else "unknown"
        gone = False

        async def watched_receive() -> Any:
            nonlocal gone
            message = await receive()
            gone = gone or message["type"] == "http.disconnect"
            return message

        async def watched(message: Any) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500 and not gone:
                self.guard.refused_request(address)
                if not self.guard.heard(address):
                    message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)
        await self.app(scope, watched_receive, watched)


def _refusal(message: bytes) -> Callable[..., Any]:
    """An app that answers every request 429 `busy` with `message`, before any routing."""
    body = b'{"error":{"code":"busy","message":"%s"}}' % message

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 429,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"retry-after", b"1"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})
    return refuse


_too_many_requests = _refusal(b"too many HTTP requests in flight from your address (or in all): try again later")
_not_heard = _refusal(b"your address goes on sending requests after being refused: try again later")


class WebSocketProtocol(_WatchedWrites, WebSocketsSansIOProtocol):
    def __init__(self, *args: Any, limits: Limits, client: tuple[str, int] | None = None,
                 guard: ConnectionGuard | None = None, **kwargs: Any) -> None:
        """`client`: who the connection is for, where a trusted proxy said so (else its peer);
        `guard`: told of a refused handshake (`ConnectionGuard.refused_request`)."""
        super().__init__(*args, **kwargs)
        self._forwarded_client = client
        self.guard = guard
        self._refusal_told = False
        self.budget = MessageBudget(limits.max_messages_per_s)
        self.stall_timeout_s = limits.write_stall_timeout_s + (self.ping_timeout or 0.0)
        self.stall = StallWatch(self, self.stall_timeout_s)
        self._owed_pong: bytes | None = None
        self._acked_at_ping: int | None = None
        self._progress_at = 0.0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        if self._forwarded_client is not None:
            self.client = self._forwarded_client
        bound_writes(transport)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if not self.handshake_initiated and self.conn.handshake_exc is not None and not self.transport.is_closing():
            self._refuse_handshake(self.conn.handshake_exc)

    def _refuse_handshake(self, exc: BaseException) -> None:
        """websockets refused the handshake's request: it only half-closes, and uvicorn writes
        nothing; answered here (431 for header lines, 400 else) and closed."""
        cause = exc.__cause__ or exc
        log.info("%s: a WebSocket handshake websockets cannot read (%s): answered", self.client, cause)
        self.handshake_complete = self.close_sent = True
        if isinstance(cause, (HeaderLineTooLong, TooManyHeaders)):
            answer = _response(431, "Request Header Fields Too Large", "too_large", f"the handshake's {cause}")
        else:
            answer = _response(400, "Bad Request", "bad_request",
                               f"not a WebSocket handshake this server reads: {cause}")
        self.transport.write(answer)
        self.refused()
        self.transport.close()
        self._abort_if_unsent(self.close_timeout)

    def handle_connect(self, event: Any) -> None:
        offer = event.headers.get_all("Sec-WebSocket-Protocol")
        if offer and bounded_subprotocols(offer) is None:
            # Past the bounds nothing offered is taken: dropped before websockets' `accept`
            # parses it item by item (and uvicorn splits it for the scope), as if not offered.
            del event.headers["Sec-WebSocket-Protocol"]
            log.debug("%s: an offer of subprotocols past the bounds (%d bytes): dropped", self.client,
                      sum(len(value) for value in offer))
        super().handle_connect(event)
        if self.response.status_code != 101:
            self.refused()                        # websockets refused it (and uvicorn answered)
        scope = getattr(self, "scope", None)
        if scope is not None:
            scope["extensions"][BUDGET_EXTENSION] = self.budget
            scope["extensions"][REFUSAL_EXTENSION] = self.refused

    def refused(self) -> None:
        """The handshake was refused (here, by websockets, or by the app): the client's
        refusal budget pays, once a connection."""
        if self.guard is not None and not self._refusal_told:
            self._refusal_told = True
            self.guard.refused_request(self.client[0] if self.client else "unknown")

    async def send(self, message: Any) -> None:
        if not self.handshake_complete and (message["type"] == "websocket.close" or (
                message["type"] == "websocket.http.response.start" and 400 <= message["status"] < 500)):
            self.refused()                        # the app refused the handshake (403, or its own answer)
        await super().send(message)
        if message["type"] == "websocket.http.response.body" and not message.get("more_body", False):
            # uvicorn has sent the app's own answer to the handshake (a typed 403 or 421) and
            # closed, but leaves the handshake unfinished: it would log an error ("returned
            # without completing handshake") for every refusal an attacker's page makes.
            self.handshake_complete = True

    # ---------------------------------------------------------------- writing

    @property
    def write_paused(self) -> bool:
        return not self.writable.is_set()

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._owed_pong is not None and not self.transport.is_closing():
            self.transport.write(self._owed_pong)
        self._owed_pong = None

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
        self.stall.disarm()
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


def asgi_send(ws: Any) -> Callable[[dict[str, Any]], Awaitable[None]]:
    """The ASGI send callable under a Starlette `WebSocket`: frames of an accepted connection need
    none of its state checks, and a chunk's path to the socket is the hot one. The one place
    outside Starlette that reaches its private attribute (tests/test_dependency_internals.py
    checks it is still there)."""
    return ws._send
