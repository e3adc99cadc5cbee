"""Who a client is behind a balancer the server trusts, and only then.

A connection's peer is the client unless the peer is in `--trusted-proxies`. From a trusted
peer, the client's address comes from what that peer says:
- the PROXY protocol (HAProxy's, v1 text or v2 binary) at the start of the connection: the
  address HAProxy accepted the client's connection from. A LOCAL (v2) or UNKNOWN (v1) header is
  the balancer's own connection, its health checks: the peer itself;
- a forwarding header (`X-Forwarded-For` by default, or RFC 7239 `Forwarded`): the right-most
  hop not itself a trusted proxy, since every hop to its left was written by someone the server
  does not trust (the client may send any header it likes; a proxy only appends).

From any other peer both are ignored: a PROXY header is not looked for (its bytes are HTTP), and
a forwarding header changes nothing. The parser is written here rather than taken from a package
because it is the trust boundary: every length is bounded before bytes are waited for, and an
address that does not parse is refused, not passed on.
"""

from __future__ import annotations

import ipaddress
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# HTTP headers a trusted proxy may write the client's address in.
FORWARDING_HEADERS = ("x-forwarded-for", "forwarded", "none")

V1_PREFIX = b"PROXY "
V1_MAX_BYTES = 107                     # the spec's bound on a v1 line, CRLF included
V2_SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"
V2_FIXED_BYTES = 16
# A v2 header may carry TLVs (HAProxy's unique id, TLS details); more than this is not a
# balancer's header.
V2_MAX_BYTES = 4096

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_FORWARDED_FOR = re.compile(r'(?:^|;)\s*for\s*=\s*("[^"]*"|[^;,\s]*)', re.IGNORECASE)


class ProxyHeaderError(ValueError):
    """A trusted peer's connection began with a malformed PROXY header."""


@dataclass(frozen=True)
class ProxyHeader:
    length: int                  # bytes of the connection it took (0: there was none)
    source: str | None = None    # the client's address; None: the balancer's own connection
    port: int = 0


NO_PROXY_HEADER = ProxyHeader(0)


def parse_proxy_header(data: bytes) -> ProxyHeader | None:
    """The PROXY header `data` begins with, `NO_PROXY_HEADER` if it begins with something else,
    or None while too few bytes have come to tell. Raises ProxyHeaderError if it is malformed."""
    if V1_PREFIX.startswith(data[:len(V1_PREFIX)]):
        return _parse_v1(data) if len(data) >= len(V1_PREFIX) else None
    if V2_SIGNATURE.startswith(data[:len(V2_SIGNATURE)]):
        return _parse_v2(data) if len(data) >= len(V2_SIGNATURE) else None
    return NO_PROXY_HEADER


def v2_header_length(fixed: bytes) -> int:
    """The whole length of a v2 header from its first 16 bytes (for readers that read exactly)."""
    length = V2_FIXED_BYTES + struct.unpack_from("!H", fixed, 14)[0]
    if length > V2_MAX_BYTES:
        raise ProxyHeaderError(f"a PROXY v2 header of {length} bytes (at most {V2_MAX_BYTES})")
    return length


def _parse_v1(data: bytes) -> ProxyHeader | None:
    end = data.find(b"\r\n", 0, V1_MAX_BYTES)
    newline = data.find(b"\n", 0, V1_MAX_BYTES)
    if newline >= 0 and newline != end + 1:
        raise ProxyHeaderError("a PROXY v1 line not ended by CRLF")
    if end < 0:
        if len(data) >= V1_MAX_BYTES:
            raise ProxyHeaderError(f"a PROXY v1 line longer than {V1_MAX_BYTES} bytes")
        return None
    try:
        parts = data[:end].decode("ascii").split(" ")
    except UnicodeDecodeError:
        raise ProxyHeaderError("a PROXY v1 line that is not ASCII") from None
    if len(parts) >= 2 and parts[1] == "UNKNOWN":
        return ProxyHeader(end + 2)
    if len(parts) != 6 or parts[1] not in ("TCP4", "TCP6"):
        raise ProxyHeaderError("a PROXY v1 line that is not 'PROXY TCP4|TCP6 SRC DST SPORT DPORT'")
    source, port = _address(parts[2], 4 if parts[1] == "TCP4" else 6), _port(parts[4])
    _address(parts[3], 4 if parts[1] == "TCP4" else 6)
    _port(parts[5])
    return ProxyHeader(end + 2, source, port)


def _parse_v2(data: bytes) -> ProxyHeader | None:
    if len(data) < V2_FIXED_BYTES:
        return None
    version, command = data[12] >> 4, data[12] & 0x0F
    if version != 2 or command not in (0, 1):
        raise ProxyHeaderError(f"a PROXY v2 header of version {version}, command {command}")
    length = v2_header_length(data)
    if len(data) < length:
        return None
    family = data[13] >> 4
    if command == 0 or family not in (1, 2):     # LOCAL, or UNSPEC/UNIX: the balancer's own
        return ProxyHeader(length)
    body = data[V2_FIXED_BYTES:length]
    size = 4 if family == 1 else 16
    if len(body) < 2 * size + 4:
        raise ProxyHeaderError("a PROXY v2 header too short for its addresses")
    source = ipaddress.ip_address(body[:size])
    port = struct.unpack_from("!H", body, 2 * size)[0]
    return ProxyHeader(length, _plain(source), port)


def _address(text: str, version: int) -> str:
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        raise ProxyHeaderError(f"{text[:64]!r} in a PROXY line is not an address") from None
    if address.version != version:
        raise ProxyHeaderError(f"{text!r} in a PROXY line is not IPv{version}")
    return _plain(address)


def _port(text: str) -> int:
    if not text.isdigit() or int(text) > 65535:
        raise ProxyHeaderError(f"{text[:16]!r} in a PROXY line is not a port")
    return int(text)


def _plain(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> str:
    """The address as per-address bounds key it (an IPv4-mapped IPv6 address as the IPv4 one)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return str(address.ipv4_mapped)
    return str(address)


def parse_host(text: str) -> str | None:
    """One hop of a forwarding header as an address: `1.2.3.4`, `1.2.3.4:5`, `2001:db8::1`,
    `[2001:db8::1]:5`, quoted or not; None if it is none of these ("unknown", obfuscated ids)."""
    text = text.strip().strip('"')
    if text.startswith("["):
        text = text[1:text.find("]")] if "]" in text else ""
    elif text.count(":") == 1:
        text = text.split(":")[0]
    try:
        return _plain(ipaddress.ip_address(text))
    except ValueError:
        return None


def forwarded_hops(headers: Iterable[tuple[bytes, bytes]], header: str) -> list[str | None]:
    """The hops a forwarding header lists, left (first) to right (nearest), every occurrence of
    it in order; None for a hop that is not an address."""
    if header == "none":
        return []
    name = header.encode()
    hops: list[str | None] = []
    for key, value in headers:
        if key.lower() != name:
            continue
        text = value.decode("latin-1")
        if header == "forwarded":
            for element in text.split(","):
                match = _FORWARDED_FOR.search(element.strip())
                hops.append(parse_host(match.group(1)) if match else None)
        else:
            hops.extend(parse_host(item) for item in text.split(","))
    return hops


class TrustedProxies:
    """The networks whose connections may say who the client is (`--trusted-proxies`)."""

    def __init__(self, networks: Sequence[str] = (), header: str = "x-forwarded-for") -> None:
        if header not in FORWARDING_HEADERS:
            raise ValueError(f"--proxy-header {header!r}: one of {', '.join(FORWARDING_HEADERS)}")
        self.header = header
        self.networks: list[_Network] = []
        for text in networks:
            try:
                self.networks.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError:
                raise ValueError(f"--trusted-proxies: {text!r} is not an address or a network (CIDR)") from None

    def __bool__(self) -> bool:
        return bool(self.networks)

    def trusts(self, host: str | None) -> bool:
        if not self.networks or host is None:
            return False
        try:
            address = ipaddress.ip_address(_plain(ipaddress.ip_address(host)))
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def client(self, peer: str, proxied: str | None, headers: Iterable[tuple[bytes, bytes]]) -> str:
        """The client of a request that came from trusted `peer`, which said `proxied` (its
        PROXY header's source, if any) and sent `headers`: the right-most hop not trusted;
        where every hop is trusted, the left-most (a proxy's own request). A hop that is not an
        address ends the walk as "unknown", so that no trusted address is taken for it."""
        hops = [*forwarded_hops(headers, self.header), proxied or peer]
        for hop in reversed(hops):
            if hop is None:
                return "unknown"
            if not self.trusts(hop):
                return hop
        return hops[0] or "unknown"
