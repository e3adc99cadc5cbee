"""Who may do what: tokens and browser origins, the same rules for HTTP and WebSocket."""

from __future__ import annotations

import hashlib
import hmac

from starlette.requests import HTTPConnection

from ..service import ANY_OWNER


def presented_tokens(conn: HTTPConnection) -> list[str]:
    """Tokens from `Authorization: Bearer <t>` (servers) or `?token=<t>` (browsers, which
    cannot set headers on a WebSocket)."""
    tokens = []
    headers = conn.headers.getlist("authorization")
    if len(headers) > 1:
        return []          # which one would count is anyone's guess: none does
    header = headers[0] if headers else ""
    if header.lower().startswith("bearer "):
        tokens.append(header[7:].strip())
    tokens += conn.query_params.getlist("token")
    return [t for t in tokens if t]


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


def origin_allowed(conn: HTTPConnection, allow_origins: list[str]) -> bool:
    """Browsers always send Origin; requests without one (servers) are not affected."""
    origin = conn.headers.get("origin")
    return not allow_origins or origin is None or origin in allow_origins


def owner(conn: HTTPConnection, tokens: list[str], admin_tokens: list[str]) -> str:
    """Whom a request acts for, in the stream service's words: "admin" (may delete any voice),
    one client token (by a digest, never the token itself), or the client's address where no
    token was presented."""
    presented = presented_tokens(conn)
    if is_admin(conn, admin_tokens):
        return ANY_OWNER
    for token in tokens:
        if token_matches(presented, [token]):
            return token_owner(token)
    return address_owner(conn.client.host if conn.client is not None else "unknown")


def token_owner(token: str) -> str:
    """The owner a client presenting this token is (a digest of it, never the token)."""
    return "token:" + hashlib.sha256(token.encode()).hexdigest()[:16]


def address_owner(host: str) -> str:
    """The owner a client without a token is, by its address, at every door (so one client
    speaking over several doors is one client to the fair shares)."""
    return "address:" + host
