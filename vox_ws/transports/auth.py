"""Who may do what: tokens and browser origins, the same rules for HTTP and WebSocket."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence
from urllib.parse import unquote_plus, urlsplit

from starlette.requests import HTTPConnection

from ..addresses import client_key
from ..service import ANY_OWNER
from ..service.voices.store import ADDRESS_OWNER_PREFIX, OPAQUE_PAGE, PAGE_OWNER_MARK

# A browser cannot set headers on a WebSocket: it offers the subprotocols SUBPROTOCOL and
# BEARER_PREFIX + the token in unpadded base64url (any token, in characters a subprotocol may
# hold), and the server answers SUBPROTOCOL. The token stays out of the URL (and so out of logs,
# history and Referer headers).
SUBPROTOCOL = "vox-ws"
BEARER_PREFIX = "vox-ws.bearer."
# A browser offers two subprotocols (SUBPROTOCOL and its token's); past these bounds none is
# taken (a token among them is not presented), and the offer costs one pass over its bytes.
MAX_SUBPROTOCOLS = 8
MAX_SUBPROTOCOL_BYTES = 4096
# `?token=T` is found by a scan of the raw query string, never by parsing the query whole:
# parsing 64 KB of parameters cost the event loop 25-31 ms a request, before a 401 could be
# answered (Hardening VI, 8; the scan, one pass in C: 0.1 ms). The key is taken as spelled (not
# percent-encoded); past MAX_QUERY_TOKENS of them none is taken, and a value longer than
# MAX_QUERY_TOKEN_BYTES is no token.
MAX_QUERY_TOKENS = 8
MAX_QUERY_TOKEN_BYTES = 4096
_QUERY_TOKEN = b"&token="
# What a request presented, worked out once per request (each rule below asks for it).
_TOKENS = "vox_ws.presented_tokens"
_OFFERED = "vox_ws.offered_subprotocols"


def presented_tokens(conn: HTTPConnection) -> list[str]:
    """Tokens from `Authorization: Bearer <t>` (servers), a WebSocket subprotocol
    `vox-ws.bearer.<base64url(t)>` (browsers), or `?token=<t>`; read once per request."""
    found = conn.scope.get(_TOKENS)
    if found is None:
        found = conn.scope[_TOKENS] = _read_tokens(conn)
    return found


def _read_tokens(conn: HTTPConnection) -> list[str]:
    tokens = []
    headers = conn.headers.getlist("authorization")
    if len(headers) > 1:
        return []          # which one would count is anyone's guess: none does
    header = headers[0] if headers else ""
    if header.lower().startswith("bearer "):
        tokens.append(header[7:].strip())
    tokens += [_unbase64(p[len(BEARER_PREFIX):]) for p in offered_subprotocols(conn) if p.startswith(BEARER_PREFIX)]
    tokens += query_tokens(conn.scope.get("query_string", b""))
    return [t for t in tokens if t]


def query_tokens(query: bytes) -> list[str]:
    """The values of `token=` in a raw query string, decoded as a parsed query's would be,
    found without splitting the rest (see MAX_QUERY_TOKENS)."""
    marked = b"&" + query                  # every key follows an `&`: no `xtoken=` is taken for one
    values = []
    start = marked.find(_QUERY_TOKEN)
    while start >= 0:
        if len(values) == MAX_QUERY_TOKENS:
            return []
        start += len(_QUERY_TOKEN)
        end = marked.find(b"&", start)
        end = len(marked) if end < 0 else end
        values.append(marked[start:end])
        start = marked.find(_QUERY_TOKEN, end)
    return [unquote_plus(value.decode("latin-1")) for value in values if len(value) <= MAX_QUERY_TOKEN_BYTES]


def offered_subprotocols(conn: HTTPConnection) -> list[str]:
    """The subprotocols offered, parsed once per request; none past MAX_SUBPROTOCOLS or
    MAX_SUBPROTOCOL_BYTES."""
    offered = conn.scope.get(_OFFERED)
    if offered is None:
        values = conn.headers.getlist("sec-websocket-protocol")
        offered = conn.scope[_OFFERED] = bounded_subprotocols(values) or []
    return offered


def bounded_subprotocols(values: Sequence[str]) -> list[str] | None:
    """The subprotocols a request's `Sec-WebSocket-Protocol` values offer, or None past
    MAX_SUBPROTOCOLS or MAX_SUBPROTOCOL_BYTES (then only their lengths were looked at). The
    WebSocket protocol drops such an offer before websockets parses it (`connections.py`)."""
    if sum(len(value) for value in values) > MAX_SUBPROTOCOL_BYTES:
        return None
    offered = [p.strip() for value in values for p in value.split(",") if p.strip()]
    return offered if len(offered) <= MAX_SUBPROTOCOLS else None


def _unbase64(text: str) -> str:
    try:
        return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4)).decode("utf-8")
    except (binascii.Error, ValueError):
        return ""


def token_matches(presented: list[str], accepted: list[str]) -> bool:
    # Compare against every accepted token without stopping early, so timing reveals nothing.
    found = False
    for candidate in presented:
        for token in accepted:
            found |= hmac.compare_digest(candidate.encode(), token.encode())
    return found


def is_authorized(conn: HTTPConnection, tokens: list[str], admin_tokens: list[str]) -> bool:
    """With client tokens configured, a request must present one (or an admin token)."""
    return not tokens or token_matches(presented_tokens(conn), tokens + admin_tokens)


def is_admin(conn: HTTPConnection, admin_tokens: list[str]) -> bool:
    return bool(admin_tokens) and token_matches(presented_tokens(conn), admin_tokens)


# What a page may send another origin without asking first (a form's POST needs no preflight):
# such requests from another origin are refused unless the server was told to take them.
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def changes_state(conn: HTTPConnection) -> bool:
    """Whether a page may send this to another origin unasked and have it act: a state-changing
    HTTP method, or a WebSocket handshake (a browser opens any origin's WebSocket without a
    preflight, and its session speaks, registers and deletes voices)."""
    return conn.scope.get("type") == "websocket" or conn.scope.get("method") in STATE_CHANGING


def cross_origin(conn: HTTPConnection) -> bool:
    """Whether a browser sent this from a page of another origin than the server's own (its
    Origin names another host and port than the request's Host; scheme aside, which a TLS
    balancer in front changes)."""
    origin = conn.headers.get("origin")
    if origin is None:
        return False
    netloc = urlsplit(origin).netloc.lower() if origin != "null" else ""
    return not netloc or netloc != (conn.headers.get("host") or "").lower()


def origin_allowed(conn: HTTPConnection, allow_origins: list[str], cors_origins: Sequence[str] = ()) -> bool:
    """One rule for every door. Browsers always send Origin; requests without one (servers) are
    not affected. With `allow_origins`, only those; and what `changes_state` (a state-changing
    HTTP request, a WebSocket handshake) from a page of another origin only where
    `allow_origins` or `cors_origins` names it (`*`: any). Such a page without a token acts as
    its own owner, never as its visitor (`owner`)."""
    origin = conn.headers.get("origin")
    if origin is None:
        return True
    if allow_origins and origin not in allow_origins:
        return False
    if not changes_state(conn) or not cross_origin(conn):
        return True
    return origin in cors_origins or origin in allow_origins or "*" in cors_origins


def owner(conn: HTTPConnection, tokens: list[str], admin_tokens: list[str], ipv6_prefix: int) -> str:
    """Whom a request acts for, in the stream service's words: "admin" (may delete any voice),
    one client token (by a digest, never the token itself), or the client's address (an IPv6
    one's network, `addresses.client_key`) where no token was presented; for a page of another
    origin presenting none, that address and the page's origin (`page_owner`)."""
    presented = presented_tokens(conn)
    if is_admin(conn, admin_tokens):
        return ANY_OWNER
    for token in tokens:
        if token_matches(presented, [token]):
            return token_owner(token)
    address = address_owner(conn.client.host if conn.client is not None else "unknown", ipv6_prefix)
    return page_owner(address, conn.headers.get("origin")) if cross_origin(conn) else address


def token_owner(token: str) -> str:
    """The owner a client presenting this token is (a digest of it, never the token)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def address_owner(host: str, ipv6_prefix: int) -> str:
    """The owner a client without a token is, by its address (an IPv6 one's network), at every
    door (so one client speaking over several doors is one client to the fair shares)."""
    return ADDRESS_OWNER_PREFIX + client_key(host, ipv6_prefix)


def page_owner(address: str, origin: str | None) -> str:
    """The owner a page of another origin is where it presents no token: its visitor's address
    (`address_owner`) and the page's origin (a digest: bounded, whatever the header holds). Any
    site's page reaches the server from its visitor's address; as this owner it speaks, lists
    and deletes only the voices it registered itself, never the visitor's own. Its voices are
    still its address's network's (`voices.store.network_key`): the shares stay by network."""
    if origin is None or origin.strip().lower() == OPAQUE_PAGE:
        # Every sandboxed frame and `file:` page of every site says `null`: no owner it could
        # keep voices under (`store.refuse_page` refuses it registrations).
        return address + PAGE_OWNER_MARK + OPAQUE_PAGE
    digest = hashlib.sha256(origin.lower().encode()).hexdigest()[:16]
    return address + PAGE_OWNER_MARK + digest
