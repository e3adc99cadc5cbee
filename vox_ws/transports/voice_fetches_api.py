"""REST for the Piper voices an operator fetches by name into the folder the server serves, and
removes (admin token; `service/voices/fetches.py`):

    GET    /v1/admin/voices/available[?language=en]   200 {"folder", "skipped", "voices": [{"name",
                                                       "language", "language_name", "quality",
                                                       "speakers", "size_bytes", "in_folder", "served"}]}
    POST   /v1/admin/voices/{name}     201 {"voice", "served": true, "language", ..., "folder"}
    DELETE /v1/admin/voices/{name}     200 {"voice", "removed": true, "served": false, "folder"}

Refusals are `{"error": {"code", "message", "reason"}}`: `code` protocol v1's, `reason` which
refusal (`FetchRefusal`), with the statuses below. A server without an admin token refuses
them all (401/403): fetching runs downloads and writes to disk, an operator's act.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..service.voices.fetches import FetchRefusal, VoiceFetchRefused
from ..wire import UNAVAILABLE
from . import protocol as p
from .errors import access_refusal, admin_refusal
from .state import server_state

# Each refusal's HTTP status and protocol v1 code.
ANSWERS: dict[FetchRefusal, tuple[int, str]] = {
    FetchRefusal.NO_FOLDER: (501, p.UNSUPPORTED),
    FetchRefusal.NOT_READY: (503, p.NOT_READY),
    FetchRefusal.BAD_NAME: (400, p.BAD_REQUEST),
    FetchRefusal.UNKNOWN_VOICE: (404, p.BAD_REQUEST),
    FetchRefusal.ALREADY_PRESENT: (409, p.BAD_REQUEST),
    FetchRefusal.UNDER_WAY: (409, p.BAD_REQUEST),
    FetchRefusal.BUSY: (409, p.BAD_REQUEST),
    FetchRefusal.NAMED_AT_START: (409, p.BAD_REQUEST),
    FetchRefusal.HUB_UNREACHABLE: (503, UNAVAILABLE),
    FetchRefusal.HUB_ERROR: (502, UNAVAILABLE),
    FetchRefusal.HUB_TOO_SLOW: (504, UNAVAILABLE),
    FetchRefusal.VOICE_REFUSED: (502, p.BAD_REQUEST),
    FetchRefusal.NOT_WRITABLE: (507, p.INTERNAL),
    FetchRefusal.NO_HUB_CLIENT: (501, p.UNSUPPORTED),
}


def refusal_response(err: VoiceFetchRefused) -> JSONResponse:
    status, code = ANSWERS[err.reason]
    headers = {"Retry-After": "60"} if status == 503 else None
    return JSONResponse({"error": {"code": code, "message": err.message, "reason": err.reason.value}},
                        status_code=status, headers=headers)


async def _admin(request: Request, what: str, verb: Callable[[Any], Awaitable[dict[str, Any]]],
                 status_code: int = 200) -> Response:
    """An operator's act on the voices folder: the admin token checked, `verb` run on the
    service's `VoiceFetches`, its refusal answered as ANSWERS says."""
    state = server_state(request)
    refusal = access_refusal(request, state.config) or admin_refusal(request, state.config, what)
    if refusal is not None:
        return refusal
    try:
        return JSONResponse(await verb(state.service.voice_fetches), status_code=status_code)
    except VoiceFetchRefused as err:
        return refusal_response(err)


async def available(request: Request) -> Response:
    language = request.query_params.get("language")
    return await _admin(request, "listing the voices that can be fetched",
                        lambda fetches: fetches.available(language))


async def fetch(request: Request) -> Response:
    name = request.path_params["name"]
    return await _admin(request, "fetching a voice", lambda fetches: fetches.fetch(name), status_code=201)


async def remove(request: Request) -> Response:
    name = request.path_params["name"]
    return await _admin(request, "removing a voice", lambda fetches: fetches.remove(name))


ROUTES: list[BaseRoute] = [
    Route("/v1/admin/voices/available", available, methods=["GET"]),
    Route("/v1/admin/voices/{name}", fetch, methods=["POST"]),
    Route("/v1/admin/voices/{name}", remove, methods=["DELETE"]),
]
