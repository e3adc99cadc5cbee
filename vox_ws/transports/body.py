"""Reading an HTTP request's body with a bound, and a JSON body within the parser's depth, for
every route that takes one."""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
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


# No body any route takes nests past 3 (an OpenAI request's pronunciations).
MAX_JSON_DEPTH = 64
# A JSON string, escapes and all: the brackets inside one are not nesting.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


def parse_json(data: bytes) -> Any:
    """A body's JSON; BadJson for bytes that are none, or nested past MAX_JSON_DEPTH (1,000 `[`
    raised RecursionError, answered 500 with a traceback: Hardening VII, 8). The depth is
    counted here, not left to the parser, whose bound is the interpreter's recursion limit: what
    else runs in the process may raise it (torch's compiler sets 2,000), and 1,000 `[` were then
    told "Expecting value" instead."""
    if nested_past(data, MAX_JSON_DEPTH):
        raise BadJson("nested too deeply")
    try:
        return json.loads(data)
    except RecursionError:
        raise BadJson("nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadJson(str(exc)[:200]) from None


def nested_past(data: bytes, depth: int) -> bool:
    """Whether `data`'s arrays and objects nest deeper than `depth` as JSON reads them (brackets
    inside strings do not count). Two counts for a body with at most `depth` `[` and `{` (every
    real one); else one pass of a regular expression and numpy, never a Python loop per byte."""
    if data.count(b"[") + data.count(b"{") <= depth:
        return False
    codes = np.frombuffer(_STRING.sub(b"", data), dtype=np.uint8)
    opens = (codes == ord("[")) | (codes == ord("{"))
    closes = (codes == ord("]")) | (codes == ord("}"))
    return int(np.cumsum(opens.astype(np.int32) - closes).max(initial=0)) > depth
