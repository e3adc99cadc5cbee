"""The plain-HTTP endpoints that share the WebSocket port: health, readiness, info."""

from __future__ import annotations

import dataclasses
import json
from http import HTTPStatus
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


class HttpRoutes:
    """Answers GET requests that are not WebSocket upgrades to the stream endpoint."""

    def __init__(self, info: Callable[[], dict[str, Any]], ready: Callable[[], bool], metrics: Metrics) -> None:
        self._info = info
        self._ready = ready
        self._metrics = metrics

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
            response = conn.respond(HTTPStatus.OK, "")
            body = self._metrics.exposition()
            del response.headers["Content-Type"]
            del response.headers["Content-Length"]
            response.headers["Content-Type"] = CONTENT_TYPE
            response.headers["Content-Length"] = str(len(body))
            return dataclasses.replace(response, body=body)
        return conn.respond(HTTPStatus.NOT_FOUND, f"no such path: {path}\n")
