"""`transports/auth.py`: tokens (header, query, subprotocol, admin) refused before any work, and
browser origins, on a real server."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from attackers import ATTACKER, closed_with
from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from helpers import SENTENCE, wav
from vox_ws.engines.piper import PiperEngine


@pytest.fixture(scope="module")
def guarded(start_server):
    return start_server(PiperEngine(), tokens=["alpha", "beta"], admin_tokens=["root"],
                        allow_origins=["https://app.example"])


@pytest.mark.hardening
async def test_two_authorization_headers_are_refused_quietly(guarded, caplog):
    headers = [("Authorization", "Bearer alpha"), ("Authorization", "Bearer beta")]
    async with connect(guarded.url, additional_headers=headers) as ws:
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 4001
    assert not [r for r in caplog.records if r.exc_info]
    async with connect_client(guarded, additional_headers={"Authorization": "Bearer beta"}) as c:
        assert_good_stream(await c.speak(SENTENCE, "ok"))


@pytest.mark.hardening
async def test_connections_without_a_valid_token_are_refused_before_any_work(guarded):
    await wait_until(lambda: not guarded.server.sessions)       # the module's earlier clients have gone
    steps = guarded.devices.stats()["steps_total"]
    reason = await closed_with(guarded, 4001)
    assert "unauthorized" in reason
    await closed_with(guarded, 4001, additional_headers={"Authorization": "Bearer wrong"})
    await closed_with(guarded, 4001, url=guarded.url + "?token=alph")
    assert guarded.devices.stats()["steps_total"] == steps and not guarded.server.sessions


@pytest.mark.hardening
async def test_a_token_as_a_subprotocol_is_taken_and_a_malformed_one_is_no_token(guarded):
    """What the demo sends: subprotocols `vox-ws` and `vox-ws.bearer.<base64url(token)>`. Not
    base64, not UTF-8 or a wrong token: refused 4001 like no token; then the right one is
    served on the same server, its subprotocol answered."""
    import base64

    def bearer(raw: bytes) -> str:
        return "vox-ws.bearer." + base64.urlsafe_b64encode(raw).decode().rstrip("=")

    for offered in (["vox-ws", "vox-ws.bearer.a"], ["vox-ws", bearer(b"\xff\xfe")],
                    ["vox-ws", bearer(b"alph")], ["vox-ws.bearer."]):
        await closed_with(guarded, 4001, subprotocols=offered)
    async with connect(guarded.url, subprotocols=["vox-ws", bearer(b"alpha")]) as ws:
        assert ws.subprotocol == "vox-ws"
        assert msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10))["type"] == "hello"
    async with connect_client(guarded, additional_headers={"Authorization": "Bearer alpha"}) as c:
        assert_good_stream(await c.speak("Still served.", "a"))


@pytest.mark.hardening
async def test_offered_subprotocols_are_read_once_and_bounded(guarded, monkeypatch):
    """Hardening V, 11: offered `vox-ws.bearer.*` subprotocols cost the event loop 10-18x what as
    many ordinary header bytes did (every rule decoded every one again). They are parsed once a
    request, none taken past 8 of them or 4 KiB: a token among 60 offered is no token, and each
    bearer of a handshake is decoded at most once."""
    import base64

    from vox_ws.transports import auth

    decoded: list[str] = []
    unbase64 = auth._unbase64
    monkeypatch.setattr(auth, "_unbase64", lambda text: decoded.append(text) or unbase64(text))
    good = "vox-ws.bearer." + base64.urlsafe_b64encode(b"alpha").decode().rstrip("=")
    many = [f"vox-ws.bearer.{n:x}" for n in range(60)] + [good]
    await closed_with(guarded, 4001, subprotocols=["vox-ws", *many])
    assert decoded == []                                         # past the bound: not one decoded
    async with connect(guarded.url, subprotocols=["vox-ws", good]) as ws:
        assert msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10))["type"] == "hello"
    assert decoded == [good[len("vox-ws.bearer."):]]             # once, for every rule that asked


@pytest.mark.hardening
async def test_a_query_string_is_scanned_for_its_token_never_parsed_whole(guarded, monkeypatch):
    """Hardening VI, 8: the token was read by parsing the whole query string (up to 64 KB:
    25-31 ms of the event loop a request, before its 401). Now `token=` is found by a scan of
    the raw string and only its value is decoded: from 4 connections at once, 64 KB queries
    without a token are refused 401 and one with its token after them is served, and no
    query is parsed; past 8 `token=` keys none is taken. Then a good request is served."""
    import starlette.datastructures

    from vox_ws.transports.auth import query_tokens

    parsed: list[int] = []                # what the query parser (QueryParams) was given, by length
    parse_qsl = starlette.datastructures.parse_qsl

    def spied(query: str, *args, **kwargs):
        parsed.append(len(query))
        return parse_qsl(query, *args, **kwargs)
    monkeypatch.setattr(starlette.datastructures, "parse_qsl", spied)
    junk = "a=1&" * 16000                                                  # 64,000 bytes of parameters

    def speech(query: str) -> httpx.Response:
        attacker = httpx.HTTPTransport(local_address=ATTACKER)
        with httpx.Client(transport=attacker, timeout=WAIT_TIMEOUT) as http:
            return http.post(guarded.http + "/v1/audio/speech?" + query,
                             json={"input": "Hello.", "response_format": "pcm"})

    refused = await asyncio.gather(*(asyncio.to_thread(speech, junk + "b=2") for _ in range(4)))
    assert [r.status_code for r in refused] == [401] * 4
    served = await asyncio.to_thread(speech, junk + "token=alpha")
    assert served.status_code == 200 and len(served.content) > 4800, served.text[:300]
    assert (await asyncio.to_thread(speech, "token=x&" * 8 + "token=alpha")).status_code == 401
    assert parsed == []
    # Decoded as a parsed query's values are; a key is `token` as spelled, after `&` or first.
    assert query_tokens(b"xtoken=no&token=a%2Bb+c&tok%65n=no&token=&token") == ["a+b c", ""]
    assert query_tokens(b"token=" + b"t" * 4097) == [] and query_tokens(b"token=%FF") == ["\ufffd"]
    async with connect_client(guarded, additional_headers={"Authorization": "Bearer alpha"}) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


@pytest.mark.hardening
async def test_an_offer_of_subprotocols_past_the_bounds_never_reaches_websockets_parser(guarded, monkeypatch):
    """Hardening VI, 18: websockets' `accept` parsed every offered subprotocol before vox-ws's
    bounded read saw the offer (a 960 KB offer of one-letter subprotocols: over 500 ms of the
    event loop). An offer past 8 subprotocols or 4 KiB is now dropped from the handshake first:
    websockets' parser never sees it, the handshake is answered without a subprotocol, and the
    token in it is not taken (4001). A browser's offer is parsed and answered as before."""
    import base64

    import websockets.server

    parsed: list[int] = []                # what websockets' subprotocol parser was given, by length
    parse_subprotocol = websockets.server.parse_subprotocol
    monkeypatch.setattr(websockets.server, "parse_subprotocol",
                        lambda header: parsed.append(len(header)) or parse_subprotocol(header))
    good = "vox-ws.bearer." + base64.urlsafe_b64encode(b"alpha").decode().rstrip("=")
    lines = [f"vox-ws, {good}"] + [",".join(["a"] * 3999)] * 119          # 952 KB in 120 header lines
    for offer in (lines, [", ".join(["vox-ws", good] + [f"p{n}" for n in range(7)])]):   # 4 KiB; 9 of them
        headers = [("Sec-WebSocket-Protocol", line) for line in offer]
        async with connect(guarded.url, additional_headers=headers) as ws:
            assert ws.subprotocol is None and ws.response.headers.get("Sec-WebSocket-Protocol") is None
            with pytest.raises(ConnectionClosed):
                await asyncio.wait_for(ws.recv(), 10)
            assert ws.close_code == 4001, (ws.close_code, ws.close_reason)
    assert parsed == []
    async with connect(guarded.url, subprotocols=["vox-ws", good]) as ws:
        assert ws.subprotocol == "vox-ws"
        assert msgpack.unpackb(await asyncio.wait_for(ws.recv(), 10))["type"] == "hello"
    assert parsed == [len(f"vox-ws, {good}")]


@pytest.mark.hardening
@pytest.mark.parametrize("how", ["header", "query", "second", "admin"])
async def test_valid_tokens_by_header_or_query(guarded, how):
    kwargs = {
        "header": {"additional_headers": {"Authorization": "Bearer alpha"}},
        "second": {"additional_headers": {"Authorization": "Bearer beta"}},
        "admin": {"additional_headers": {"Authorization": "Bearer root"}},
        "query": {},
    }[how]
    server = guarded
    if how == "query":
        class Q:
            url = guarded.url + "?token=alpha"
        server = Q()
    async with connect_client(server, **kwargs) as c:
        assert c.hello["type"] == "hello"
        assert_good_stream(await c.speak("Authorized.", "a"))


@pytest.mark.hardening
async def test_browser_origins_are_checked(guarded):
    headers = {"Authorization": "Bearer alpha"}
    with pytest.raises(InvalidStatus) as info:
        async with connect(guarded.url, origin="https://evil.example", additional_headers=headers):
            pass
    assert info.value.response.status_code == 403
    async with connect(guarded.url, origin="https://app.example", additional_headers=headers) as ws:
        assert msgpack.unpackb(await ws.recv())["type"] == "hello"


EVIL_PAGE = "http://evil.example"


def _cloning_server(start_server, tiny_model, **overrides):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    return start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1), slots=1,
                        max_voice_audio_s=5.0, **overrides)


def _register_named(server, name: str, headers: dict[str, str] | None = None) -> str:
    made = httpx.post(server.http + "/v1/voices", params={"name": name}, content=wav(1.0),
                      headers={"content-type": "audio/wav", **(headers or {})}, timeout=60)
    assert made.status_code == 201, made.text
    return made.json()["voice"]


async def _voice_delete(client, voice: str) -> bool:
    await client.send({"type": "voice_delete", "id": "del", "voice": voice})
    return (await client.recv_where(lambda m: m.get("id") == "del"))["deleted"]


@pytest.mark.hardening
async def test_a_page_of_another_origin_cannot_open_the_stream_as_its_visitor(start_server, tiny_model,
                                                                              caplog):
    """Hardening VI, 1: a browser opens a WebSocket to any origin without a preflight, and the
    handshake let every origin through: a page on any site opened /v1/stream as its visitor (by
    address), spoke the visitor's named voice "me" (61,440 bytes of audio) and deleted it with
    `voice_delete`. The handshake from a page of another origin is refused 403 (the HTTP
    refusal's typed error) and "me" is untouched; the server's own page and a client without an
    Origin still speak it."""
    server = _cloning_server(start_server, tiny_model)
    mine = _register_named(server, "me")
    with pytest.raises(InvalidStatus) as info:
        async with connect(server.url, origin=EVIL_PAGE):
            pass
    refused = info.value.response
    assert refused.status_code == 403, refused
    error = json.loads(refused.body)["error"]
    assert error["code"] == "unauthorized" and "origin not allowed" in error["message"], error
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]      # an answer, not a failure
    async with connect_client(server, origin=server.http) as c:          # the server's own page
        spoken = await c.speak("Hello.", "own", voice="me", options={"max_len": 3})
        assert spoken.end["reason"] == "max_len" and spoken.pcm().size > 0
    async with connect_client(server) as c:                               # no Origin: not a browser
        spoken = await c.speak("Hello.", "plain", voice=mine, options={"max_len": 3})
        assert spoken.end["reason"] == "max_len"
        assert await _voice_delete(c, "me") is True


@pytest.mark.hardening
async def test_with_cors_for_any_page_a_page_without_a_token_reaches_none_of_its_visitors_voices(start_server,
                                                                                               tiny_model):
    """Hardening VI, 1 with `--cors-origins '*'`: the handshake of any page is taken (what '*'
    is for), but a page of another origin without a token is its own owner (its visitor's
    address and its origin), never its visitor: over the WebSocket and HTTP alike it cannot
    speak, list or delete the visitor's "me" (by name or id); it still speaks the server's
    voices, and a voice it registers (even named "me") is its own."""
    server = _cloning_server(start_server, tiny_model, cors_origins=["*"])
    mine = _register_named(server, "me")
    async with connect_client(server, origin=EVIL_PAGE) as c:
        for voice in ("me", mine):
            stolen = await c.speak("Hello.", f"steal-{voice}", voice=voice, options={"max_len": 3})
            assert stolen.error is not None and stolen.error["code"] == "bad_request", stolen.error
            assert not stolen.chunks
            assert await _voice_delete(c, voice) is False
        assert (await c.speak("Hello.", "builtin", options={"max_len": 3})).end["reason"] == "max_len"
    async with httpx.AsyncClient(base_url=server.http, headers={"origin": EVIL_PAGE}, timeout=60) as page:
        listed = (await page.get("/v1/audio/voices")).json()
        assert listed["uploaded_voices"] == [] and all(v["kind"] != "uploaded" for v in listed["voices"])
        spoken = await page.post("/v1/audio/speech",
                                 json={"input": "Hi.", "voice": "me", "response_format": "pcm"})
        assert spoken.status_code == 400 and spoken.json()["error"]["code"] == "voice_not_found", spoken.text
        assert (await page.delete("/v1/audio/voices/me")).status_code == 404
        assert (await page.delete(f"/v1/voices/{mine}")).status_code == 404
    theirs = _register_named(server, "me", headers={"origin": EVIL_PAGE})
    assert theirs != mine
    async with connect_client(server, origin=EVIL_PAGE) as c:
        assert await _voice_delete(c, "me") is True                       # its own "me"
    async with connect_client(server) as c:                               # the visitor's, untouched
        spoken = await c.speak("Hello.", "visitor", voice="me", options={"max_len": 3})
        assert spoken.end["reason"] == "max_len"
    listed = httpx.get(server.http + "/v1/audio/voices", timeout=60).json()["uploaded_voices"]
    assert [v["name"] for v in listed] == ["me"]


def test_a_page_owner_is_its_visitors_network_for_the_stores_shares():
    """A page of another origin is an owner of its own, but its voices count in its visitor's
    network's share of the store (and are an owner's without a token: they expire)."""
    from vox_ws.service.voices.store import is_anonymous, network_key
    from vox_ws.transports.auth import address_owner, page_owner

    visitor = address_owner("192.0.2.7", 64)
    page = page_owner(visitor, EVIL_PAGE)
    assert page != visitor and page != page_owner(visitor, "https://other.example") and is_anonymous(page)
    assert network_key(page) == network_key(visitor) == network_key(address_owner("192.0.2.99", 64))
    assert network_key(page_owner(address_owner("2001:db8:1:2::1", 64), EVIL_PAGE)) == \
        network_key(address_owner("2001:db8:1:9::1", 64))
    from vox_ws.service.voices.store import is_opaque_page, keyed_under, owner_key

    assert keyed_under(owner_key(page), owner_key(visitor))
    assert not keyed_under(owner_key(visitor), owner_key(page))
    assert not keyed_under(owner_key(page), owner_key(address_owner("192.0.2.8", 64)))
    assert is_opaque_page(page_owner(visitor, "null")) and is_opaque_page(page_owner(visitor, None))
    assert not is_opaque_page(page)


@pytest.mark.hardening
async def test_a_page_of_another_origin_publishes_nothing_without_a_token(start_server, tiny_model):
    """Hardening VII, 3: under `--cors-origins '*'` a drive-by page without a token (an owner of
    its own) registered a public voice, "Call 555-0100 for support", which every user's list
    then showed and spoke; the admin's deletion by the visitor's address missed it. Publishing
    from such a page (registering public, PATCH, `voice_update`) is now refused `bad_request`
    (field `public`), its private voices stay its own, and the admin's deletion by address
    takes them too. A client of the server's own (no Origin) still publishes."""
    server = _cloning_server(start_server, tiny_model, cors_origins=["*"], admin_tokens=["root"])
    spam = "Call 555-0100 for support"
    page = {"origin": EVIL_PAGE}
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        published = await http.post("/v1/voices", params={"name": spam, "public": "true"}, content=wav(1.0),
                                    headers={"content-type": "audio/wav", **page})
        assert published.status_code == 400, published.text
        assert "token" in published.json()["error"]["message"], published.text
        private = await http.post("/v1/voices", params={"name": spam}, content=wav(1.0),
                                  headers={"content-type": "audio/wav", **page})
        assert private.status_code == 201, private.text
        patched = await http.patch(f"/v1/audio/voices/{spam}", json={"public": True}, headers=page)
        assert patched.status_code == 400 and patched.json()["error"]["code"] == "bad_request", patched.text
    async with connect_client(server, origin=EVIL_PAGE) as c:
        await c.send({"type": "voice_update", "id": "up", "voice": spam, "public": True})
        refused = await c.recv_where(lambda m: m.get("id") == "up")
        assert refused["type"] == "error" and refused["code"] == "bad_request", refused
        await c.send({"type": "voice", "id": "reg", "audio": wav(1.0), "name": "Other spam", "public": True})
        refused = await c.recv_where(lambda m: m.get("id") == "reg")
        assert refused["type"] == "error" and "token" in refused["message"], refused
        spoken = await c.speak("Hello.", "own", voice=spam, options={"max_len": 3})    # its own, privately
        assert spoken.end["reason"] == "max_len"
    everyone = httpx.get(server.http + "/v1/audio/voices", timeout=60).json()["voices"]
    assert not [v for v in everyone if v["kind"] == "public"], everyone
    admin = {"authorization": "Bearer root"}
    swept = httpx.delete(server.http + "/v1/admin/voices", params={"address": "127.0.0.1"}, headers=admin)
    assert swept.status_code == 200 and private.json()["voice"] in swept.json()["deleted"], swept.text
    good = httpx.post(server.http + "/v1/voices", params={"name": "Narrator", "public": "true"},
                      content=wav(1.0), headers={"content-type": "audio/wav"}, timeout=60)
    assert good.status_code == 201 and good.json()["public"] is True, good.text


@pytest.mark.hardening
async def test_a_page_with_an_opaque_origin_is_no_owner(start_server, tiny_model):
    """Hardening VII (found on the way): under `--cors-origins '*'` every sandboxed frame and
    `file:` page of every site sends `Origin: null`, and was one page owner per address: any of
    them used the voices another registered. Such a page registers nothing now (`bad_request`,
    over HTTP and v1), so there is nothing of another's to reach; it still speaks the server's
    voices, and the same connection's next good request is served."""
    server = _cloning_server(start_server, tiny_model, cors_origins=["*"])
    refused = httpx.post(server.http + "/v1/voices", params={"name": "sandboxed"}, content=wav(1.0),
                         headers={"content-type": "audio/wav", "origin": "null"}, timeout=60)
    assert refused.status_code == 400 and "Origin: null" in refused.json()["error"]["message"], refused.text
    async with connect_client(server, origin="null") as c:
        await c.send({"type": "voice", "id": "reg", "audio": wav(1.0), "name": "sandboxed"})
        answer = await c.recv_where(lambda m: m.get("id") == "reg")
        assert answer["type"] == "error" and answer["code"] == "bad_request", answer
        assert (await c.speak("Hello.", "builtin", options={"max_len": 3})).end["reason"] == "max_len"
    listed = httpx.get(server.http + "/v1/audio/voices", headers={"origin": "null"}, timeout=60)
    assert listed.status_code == 200 and listed.json()["uploaded_voices"] == []
