"""HTTP's words for the engine's and the stream service's refusals."""

from __future__ import annotations

import math

from starlette.requests import Request
from starlette.responses import JSONResponse

from ..config import ServerConfig
from ..engine import ErrorKind, Refused
from . import protocol as p
from .auth import is_admin, is_authorized, origin_allowed

HTTP_STATUS = {
    ErrorKind.INVALID: 400,
    ErrorKind.TOO_LARGE: 413,
    ErrorKind.UNSUPPORTED: 501,
    ErrorKind.BUSY: 429,
    ErrorKind.NOT_READY: 503,
    ErrorKind.INTERNAL: 500,
    ErrorKind.TIMEOUT: 408,
    ErrorKind.SLOW_CONSUMER: 408,
    ErrorKind.GOING_AWAY: 503,
    ErrorKind.UNAVAILABLE: 503,
}


ORIGIN_REFUSED = ("origin not allowed: a page of another origin may not send this here (the server's "
                  "--allow-origin and --cors-origins say which may)")


def error_response(status: int, code: str, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """`{"error": {"code", "message"}}`, with protocol v1's error codes."""
    return JSONResponse({"error": {"code": code, "message": message}}, status_code=status, headers=headers)


def retry_headers(err: Refused) -> dict[str, str] | None:
    """`Retry-After` (whole seconds, at least one) for a refusal that may pass later: the
    refusal's own estimate where it has one (a full queue: the queue's measured pace)."""
    if not err.kind.retryable:
        return None
    return {"Retry-After": str(max(1, math.ceil(err.retry_after_s))) if err.retry_after_s else "1"}


def refused_response(err: Refused) -> JSONResponse:
    return error_response(HTTP_STATUS[err.kind], p.code_for(err.kind), err.message, retry_headers(err))


def unauthorized_response() -> JSONResponse:
    return error_response(401, p.UNAUTHORIZED, "unauthorized: present a valid token", {"WWW-Authenticate": "Bearer"})


def access_refusal(request: Request, config: ServerConfig) -> JSONResponse | None:
    """The refusal of a request from an origin or without a token the server does not take."""
    if not origin_allowed(request, config.allow_origins, config.cors_origins):
        return error_response(403, p.UNAUTHORIZED, ORIGIN_REFUSED)
    if not is_authorized(request, config.tokens, config.admin_tokens):
        return unauthorized_response()
    return None


def listing_refusal(request: Request, config: ServerConfig) -> JSONResponse | None:
    """The refusal of a request for the lists of the server's own voices and models: only from
    an origin it does not take, or without a token under `--private-info`. Clients such as Open
    WebUI send no key when they list, and fall back to OpenAI's names silently on a 401."""
    if config.private_info:
        return access_refusal(request, config)
    if not origin_allowed(request, config.allow_origins, config.cors_origins):
        return error_response(403, p.UNAUTHORIZED, ORIGIN_REFUSED)
    return None


def admin_refusal(request: Request, config: ServerConfig, what: str) -> JSONResponse | None:
    """The refusal of an admin operation to a caller without the admin token: 403 for a caller
    the server otherwise serves, 401 for one it does not."""
    if is_admin(request, config.admin_tokens):
        return None
    allowed = is_authorized(request, config.tokens, config.admin_tokens)
    return error_response(403 if allowed else 401, p.UNAUTHORIZED, f"{what} needs the admin token")
