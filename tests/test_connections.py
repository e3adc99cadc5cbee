"""`transports/connections.py`: uvicorn's HTTP and WebSocket protocols with their bounds, attacked
over real sockets (bodies that never finish, headers that never end, answers nobody reads,
requests in flight per address), each attack followed by a good request served."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from attackers import ATTACKER, assert_speaks, attacker_socket, closed_with, read_until_closed, speech_headers
from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from helpers import LONG, SENTENCE
from vox_ws.config import Limits
from vox_ws.engines.piper import PiperEngine
from vox_ws.transports.connections import BodyClock, HttpProtocol


def send_until_answered(sock: socket.socket, piece: bytes, every_s: float) -> bytes:
    """Sends `piece` each `every_s` (or less often) until the server answers; its answer."""
    sock.settimeout(every_s)
    while True:
        try:
            answer = sock.recv(65536)
            return answer + read_until_closed(sock)
        except TimeoutError:
            pass
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return b""


def http_connections(server, port: int | None = None) -> list[HttpProtocol]:
    """The server's HTTP connections (from the attacker's `port`, if given)."""
    return [c for c in server.server._uvicorn.server_state.connections
            if isinstance(c, HttpProtocol) and (port is None or (c.client and c.client[1] == port))]


@pytest.mark.hardening
def test_a_body_has_its_time_and_earns_more_by_arriving():
    limits = Limits(body_timeout_s=20.0, body_min_rate=1000.0, body_max_s=120.0)
    clock = BodyClock(limits, now=100.0)
    assert clock.deadline() == 120.0
    clock.received = 30_000
    assert clock.deadline() == 150.0                       # 30 more seconds for 30 kB
    clock.received = 10_000_000
    assert clock.deadline() == 220.0                       # never past body_max_s


@pytest.mark.hardening
async def test_bodies_that_never_finish_are_bounded_per_address(start_server):
    # No body time-out in reach: the held requests stay in flight for the whole test.
    server = start_server(PiperEngine(), max_connections_per_address=4, body_timeout_s=3600.0)
    # Complete headers, 11 bytes of a 30,000-byte body, then nothing.
    holders = [attacker_socket(server.port) for _ in range(4)]
    for sock in holders:
        sock.sendall(speech_headers(30_000) + b'{"input": "')
    await wait_until(lambda: server.server.guard.requests_in_flight == 4)
    # One more from the same address is refused at once, 429 with Retry-After.
    extra = attacker_socket(server.port)
    extra.sendall(speech_headers(30_000) + b'{"input": "')
    refusal = await asyncio.to_thread(read_until_closed, extra)
    assert refusal.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in refusal.lower(), refusal
    # The victim, from another address, is served meanwhile.
    assert server.get("/healthz")[0] == 200
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))
    await asyncio.to_thread(assert_speaks, server)
    for sock in holders:
        sock.close()
    await wait_until(lambda: server.server.guard.requests_in_flight == 0)


@pytest.mark.hardening
async def test_an_address_that_goes_on_after_429s_is_not_heard_and_another_is_served(start_server):
    """Refused requests cost the server their headers, routing and answer; past its budget of
    them an address's new connections are closed at accept, before any HTTP is read."""
    # A budget that does not refill within the test: one refusal (the least burst) and no more.
    server = start_server(PiperEngine(), max_connections_per_address=1, body_timeout_s=3600.0,
                          refused_requests_per_s=0.001)
    guard = server.server.guard
    holder = attacker_socket(server.port)
    holder.sendall(speech_headers(30_000) + b'{"input": "')
    await wait_until(lambda: guard.requests_in_flight == 1)
    refused = attacker_socket(server.port)
    refused.sendall(speech_headers(30_000) + b'{"input": "')
    assert (await asyncio.to_thread(read_until_closed, refused)).startswith(b"HTTP/1.1 429")
    # The budget spent: the next connection is closed before a byte of its request is read.
    unheard = attacker_socket(server.port)
    try:
        unheard.sendall(speech_headers(30_000) + b'{"input": "')
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert await asyncio.to_thread(read_until_closed, unheard) == b""
    assert guard.unheard == 1 and not guard.heard(ATTACKER)
    # The victim's address is heard as before, over HTTP and WebSocket.
    assert guard.heard("127.0.0.1")
    await asyncio.to_thread(assert_speaks, server)
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))
    for sock in (holder, refused, unheard):
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)


@pytest.mark.hardening
def test_the_budget_of_refusals_refills_at_its_rate():
    from vox_ws.transports.connections import ConnectionGuard

    now = [1000.0]
    guard = ConnectionGuard(Limits(refused_requests_per_s=2.0), clock=lambda: now[0])   # bursts of 10
    for _ in range(9):
        guard.refused_request(ATTACKER)
    assert guard.heard(ATTACKER)
    guard.refused_request(ATTACKER)
    assert not guard.heard(ATTACKER) and guard.heard("127.0.0.1")
    now[0] += 0.5                                                     # one more at 2 a second
    assert guard.heard(ATTACKER)
    guard.refused_request(ATTACKER)
    assert not guard.heard(ATTACKER)
    assert guard.admit(object(), ATTACKER) is not None and guard.unheard == 1
    off = ConnectionGuard(Limits(refused_requests_per_s=0.0), clock=lambda: now[0])
    for _ in range(1000):
        off.refused_request(ATTACKER)
    assert off.heard(ATTACKER)


def _attacker_http(server) -> http.client.HTTPConnection:
    return http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_TIMEOUT,
                                      source_address=(ATTACKER, 0))


def _answer_to(server, request: bytes) -> bytes:
    """The whole answer to `request`, sent on a connection of its own from the attacker's address."""
    sock = attacker_socket(server.port)
    try:
        sock.sendall(request)
    except (BrokenPipeError, ConnectionResetError):
        pass
    try:
        return read_until_closed(sock)
    finally:
        sock.close()


@pytest.mark.hardening
async def test_every_kind_of_refusal_counts_against_the_addresss_budget(start_server, monkeypatch):
    """Hardening VI, 8: only 429s counted against an address's budget of refused requests; a
    client sending requests refused otherwise (401s without a token, each after a 64 KB query's
    parse) was heard for ever. Now every refusal counts, HTTP and WebSocket, the app's and those
    written below it: past the budget (11 here, on a clock that stands still) the keep-alive
    connection that spent it is closed with its answer and the next one at accept, while
    another address is served."""
    server = start_server(PiperEngine(), tokens=["alpha"], allow_origins=["https://app.example"],
                          refused_requests_per_s=2.2)                         # bursts of 11
    guard = server.server.guard
    monkeypatch.setattr(guard, "_clock", lambda: 1000.0)                   # no refill during the test

    def spent() -> float:
        bucket = guard._refusals.get(ATTACKER)
        return 0.0 if bucket is None else bucket.burst - bucket.tokens

    junk = "a=1&" * 16000                                                   # 64,000 bytes of query
    refusals = [
        (b"POST /v1/audio/speech?%s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
         b"Content-Length: 2\r\nConnection: close\r\n\r\n{}" % junk.encode(), 401),       # no token
        (b"GET /nowhere HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer alpha\r\n"
         b"Connection: close\r\n\r\n", 404),
        (b"GET /healthz HTTP/1.1\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n", 431),           # a header line
        (b"NOT HTTP AT ALL\r\n\r\n", 400),                                          # httptools' refusal
        (_handshake(headers=[("Authorization", "Bearer alpha")]).replace(b"Version: 13", b"Version: 12"),
         400),                                                                       # websockets' accept
        (_handshake(path="/v1/stream?" + "a" * 9000), 400),                         # websockets' parser
        (_handshake(path="/nowhere", headers=[("Authorization", "Bearer alpha")]), 403),    # no such route
        (_handshake(path="/v1/stream", headers=[("Authorization", "Bearer alpha"),
                                                ("Origin", "https://evil.example")]), 403),  # an origin
    ]
    for n, (request, status) in enumerate(refusals, 1):
        answer = await asyncio.to_thread(_answer_to, server, request)
        assert answer.startswith(b"HTTP/1.1 %d " % status), (n, answer[:300])
        assert spent() == pytest.approx(n), (n, status)
    # Accepted, then refused for its missing token (4001): the ninth.
    assert "unauthorized" in await closed_with(server, 4001, sock=attacker_socket(server.port))
    assert spent() == pytest.approx(9) and guard.heard(ATTACKER)

    def keep_alive_refusals() -> list[tuple[int, bool]]:
        conn = _attacker_http(server)
        answers = []
        for path in ("/nowhere", "/still-nowhere"):                         # the 11th spends the budget
            conn.request("GET", path, headers={"Authorization": "Bearer alpha"})
            response = conn.getresponse()
            response.read()
            answers.append((response.status, response.will_close))
        conn.close()
        return answers
    assert await asyncio.to_thread(keep_alive_refusals) == [(404, False), (404, True)]
    assert not guard.heard(ATTACKER)
    # Not heard: its next connection is closed before a byte of its request is read.
    unheard = await asyncio.to_thread(_answer_to, server, b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    assert unheard == b"" and guard.unheard == 1
    # Another address is heard and served, over HTTP and WebSocket.
    assert server.get("/healthz")[0] == 200
    async with connect_client(server, additional_headers={"Authorization": "Bearer alpha"}) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))


@pytest.mark.hardening
async def test_a_body_that_never_finishes_is_answered_408_when_its_time_runs_out(start_server):
    server = start_server(PiperEngine(), body_timeout_s=1.0)
    holder = attacker_socket(server.port)
    holder.sendall(speech_headers(30_000) + b'{"input": "')
    answer = await asyncio.to_thread(read_until_closed, holder)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
    holder.close()
    await wait_until(lambda: server.server.guard.requests_in_flight == 0)
    await asyncio.to_thread(assert_speaks, server)


@pytest.mark.hardening
async def test_a_chunked_body_that_trickles_extensions_or_crawls_is_cut_off(start_server):
    server = start_server(PiperEngine(), body_timeout_s=1.0, body_min_rate=1000.0)
    # Chunk extensions, a byte at a time: the body never grows.
    trickler = attacker_socket(server.port)
    trickler.sendall(speech_headers(None, chunked=True) + b"5;name=")

    answer = await asyncio.to_thread(send_until_answered, trickler, b"a", 0.05)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    # A body that comes at 500 bytes a second, half the minimum rate (any machine only makes it
    # slower): its deadline recedes half as fast as time passes, and it is cut off.
    crawler = attacker_socket(server.port)
    crawler.sendall(speech_headers(30_000))

    answer = await asyncio.to_thread(send_until_answered, crawler, b" " * 50, 0.1)   # 500 bytes/s at most
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert server.server.guard.requests_in_flight == 0
    await asyncio.to_thread(assert_speaks, server)


@pytest.mark.hardening
async def test_a_speech_response_nobody_reads_ends_and_its_connection_closes(start_server, caplog):
    server = start_server(PiperEngine(), max_buffered_audio_s=1.0, write_stall_timeout_s=1.0, slots=2)
    body = json.dumps({"input": LONG * 3, "response_format": "pcm"}).encode()
    readers = [attacker_socket(server.port, rcvbuf=4096) for _ in range(3)]
    ports = [sock.getsockname()[1] for sock in readers]
    for sock in readers:
        sock.sendall(speech_headers(len(body)) + body)     # and never reads
    # Each stream ends slow_consumer, its slot goes to the next, and the connection is aborted.
    def aborted() -> set[int]:
        return {r.args[0][1] for r in caplog.records
                if r.name == "vox_ws.connections" and "read nothing for" in r.msg and isinstance(r.args[0], tuple)}
    await wait_until(lambda: aborted() >= set(ports))
    await wait_until(lambda: all(http_connections(server, port) == [] for port in ports))
    await wait_until(lambda: server.devices.stats()["active"] == 0)
    for sock in readers:
        received = await asyncio.to_thread(read_until_closed, sock)
        assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"0\r\n\r\n")   # cut short
        sock.close()
    await asyncio.to_thread(assert_speaks, server)


def _answer(sock: socket.socket) -> http.client.HTTPResponse:
    sock.settimeout(WAIT_TIMEOUT)
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    answer.read()
    return answer


@pytest.mark.hardening
async def test_bodies_answered_before_they_are_read_are_dropped_within_a_budget_then_cut_off(start_server):
    """A refused upload's body is read and dropped, so that its client reads the answer and
    may send its next request on the connection; but only up to the address's budget (one
    `max_frame_bytes` bodies, then `discard_bytes_per_s`): beyond, the connection is closed and
    the kernel drops the rest, so a client that sends refused bodies again and again costs the
    server their headers, not their megabytes."""
    from vox_ws.transports.connections import DISCARD_BURST_FRAMES

    server = start_server(PiperEngine(), discard_bytes_per_s=1.0)       # the burst, then next to nothing
    burst = DISCARD_BURST_FRAMES * server.config.limits.max_frame_bytes
    upload = (b"POST /v1/voices HTTP/1.1\r\nHost: localhost\r\nContent-Type: audio/wav\r\n"
              b"Content-Length: %d\r\n\r\n")
    size = burst * 3 // 4
    first = attacker_socket(server.port)
    first.sendall(upload % size)
    answer = _answer(first)                                  # answered before a byte of the body
    assert answer.status == 501 and answer.getheader("connection") is None
    first.sendall(b"\0" * size)                             # dropped within the budget ...
    first.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    assert _answer(first).status == 200                      # ... and the connection goes on
    first.close()

    second = attacker_socket(server.port)                     # the budget has a quarter left
    second.sendall(upload % size)
    assert _answer(second).status == 501
    try:
        second.sendall(b"\0" * size + b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass                                                 # closed while the body was coming
    assert read_until_closed(second) == b""                  # no answer to the next request: closed
    await wait_until(lambda: not http_connections(server, second.getsockname()[1]))
    second.close()
    # Another address has its own budget, and the server serves on.
    assert_speaks(server)


@pytest.mark.hardening
async def test_unfinished_requests_are_bounded_per_address_and_timed_out(start_server, monkeypatch, caplog):
    from vox_ws.transports import connections

    monkeypatch.setattr(connections, "REQUEST_HEADER_TIMEOUT_S", 3.0)
    server = start_server(PiperEngine(), max_connections_per_address=4)

    def closed_by_server(sock: socket.socket, within: float) -> bool:
        sock.settimeout(within)
        try:
            return sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    for sock in idle:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n")       # headers never finished
    await wait_until(lambda: server.server.guard.pending == 4)
    extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    assert all([await asyncio.to_thread(closed_by_server, sock, WAIT_TIMEOUT) for sock in extra])
    # Refused as they came (not closed later by the header time-out, as the others are).
    refused = [r for r in caplog.records if "too many unfinished connections" in r.getMessage()]
    assert len(refused) == 4, [r.getMessage() for r in caplog.records]
    # The unfinished ones are closed when their header time runs out; then clients get in.
    assert all([await asyncio.to_thread(closed_by_server, sock, WAIT_TIMEOUT) for sock in idle])
    assert server.server.guard.pending == 0
    for sock in idle + extra:
        sock.close()
    status, _ = server.get("/healthz")
    assert status == 200
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


def _handshake(path: str = "/", headers: list[tuple[str, str]] = ()) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.hardening
@pytest.mark.parametrize("attack, status", [
    (_handshake(headers=[("X-Long", "a" * 9000)]), 431),                                  # a line over 8 KiB
    (_handshake(headers=[(f"X-H{n}", "1") for n in range(129)]), 431),                    # 129 lines and more
    (_handshake(headers=[("X-Long", "a" * 3_000_000)])[:-4], 431),                       # one line, never ended
    (_handshake(path="/?" + "a" * 9000), 400),                                            # websockets' own refusal
])
async def test_a_handshake_refused_for_its_headers_is_answered_and_closed(start_server, attack, status):
    """Hardening V, 4: a handshake with a header line over 8 KiB (or over 128 lines) was taken
    by httptools, refused by websockets' parser and never answered nor timed out; it counted
    nowhere, and one address held 1,100 of them. Now each is answered (431, or 400 for what
    websockets alone refuses) and closed; then a bystander is served."""
    server = start_server(PiperEngine(), max_connections_per_address=4)

    def attack_once() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            try:
                sock.sendall(attack)
            except (BrokenPipeError, ConnectionResetError):
                pass                              # answered and closed before the rest was read
            return read_until_closed(sock)               # a hang (the attack before) fails as a time-out

    answers = []
    for _ in range(3):                            # 12 in all: 3x the per-address bound, each round at it
        answers += await asyncio.gather(*(asyncio.to_thread(attack_once) for _ in range(4)))
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            ("too_large" if status == 431 else "bad_request")
    assert server.server.guard.pending == 0
    status_now, _ = server.get("/healthz")
    assert status_now == 200
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


@pytest.mark.hardening
async def test_errors_do_not_keep_a_connection_alive_and_many_in_a_row_close_it(start_server):
    server = start_server(PiperEngine(), idle_timeout_s=2.0)
    async with connect(server.url) as ws:
        await ws.recv()
        started = time.monotonic()
        with pytest.raises(ConnectionClosed):
            while time.monotonic() - started < 10 * 2.0:               # ten idle time-outs
                await ws.send(b"\xc1")                                 # not msgpack: bad_frame
                await asyncio.sleep(0.5)
        assert ws.close_code == 4000
    async with connect(server.url) as ws:
        await ws.recv()
        for _ in range(60):
            await ws.send(b"\xc1")
        with pytest.raises(ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 1008


@pytest.mark.hardening
async def test_connection_limits(start_server):
    server = start_server(PiperEngine(), max_connections=3, max_connections_per_address=2)
    async with connect_client(server), connect_client(server):
        # A third from the same address: its own code.
        assert "address" in await closed_with(server, 4029)
        server.config.limits.__dict__["max_connections_per_address"] = 10   # now the total limit applies
        async with connect_client(server):
            assert "try again later" in await closed_with(server, 1013)
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("Room again.", "a"))
