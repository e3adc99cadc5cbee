"""The HTTP API described: `GET /openapi.json` (OpenAPI 3.1) and `GET /docs` (the same, as a
page a person reads, rendered here: no script, nothing fetched from elsewhere).

The description is written out below, route by route, and checked from two sides by
tests/test_openapi.py: every route the app serves is described and every description is
served, and real responses of a live server validate against it. The WebSocket (protocol v1)
and Wyoming are not HTTP APIs: docs/PROTOCOL.md is their contract.
"""

from __future__ import annotations

import html
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route

from .. import __version__

_ANY: dict[str, Any] = {}
_STRING = {"type": "string"}
_INT = {"type": "integer"}
_NUMBER = {"type": "number"}
_BOOL = {"type": "boolean"}
_STRINGS = {"type": "array", "items": _STRING}


def _object(required: dict[str, Any], optional: dict[str, Any] | None = None, more: bool = True) -> dict[str, Any]:
    return {"type": "object", "required": sorted(required), "properties": {**required, **(optional or {})},
            "additionalProperties": more}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


SCHEMAS: dict[str, Any] = {
    # vox-ws's own routes: {"error": {"code", "message", ...}} with protocol v1's codes.
    "Error": _object({"error": _object({"code": _STRING, "message": _STRING},
                                       {"problems": _STRINGS, "reason": _STRING})}),
    "CatalogueVoice": _object({"name": _STRING, "language": _STRING, "language_name": _STRING,
                               "quality": _STRING, "speakers": _INT, "size_bytes": _INT},
                              {"in_folder": _BOOL, "served": _BOOL}),
    # The OpenAI door's, as OpenAI answers.
    "OpenAIError": _object({"error": _object({"message": _STRING, "type": _STRING,
                                              "param": {"type": ["string", "null"]},
                                              "code": {"type": ["string", "null"]}})}),
    "Load": _object({"ready": _BOOL, "draining": _BOOL, "slots": _INT, "step_rows": _INT, "active": _INT,
                     "queued": _INT, "free_slots": _INT, "mean_step_ms": _NUMBER, "load": _NUMBER,
                     "sessions": _INT}),
    "Info": _object({"status": _STRING, "engine": _STRING, "model": {"type": ["string", "null"]},
                     "sample_rate": _INT, "voices": _STRINGS, "languages": _STRINGS, "features": _STRINGS,
                     "version": _STRING}, {"error": {"type": ["string", "null"]}}),
    "ServerVoice": _object({"id": _STRING, "kind": {"enum": ["builtin", "alias", "public"]},
                            "languages": _STRINGS},
                           {"name": _STRING, "voice": {"type": ["string", "null"]}, "instructions": _STRING,
                            "options": {"type": "object"}}),
    "RegisteredVoice": _object({"voice": _STRING, "mode": {"enum": ["reference", "continuation", "both"]},
                                "audio_s": _NUMBER}, {"name": _STRING, "public": _BOOL}),
    "UploadedVoice": _object({"id": _STRING, "name": _STRING, "voice_id": _STRING, "mode": _STRING},
                             {"kind": _STRING, "created_at": _NUMBER, "file_size": _INT, "ref_text": _STRING,
                              "audio_s": _NUMBER, "expires_at": _NUMBER, "public": _BOOL}),
    "Model": _object({"id": _STRING, "object": {"const": "model"}, "created": _INT, "owned_by": _STRING},
                     {"name": _STRING}),
    "SpeechRequest": _object(
        {"input": {"type": "string", "minLength": 1}},
        {"model": {**_STRING, "description": "the served model, tts-1, tts-1-hd, gpt-4o-mini-tts (and dated "
                                             "names), kokoro or a --model-aliases name; any other is served and "
                                             "named in X-Ignored-Parameters"},
         "voice": {"description": "a built-in voice, an alias, a registered id or name",
                   "oneOf": [_STRING, _object({"id": _STRING})]},
         "response_format": {"enum": ["mp3", "opus", "aac", "flac", "wav", "pcm"], "default": "mp3"},
         "speed": {"type": "number", "minimum": 0.25, "maximum": 4.0, "default": 1.0},
         "instructions": _STRING, "stream_format": {"enum": ["audio", "sse"], "default": "audio"},
         "stream": {**_BOOL, "description": "false: one whole file with its Content-Length; absent: true, but "
                                            "false for flac (a streamed FLAC cannot hold its length)"},
         "sample_rate": {"type": "integer", "minimum": 8000, "maximum": 48000},
         "language": _STRING, "lang_code": _STRING, "timestamps": {"enum": ["word", "segment"]},
         "volume": _NUMBER, "volume_multiplier": _NUMBER, "lookahead_s": _NUMBER, "markup": {"enum": ["ssml", "none"]},
         "pronunciations": {"type": "array"}, "lora": _STRING, "normalization_options": {"type": "object"}},
        more=True),
}


def _json(schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"text/plain": {"schema": _STRING}}}


def _errors(*statuses: int, openai: bool = False) -> dict[str, Any]:
    words = {400: "bad request", 401: "no valid token", 403: "not allowed (origin, or the admin token needed)",
             404: "not found", 409: "in the way", 413: "too large", 415: "not a body it reads",
             429: "busy: Retry-After",
             500: "failed", 501: "not supported by this engine",
             502: "the hub answered an error, or a voice it gave was refused",
             503: "not ready, or shutting down (or the hub unreachable): Retry-After",
             507: "the voices folder cannot be written"}
    schema = _ref("OpenAIError" if openai else "Error")
    return {str(status): _json(schema, words[status]) for status in statuses}


def _op(summary: str, tag: str, responses: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {"summary": summary, "tags": [tag], "responses": responses, **more}


_VOICE_ID = [{"name": "voice_id", "in": "path", "required": True, "schema": _STRING,
              "description": "a registered voice's id, or the caller's name for it"}]
_VOICE_NAME = [{"name": "name", "in": "path", "required": True, "schema": _STRING,
                "description": "a Piper voice's name, as the catalogue lists it (en_US-lessac-medium)"}]
_ADMIN_QUERY = [{"name": "owner", "in": "query", "schema": _STRING, "description": "an owner's key, as listed"},
                {"name": "address", "in": "query", "schema": _STRING, "description": "a client address"}]
_AUDIO_UPLOAD = {"required": True, "content": {
    "audio/wav": {"schema": {"type": "string", "format": "binary"}},
    "audio/flac": {"schema": {"type": "string", "format": "binary"}},
    "audio/ogg": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": _object({}, {"audio": {"type": "string", "format": "binary"},
                                                   "audio_sample": {"type": "string", "format": "binary"},
                                                   "transcript": _STRING, "ref_text": _STRING, "mode": _STRING,
                                                   "name": _STRING, "public": _STRING})}}}
_PUBLIC_BODY = {"required": True, "content": {"application/json": {"schema": _object({"public": _BOOL})}}}
_AUDIO_TYPES = ("audio/mpeg", "audio/ogg; codecs=opus", "audio/aac", "audio/flac", "audio/wav", "audio/pcm")

PATHS: dict[str, Any] = {
    "/healthz": {"get": _op("Whether the process serves", "health", {"200": _text("ok")})},
    "/health": {"get": _op("As /healthz (the path Kokoro-FastAPI's compose files probe)", "health",
                           {"200": _text("ok")})},
    "/readyz": {"get": _op("Whether the engine serves", "health", {
        "200": _json(_object({"status": _STRING}), "ready"),
        "503": _json(_object({"status": _STRING}, {"error": {"type": ["string", "null"]}}),
                     "loading, compiling, failed, draining or full")})},
    "/v1/load": {"get": _op("The balancers' and autoscalers' figure", "health",
                            {"200": _json(_ref("Load"), "the load")})},
    "/v1/info": {"get": _op("The engine, its voices, features, queue and compile state", "health",
                            {"200": _json(_ref("Info"), "what the server is"), **_errors(401)})},
    "/metrics": {"get": _op("Prometheus metrics", "health", {"200": _text("the text exposition format"),
                                                              **_errors(401)})},
    "/v1/lexicon": {"post": _op("Read the --lexicon file again (admin)", "admin", {
        "200": _json(_object({"lexicon": {"type": ["string", "null"]}, "entries": _INT}), "reloaded"),
        **_errors(400, 401, 403)})},
    "/v1/voices": {
        "get": _op("The server's voices and aliases", "voices", {
            "200": _json(_object({"voices": {"type": "array", "items": _ref("ServerVoice")}, "cloning": _BOOL}),
                         "the voices"), **_errors(401, 403, 503)}),
        "post": _op("Register a voice from reference audio (VoxCPM2)", "voices", {
            "201": _json(_ref("RegisteredVoice"), "registered"), **_errors(400, 401, 403, 413, 415, 429, 501, 503)},
            parameters=[{"name": "transcript", "in": "query", "schema": _STRING},
                        {"name": "mode", "in": "query", "schema": _STRING},
                        {"name": "name", "in": "query", "schema": _STRING},
                        {"name": "public", "in": "query", "schema": _STRING,
                         "description": "true: anyone served speaks it by its name (needs a name)"}],
            requestBody=_AUDIO_UPLOAD)},
    "/v1/voices/{voice_id}": {
        "delete": _op("Delete a voice of the caller's", "voices", {
            "200": _json(_object({"voice": _STRING, "deleted": _BOOL}), "deleted"),
            **_errors(401, 403, 404, 503)}, parameters=_VOICE_ID),
        "patch": _op("Make a voice of the caller's public, or private again", "voices", {
            "200": _json(_object({"voice": _STRING, "name": _STRING, "public": _BOOL}), "changed"),
            **_errors(400, 401, 403, 404, 413, 503)}, parameters=_VOICE_ID, requestBody=_PUBLIC_BODY)},
    "/v1/audio/voices": {
        "get": _op("The voices in vLLM-Omni's and Kokoro-FastAPI's shape (answered without a token unless "
                   "--private-info; uploaded voices only to their owner, public ones to all)", "voices", {
            "200": _json(_object({"voices": {"type": "array", "items": {"anyOf": [_ref("ServerVoice"),
                                                                                    _ref("UploadedVoice")]}},
                                  "uploaded_voices": {"type": "array", "items": _ref("UploadedVoice")}}),
                         "the voices"), **_errors(401, 403, 503)}),
        "post": _op("Register a voice, in vLLM-Omni's shape", "voices", {
            "200": _json(_object({"success": _BOOL, "voice": _ref("UploadedVoice")}), "registered"),
            **_errors(400, 401, 403, 413, 415, 429, 501, 503)}, requestBody=_AUDIO_UPLOAD)},
    "/v1/audio/voices/{voice_id}": {
        "delete": _op("Delete a voice, in vLLM-Omni's shape", "voices", {
            "200": _json(_object({"success": _BOOL, "voice": _STRING, "deleted": _BOOL}), "deleted"),
            **_errors(401, 403, 404, 503)}, parameters=_VOICE_ID),
        "patch": _op("Make a voice public, or private again, in vLLM-Omni's shape", "voices", {
            "200": _json(_object({"success": _BOOL, "voice": _ref("UploadedVoice")}), "changed"),
            **_errors(400, 401, 403, 404, 413, 503)}, parameters=_VOICE_ID, requestBody=_PUBLIC_BODY)},
    "/v1/admin/voices": {
        "get": _op("Every registered voice with its owner's key (admin)", "admin", {
            "200": _json(_object({"voices": {"type": "array"}, "usage": _object({"voices": _INT, "bytes": _INT})}),
                         "the voices"), **_errors(400, 401, 403, 503)}, parameters=_ADMIN_QUERY),
        "delete": _op("Delete every voice of one owner (admin)", "admin", {
            "200": _json(_object({"owner": _STRING, "deleted": _STRINGS}), "deleted"),
            **_errors(400, 401, 403, 503)}, parameters=_ADMIN_QUERY)},
    "/v1/admin/voices/available": {"get": _op(
        "The Piper voices that can be fetched by name: the voices repository's catalogue (admin)", "admin", {
            "200": _json(_object({"folder": _STRING, "skipped": _INT,
                                  "voices": {"type": "array", "items": _ref("CatalogueVoice")}}),
                         "the catalogue"),
            **_errors(401, 403, 501, 502, 503)},
        parameters=[{"name": "language", "in": "query", "schema": _STRING,
                     "description": "one language's voices: en, or en_GB for one region"}])},
    "/v1/admin/voices/{name}": {
        "post": _op("Fetch a Piper voice by name into the voices folder and serve it (admin)", "admin", {
            "201": _json(_object({"voice": _STRING, "served": _BOOL, "folder": _STRING}),
                         "fetched and served"),
            **_errors(400, 401, 403, 404, 409, 501, 502, 503, 507)}, parameters=_VOICE_NAME),
        "delete": _op("Remove a Piper voice from the voices folder (admin)", "admin", {
            "200": _json(_object({"voice": _STRING, "removed": _BOOL, "served": _BOOL, "folder": _STRING}),
                         "removed"), **_errors(401, 403, 404, 409, 501, 503, 507)}, parameters=_VOICE_NAME)},
    "/v1/loras": {"get": _op("LoRA slots and the adapters loaded (VoxCPM2)", "admin", {
        "200": _json(_object({"configured": _BOOL}), "the LoRA state"), **_errors(401)})},
    "/v1/loras/{name}": {
        "post": _op("Load an adapter by name (admin)", "admin", {
            "200": _json(_ANY, "loaded"), **_errors(400, 401, 403, 404, 409, 429, 501)},
            parameters=[{"name": "name", "in": "path", "required": True, "schema": _STRING}]),
        "delete": _op("Unload an adapter (admin)", "admin", {
            "200": _json(_ANY, "unloading"), **_errors(400, 401, 403, 404, 501)},
            parameters=[{"name": "name", "in": "path", "required": True, "schema": _STRING}])},
    "/v1/audio/speech": {"post": _op("Speech, as OpenAI's API (streamed as it is generated)", "openai", {
        "200": {"description": "the audio (chunked; with stream: false, a flac's default, one body with its "
                               "length), or SSE",
                "headers": {"X-Sample-Rate": {"schema": _STRING}, "X-Request-Id": {"schema": _STRING},
                            "X-Ignored-Parameters": {"schema": _STRING}},
                "content": {**{kind: {"schema": {"type": "string", "format": "binary"}} for kind in _AUDIO_TYPES},
                            "text/event-stream": {"schema": _STRING}}},
        **_errors(400, 401, 403, 413, 415, 429, 500, 503, openai=True)},
        requestBody={"required": True, "content": {"application/json": {"schema": _ref("SpeechRequest")}}})},
    "/v1/models": {"get": _op("The served model, as OpenAI lists models", "openai", {
        "200": _json(_object({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}}),
                     "the models"), **_errors(401, openai=True)})},
    "/v1/audio/models": {"get": _op("The served model, as Kokoro-FastAPI lists TTS models (answered without a "
                                    "token unless --private-info)", "openai", {
        "200": _json(_object({"models": {"type": "array", "items": _ref("Model")}}), "the models"),
        **_errors(401, 403, openai=True)})},
    "/v1/models/{model}": {"get": _op("One model: the served one, by its id or OpenAI's names", "openai", {
        "200": _json(_ref("Model"), "the model"), **_errors(401, 404, openai=True)},
        parameters=[{"name": "model", "in": "path", "required": True, "schema": _STRING}])},
}


def document() -> dict[str, Any]:
    return {"openapi": "3.1.0",
            "info": {"title": "vox-ws", "version": __version__,
                     "description": "Real-time streaming text-to-speech. The WebSocket protocol (v1) at /v1/stream "
                                    "and Wyoming are described in docs/PROTOCOL.md."},
            "paths": PATHS, "components": {"schemas": SCHEMAS,
                                           "securitySchemes": {"token": {"type": "http", "scheme": "bearer"}}},
            "security": [{}, {"token": []}]}


async def openapi_json(request: Request) -> Response:
    return JSONResponse(document())


async def docs_page(request: Request) -> Response:
    doc = document()
    rows = []
    for path, operations in doc["paths"].items():
        for method, op in operations.items():
            statuses = ", ".join(f"{status} {html.escape(answer['description'])}"
                                 for status, answer in op["responses"].items())
            rows.append(f"<tr><td><code>{method.upper()}</code></td><td><code>{html.escape(path)}</code></td>"
                        f"<td>{html.escape(op['summary'])}</td><td>{statuses}</td></tr>")
    page = (f"<!doctype html><html lang=en><meta charset=utf-8><title>vox-ws HTTP API</title>"
            f"<style>body{{font:15px system-ui;margin:2em}}td{{padding:.3em .6em;vertical-align:top;"
            f"border-bottom:1px solid #ddd}}</style><h1>vox-ws {html.escape(doc['info']['version'])}: the HTTP "
            f"API</h1><p>{html.escape(doc['info']['description'])} The machine-readable description: "
            f"<a href=/openapi.json>/openapi.json</a> (OpenAPI 3.1).</p><table><tr><th>method<th>path<th>what"
            f"<th>answers</tr>{''.join(rows)}</table>")
    return HTMLResponse(page)


ROUTES = [Route("/openapi.json", openapi_json, methods=["GET"]), Route("/docs", docs_page, methods=["GET"])]
