"""REST for LoRA adapters: list them, load one into a free slot, unload one (admin token).

The same operations and errors as protocol v1's `lora` message, on every device at once:

    GET    /v1/loras           {"configured", "rank", "slots", "slot_bytes", "adapters": [...], "default"}
    POST   /v1/loras/{name}    201 {"name", "slot", "rank", "scaling", "loaded", "skipped", ...}
                               body (optional, JSON): {"default": true} also makes it the default
    DELETE /v1/loras/{name}    200 {"name", "unloaded", "streams_using"} | 404
"""

from __future__ import annotations

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..engine import Refused
from . import protocol as p
from .body import BadJson, BodyTooLarge, parse_json, read_body
from .errors import access_refusal, admin_refusal, error_response, refused_response
from .state import server_state

MAX_BODY_BYTES = 1024


async def list_loras(request: Request) -> Response:
    state = server_state(request)
    return access_refusal(request, state.config) or JSONResponse(state.service.loras.describe())


async def load_lora(request: Request) -> Response:
    state = server_state(request)
    refusal = access_refusal(request, state.config) or admin_refusal(request, state.config, "loading a LoRA adapter")
    if refusal is not None:
        return refusal
    try:
        body = await read_body(request, MAX_BODY_BYTES)
    except BodyTooLarge:
        return error_response(413, p.TOO_LARGE, f"body exceeds {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:
        return Response(status_code=400)
    try:
        options = parse_json(body) if body.strip() else {}
    except BadJson:
        return error_response(400, p.BAD_REQUEST, "the body must be JSON: {\"default\": true} or nothing")
    if not isinstance(options, dict) or not isinstance(options.get("default", False), bool) \
            or set(options) - {"default"}:
        return error_response(400, p.BAD_REQUEST, "the body may only hold {\"default\": true | false}")
    name = request.path_params["name"]
    try:
        result = await state.service.loras.load(name)
        if options.get("default"):
            result = {**result, **await state.service.loras.set_default(name)}
    except Refused as err:
        return refused_response(err)
    return JSONResponse(_answer(result), status_code=201)


async def unload_lora(request: Request) -> Response:
    state = server_state(request)
    refusal = access_refusal(request, state.config) or admin_refusal(request, state.config,
                                                                     "unloading a LoRA adapter")
    if refusal is not None:
        return refusal
    name = request.path_params["name"]
    if name not in {a["name"] for a in state.service.loras.describe().get("adapters", [])}:
        return error_response(404, p.BAD_REQUEST, f"no LoRA adapter {name!r} is loaded")
    try:
        result = await state.service.loras.unload(name)
    except Refused as err:
        return refused_response(err)
    return JSONResponse(_answer(result))


def _answer(result: dict) -> dict:
    """The operation's own answer (the whole listing is GET /v1/loras)."""
    return {k: v for k, v in result.items() if k not in ("op", "lora")}


ROUTES: list[BaseRoute] = [
    Route("/v1/loras", list_loras, methods=["GET"]),
    Route("/v1/loras/{name}", load_lora, methods=["POST"]),
    Route("/v1/loras/{name}", unload_lora, methods=["DELETE"]),
]
