"""Who may do what: tokens and browser origins, the same rules for HTTP and WebSocket."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.requests import HTTPConnection

from ..service import ANY_OWNER
from ..addresses import client_key
from ..service.voice_store import ADDRESS_OWNER_PREFIX

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
    tokens += conn.query_params.getlist("token")
    return [t for t in tokens if t]


def offered_subprotocols(conn: HTTPConnection) -> list[str]:
    """The subprotocols offered, parsed once per request; none past MAX_SUBPROTOCOLS or
    MAX_SUBPROTOCOL_BYTES."""
    offered = conn.scope.get(_OFFERED)
    if offered is None:
        values = conn.headers.getlist("sec-websocket-protocol")
        offered = []
        if sum(len(value) for value in values) <= MAX_SUBPROTOCOL_BYTES:
            offered = [p.strip() for value in values for p in value.split(",") if p.strip()]
            if len(offered) > MAX_SUBPROTOCOLS:
                offered = []
        conn.scope[_OFFERED] = offered
    return offered


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
    """Browsers always send Origin; requests without one (servers) are not affected. With
    `allow_origins`, only those; and a state-changing HTTP request from a page of another
    origin only where `cors_origins` names it (`*`: any, but DELETE only with a token)."""
    origin = conn.headers.get("origin")
    if origin is None:
        return True
    if allow_origins and origin not in allow_origins:
        return False
    if conn.scope.get("type") != "http" or conn.scope.get("method") not in STATE_CHANGING or not cross_origin(conn):
        return True
    if origin in cors_origins or origin in allow_origins:
        return True
    if "*" in cors_origins:
        return conn.scope["method"] != "DELETE" or bool(presented_tokens(conn))
    return False


def shows_uploaded_voices(conn: HTTPConnection) -> bool:
    """Whether a listing may name the caller's uploaded voices: not to a page of another origin
    that presents no token (with `--cors-origins '*'` any page could read the visitor's, who is
    the caller by address); the server's own voices and aliases are listed to anyone."""
    return not cross_origin(conn) or bool(presented_tokens(conn))


def owner(conn: HTTPConnection, tokens: list[str], admin_tokens: list[str], ipv6_prefix: int) -> str:
    """Whom a request acts for, in the stream service's words: "admin" (may delete any voice),
    one client token (by a digest, never the token itself), or the client's address (an IPv6
    one's network, `addresses.client_key`) where no token was presented."""
    presented = presented_tokens(conn)
    if is_admin(conn, admin_tokens):
        return ANY_OWNER
    for token in tokens:
        if token_matches(presented, [token]):
            return token_owner(token)
    return address_owner(conn.client.host if conn.client is not None else "unknown", ipv6_prefix)


def token_owner(token: str) -> str:
    """The owner a client presenting this token is (a digest of it, never the token)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def address_owner(host: str, ipv6_prefix: int) -> str:
    """The owner a client without a token is, by its address (an IPv6 one's network), at every
    door (so one client speaking over several doors is one client to the fair shares)."""
    return ADDRESS_OWNER_PREFIX + client_key(host, ipv6_prefix)
