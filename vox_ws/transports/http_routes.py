"""The plain HTTP routes on the server's port: health, readiness, info, metrics, the demo page."""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ..metrics import CONTENT_TYPE
from .state import ServerState

NO_STORE = {"Cache-Control": "no-store"}


def default_demo_dir() -> Path | None:
    """web/demo beside the package (a source checkout or an editable install)."""
    candidate = Path(__file__).resolve().parents[2] / "web" / "demo"
    return candidate if (candidate / "index.html").is_file() else None


def routes(state: ServerState, demo_dir: Path | None) -> list[BaseRoute]:
    async def healthz(request: Request) -> Response:
        return PlainTextResponse("ok\n")

    async def readyz(request: Request) -> Response:
        if state.ready():
            return JSONResponse({"status": "ready"}, headers=NO_STORE)
        return JSONResponse({"status": state.status(), "error": state.service.scheduler.error}, status_code=503,
                            headers=NO_STORE)

    async def info(request: Request) -> Response:
        return JSONResponse(state.info(), headers=NO_STORE)

    async def metrics(request: Request) -> Response:
        return Response(state.metrics.exposition(), media_type=CONTENT_TYPE, headers=NO_STORE)

    found = [
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", readyz, methods=["GET"]),
        Route("/v1/info", info, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ]
    if demo_dir is not None:
        # Files are read on a worker thread (StaticFiles), never on the event loop.
        found.append(Mount("/", StaticFiles(directory=str(demo_dir), html=True), name="demo"))
    return found
