"""Reading an HTTP request's body with a bound, and a JSON body within the parser's depth, for
every route that takes one."""

from __future__ import annotations

import json
from typing import Any

from starlette.requests import Request


class BodyTooLarge(Exception):
    """The body passed the route's limit (reading stopped there)."""


async def read_body(request: Request, limit: int) -> bytes:
    """The body, read as it streams in; raises BodyTooLarge as soon as it passes `limit` bytes,
    whatever `Content-Length` claimed."""
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise BodyTooLarge()
    return bytes(body)


class BadJson(ValueError):
    """The body is no JSON: its message says why, for the client."""


def parse_json(data: bytes) -> Any:
    """A body's JSON; BadJson for bytes that are none, or nested past what the parser follows
    (1,000 `[` raised RecursionError, answered 500 with a traceback: Hardening VII, 8)."""
    try:
        return json.loads(data)
    except RecursionError:
        raise BadJson("nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadJson(str(exc)[:200]) from None
