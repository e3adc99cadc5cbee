"""The one ASGI app of a server: protocol v1's WebSocket and every HTTP route, on one port.

    /v1/stream          protocol v1 (WebSocket; `v1_connection.py` drives `vox_ws/session.py`)
    /v1/voices...       voices over REST (`voices_api.py`)
    /v1/admin/voices/{name}  Piper voices fetched by name, and removed (`voice_fetches_api.py`)
    /v1/loras...        LoRA adapters over REST (`loras_api.py`)
    /v1/audio/speech, /v1/models   OpenAI's speech API (`openai_api.py`)
    /healthz /readyz /v1/info /metrics   operations (`http_routes.py`)
    /                   the browser demo
"""

from __future__ import annotations

import logging
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.routing import WebSocketRoute
from starlette.websockets import WebSocket

from ..addresses import client_key
from . import http_routes, loras_api, openai_api, openapi, voice_fetches_api, voices_api
from . import protocol as p
from .auth import SUBPROTOCOL, is_admin, is_authorized, offered_subprotocols, origin_allowed, owner
from .connections import REFUSAL_EXTENSION
from .errors import ORIGIN_REFUSED, error_response
from .hosts import AllowedHosts, HostCheck, listens_on_loopback_only
from .state import ServerState, server_state
from .v1_connection import V1Connection

log = logging.getLogger("vox_ws.server")

STREAM_PATH = "/v1/stream"


async def stream_endpoint(ws: WebSocket) -> None:
    """Protocol v1: one session per connection, admitted before any engine work."""
    state = server_state(ws)
    if not origin_allowed(ws, state.config.allow_origins, state.config.cors_origins):
        # A page of another origin opens a WebSocket without a preflight, as the visitor (by
        # address): refused as a state-changing HTTP request from it is, before the handshake.
        state.metrics.rejected.labels("origin").inc()
        log.info("connection from %s refused: origin %r not allowed", _address(ws, state),
                 (ws.headers.get("origin") or "")[:200])
        await ws.send_denial_response(error_response(403, p.UNAUTHORIZED, ORIGIN_REFUSED))
        return
    # A browser that offered the subprotocol (to carry its token) needs it answered.
    await ws.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered_subprotocols(ws) else None)
    refusal = _admission(state, ws)
    if refusal is not None:
        code, reason, label = refusal
        state.metrics.rejected.labels(label).inc()
        log.info("connection from %s refused: %s", _address(ws, state), reason)
        if label != "draining":
            _refused(ws)                  # the client's doing or its too-much, as an HTTP 4xx
        await ws.close(code, reason)
        return
    address = _address(ws, state)
    config = state.config
    session = V1Connection(ws, state, is_admin=is_admin(ws, config.admin_tokens),
                           owner=owner(ws, config.tokens, config.admin_tokens, config.ipv6_prefix))
    state.sessions.add(session)
    state.per_address[address] += 1
    log.info("session %d open from %s", session.number, address)
    try:
        await session.run()
    finally:
        state.sessions.discard(session)
        state.per_address[address] -= 1
        if state.per_address[address] <= 0:
            del state.per_address[address]
        log.info("session %d closed (code %s)", session.number, session.close_code)


# What a page on another origin may send and read (CORS): the headers the API takes, and the
# ones it answers with that a client needs (when to retry, the rate, what was ignored, which
# request it was).
CORS_REQUEST_HEADERS = ["Authorization", "Content-Type"]
CORS_EXPOSED_HEADERS = ["Retry-After", "X-Request-Id", "X-Sample-Rate", "X-Ignored-Parameters"]
CORS_MAX_AGE_S = 600


def cors_origins(cors: list[str], allowed: list[str]) -> list[str]:
    """The origins CORS answers for; ValueError where they contradict `--allow-origin` (an
    origin answered for whose requests would then be refused)."""
    if allowed and "*" in cors:
        raise ValueError(f"--cors-origins '*' with --allow-origin {','.join(allowed)}: name the allowed origins")
    outside = [origin for origin in cors if allowed and origin not in allowed]
    if outside:
        raise ValueError(f"--cors-origins {','.join(outside)}: not among --allow-origin {','.join(allowed)}")
    return cors


def build_app(state: ServerState, demo_dir: Path | None = None) -> Starlette:
    """Every route, module-level endpoints all: each finds the server's state on its app."""
    routes = [WebSocketRoute(STREAM_PATH, stream_endpoint), *voices_api.ROUTES, *voice_fetches_api.ROUTES,
              *loras_api.ROUTES, *openai_api.ROUTES, *openapi.ROUTES, *http_routes.routes(demo_dir)]
    # Outermost: a request for a host name the server does not answer to (DNS rebinding) is
    # refused before any other rule reads it.
    hosts = AllowedHosts(state.config.allowed_hosts,
                         loopback_only=listens_on_loopback_only(state.config.host))
    middleware = [Middleware(HostCheck, hosts=hosts,
                             on_refused=lambda: state.metrics.rejected.labels("host").inc())]
    origins = cors_origins(state.config.cors_origins, state.config.allow_origins)
    if origins:
        # Tokens travel in the Authorization header, never in cookies: no credentials mode.
        middleware.append(Middleware(CORSMiddleware, allow_origins=origins,
                                     allow_methods=["GET", "POST", "PATCH", "DELETE"],
                                     allow_headers=CORS_REQUEST_HEADERS, expose_headers=CORS_EXPOSED_HEADERS,
                                     allow_credentials=False, max_age=CORS_MAX_AGE_S))
    app = Starlette(routes=routes, middleware=middleware)
    app.state.vox = state
    return app


def _admission(state: ServerState, ws: WebSocket) -> tuple[int, str, str] | None:
    """Why this connection may not open a session (close code, reason, metric label), if so.
    Decided before any engine work."""
    config = state.config
    if not is_authorized(ws, config.tokens, config.admin_tokens):
        return p.CLOSE_UNAUTHORIZED, "unauthorized: present a valid token", "unauthorized"
    if state.draining:
        return p.CLOSE_SERVICE_RESTART, "server shutting down: connect again (another server)", "draining"
    limits = config.limits
    if len(state.sessions) >= limits.max_connections:
        return p.CLOSE_TRY_AGAIN_LATER, "try again later: server at its connection limit", "capacity"
    if config.unready_when_full and state.full():
        return p.CLOSE_TRY_AGAIN_LATER, "try again later: every generation slot is busy", "full"
    if state.per_address[_address(ws, state)] >= limits.max_connections_per_address:
        return p.CLOSE_TOO_MANY_FROM_ADDRESS, "too many connections from your address", "per_address"
    return None


def _refused(ws: WebSocket) -> None:
    """Tells the connection's guard that this accepted connection was refused: it counts
    against its client's budget of refusals as a refused handshake does
    (`connections.REFUSAL_EXTENSION`; absent under another server)."""
    tell = ws.scope.get("extensions", {}).get(REFUSAL_EXTENSION)
    if tell is not None:
        tell()


def _address(ws: WebSocket, state: ServerState) -> str:
    """What the connection counts under: its client's address, an IPv6 one's network."""
    return client_key(ws.client.host if ws.client is not None else "unknown", state.config.ipv6_prefix)
