"""HTTP on the WebSocket's port, through a real HTTP client: methods, statuses, limits, access,
and voices over REST usable from protocol v1."""

from __future__ import annotations

import logging

import httpx
import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus

from conftest import connect_client
from helpers import wav
from vox_ws.engines.piper import PiperEngine

TOKEN = "http-secret"


@pytest.fixture(scope="module")
def voxcpm_http(start_server, tiny_model):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    return start_server(engine, slots=2, max_frame_bytes=256 * 1024, max_voice_audio_s=5.0)


@pytest.fixture(scope="module")
def guarded(start_server):
    return start_server(PiperEngine(), tokens=[TOKEN], allow_origins=["https://app.example"])


async def test_methods_and_unknown_paths(piper_server):
    async with httpx.AsyncClient(base_url=piper_server.http) as http:
        head = await http.head("/healthz")
        assert head.status_code == 200 and head.content == b""
        health = await http.get("/health")                 # Kokoro-FastAPI's probe path
        assert health.status_code == 200 and health.text == "ok\n"
        assert (await http.head("/readyz")).status_code == 200
        assert (await http.get("/nope")).status_code == 404
        wrong = await http.post("/healthz", content=b"x")
        assert wrong.status_code == 405 and "GET" in wrong.headers["allow"]
        assert (await http.delete("/v1/voices")).status_code == 405
        assert (await http.get("/v1/voices/anything")).status_code == 405
        demo = await http.get("/")
        assert demo.status_code == 200 and demo.headers["content-type"].startswith("text/html")
        assert (await http.get("/app.mjs")).headers["content-type"].startswith("text/javascript")
        assert (await http.get("/healthz")).headers["server"].startswith("vox-ws/")


async def test_voices_rest_on_an_engine_that_cannot_clone(piper_server):
    async with httpx.AsyncClient(base_url=piper_server.http) as http:
        listed = await http.get("/v1/voices")
        voices = listed.json()["voices"]
        assert listed.json()["cloning"] is False
        assert voices[0] == {"id": "joe", "kind": "builtin", "languages": ["en_US"]}
        assert {v["kind"] for v in voices[1:]} == {"alias"} and all(v["voice"] == "joe" for v in voices[1:])
        refused = await http.post("/v1/voices", content=wav(1.0), headers={"content-type": "audio/wav"})
        assert refused.status_code == 501 and refused.json()["error"]["code"] == "unsupported"


async def test_register_use_and_delete_a_voice_over_rest(voxcpm_http):
    async with httpx.AsyncClient(base_url=voxcpm_http.http) as http:
        created = await http.post("/v1/voices", content=wav(1.0), headers={"content-type": "audio/wav"})
        assert created.status_code == 201, created.text
        voice = created.json()
        assert voice["voice"].startswith("v_") and voice["mode"] == "reference" and voice["audio_s"] == 1.0
        # Multipart, with a transcript: the continuation prompt too.
        form = await http.post("/v1/voices", files={"audio": ("ref.flac", wav(1.0, fmt="FLAC"), "audio/flac")},
                               data={"transcript": "A short reference."})
        assert form.status_code == 201 and form.json()["mode"] == "both", form.text
        # Usable from protocol v1.
        async with connect_client(voxcpm_http) as c:
            result = await c.speak("Hello.", "a", voice=voice["voice"], options={"max_len": 3})
            assert result.end["reason"] == "max_len" and result.end["chunks"] >= 1
        deleted = await http.delete(f"/v1/voices/{voice['voice']}")
        assert deleted.status_code == 200 and deleted.json() == {"voice": voice["voice"], "deleted": True}
        again = await http.delete(f"/v1/voices/{voice['voice']}")
        assert again.status_code == 404
        async with connect_client(voxcpm_http) as c:
            result = await c.speak("Hello.", "b", voice=voice["voice"])
            assert result.error["code"] == "bad_request" and "unknown voice" in result.error["message"]


@pytest.mark.parametrize("name, request_kwargs, status, code", [
    ("wrong type", {"content": b"hello", "headers": {"content-type": "text/plain"}}, 415, "bad_request"),
    ("no type", {"content": b"hello"}, 415, "bad_request"),
    ("not audio", {"content": b"RIFF0000WAVEjunk", "headers": {"content-type": "audio/wav"}}, 400, "bad_request"),
    ("empty", {"content": b"", "headers": {"content-type": "audio/wav"}}, 400, "bad_request"),
    ("too long", {"content": wav(6.0, rate=8000), "headers": {"content-type": "audio/wav"}}, 413, "too_large"),
    ("too short", {"content": wav(0.1), "headers": {"content-type": "audio/wav"}}, 400, "bad_request"),
    ("bad mode", {"content": wav(1.0), "headers": {"content-type": "audio/wav"}, "params": {"mode": "x"}}, 400,
     "bad_request"),
    ("needs transcript", {"content": wav(1.0), "headers": {"content-type": "audio/wav"},
                          "params": {"mode": "continuation"}}, 400, "bad_request"),
    ("multipart without audio", {"files": {"other": ("a.txt", b"x", "text/plain")}}, 400, "bad_request"),
])
async def test_voice_upload_errors(voxcpm_http, name, request_kwargs, status, code):
    async with httpx.AsyncClient(base_url=voxcpm_http.http) as http:
        response = await http.post("/v1/voices", **request_kwargs)
        assert response.status_code == status, (name, response.text)
        assert response.json()["error"]["code"] == code and response.json()["error"]["message"]


async def test_bodies_over_the_limit_are_refused_without_reading_them_whole(voxcpm_http):
    limit = voxcpm_http.config.limits.max_frame_bytes
    async with httpx.AsyncClient(base_url=voxcpm_http.http) as http:
        declared = await http.post("/v1/voices", content=b"\0" * (limit + 1), headers={"content-type": "audio/wav"})
        assert declared.status_code == 413 and declared.json()["error"]["code"] == "too_large"

        async def chunked():
            for _ in range(limit // 65536 + 2):
                yield b"\0" * 65536

        streamed = await http.post("/v1/voices", content=chunked(), headers={"content-type": "audio/wav"})
        assert streamed.status_code == 413
        big_form = await http.post("/v1/voices", files={"audio": ("a.wav", b"\0" * (limit + 10), "audio/wav")})
        assert big_form.status_code == 413
    # The server is fine afterwards.
    async with connect_client(voxcpm_http) as c:
        assert (await c.speak("Still here.", "ok", options={"max_len": 2})).end["reason"] == "max_len"


async def test_tokens_and_origins_apply_to_http_as_to_the_websocket(guarded):
    async with httpx.AsyncClient(base_url=guarded.http) as http:
        assert (await http.get("/healthz")).status_code == 200          # probes stay open
        assert (await http.get("/readyz")).status_code == 200
        refused = await http.get("/v1/voices")
        assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
        assert refused.headers["www-authenticate"] == "Bearer"
        assert (await http.get("/v1/voices", headers={"authorization": "Bearer wrong"})).status_code == 401
        assert (await http.get("/v1/voices", headers={"authorization": f"Bearer {TOKEN}"})).status_code == 200
        assert (await http.get("/v1/voices", params={"token": TOKEN})).status_code == 200
        evil = await http.get("/v1/voices", params={"token": TOKEN}, headers={"origin": "https://evil.example"})
        assert evil.status_code == 403
        good = await http.get("/v1/voices", params={"token": TOKEN}, headers={"origin": "https://app.example"})
        assert good.status_code == 200


async def test_info_and_metrics_need_a_token_only_when_asked(guarded, start_server):
    async with httpx.AsyncClient(base_url=guarded.http) as http:
        assert (await http.get("/v1/info")).status_code == 200          # the default: open
        assert (await http.get("/metrics")).status_code == 200
    private = start_server(PiperEngine(), tokens=[TOKEN], private_info=True)
    async with httpx.AsyncClient(base_url=private.http) as http:
        for path in ("/v1/info", "/metrics"):
            refused = await http.get(path)
            assert refused.status_code == 401 and refused.json()["error"]["code"] == "unauthorized"
            assert (await http.get(path, headers={"authorization": f"Bearer {TOKEN}"})).status_code == 200
        assert (await http.get("/healthz")).status_code == 200
        assert (await http.get("/readyz")).status_code == 200


async def test_each_endpoint_stands_alone_on_an_app_that_carries_a_servers_state(piper_server):
    """The HTTP endpoints are module-level functions that find the server's state on their
    app (Starlette's `request.app.state`): mounted alone, under other paths, they answer as
    they do on the server."""
    from starlette.applications import Starlette
    from starlette.routing import Route

    from vox_ws.transports import http_routes, openai_api, voices_api

    app = Starlette(routes=[Route("/ready", http_routes.readyz), Route("/voices", voices_api.list_voices),
                            Route("/models", openai_api.models)])
    app.state.vox = piper_server.server.state
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://alone") as alone, \
            httpx.AsyncClient(base_url=piper_server.http) as server:
        for path, on_server in (("/ready", "/readyz"), ("/voices", "/v1/voices"), ("/models", "/v1/models")):
            mine, theirs = await alone.get(path), await server.get(on_server)
            assert (mine.status_code, mine.json()) == (theirs.status_code, theirs.json()), path
        assert (await alone.get("/ready")).json() == {"status": "ready"}


async def test_a_page_of_another_origin_cannot_register_or_delete_for_its_visitor(voxcpm_http):
    """Hardening V, 8: a multipart POST needs no preflight, so a page the visitor opened sent
    four registrations as the visitor (by address) and retired the visitor's own voice. A
    state-changing request whose Origin is neither the server's own nor configured is refused
    403, and nothing changes; the server's own page and clients without an Origin are served."""
    async with httpx.AsyncClient(base_url=voxcpm_http.http) as http:
        own = await http.post("/v1/audio/voices", files={"audio": ("me.wav", wav(1.0), "audio/wav")},
                              data={"name": "mine"})
        assert own.status_code == 200, own.text
        before = (await http.get("/v1/audio/voices")).json()["uploaded_voices"]
        evil = {"origin": "https://evil.example"}
        for _ in range(4):
            forged = await http.post("/v1/audio/voices", files={"audio": ("x.wav", wav(1.0), "audio/wav")},
                                     headers=evil)
            assert forged.status_code == 403 and "origin not allowed" in forged.text, forged.text
        for path in ("/v1/voices", "/v1/audio/speech"):
            refused = await http.post(path, content=b"{}", headers={**evil, "content-type": "application/json"})
            assert refused.status_code == 403, (path, refused.text)
        refused = await http.delete("/v1/audio/voices/mine", headers=evil)
        assert refused.status_code == 403
        assert (await http.get("/v1/audio/voices")).json()["uploaded_voices"] == before
        # The server's own page (its Origin is the server's host and port) is served.
        same = await http.post("/v1/audio/speech", json={"input": "Same origin.", "voice": "mine",
                                                         "response_format": "pcm"},
                               headers={"origin": voxcpm_http.http})
        assert same.status_code == 200, same.text
        assert (await http.delete("/v1/audio/voices/mine", headers={"origin": voxcpm_http.http})).status_code == 200


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_cors_for_any_page_never_deletes_nor_lists_a_visitors_voices_without_a_token(start_server,
                                                                                          tiny_model):
    """Hardening V, 9: with `--cors-origins '*'` and no tokens, any page listed the visitor's
    voices and, after a preflight that allowed DELETE, deleted them. Now a page of another
    origin may still speak and register (what '*' is for), but without a token it is its own
    owner (Hardening VI, 1): it lists only the server's voices and its own, and deletes only
    its own (the visitor's: 404, as no voice)."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1), slots=1,
                          cors_origins=["*"], max_voice_audio_s=5.0)
    evil = {"origin": "https://evil.example"}
    async with httpx.AsyncClient(base_url=server.http) as http:
        own = await http.post("/v1/audio/voices", files={"audio": ("me.wav", wav(1.0), "audio/wav")},
                              data={"name": "mine"})
        assert own.status_code == 200, own.text
        mine = (await http.get("/v1/audio/voices")).json()
        assert [v["name"] for v in mine["uploaded_voices"]] == ["mine"]
        seen = await http.get("/v1/audio/voices", headers=evil)
        assert seen.status_code == 200 and seen.headers["access-control-allow-origin"] == "*"
        assert seen.json()["uploaded_voices"] == [] and all(v["kind"] != "uploaded" for v in seen.json()["voices"])
        gone = await http.delete("/v1/audio/voices/mine", headers=evil)
        assert gone.status_code == 404
        spoken = await http.post("/v1/audio/speech", json={"input": "Any page.", "voice": "alloy",
                                                           "response_format": "pcm"}, headers=evil)
        assert spoken.status_code == 200, spoken.text
        assert [v["name"] for v in (await http.get("/v1/audio/voices")).json()["uploaded_voices"]] == ["mine"]


REBOUND = "rebind.example"


@pytest.mark.hardening
async def test_a_rebound_host_name_reaches_nothing_of_the_visitors(voxcpm_http, caplog):
    """Hardening VI, 2: DNS rebinding. A page whose name was re-pointed at the server (Host and
    Origin both `rebind.example:PORT`) is its own origin to the cross-origin rule: it listed the
    visitor's uploaded voices with their ids, spoke one, deleted it and registered another. A
    request (HTTP or WebSocket handshake) for a host name the server does not answer to is now
    refused 421 (`bad_request`) before anything of it is read; at `localhost:PORT` and
    `127.0.0.1:PORT` the same requests are served."""
    port = voxcpm_http.port
    made = await _named_voice(voxcpm_http.http, "rebound-me")
    rebound = f"{REBOUND}:{port}"
    page = {"host": rebound, "origin": f"http://{rebound}"}
    attacks = [("GET", "/v1/audio/voices", {}),
               ("POST", "/v1/audio/speech",
                {"json": {"input": "Hi.", "voice": "rebound-me", "response_format": "pcm"}}),
               ("DELETE", "/v1/audio/voices/rebound-me", {}),
               ("POST", "/v1/voices", {"content": wav(1.0), "headers": {"content-type": "audio/wav"}})]
    async with httpx.AsyncClient(base_url=voxcpm_http.http, timeout=60) as http:
        for method, path, kwargs in attacks:
            headers = {**kwargs.pop("headers", {}), **page}
            refused = await http.request(method, path, headers=headers, **kwargs)
            assert refused.status_code == 421, (method, path, refused.text)
            error = refused.json()["error"]
            assert error["code"] == "bad_request" and REBOUND in error["message"], error
        with pytest.raises(InvalidStatus) as info:
            async with connect(f"ws://{rebound}/v1/stream", host="127.0.0.1", port=port, origin=f"http://{rebound}"):
                pass
        assert info.value.response.status_code == 421
        assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len([r for r in caplog.records if "refused (421)" in r.getMessage()]) == 1    # once per name
        metrics = (await http.get("/metrics")).text
        assert 'voxws_connections_rejected_total{reason="host"} 5.0' in metrics
        for host in (f"localhost:{port}", f"127.0.0.1:{port}"):
            served = {"host": host, "origin": f"http://{host}"}
            listed = await http.get("/v1/audio/voices", headers=served)
            assert "rebound-me" in [v["id"] for v in listed.json()["uploaded_voices"]], listed.text
            spoken = await http.post("/v1/audio/speech", headers=served, json={
                "input": "Hi.", "voice": "rebound-me", "response_format": "pcm", "max_len": 3})
            assert spoken.status_code == 200 and spoken.content, spoken.text
        async with connect_client(voxcpm_http, origin=voxcpm_http.http) as c:
            spoken = await c.speak("Hi.", "own", voice=made, options={"max_len": 3})
            assert spoken.end["reason"] == "max_len"
        deleted = await http.delete("/v1/audio/voices/rebound-me", headers={"host": f"localhost:{port}"})
        assert deleted.status_code == 200


async def _named_voice(base: str, name: str) -> str:
    async with httpx.AsyncClient(base_url=base, timeout=60) as http:
        made = await http.post("/v1/voices", params={"name": name}, content=wav(1.0),
                               headers={"content-type": "audio/wav"})
        assert made.status_code == 201, made.text
        return made.json()["voice"]


@pytest.mark.hardening
async def test_allowed_hosts_admits_the_names_it_lists(start_server):
    """`--allowed-hosts rebind.example` (a name of the server's own) admits it, for HTTP and the
    WebSocket; another name is still refused, and a request without a Host (HTTP/1.0: no
    browser sends one) is served."""
    import socket

    from attackers import read_until_closed

    server = start_server(PiperEngine(), allowed_hosts=[REBOUND])
    port = server.port
    rebound = f"{REBOUND}:{port}"
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        listed = await http.get("/v1/audio/voices", headers={"host": rebound, "origin": f"http://{rebound}"})
        assert listed.status_code == 200, listed.text
        other = await http.get("/v1/audio/voices", headers={"host": f"other.example:{port}"})
        assert other.status_code == 421
    async with connect(f"ws://{rebound}/v1/stream", host="127.0.0.1", port=port,
                       origin=f"http://{rebound}") as ws:
        assert msgpack.unpackb(await ws.recv())["type"] == "hello"
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
        assert read_until_closed(sock).startswith(b"HTTP/1.1 200")


@pytest.mark.hardening
def test_the_names_a_server_answers_to():
    """The host matcher: what no outside attacker can re-point (IP literals, localhost, single
    labels such as `vox-ws` or Starlette's `testserver`, .local/.internal names, the machine's
    own name) for a server listening elsewhere than loopback; loopback names only (localhost,
    loopback literals, the machine's name) for one listening on loopback only; `--allowed-hosts`
    names, `.domain` with its subdomains, `*` anything."""
    from vox_ws.transports.hosts import listens_on_loopback_only

    for host in ("127.0.0.1", "127.0.0.5", "::1", "[::1]", "localhost", "LOCALHOST.", "app.localhost"):
        assert listens_on_loopback_only(host), host
    for host in ("0.0.0.0", "::", "", "10.0.0.5", "::ffff:10.0.0.5", "no-such-host.invalid"):
        assert not listens_on_loopback_only(host), host
    from vox_ws.transports.hosts import AllowedHosts, host_name

    default = AllowedHosts([], own_names=["box.corp.example"])
    for host in ("localhost:8765", "app.localhost", "127.0.0.1:8765", "[::1]:8765", "10.0.0.5", "vox-ws:8765",
                 "testserver", "tv.local", "vox-ws.default.svc.cluster.local", "nas.home.arpa",
                 "api.internal", "box.corp.example:8765", "LOCALHOST.", None):
        assert default.allows(host), host
    for host in ("rebind.example:8765", "rebind.example", "evil.example.", "localhost.evil.example",
                 "box.corp.example.evil", "", "[not-an-address]"):
        assert not default.allows(host), host
    loopback = AllowedHosts([], own_names=["box"], loopback_only=True)
    for host in ("localhost:8765", "app.localhost", "127.0.0.1:8765", "127.3.2.1", "[::1]:8765", "box:8765",
                 None):
        assert loopback.allows(host), host
    for host in ("vox-ws:8765", "evil", "evil.local:8765", "nas.home.arpa", "api.internal", "10.0.0.5",
                 "[::ffff:10.0.0.5]", "0.0.0.0", "rebind.example"):
        assert not loopback.allows(host), host
    assert AllowedHosts(["evil.local"], loopback_only=True).allows("evil.local:1")
    listed = AllowedHosts(["tts.example.com", ".corp.example"], own_names=[])
    assert listed.allows("TTS.example.com:443") and listed.allows("corp.example")
    assert listed.allows("a.b.corp.example")
    assert not listed.allows("xcorp.example") and not listed.allows("tts.example.com.evil")
    assert AllowedHosts(["*"]).allows("anything.example")
    assert host_name("Example.COM.:443") == "example.com" and host_name("[::1]:80") == "[::1]"
    for bad in ("*.example.com", ".", "a/b"):
        with pytest.raises(ValueError):
            AllowedHosts([bad])


@pytest.mark.hardening
async def test_a_loopback_server_answers_no_name_a_neighbour_can_point_at_it(voxcpm_http, caplog):
    """Hardening VII, 2: single-label names (LLMNR, NetBIOS) and `.local` ones (mDNS) are
    answered by any machine on the link, so a page at `evil.local:PORT` or `evil:PORT`
    re-pointed at 127.0.0.1 was the visitor's own origin to a loopback server: it listed the
    visitor's voices, spoke one, opened the WebSocket and deleted it. A server listening on
    loopback only (the tests', as the default) now refuses them 421 at every door; on the same
    server a loopback name is served, and the voice is still there."""
    port = voxcpm_http.port
    await _named_voice(voxcpm_http.http, "neighbour-me")
    async with httpx.AsyncClient(base_url=voxcpm_http.http, timeout=60) as http:
        for name in ("evil.local", "evil", "evil.home.arpa"):
            page = {"host": f"{name}:{port}", "origin": f"http://{name}:{port}"}
            for method, path, body in (("GET", "/v1/audio/voices", None),
                                       ("POST", "/v1/audio/speech",
                                        {"input": "Hi.", "voice": "neighbour-me"}),
                                       ("DELETE", "/v1/audio/voices/neighbour-me", None)):
                refused = await http.request(method, path, headers=page, json=body)
                assert refused.status_code == 421 and name in refused.json()["error"]["message"], refused.text
            with pytest.raises(InvalidStatus) as info:
                async with connect(f"ws://{name}:{port}/v1/stream", host="127.0.0.1", port=port,
                                   origin=f"http://{name}:{port}"):
                    pass
            assert info.value.response.status_code == 421
        served = {"host": f"localhost:{port}", "origin": f"http://localhost:{port}"}
        listed = await http.get("/v1/audio/voices", headers=served)
        assert "neighbour-me" in [v["id"] for v in listed.json()["uploaded_voices"]], listed.text
        deleted = await http.delete("/v1/audio/voices/neighbour-me", headers=served)
        assert deleted.status_code == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


@pytest.mark.hardening
async def test_a_patch_nested_too_deeply_is_a_typed_400(voxcpm_http, caplog):
    """Hardening VII, 8: `PATCH /v1/voices/{name}` with 1,000 `[` was a 500 with a
    RecursionError's traceback, from any client; every JSON body is now read the same bounded
    way (`body.parse_json`): 400 `bad_request`, and the same connection's next PATCH works."""
    await _named_voice(voxcpm_http.http, "deep-me")
    async with httpx.AsyncClient(base_url=voxcpm_http.http, timeout=60) as http:
        for body in (b"[" * 1000, b"[" * 100_000 + b"]" * 100_000, b"{\"public\": " * 900):
            refused = await http.patch("/v1/voices/deep-me", content=body,
                                       headers={"content-type": "application/json"})
            assert refused.status_code in (400, 413), refused.text
            assert refused.json()["error"]["code"] in ("bad_request", "too_large"), refused.text
        nested = await http.patch("/v1/voices/deep-me", content=b"[" * 1000)
        assert nested.status_code == 400 and "nested too deeply" in nested.json()["error"]["message"]
        made = await http.patch("/v1/voices/deep-me", json={"public": False})
        assert made.status_code == 200 and made.json()["public"] is False, made.text
        await http.delete("/v1/voices/deep-me")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_a_json_body_nested_too_deeply_is_refused_whatever_the_recursion_limit():
    """The depth is counted before the parser runs (`body.nested_past`): the parser's own bound
    is the interpreter's recursion limit, which torch's compiler raises to 2,000 in the process
    it compiles in, and 1,000 `[` were then "Expecting value". Brackets inside strings (escaped
    quotes and all) are not nesting."""
    import json
    import sys

    from vox_ws.transports.body import MAX_JSON_DEPTH, BadJson, parse_json

    deepest = b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 2000))
    try:
        for body in (b"[" * 1000, b"[" + deepest + b"]", b'{"a": ' * (MAX_JSON_DEPTH + 1)):
            with pytest.raises(BadJson, match="nested too deeply"):
                parse_json(body)
    finally:
        sys.setrecursionlimit(limit)
    assert parse_json(deepest) == json.loads(deepest)
    text = '"[{' * 500 + "[" * 100
    assert parse_json(json.dumps({"input": text, "voice": [["a"]]}).encode()) == {"input": text, "voice": [["a"]]}
