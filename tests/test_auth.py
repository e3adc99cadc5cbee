"""`transports/auth.py`: tokens (header, query, subprotocol, admin) refused before any work, and
browser origins, on a real server."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
from attackers import closed_with
from conftest import assert_good_stream, connect_client, wait_until
from test_server_piper import SENTENCE
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

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
