"""Attacks an adversarial client made, each kept here with what must hold (issue: Hardening II)."""

from __future__ import annotations

import asyncio
import time

import msgpack
import pytest
from conftest import assert_good_stream, connect_client
from test_server_piper import SENTENCE
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from vox_ws.engines.piper import PiperEngine


async def test_frames_that_are_cheap_to_send_and_costly_to_decode_are_refused_at_once(piper_server):
    two_million_maps = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000
    wide_and_deep = msgpack.packb([[{} for _ in range(60)] for _ in range(60)])
    deep = b"\x91" * 3000 + b"\xc0"
    async with connect_client(piper_server) as c:
        for frame in (two_million_maps, wide_and_deep, deep):
            started = time.monotonic()
            await c.send(frame)
            error = await c.error()
            assert error["code"] == "bad_frame", error
        # Ten of the first kind, back to back: the session answers each and goes on serving.
        for _ in range(10):
            await c.send(two_million_maps)
        for _ in range(10):
            assert (await c.error())["code"] == "bad_frame"
        assert time.monotonic() - started < 60
        assert_good_stream(await c.speak(SENTENCE, "after"))


async def test_nul_in_text_is_a_bad_request(piper_server):
    async with connect_client(piper_server) as c:
        result = await c.speak("Hello\x00there.", "nul")
        assert result.error["code"] == "bad_request" and "NUL" in result.error["message"]
        await c.send({"type": "start", "id": "in", "stream_input": True})
        await c.recv_where(lambda m: m.get("id") == "in" and m["type"] == "start")
        await c.send({"type": "chunk", "id": "in", "text": "more\x00"})
        assert (await c.error("in"))["code"] == "bad_request"
        await c.send({"type": "cancel", "id": "in"})
        assert_good_stream(await c.speak(SENTENCE, "after"))


@pytest.fixture(scope="module")
def guarded(start_server):
    return start_server(PiperEngine(), tokens=["alpha", "beta"])


async def test_two_authorization_headers_are_refused_quietly(guarded, caplog):
    headers = [("Authorization", "Bearer alpha"), ("Authorization", "Bearer beta")]
    async with connect(guarded.url, additional_headers=headers) as ws:
        with pytest.raises(ConnectionClosed):
            await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 4001
    assert not [r for r in caplog.records if r.exc_info]
    async with connect_client(guarded, additional_headers={"Authorization": "Bearer beta"}) as c:
        assert_good_stream(await c.speak(SENTENCE, "ok"))
