"""Who the client is behind a balancer the server trusts (`--trusted-proxies`), and only then:
the PROXY protocol (v1, v2) and forwarding headers parsed, and what each changes on a real
server: per-address bounds over HTTP, WebSocket and Wyoming, voice ownership, and a forged
header from a peer the server does not trust. The same through a real HAProxy is in
tests/test_balancer_trust.py."""

from __future__ import annotations

import asyncio
import json
import socket
import struct

import httpx
import pytest
import websockets

from attackers import read_until_closed, speech_headers
from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from helpers import v2, wav
from vox_ws.engines.piper import PiperEngine
from vox_ws.transports import protocol as p
from vox_ws.transports.proxies import (
    NO_PROXY_HEADER,
    V2_SIGNATURE,
    ProxyHeader,
    ProxyHeaderError,
    TrustedProxies,
    forwarded_hops,
    parse_proxy_header,
)

BALANCER = "127.0.0.1"            # the trusted peer: these tests connect from it
CLIENT_A, CLIENT_B = "203.0.113.7", "198.51.100.9"


def v1(source: str, port: int = 40000) -> bytes:
    family = "TCP6" if ":" in source else "TCP4"
    destination = "::1" if family == "TCP6" else "127.0.0.1"
    return f"PROXY {family} {source} {destination} {port} 8765\r\n".encode()


# ---------------------------------------------------------------- the parser


@pytest.mark.parametrize("header, source", [
    (v1(CLIENT_A), CLIENT_A),
    (v1("2001:db8::7"), "2001:db8::7"),
    (b"PROXY UNKNOWN\r\n", None),
    (b"PROXY UNKNOWN ffff::1 ffff::2 1 2\r\n", None),
    (v2(CLIENT_B), CLIENT_B),
    (v2("2001:db8::9"), "2001:db8::9"),
    (v2("::ffff:192.0.2.1"), "192.0.2.1"),                  # IPv4-mapped: keyed as the IPv4 address
    (v2(CLIENT_B, tlvs=b"\x05\x00\x04abcd"), CLIENT_B),      # HAProxy's unique-id TLV
    (v2(None), None),
])
def test_a_proxy_header_is_read_whole_and_only_when_whole(header, source):
    rest = b"GET /healthz HTTP/1.1\r\n\r\n"
    for cut in range(len(header)):                           # every prefix: not yet told
        assert parse_proxy_header(header[:cut]) is None, cut
    parsed = parse_proxy_header(header + rest)
    assert parsed == ProxyHeader(len(header), source, 40000 if source else 0)


@pytest.mark.parametrize("data", [
    b"PROXY TCP4 203.0.113.7 127.0.0.1 1 2\n",                        # no CR
    b"PROXY TCP4 " + b"1" * 120 + b"\r\n",                           # past 107 bytes
    b"PROXY TCP4 not-an-address 127.0.0.1 1 2\r\n",
    b"PROXY TCP4 2001:db8::1 127.0.0.1 1 2\r\n",                     # not IPv4
    b"PROXY TCP4 203.0.113.7 127.0.0.1 70000 2\r\n",                 # not a port
    b"PROXY TCP4 203.0.113.7 127.0.0.1 1\r\n",                       # a field short
    b"PROXY HTTP 203.0.113.7\r\n",
    b"PROXY TCP4 \xff\xfe 127.0.0.1 1 2\r\n",
    V2_SIGNATURE + bytes([0x11, 0x11, 0, 12]) + bytes(12),          # version 1 in v2 framing
    V2_SIGNATURE + bytes([0x23, 0x11, 0, 12]) + bytes(12),          # command 3
    V2_SIGNATURE + bytes([0x21, 0x11, 0xFF, 0xFF]),                 # 65,535 bytes announced
    V2_SIGNATURE + bytes([0x21, 0x11, 0, 4]) + bytes(4),            # too short for its addresses
])
def test_a_malformed_proxy_header_is_refused(data):
    with pytest.raises(ProxyHeaderError):
        parse_proxy_header(data)


@pytest.mark.parametrize("data", [b"GET / HTTP/1.1\r\n", b"{\"type\": \"describe\"}\n", b"\x16\x03\x01", b"POST"])
def test_what_is_not_a_proxy_header_is_left_alone(data):
    assert parse_proxy_header(data) == NO_PROXY_HEADER


def xff(*values: str) -> list[tuple[bytes, bytes]]:
    return [(b"x-forwarded-for", value.encode()) for value in values]


@pytest.mark.parametrize("peer, proxied, headers, client", [
    # An nginx that appends the address it saw: the right-most hop not trusted.
    ("10.0.0.5", None, xff("203.0.113.7"), "203.0.113.7"),
    ("10.0.0.5", None, xff("1.1.1.1, 203.0.113.7"), "203.0.113.7"),            # the client's forgery left of it
    ("10.0.0.5", None, xff("1.1.1.1", "203.0.113.7, 10.0.0.9"), "203.0.113.7"),  # two proxies, two headers
    ("10.0.0.5", None, xff("[2001:db8::1]:443"), "2001:db8::1"),
    ("10.0.0.5", None, xff("203.0.113.7:5555"), "203.0.113.7"),
    ("10.0.0.5", None, [], "10.0.0.5"),                                         # the proxy's own request
    ("10.0.0.5", None, xff("10.0.0.9"), "10.0.0.9"),                            # all trusted: the left-most
    ("10.0.0.5", None, xff("203.0.113.7, unknown"), "unknown"),                 # never a trusted address for junk
    # A PROXY header's source is the hop nearest the server: a client's header is not believed.
    ("10.0.0.5", "198.51.100.9", xff("203.0.113.7"), "198.51.100.9"),
    # Behind a CDN in the trusted networks, the header it wrote counts.
    ("10.0.0.5", "10.0.0.8", xff("203.0.113.7"), "203.0.113.7"),
])
def test_the_client_is_the_right_most_hop_the_server_does_not_trust(peer, proxied, headers, client):
    assert TrustedProxies(["10.0.0.0/8"]).client(peer, proxied, headers) == client


def test_forwarded_header_and_bad_networks():
    headers = [(b"forwarded", b'for=192.0.2.60;proto=http;by=203.0.113.43, for="[2001:db8:cafe::17]:4711"')]
    assert forwarded_hops(headers, "forwarded") == ["192.0.2.60", "2001:db8:cafe::17"]
    assert forwarded_hops([(b"forwarded", b"for=_hidden, proto=https")], "forwarded") == [None, None]
    proxies = TrustedProxies(["127.0.0.1"], "forwarded")
    assert proxies.client("127.0.0.1", None, headers + xff("198.51.100.1")) == "2001:db8:cafe::17"
    assert TrustedProxies(["127.0.0.1"], "none").client("127.0.0.1", None, xff("198.51.100.1")) == "127.0.0.1"
    assert not TrustedProxies() and not TrustedProxies().trusts("127.0.0.1")
    assert TrustedProxies(["::ffff:127.0.0.0/104", "10.1.2.3"]).trusts("10.1.2.3")
    with pytest.raises(ValueError, match="not an address or a network"):
        TrustedProxies(["10.0.0.0/33"])
    with pytest.raises(ValueError, match="--proxy-header"):
        TrustedProxies([], "x-real-ip")


# ---------------------------------------------------------------- a real server behind "a balancer"


@pytest.fixture(scope="module")
def behind_balancer(start_server):
    """Trusts this test's own connections (from 127.0.0.1): they are the balancer's."""
    return start_server(PiperEngine(), slots=2, trusted_proxies=[BALANCER], max_connections_per_address=1,
                        body_timeout_s=3600.0, refused_requests_per_s=0.001, wyoming="tcp://127.0.0.1:0")


@pytest.fixture
def not_behind_one(start_server):
    """Trusts 127.0.0.2 only: this test's connections from 127.0.0.1 are clients'. One test's:
    stopped when it ends, not held to the module's."""
    return start_server(PiperEngine(), slots=2, trusted_proxies=["127.0.0.2"], max_connections_per_address=1,
                        body_timeout_s=3600.0)


def connected(port: int, preamble: bytes = b"", source: str = BALANCER) -> socket.socket:
    sock = socket.socket()
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    if preamble:
        sock.sendall(preamble)
    return sock


def request(port: int, preamble: bytes, text: bytes) -> bytes:
    with connected(port, preamble) as sock:
        sock.sendall(text)
        return read_until_closed(sock)


HEALTH = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"


def held_body(port: int, preamble: bytes = b"", extra: bytes = b"", source: str = BALANCER) -> socket.socket:
    """A speech request whose body never finishes: in flight for as long as the test holds it."""
    sock = connected(port, preamble, source)
    sock.sendall(speech_headers(30_000).replace(b"\r\n\r\n", b"\r\n" + extra + b"\r\n") + b'{"input": "')
    return sock


async def test_a_proxy_header_names_the_client_of_an_http_request(behind_balancer):
    server = behind_balancer
    guard = server.server.guard
    # v1 and v2, then plain HTTP (the balancer's own health check), each answered.
    for preamble in (v1(CLIENT_A), v2(CLIENT_B), v2(None), b"PROXY UNKNOWN\r\n", b""):
        answer = await asyncio.to_thread(request, server.port, preamble, HEALTH)
        assert answer.startswith(b"HTTP/1.1 200"), (preamble, answer)
    # One request in flight per address (max_connections_per_address 1), by the named client.
    holder = held_body(server.port, v1(CLIENT_A))
    await wait_until(lambda: guard.requests_in_flight == 1)
    second = held_body(server.port, v2(CLIENT_A))
    assert (await asyncio.to_thread(read_until_closed, second)).startswith(b"HTTP/1.1 429")
    # Another client through the same balancer is not that one: its request is in flight too.
    other = held_body(server.port, v2(CLIENT_B))
    await wait_until(lambda: guard.requests_in_flight == 2)
    for sock in (holder, second, other):
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)


async def test_a_client_past_its_refusals_is_answered_through_the_balancer_which_stays_heard(behind_balancer):
    """A client that spent its refusal budget (one refusal, a rate that does not refill) is,
    through the balancer, answered 429 at the cost of its headers, not closed at accept (which
    the balancer would take for a dead replica); the balancer's own connections and another
    client are served."""
    server = behind_balancer
    guard = server.server.guard
    spender = "192.0.2.77"
    holder = held_body(server.port, v1(spender))
    await wait_until(lambda: guard.requests_in_flight == 1)
    over = held_body(server.port, v1(spender))
    assert (await asyncio.to_thread(read_until_closed, over)).startswith(b"HTTP/1.1 429")
    holder.close()
    over.close()
    await wait_until(lambda: guard.requests_in_flight == 0)
    for _ in range(3):
        refused = await asyncio.to_thread(request, server.port, v1(spender), HEALTH)
        assert refused.startswith(b"HTTP/1.1 429") and b"after being refused" in refused, refused
    # A WebSocket upgrade from it is refused the same way, not upgraded.
    upgrade = (b"GET /v1/stream HTTP/1.1\r\nHost: localhost\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n")
    refused = await asyncio.to_thread(request, server.port, v2(spender), upgrade)
    assert refused.startswith(b"HTTP/1.1 429"), refused
    assert not guard.heard(spender) and guard.heard(BALANCER) and guard.heard(CLIENT_B)
    for preamble in (v2(None), b"", v1(CLIENT_B)):
        answer = await asyncio.to_thread(request, server.port, preamble, HEALTH)
        assert answer.startswith(b"HTTP/1.1 200"), answer
    # The balancer itself is never one client: it holds more than one request at once.
    holders = [held_body(server.port) for _ in range(3)]
    await wait_until(lambda: guard.requests_in_flight == 3)
    for sock in holders:
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)


async def test_a_malformed_proxy_header_closes_only_its_connection(behind_balancer):
    server = behind_balancer
    for bad in (b"PROXY TCP4 nonsense\r\n", V2_SIGNATURE + bytes([0x21, 0x11, 0xFF, 0xFF]), b"PROXY " + b"x" * 200):
        assert await asyncio.to_thread(request, server.port, bad, HEALTH) == b""
    assert (await asyncio.to_thread(request, server.port, v1(CLIENT_B), HEALTH)).startswith(b"HTTP/1.1 200")


async def test_a_forwarded_for_header_from_the_balancer_names_the_client(behind_balancer):
    """An nginx or an ingress that sends no PROXY header but appends X-Forwarded-For."""
    server = behind_balancer
    guard = server.server.guard
    holder = held_body(server.port, extra=b"X-Forwarded-For: 1.1.1.1, 192.0.2.10\r\n")
    await wait_until(lambda: guard.requests_in_flight == 1)
    same = held_body(server.port, extra=b"X-Forwarded-For: 192.0.2.10\r\n")
    assert (await asyncio.to_thread(read_until_closed, same)).startswith(b"HTTP/1.1 429")
    other = held_body(server.port, extra=b"X-Forwarded-For: 192.0.2.10, 192.0.2.11\r\n")   # 2.10 forged by 2.11
    await wait_until(lambda: guard.requests_in_flight == 2)
    for sock in (holder, same, other):
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)


UNSPEC = V2_SIGNATURE + bytes([0x21, 0x00]) + struct.pack("!H", 0)                  # PROXY, no address
UNIX = V2_SIGNATURE + bytes([0x21, 0x31]) + struct.pack("!H", 216) + b"/run/x.sock".ljust(216, b"\0")


@pytest.mark.parametrize("preamble", [v2(None), UNSPEC, UNIX, b"PROXY UNKNOWN\r\n"],
                         ids=["local", "unspec", "unix", "v1-unknown"])
async def test_a_proxy_header_that_names_no_address_leaves_the_peer_and_ignores_forwarding(behind_balancer,
                                                                                           preamble):
    """Hardening V, 10: after a PROXY header naming no address, the client's own
    X-Forwarded-For decided who it was. Now such a connection is its peer: a request there that
    forwards for 192.0.2.88 does not count against 192.0.2.88 (which holds one in flight, its
    bound), nor is it refused as that client."""
    server = behind_balancer
    guard = server.server.guard
    named = held_body(server.port, v1("192.0.2.88"))
    await wait_until(lambda: guard.requests_in_flight == 1)
    unnamed = held_body(server.port, preamble, extra=b"X-Forwarded-For: 192.0.2.88\r\n")
    await wait_until(lambda: guard.requests_in_flight == 2)
    assert guard.requests_in_flight == 2
    for sock in (named, unnamed):
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)


async def test_websocket_sessions_are_counted_by_the_client_the_balancer_names(behind_balancer):
    server = behind_balancer

    async def session(preamble: bytes):
        sock = await asyncio.to_thread(connected, server.port, preamble)
        return await websockets.connect(server.url, sock=sock)

    first = await session(v2(CLIENT_B, port=1))
    assert await asyncio.wait_for(first.recv(), WAIT_TIMEOUT)          # hello
    # The same client again: over its one connection (max_connections_per_address 1).
    second = await session(v1(CLIENT_B, port=2))
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(second.recv(), WAIT_TIMEOUT)
    assert closed.value.rcvd.code == p.CLOSE_TOO_MANY_FROM_ADDRESS
    # Another client through the same balancer speaks.
    third = await session(v2("192.0.2.44"))
    assert await asyncio.wait_for(third.recv(), WAIT_TIMEOUT)
    await first.close()
    await third.close()
    async with connect_client(server) as c:                 # the balancer's own session
        assert_good_stream(await c.speak("Still here.", "s"))


async def test_wyoming_connections_are_counted_by_the_client_a_proxy_header_names(behind_balancer):
    port = behind_balancer.server.wyoming.port
    describe = b'{"type": "describe"}\n'

    async def ask(preamble: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, dict]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(preamble + describe)
        header = json.loads(await asyncio.wait_for(reader.readline(), WAIT_TIMEOUT))
        if header.get("data_length"):
            header["data"] = json.loads(await reader.readexactly(header["data_length"]))
        return reader, writer, header

    first = await ask(v2("192.0.2.50"))
    assert first[2]["type"] == "info"
    second = await ask(v1("192.0.2.50"))
    assert second[2]["type"] == "error" and "from your address" in json.dumps(second[2]), second[2]
    third = await ask(v1("192.0.2.51"))
    assert third[2]["type"] == "info"
    plain = await ask(b"")                                   # the balancer's own, no header: served
    assert plain[2]["type"] == "info"
    broken_reader, broken_writer = await asyncio.open_connection("127.0.0.1", port)
    broken_writer.write(b"PROXY TCP4 nonsense\r\n" + describe)
    assert await asyncio.wait_for(broken_reader.read(), WAIT_TIMEOUT) == b""
    for _, writer, _ in (first, second, third, plain):
        writer.close()
    broken_writer.close()


async def test_from_a_peer_it_does_not_trust_neither_a_proxy_header_nor_forwarded_for_counts(not_behind_one):
    server = not_behind_one
    guard = server.server.guard
    # A PROXY line is not HTTP.
    answer = await asyncio.to_thread(request, server.port, v1(CLIENT_A), HEALTH)
    assert answer.startswith(b"HTTP/1.1 400"), answer
    # X-Forwarded-For changes nothing: two requests "for" different clients are one address's.
    holder = held_body(server.port, extra=b"X-Forwarded-For: 192.0.2.1\r\n")
    await wait_until(lambda: guard.requests_in_flight == 1)
    forged = held_body(server.port, extra=b"X-Forwarded-For: 192.0.2.2\r\nForwarded: for=192.0.2.3\r\n")
    assert (await asyncio.to_thread(read_until_closed, forged)).startswith(b"HTTP/1.1 429")
    holder.close()
    forged.close()
    await wait_until(lambda: guard.requests_in_flight == 0)
    assert server.get("/healthz")[0] == 200


async def test_a_forged_forwarded_for_cannot_act_for_another_clients_voices(tiny_voxcpm):
    """A server with no trusted proxies (the default): a caller naming another address in
    X-Forwarded-For is still itself, and cannot delete that address's voice."""
    owner = httpx.AsyncHTTPTransport(local_address="127.0.0.3")
    other = httpx.AsyncHTTPTransport(local_address="127.0.0.4")
    async with httpx.AsyncClient(base_url=tiny_voxcpm.http, transport=owner) as mine, \
            httpx.AsyncClient(base_url=tiny_voxcpm.http, transport=other) as theirs:
        created = await mine.post("/v1/voices", content=wav(1.0), headers={"content-type": "audio/wav"})
        assert created.status_code == 201, created.text
        voice = created.json()["voice"]
        for header in ({"X-Forwarded-For": "127.0.0.3"}, {"Forwarded": "for=127.0.0.3"}, {"X-Real-IP": "127.0.0.3"}):
            forged = await theirs.delete(f"/v1/voices/{voice}", headers=header)
            assert forged.status_code == 404, forged.text
        deleted = await mine.delete(f"/v1/voices/{voice}")
        assert deleted.status_code == 200 and deleted.json()["deleted"], deleted.text


async def test_a_clients_unfinished_requests_through_the_balancer_count_as_its_own(start_server):
    """Hardening V, 5: behind a TCP balancer speaking PROXY, unfinished requests counted under
    the balancer, which no per-address bound holds: one client's filled `max_connections`, and
    every client of the balancer, and its health checks, were closed at accept. Now each counts
    under the client its PROXY header names, as soon as it is read: held to that client's
    bound, while another client and the balancer's check are served."""
    server = start_server(PiperEngine(), trusted_proxies=[BALANCER], max_connections=6,
                          max_connections_per_address=2)
    guard = server.server.guard
    unfinished = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\n"                 # headers never finished
    held = []
    for n in range(6):
        held.append(await asyncio.to_thread(connected, server.port, v2(CLIENT_A, port=40000 + n) + unfinished))
        if n < 2:
            await wait_until(lambda: guard.pending_from(CLIENT_A) == n + 1)
        else:                                    # closed once its PROXY header was read
            assert await asyncio.to_thread(read_until_closed, held[-1]) == b""
    assert guard.pending == guard.pending_from(CLIENT_A) == 2 and guard.pending_from(BALANCER) == 0
    for preamble in (v2(CLIENT_B), v2(None), v1("192.0.2.45")):          # another client; the balancer's check
        request = b"GET /healthz HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        sock = await asyncio.to_thread(connected, server.port, preamble + request)
        answer = await asyncio.to_thread(read_until_closed, sock)
        sock.close()
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:100]
    for sock in held:
        sock.close()
    await wait_until(lambda: guard.pending == 0)


async def test_an_ipv6_client_counts_by_its_64_for_every_bound_and_owner(behind_balancer):
    """Hardening V, 6: IPv6 clients were keyed by their whole /128, though every IPv6 host has a
    /64: 40 sessions from one /64 were all admitted, against 32 from one address. Now a client
    is its /64 (`--ipv6-prefix`) for requests in flight, sessions and owners
    (`max_connections_per_address` is 1 here)."""
    from vox_ws.transports.auth import address_owner

    server = behind_balancer
    guard = server.server.guard
    holder = held_body(server.port, v1("2001:db8:5:6::1"))
    await wait_until(lambda: guard.requests_in_flight == 1)
    same = held_body(server.port, v2("2001:db8:5:6:ffff:ffff:ffff:ffff"))
    assert (await asyncio.to_thread(read_until_closed, same)).startswith(b"HTTP/1.1 429")
    other = held_body(server.port, v2("2001:db8:5:7::1"))                  # the next /64
    await wait_until(lambda: guard.requests_in_flight == 2)
    for sock in (holder, same, other):
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)

    async def session(source: str):
        sock = await asyncio.to_thread(connected, server.port, v2(source))
        return await websockets.connect(server.url, sock=sock)

    first = await session("2001:db8:9:1::1")
    assert await asyncio.wait_for(first.recv(), WAIT_TIMEOUT)              # hello
    second = await session("2001:db8:9:1::2")
    with pytest.raises(websockets.ConnectionClosed) as closed:
        await asyncio.wait_for(second.recv(), WAIT_TIMEOUT)
    assert closed.value.rcvd.code == p.CLOSE_TOO_MANY_FROM_ADDRESS
    third = await session("2001:db8:9:2::1")
    assert await asyncio.wait_for(third.recv(), WAIT_TIMEOUT)
    await first.close()
    await third.close()
    # One owner (voices, quotas, usage) per /64; an IPv4-mapped address is its IPv4 address.
    assert address_owner("2001:db8:9:1::1", 64) == address_owner("2001:db8:9:1:a:b:c:d", 64) == \
        "address:2001:db8:9:1::/64" != address_owner("2001:db8:9:2::1", 64)
    assert address_owner("2001:db8:9:1::1", 128) != address_owner("2001:db8:9:1::2", 128)
    assert address_owner("::ffff:192.0.2.5", 64) == address_owner("192.0.2.5", 64) == "address:192.0.2.5"
