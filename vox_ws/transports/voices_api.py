"""REST for voices: list, register (reference audio as the body or multipart), delete.

The same limits and errors as protocol v1's `voice` and `voice_delete` messages; a voice
registered here is usable from every front door (`voice` in a `start`, the HTTP endpoints).

    GET    /v1/voices            {"voices": [{"id", "kind": "builtin" | "alias" | "public", "languages"}],
                                  "cloning": bool}
    POST   /v1/voices            201 {"voice", "mode", "audio_s", "public"[, "name"]}
    PATCH  /v1/voices/{id|name}  {"public": bool} -> 200 {"voice", "name", "public"} | 404
    DELETE /v1/voices/{id|name}  200 {"voice", "deleted": true} | 404

The same operations in the shape OpenAI-style servers give them (vLLM-Omni, Kokoro-FastAPI),
for their clients (Open WebUI reads `voices[].id` and `voices[].name`); a caller is shown the
voices it registered, and other owners' public ones (by name, `kind: "public"`), never another
owner's private voice:

    GET    /v1/audio/voices      {"voices": [{"id", "name", "kind", ...}], "uploaded_voices": [{"id", "name", ...}]}
    POST   /v1/audio/voices      200 {"success": true, "voice": {"id", "name", "public", ...}}
    PATCH  /v1/audio/voices/{id|name} {"public": bool} -> 200 {"success": true, "voice": {...}} | 404
    DELETE /v1/audio/voices/{id|name} 200 {"success": true, "voice", "deleted": true, "message"} | 404

An admin (the admin token) sees and deletes every owner's voices, by the owner's key (as listed)
or by a token-less client's address:

    GET    /v1/admin/voices[?owner=KEY|?address=IP]  {"voices": [{"voice", "owner", ...}], "usage": {...}}
    DELETE /v1/admin/voices?owner=KEY|?address=IP    200 {"owner", "deleted": [ids]}
"""

from __future__ import annotations

import logging

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from ..engine import Readiness, Refused
from ..service.voices.registrations import Registration
from ..service.voices.store import VoiceSummary, owner_key
from . import protocol as p
from .auth import address_owner, owner
from .body import BadJson, BodyTooLarge, parse_json, read_body
from .errors import access_refusal, admin_refusal, error_response, listing_refusal, refused_response
from .multipart import MultiPartException
from .proxies import parse_host
from .state import ServerState, server_state

log = logging.getLogger("vox_ws.voices")

AUDIO_TYPES = ("audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave", "audio/flac", "audio/x-flac",
               "audio/ogg", "application/octet-stream")


def _owner(request: Request, state: ServerState) -> str:
    return owner(request, state.config.tokens, state.config.admin_tokens, state.config.ipv6_prefix)


async def list_voices(request: Request) -> Response:
    state = server_state(request)
    if (refusal := access_refusal(request, state.config)) is not None:
        return refusal
    if (loading := _loading(state)) is not None:
        return loading
    # Registered voice ids are capabilities (unguessable, handed to whoever registered
    # them): they are never listed here; public voices are, by their names.
    try:
        public = await state.service.voices.sharing.listed_for(_owner(request, state))
    except Refused as err:
        return refused_response(err)
    voices = [{key: value for key, value in v.items() if key != "name"}
              for v in [*_server_voices(state), *_public_described(state, public)]]
    return JSONResponse({"voices": voices, "cloning": state.service.engine.supports_voices})


def _loading(state: ServerState) -> Response | None:
    """503 `not_ready` (with `Retry-After`) while the engine loads, or after it failed: which
    voices it serves is known once it has loaded. (The lists answered 200 with no voice, which
    a client keeps as the server's answer.)"""
    devices = state.service.devices
    return None if devices.status == Readiness.READY else refused_response(devices.not_ready())


def _public_described(state: ServerState, public: list[VoiceSummary]) -> list[dict]:
    """Public voices as every caller is shown them: by name, speaking the engine's languages;
    never their ids or owners."""
    languages = list(state.service.engine.voices.languages(None))
    return [{"id": v.name, "name": v.name, "kind": "public", "languages": languages} for v in public]


def _server_voices(state: ServerState) -> list[dict]:
    """The server's own voices, built-in then aliases, as clients list them."""
    service = state.service
    engine = service.engine
    voices = [{"id": v, "name": v, "kind": "builtin", "languages": list(engine.voices.languages(v))}
              for v in service.voices.listed()]
    for name, alias in service.voices.aliases().items():
        voices.append({"id": name, "name": name, "kind": "alias", **alias.describe(),
                       "languages": list(engine.voices.languages(alias.voice))})
    return voices


async def register(request: Request) -> Response:
    state = server_state(request)
    result = await _registered(request, state)
    return result if isinstance(result, Response) else JSONResponse(result, status_code=201)


async def register_openai_style(request: Request) -> Response:
    state = server_state(request)
    result = await _registered(request, state)
    if isinstance(result, Response):
        return result
    owned = {v.id: v for v in await state.service.voices.owned_by(_owner(request, state))}
    voice = owned.get(result["voice"])
    described = _described(voice) if voice is not None else {"name": result.get("name", result["voice"]),
                                                             "id": result.get("name", result["voice"])}
    return JSONResponse({"success": True, "voice": {**described, "mode": result["mode"],
                                                    "audio_s": result["audio_s"]}})


async def _registered(request: Request, state: ServerState) -> dict | Response:
    """{voice, mode, audio_s} of a registration, or the response that refuses it."""
    if (refusal := access_refusal(request, state.config)) is not None:
        return refusal
    try:                                      # refused before a byte of the body is read
        registration = state.service.voices.admit_registration(_owner(request, state))
    except Refused as err:
        return refused_response(err)
    try:
        return await _register(request, state, registration)
    finally:
        registration.release()


async def _register(request: Request, state: ServerState, registration: Registration) -> dict | Response:
    limit = state.limits.max_frame_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        return error_response(413, p.TOO_LARGE, f"body of {declared} bytes exceeds {limit} bytes")
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    transcript = request.query_params.get("transcript")
    mode = request.query_params.get("mode")
    name = request.query_params.get("name")
    public = request.query_params.get("public")
    try:
        if kind == "multipart/form-data":
            if declared is None:
                return error_response(411, p.BAD_REQUEST, "multipart uploads need a Content-Length")
            body = await read_body(request, limit)
            try:
                fields = await state.multipart.parse(request.headers["content-type"], body, limit)
            except MultiPartException as exc:
                return error_response(400, p.BAD_REQUEST, f"bad multipart body: {exc.message}")
            # `audio_sample` and `ref_text` are what vLLM-Omni's clients send.
            audio = fields.get("audio", fields.get("audio_sample"))
            if not isinstance(audio, bytes):
                return error_response(400, p.BAD_REQUEST, "multipart field 'audio' (a file) is required")
            transcript = _text_field(fields.get("transcript")) or _text_field(fields.get("ref_text")) or transcript
            mode = _text_field(fields.get("mode")) or mode
            name = _text_field(fields.get("name")) or name
            public = _text_field(fields.get("public")) or public
        elif kind in AUDIO_TYPES:
            audio = await read_body(request, limit)
        else:
            return error_response(415, p.BAD_REQUEST, f"content type {kind or 'none'!r} is not accepted: send "
                                                      "WAV, FLAC or OGG audio, or multipart/form-data")
    except BodyTooLarge:
        return error_response(413, p.TOO_LARGE, f"body exceeds {limit} bytes")
    except ClientDisconnect:
        return Response(status_code=400)
    if len(audio) > limit:
        return error_response(413, p.TOO_LARGE, f"audio exceeds {limit} bytes")
    if not audio:
        return error_response(400, p.BAD_REQUEST, "no audio in the request")
    made_public = _flag(public)
    if made_public is None:
        return error_response(400, p.BAD_REQUEST,
                              f"field 'public' must be true or false, got {(public or '')[:16]!r}")
    try:
        return await state.service.voices.register(audio, transcript, mode, owner=registration, name=name,
                                                  public=made_public)
    except Refused as err:
        return refused_response(err)
    except Exception as exc:                  # answered, and logged in a line, not a traceback
        return _failed("register", exc)


async def list_openai_style(request: Request) -> Response:
    """The server's voices to anyone it serves (`listing_refusal`: Open WebUI lists without a
    key), and the caller's uploaded voices to a caller that may use them."""
    state = server_state(request)
    if (refusal := listing_refusal(request, state.config)) is not None:
        return refusal
    if (loading := _loading(state)) is not None:
        return loading
    # A page of another origin without a token is its own owner (`auth.page_owner`): it is
    # listed the voices it registered, never its visitor's.
    mine = access_refusal(request, state.config) is None
    caller = _owner(request, state) if mine else None
    try:
        owned = await state.service.voices.owned_by(caller) if caller is not None else []
        # Other owners' public voices (the caller's own are among its uploaded ones).
        public = await state.service.voices.sharing.others_for(caller, owned if caller is not None else None)
    except Refused as err:
        return refused_response(err)
    uploaded = [_described(v) for v in owned]
    return JSONResponse({"voices": [*_server_voices(state), *({**v, "kind": "uploaded"} for v in uploaded),
                                    *_public_described(state, public)],
                         "uploaded_voices": uploaded})


async def delete(request: Request) -> Response:
    state = server_state(request)
    if (refusal := access_refusal(request, state.config)) is not None:
        return refusal
    voice = request.path_params["voice_id"]
    try:
        deleted = await state.service.voices.delete(voice, owner=_owner(request, state))
    except Refused as err:
        return refused_response(err)
    except Exception as exc:
        return _failed("delete", exc)
    if not deleted:
        return error_response(404, p.BAD_REQUEST, f"no registered voice {voice!r}")
    answer = {"voice": voice, "deleted": True}
    if request.url.path.startswith("/v1/audio/"):
        answer = {"success": True, **answer, "message": f"voice {voice!r} deleted"}
    return JSONResponse(answer)


async def update(request: Request) -> Response:
    """`{"public": bool}`: a voice of the caller's made public, or private again."""
    state = server_state(request)
    if (refusal := access_refusal(request, state.config)) is not None:
        return refusal
    voice = request.path_params["voice_id"]
    try:
        body = parse_json(await read_body(request, MAX_UPDATE_BYTES))
    except BodyTooLarge:
        return error_response(413, p.TOO_LARGE, f"body exceeds {MAX_UPDATE_BYTES} bytes")
    except BadJson as exc:
        return error_response(400, p.BAD_REQUEST, f"the body must be JSON: {exc}")
    except ClientDisconnect:
        return Response(status_code=400)
    if not isinstance(body, dict) or not isinstance(body.get("public"), bool) or set(body) - {"public"}:
        return error_response(400, p.BAD_REQUEST, 'the body must be {"public": true} or {"public": false}')
    try:
        changed = await state.service.voices.sharing.set_public(voice, _owner(request, state), body["public"])
    except Refused as err:
        return refused_response(err)
    except Exception as exc:
        return _failed("update", exc)
    if changed is None:
        return error_response(404, p.BAD_REQUEST, f"no registered voice {voice!r}")
    if request.url.path.startswith("/v1/audio/"):
        return JSONResponse({"success": True, "voice": _described(changed)})
    return JSONResponse({"voice": changed.id, "name": changed.name, "public": changed.public})


def _admin_owner(request: Request) -> str | None | Response:
    """The owner key an admin request names (`owner`, or `address`), None for all, or a 400."""
    given = {k: v for k, v in request.query_params.items() if k in ("owner", "address")}
    if set(request.query_params) - {"owner", "address"} or len(given) > 1:
        return error_response(400, p.BAD_REQUEST, "name one owner: ?owner=KEY (as listed) or ?address=IP")
    if "address" in given:
        address = parse_host(given["address"])
        if address is None:
            return error_response(400, p.BAD_REQUEST, f"{given['address'][:64]!r} is not an IP address")
        return owner_key(address_owner(address, server_state(request).config.ipv6_prefix))
    return given.get("owner")


async def admin_list(request: Request) -> Response:
    state = server_state(request)
    refusal = access_refusal(request, state.config) or admin_refusal(request, state.config, "listing every voice")
    if refusal is not None:
        return refusal
    selected = _admin_owner(request)
    if isinstance(selected, Response):
        return selected
    try:
        voices = await state.service.voices.every(selected)
        usage = await state.service.voices.store.usage()
    except Refused as err:
        return refused_response(err)
    return JSONResponse({"voices": [admin_described(v) for v in voices], "usage": usage})


async def admin_delete(request: Request) -> Response:
    state = server_state(request)
    refusal = access_refusal(request, state.config) or admin_refusal(request, state.config,
                                                                     "deleting an owner's voices")
    if refusal is not None:
        return refusal
    selected = _admin_owner(request)
    if isinstance(selected, Response):
        return selected
    if selected is None:
        return error_response(400, p.BAD_REQUEST, "name the owner whose voices to delete: ?owner=KEY or ?address=IP")
    try:
        deleted = await state.service.voices.delete_owned(selected)
    except Refused as err:
        return refused_response(err)
    return JSONResponse({"owner": selected, "deleted": deleted})


def admin_described(voice: VoiceSummary) -> dict:
    """A voice as an admin is shown it: its owner's key, never the owner's token or address."""
    return {"voice": voice.id, "name": voice.name, "owner": voice.owner, "mode": voice.mode,
            "audio_bytes": voice.audio_bytes, "created_at": int(voice.created),
            "expires_at": int(voice.expires) if voice.expires is not None else None}


ROUTES: list[BaseRoute] = [
    Route("/v1/admin/voices", admin_list, methods=["GET"]),
    Route("/v1/admin/voices", admin_delete, methods=["DELETE"]),
    Route("/v1/voices", list_voices, methods=["GET"]),
    Route("/v1/voices", register, methods=["POST"]),
    Route("/v1/voices/{voice_id}", delete, methods=["DELETE"]),
    Route("/v1/voices/{voice_id}", update, methods=["PATCH"]),
    Route("/v1/audio/voices", list_openai_style, methods=["GET"]),
    Route("/v1/audio/voices", register_openai_style, methods=["POST"]),
    Route("/v1/audio/voices/{voice_id}", delete, methods=["DELETE"]),
    Route("/v1/audio/voices/{voice_id}", update, methods=["PATCH"]),
]




def _described(voice: VoiceSummary) -> dict:
    """A registered voice as vLLM-Omni describes an uploaded one: `id` and `name` are what to speak
    it by (its name, where its owner gave one; else its id), `voice_id` its id."""
    called = voice.name or voice.id
    described = {"id": called, "name": called, "voice_id": voice.id, "mode": voice.mode,
                 "created_at": int(voice.created), "file_size": voice.audio_bytes, "public": voice.public}
    if voice.transcript:
        described["ref_text"] = voice.transcript
    if voice.expires is not None:
        described["expires_at"] = int(voice.expires)
    return described


def _failed(what: str, exc: Exception) -> Response:
    log.error("voice %s failed: %s: %s", what, type(exc).__name__, exc)
    return error_response(500, p.INTERNAL, f"voice {what} failed: {type(exc).__name__}")


def _text_field(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


# A PATCH's body is `{"public": false}`: a few bytes.
MAX_UPDATE_BYTES = 1024


def _flag(value: str | None) -> bool | None:
    """A form's or query's boolean (`public=true`); absent: False; None for anything else."""
    if value is None:
        return False
    return {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
            "off": False}.get(value.strip().lower())
