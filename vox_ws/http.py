"""The plain-HTTP endpoints that share the WebSocket port: health, readiness, info."""

from __future__ import annotations

import dataclasses
import json
from http import HTTPStatus
from pathlib import Path
from typing import Any, Callable

from websockets.asyncio.server import ServerConnection
from websockets.http11 import Request, Response

from .metrics import CONTENT_TYPE, Metrics

STREAM_PATH = "/v1/stream"


def json_response(conn: ServerConnection, status: HTTPStatus, body: Any) -> Response:
    response = conn.respond(status, json.dumps(body) + "\n")
    # websockets' Headers is a multi-map: replace the text/plain type rather than add a second.
    del response.headers["Content-Type"]
    response.headers["Content-Type"] = "application/json"
    response.headers["Cache-Control"] = "no-store"
    return response


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
    """web/demo beside the package (a source checkout or an editable install)."""
    candidate = Path(__file__).resolve().parent.parent / "web" / "demo"
    return candidate if (candidate / "index.html").is_file() else None


class HttpRoutes:
    """Answers GET requests that are not WebSocket upgrades to the stream endpoint."""

    def __init__(self, info: Callable[[], dict[str, Any]], ready: Callable[[], bool], metrics: Metrics,
                 demo_dir: Path | None = None) -> None:
        self._info = info
        self._ready = ready
        self._metrics = metrics
        self._demo = demo_dir.resolve() if demo_dir else None
        # Read once: the demo is small, and the event loop must not wait on disk per request.
        self._files: dict[str, tuple[bytes, str]] = {}
        if self._demo is not None:
            for path in self._demo.rglob("*"):
                if path.is_file() and path.suffix in CONTENT_TYPES:
                    self._files["/" + path.relative_to(self._demo).as_posix()] = (
                        path.read_bytes(), CONTENT_TYPES[path.suffix])

    def __call__(self, conn: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == STREAM_PATH:
            return None  # the WebSocket handshake goes on
        if path == "/healthz":
            return conn.respond(HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            info = self._info()
            if self._ready():
                return json_response(conn, HTTPStatus.OK, {"status": "ready"})
            return json_response(conn, HTTPStatus.SERVICE_UNAVAILABLE,
                                 {"status": info["status"], "error": info.get("error")})
        if path == "/v1/info":
            return json_response(conn, HTTPStatus.OK, self._info())
        if path == "/metrics":
            return _bytes_response(conn, self._metrics.exposition(), CONTENT_TYPE)
        static = self._files.get("/index.html" if path == "/" else path)
        if static is not None:
            return _bytes_response(conn, static[0], static[1])
        return conn.respond(HTTPStatus.NOT_FOUND, f"no such path: {path}\n")


def _bytes_response(conn: ServerConnection, body: bytes, content_type: str) -> Response:
    response = conn.respond(HTTPStatus.OK, "")
    del response.headers["Content-Type"]
    del response.headers["Content-Length"]
    response.headers["Content-Type"] = content_type
    response.headers["Content-Length"] = str(len(body))
    response.headers["Cache-Control"] = "no-cache"
    return dataclasses.replace(response, body=body)
