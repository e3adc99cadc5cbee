"""Who may do what: tokens presented at the WebSocket handshake, compared in constant time."""

from __future__ import annotations

import hmac
from urllib.parse import parse_qs, urlsplit

from websockets.http11 import Request


def presented_tokens(request: Request) -> list[str]:
    """Tokens from `Authorization: Bearer <t>` (servers) or `?token=<t>` (browsers, which
    cannot set headers on a WebSocket)."""
    tokens = []
    header = request.headers.get("Authorization", "")
    if header.lower().startswith("bearer "):
        tokens.append(header[7:].strip())
    tokens += parse_qs(urlsplit(request.path).query).get("token", [])
    return [t for t in tokens if t]


def token_matches(presented: list[str], accepted: list[str]) -> bool:
    # Compare against every accepted token without stopping early, so timing reveals nothing.
    found = False
    for candidate in presented:
        for token in accepted:
            found |= hmac.compare_digest(candidate.encode(), token.encode())
    return found
