"""The names the server answers to: a request whose Host is none of them is refused (DNS rebinding).

A page of `rebind.example` whose name the attacker re-points at this server's address reaches
the server from the visitor's browser as the page's own origin (Host and Origin alike
`rebind.example:PORT`): the cross-origin rule sees no other origin, and the server serves the
visitor's voices to it. Only a name the server does not answer to tells such a request apart,
so every HTTP request and WebSocket handshake names one it does (`--allowed-hosts`), before
anything of it is read.

Answered to by a server listening elsewhere than loopback only (a LAN address, `0.0.0.0`, a
container's), as no outside attacker can re-point them at it: IP literals (a page served from an
address is that address's own), `localhost` and `*.localhost`, single-label names (`vox-ws` in a
compose network, resolved by the local resolver's search list, never by public DNS), names under
the special-use suffixes public DNS never delegates (`.local`, `.internal`, `.home.arpa`: mDNS
and private networks, Kubernetes' `*.svc.cluster.local`), and the machine's own host name. A
neighbour on the same link can still re-point single-label names (LLMNR, NetBIOS) and `.local`
ones (mDNS) for the machines that ask it: a server listening only on loopback (the default,
`127.0.0.1`) has no use for them, so it answers only loopback names: `localhost`,
`*.localhost`, loopback literals (`127.0.0.0/8`, `[::1]`) and the machine's own name (a page at
`evil.local:PORT` or `evil:PORT` re-pointed at 127.0.0.1 listed, spoke and deleted the visitor's
voices: Hardening VII, 2). `--allowed-hosts` adds names: `tts.example.com`, `.example.com` (that
name and every subdomain), or `*` (no check). A request without a Host (HTTP/1.0) is served:
every browser sends one, so no page is behind it. Wyoming has no Host, and no page speaks it (a
browser's request is no Wyoming event: the door closes the connection).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Sequence

from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

from . import protocol as p
from .errors import error_response

log = logging.getLogger("vox_ws.server")

ANY_HOST = "*"
# Suffixes public DNS never delegates (RFC 6761 localhost, RFC 6762 .local, RFC 8375 .home.arpa,
# ICANN's private-use .internal): a name under one is not the attacker's to re-point.
PRIVATE_SUFFIXES = (".localhost", ".local", ".internal", ".home.arpa")
# 421 Misdirected Request (RFC 9110 15.5.20): the server is not authoritative for the name the
# request was sent to. Not 400: nothing in the request is malformed, and a client that retries
# at one of the server's names is served; not 403: no token would change the answer.
MISDIRECTED = 421
# The refused names logged (each once: a rebinding page repeats its requests); the count of all
# refusals is in /metrics (voxws_connections_rejected{reason="host"}).
MAX_LOGGED_NAMES = 256


def host_name(value: str) -> str:
    """The name of a Host header value (or of an `--allowed-hosts` entry), without its port and
    trailing dot, lower case: `Example.COM.:443` -> `example.com`, `[::1]:80` -> `[::1]`."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        return value[:end + 1] if end > 0 else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


def always_answered(name: str, own_names: Iterable[str] = (), loopback_only: bool = False) -> bool:
    """Whether `name` (`host_name`) is one no outside attacker can re-point at this server; for a
    server listening on loopback only (`loopback_only`), at its loopback addresses."""
    if not name:
        return False
    bracketed = name.startswith("[") and name.endswith("]")
    try:
        address = ipaddress.ip_address(name[1:-1] if bracketed else name)
        return not loopback_only or _is_loopback(address)
    except ValueError:
        if bracketed:
            return False                    # brackets hold an IPv6 address or nothing a browser sends
    if name == "localhost" or name.endswith(".localhost") or name in own_names:
        return True
    return not loopback_only and ("." not in name or name.endswith(PRIVATE_SUFFIXES))


def listens_on_loopback_only(host: str) -> bool:
    """Whether every address `host` (what the server listens on: an address, or a name the
    resolver turns into some) is a loopback one. `0.0.0.0`, `::` and "" are every interface."""
    name = host.strip().strip("[]")
    try:
        return _is_loopback(ipaddress.ip_address(name))
    except ValueError:
        pass
    if not name:
        return False
    if name.lower().rstrip(".") == "localhost" or name.lower().rstrip(".").endswith(".localhost"):
        return True
    try:                                    # as binding to it would: the resolver's answer
        found = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    return bool(found) and all(_is_loopback(ipaddress.ip_address(str(info[4][0]).partition("%")[0]))
                               for info in found)


def _is_loopback(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


def own_host_names() -> frozenset[str]:
    """The machine's own host name(s) (no DNS lookup: `getfqdn` may wait seconds for one)."""
    name = host_name(socket.gethostname())
    return frozenset({name} if name else ())


class AllowedHosts:
    """`--allowed-hosts` and the names always answered to (`loopback_only`: by a server that
    listens on loopback only); `allows(host)` decides."""

    def __init__(self, allowed: Sequence[str], own_names: Iterable[str] | None = None,
                 loopback_only: bool = False) -> None:
        self.any = ANY_HOST in allowed
        self.loopback_only = loopback_only
        self.own_names = frozenset(own_host_names() if own_names is None else own_names)
        self.exact: set[str] = set()
        suffixes: list[str] = []
        for entry in allowed:
            if entry == ANY_HOST:
                continue
            if "*" in entry or "/" in entry or not host_name(entry).strip("."):
                raise ValueError(f"--allowed-hosts {entry!r}: a host name, .domain (and its subdomains) or *")
            name = host_name(entry)
            if name.startswith("."):
                suffixes.append(name)
                self.exact.add(name[1:])
            else:
                self.exact.add(name)
        self.suffixes = tuple(suffixes)

    def allows(self, host: str | None) -> bool:
        if self.any or host is None:
            return True
        name = host_name(host)
        return always_answered(name, self.own_names, self.loopback_only) or name in self.exact \
            or name.endswith(self.suffixes)


class HostCheck:
    """ASGI middleware: an HTTP request or WebSocket handshake whose Host the server does not
    answer to is refused 421 (a typed error, `bad_request`) before anything else of it is read
    or done; `on_refused` counts it."""

    def __init__(self, app: ASGIApp, hosts: AllowedHosts,
                 on_refused: Callable[[], object] | None = None) -> None:
        self.app = app
        self.hosts = hosts
        self.on_refused = on_refused
        self._logged: set[str] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or self.hosts.any:
            await self.app(scope, receive, send)
            return
        refused = [host for host in _host_headers(scope) if not self.hosts.allows(host)]
        if not refused:
            await self.app(scope, receive, send)
            return
        name = host_name(refused[0])
        if self.on_refused is not None:
            self.on_refused()
        if name not in self._logged and len(self._logged) < MAX_LOGGED_NAMES:
            self._logged.add(name)
            log.warning("requests for host %r refused (421): not a name this server answers to; name it in "
                        "--allowed-hosts if it is one (logged once per name)", name[:253])
        response = error_response(MISDIRECTED, p.BAD_REQUEST,
                                  f"misdirected request: this server does not answer to the host "
                                  f"{name[:253]!r} (its --allowed-hosts name those it does)")
        if scope["type"] == "websocket":
            await WebSocket(scope, receive, send).send_denial_response(response)   # no extension: a 403
        else:
            await response(scope, receive, send)


def _host_headers(scope: Scope) -> list[str]:
    """The request's Host headers: none (HTTP/1.0), one, or more (a browser never sends two;
    each must be a name the server answers to, whichever one a later reader takes)."""
    return [value.decode("latin-1") for key, value in scope.get("headers", ()) if key == b"host"]
