"""The plain HTTP routes on the server's port: health, readiness, load, info, metrics, the lexicon's
reload, the demo page."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Route

from ..engine import Readiness
from ..service.metrics import CONTENT_TYPE
from . import protocol as p
from .auth import is_authorized
from .errors import admin_refusal, unauthorized_response
from .state import ServerState, server_state

NO_STORE = {"Cache-Control": "no-store"}
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".mjs": "text/javascript; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".json": "application/json",
}


def default_demo_dir() -> Path | None:
    """The demo page: web/demo of a source checkout (an editable install serves the files being
    edited), else the copy an installed wheel carries as vox_ws/demo."""
    package = Path(__file__).resolve().parents[1]
    for candidate in (package.parent / "web" / "demo", package / "demo"):
        if (candidate / "index.html").is_file():
            return candidate
    return None


async def healthz(request: Request) -> Response:
    return PlainTextResponse("ok\n")


async def readyz(request: Request) -> Response:
    state = server_state(request)
    if state.ready():
        if state.config.unready_when_full and state.full():
            return JSONResponse({"status": "full"}, status_code=503, headers=NO_STORE)
        return JSONResponse({"status": Readiness.READY}, headers=NO_STORE)
    return JSONResponse({"status": state.status(), "error": state.service.devices.error}, status_code=503,
                        headers=NO_STORE)


async def load(request: Request) -> Response:
    return JSONResponse(server_state(request).load(), headers=NO_STORE)


async def info(request: Request) -> Response:
    state = server_state(request)
    return _private(request, state) or JSONResponse(state.info(), headers=NO_STORE)


async def metrics(request: Request) -> Response:
    state = server_state(request)
    return _private(request, state) or Response(state.metrics.exposition(), media_type=CONTENT_TYPE,
                                                headers=NO_STORE)


async def reload_lexicon(request: Request) -> Response:
    state = server_state(request)
    config = state.config
    if (refusal := admin_refusal(request, config, "reloading the lexicon")) is not None:
        return refusal
    problems = await state.reload_lexicon()
    if problems:
        return JSONResponse({"error": {"code": p.BAD_REQUEST, "message": "the lexicon was not reloaded (the one "
                                       "in use is kept)", "problems": problems}}, status_code=400)
    return JSONResponse({"lexicon": config.lexicon, "entries": len(state.service.lexicon)})


def _private(request: Request, state: ServerState) -> Response | None:
    """The refusal of a request for what `--private-info` keeps to token holders, if it is one."""
    config = state.config
    if config.private_info and not is_authorized(request, config.tokens, config.admin_tokens):
        return unauthorized_response()
    return None


ROUTES: list[BaseRoute] = [
    Route("/healthz", healthz, methods=["GET"]),
    Route("/health", healthz, methods=["GET"]),             # what Kokoro-FastAPI's compose files probe
    Route("/v1/lexicon", reload_lexicon, methods=["POST"]),
    Route("/readyz", readyz, methods=["GET"]),
    Route("/v1/load", load, methods=["GET"]),
    Route("/v1/info", info, methods=["GET"]),
    Route("/metrics", metrics, methods=["GET"]),
]


def routes(demo_dir: Path | None) -> list[BaseRoute]:
    """The operations' routes, and the demo's files where there is a demo."""
    return ROUTES + _demo_routes(demo_dir) if demo_dir is not None else list(ROUTES)


def _demo_routes(demo_dir: Path) -> list[BaseRoute]:
    """One route per file of the demo, read once at start: it is small, and the event loop must
    not wait on disk per request. Exact paths keep 404 and 405 right for every other path."""
    found: list[BaseRoute] = []
    root = demo_dir.resolve()
    for path in sorted(root.rglob("*")):
        if path.is_file() and path.suffix in CONTENT_TYPES:
            body, kind = path.read_bytes(), CONTENT_TYPES[path.suffix]
            url = "/" + path.relative_to(root).as_posix()
            urls = [url, "/"] if url == "/index.html" else [url]
            for each in urls:
                found.append(Route(each, _file(body, kind), methods=["GET"]))
    return found


def _file(body: bytes, kind: str):
    async def serve(request: Request) -> Response:
        return Response(body, media_type=kind, headers={"Cache-Control": "no-cache"})
    return serve
