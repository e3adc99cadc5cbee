"""Reading an HTTP request's body with a bound, for every route that takes one."""

from __future__ import annotations

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
