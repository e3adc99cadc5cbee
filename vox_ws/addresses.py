"""Who a client is to the server's bounds and owners: its address, or for IPv6 its network.

Every IPv6 host is given a /64 (often more) and may speak from any address in it, so a bound
per /128 holds nobody: an IPv6 client counts by its first `ipv6_prefix` bits (`--ipv6-prefix`,
64 by default; 128 counts each address). An IPv4 client counts by its address, and so does an
IPv4-mapped IPv6 one. What is not an address (a UNIX socket's "local", "unknown") is itself.

Wider still, the voice store shares its places among networks (`network_of`): an IPv4 /24,
an IPv6 /48 (what one site is given), so that no few networks' addresses fill it.
"""

from __future__ import annotations

import functools
import ipaddress

DEFAULT_IPV6_PREFIX = 64
# The network a client's address belongs to, for shares wider than one client.
IPV4_NETWORK_BITS = 24
IPV6_NETWORK_BITS = 48


def check_ipv6_prefix(bits: int) -> int:
    if not 16 <= bits <= 128:
        raise ValueError(f"an IPv6 prefix is 16-128 bits, got {bits}")
    return bits


@functools.lru_cache(maxsize=8192)
def client_key(host: str, ipv6_prefix: int = DEFAULT_IPV6_PREFIX) -> str:
    """What per-address bounds and owners count `host` by: "192.0.2.7", "2001:db8:1:2::/64"."""
    address = _address(host)
    if address is None:
        return host
    if address.version == 4:
        return str(address)
    if ipv6_prefix >= 128:
        return str(address)
    return str(ipaddress.IPv6Network((int(address) >> (128 - ipv6_prefix) << (128 - ipv6_prefix), ipv6_prefix)))


@functools.lru_cache(maxsize=8192)
def network_of(key: str) -> str:
    """The network a client key (`client_key`) belongs to: its /24 or /48; itself where it is
    no address."""
    try:
        network = ipaddress.ip_network(key, strict=False)
    except ValueError:
        return key
    bits = IPV4_NETWORK_BITS if network.version == 4 else IPV6_NETWORK_BITS
    return str(network.supernet(new_prefix=bits)) if network.prefixlen > bits else str(network)


def _address(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        address = ipaddress.ip_address(host.split("%", 1)[0])        # a zone ("fe80::1%eth0") names no host
    except ValueError:
        return None
    if address.version == 6 and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
