"""/openapi.json and /docs: the HTTP API described, checked from both sides. The description is
valid OpenAPI 3.1 (openapi-spec-validator); every route the app serves is described and every
description is served; and the real answers of a live Piper server, to a request for each
operation and to bad ones, validate against the schema described for their status."""

from __future__ import annotations

import re

import httpx
import jsonschema
import pytest
from openapi_spec_validator import validate

from vox_ws.engines.piper import PiperEngine
from vox_ws.transports.openapi import document

ADMIN = "admin-token"


@pytest.fixture(scope="module")
def served(start_server):
    return start_server(PiperEngine(), admin_tokens=[ADMIN])


def test_the_description_is_valid_openapi_and_served(served):
    validate(document())
    assert httpx.get(served.http + "/openapi.json").json() == document()
    page = httpx.get(served.http + "/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/v1/audio/speech" in page.text and "<script" not in page.text


def test_every_route_is_described_and_every_description_served(served):
    from vox_ws.transports.app import build_app

    app = build_app(served.server.state)
    served_routes = {(re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path), method.lower())
                     for route in app.routes if getattr(route, "methods", None)
                     for method in route.methods if method != "HEAD"}
    demo = {(path, method) for path, method in served_routes if path == "/" or "." in path}   # the page's files
    described = {(path, method) for path, operations in document()["paths"].items() for method in operations}
    assert described - served_routes == set()
    assert served_routes - described - demo - {("/openapi.json", "get"), ("/docs", "get")} == set()


def _validator(schema: dict) -> jsonschema.Validator:
    return jsonschema.Draft202012Validator({**schema, "components": document()["components"]})


def _check(response: httpx.Response, path: str, method: str, seen: set) -> None:
    operation = document()["paths"][path][method]
    answer = operation["responses"].get(str(response.status_code))
    assert answer is not None, (f"{method.upper()} {path}: {response.status_code} is not described: "
                                f"{response.text[:300]}")
    kind = response.headers.get("content-type", "").split(";")[0]
    content = answer.get("content", {})
    matching = [schema for name, schema in content.items() if name.split(";")[0] == kind]
    assert matching, f"{method.upper()} {path} {response.status_code}: {kind} is not described ({list(content)})"
    if kind == "application/json":
        errors = list(_validator(matching[0]["schema"]).iter_errors(response.json()))
        assert not errors, f"{method.upper()} {path} {response.status_code}: {errors[0].message}"
    seen.add((path, method))


def test_real_answers_validate_against_the_description(served, tmp_path):
    seen: set = set()
    admin = {"Authorization": f"Bearer {ADMIN}"}
    tone = open(__file__, "rb").read()[:100]                          # not audio: the door says so
    with httpx.Client(base_url=served.http, timeout=60) as http:
        requests = [
            ("get", "/healthz", {}), ("get", "/health", {}), ("get", "/readyz", {}), ("get", "/v1/load", {}),
            ("get", "/v1/info", {}), ("get", "/metrics", {}), ("post", "/v1/lexicon", {}),
            ("post", "/v1/lexicon", {"headers": admin}), ("get", "/v1/voices", {}),
            ("post", "/v1/voices", {"content": tone, "headers": {"content-type": "audio/wav"}}),
            ("delete", "/v1/voices/v_aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa", {}), ("get", "/v1/audio/voices", {}),
            ("post", "/v1/audio/voices", {"files": {"audio_sample": ("a.wav", tone, "audio/wav")}}),
            ("delete", "/v1/audio/voices/nobody", {}), ("get", "/v1/admin/voices", {"headers": admin}),
            ("patch", "/v1/voices/nobody", {"json": {"public": True}}),
            ("patch", "/v1/audio/voices/nobody", {"json": {"public": "yes"}}),
            ("get", "/v1/admin/voices", {}), ("delete", "/v1/admin/voices", {"headers": admin,
                                                                            "params": {"address": "192.0.2.1"}}),
            ("get", "/v1/loras", {}), ("post", "/v1/loras/bright", {"headers": admin}),
            ("delete", "/v1/loras/bright", {"headers": admin}),
            ("get", "/v1/admin/voices/available", {"headers": admin}),
            ("post", "/v1/admin/voices/en_GB-test-medium", {"headers": admin}),
            ("delete", "/v1/admin/voices/en_GB-test-medium", {"headers": admin}),
            ("post", "/v1/audio/speech", {"json": {"input": "Hello.", "voice": "alloy", "response_format": "mp3"}}),
            ("post", "/v1/audio/speech", {"json": {"input": "Hello.", "response_format": "wav", "stream": False}}),
            ("post", "/v1/audio/speech", {"json": {"input": "Hello.", "stream_format": "sse"}}),
            ("post", "/v1/audio/speech", {"json": {"input": ""}}),
            ("post", "/v1/audio/speech", {"json": {"input": "Hi.", "voice": "nobody"}}),
            ("post", "/v1/audio/speech", {"content": b"input=hi",
                                          "headers": {"content-type": "application/x-www-form-urlencoded"}}),
            ("get", "/v1/models", {}), ("get", "/v1/audio/models", {}), ("get", "/v1/models/tts-1", {}),
            ("get", "/v1/models/whisper-1", {}),
        ]
        for method, path, kwargs in requests:
            response = http.request(method.upper(), path, **kwargs)
            described = re.sub(r"^/v1/(voices|audio/voices|loras|models|admin/voices)/(?!available$)[^/]+$",
                               r"/v1/\1/{name}", path)
            described = {"/v1/voices/{name}": "/v1/voices/{voice_id}",
                         "/v1/audio/voices/{name}": "/v1/audio/voices/{voice_id}",
                         "/v1/models/{name}": "/v1/models/{model}"}.get(described, described)
            _check(response, described, method, seen)
    every = {(path, method) for path, operations in document()["paths"].items() for method in operations}
    assert every - seen == set(), "operations no real request answered here"
