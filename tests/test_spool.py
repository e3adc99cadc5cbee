"""`transports/spool.py`: whole responses held within their bounds, per owner and in all."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from attackers import ATTACKER
from conftest import WAIT_TIMEOUT, wait_until
from test_server_piper import LONG, SENTENCE

from vox_ws.engines.piper import PiperEngine


@pytest.mark.hardening
async def test_whole_responses_are_spooled_within_a_bound_per_owner(start_server, monkeypatch):
    """Hardening V, 3: `stream: false` held the whole response in memory (four requests at 48 kHz,
    speed 0.25, grew the server by 138-147 MB) with no bound. Now a whole response goes to a
    spool (here past 64 KB to a temporary file), an owner's whole responses hold at most
    `max_whole_bytes_per_owner` (over it alone: 413, and its stream stops; beside its others:
    busy), and the file is sent a piece at a time."""
    from vox_ws.transports import spool

    monkeypatch.setattr(spool, "MEMORY_BYTES", 64 << 10)
    server = start_server(PiperEngine(), max_whole_bytes_per_owner=1 << 20)
    budget = server.server.state.spools

    def whole(text: str, source: str, **fields) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=WAIT_TIMEOUT) as client:
            return client.post(server.http + "/v1/audio/speech", json={
                "input": text, "voice": "alloy", "response_format": "wav", "stream": False, **fields})

    # The attack: far over the owner's bound (a long text, slowed, at 48 kHz): refused, whole.
    refused = await asyncio.to_thread(whole, LONG, ATTACKER, speed=0.25, sample_rate=48000)
    assert refused.status_code == 413 and refused.json()["error"]["code"] == "too_large", refused.text
    assert "stream" in refused.json()["error"]["message"]
    await wait_until(lambda: server.server.service.open_streams == 0)      # its stream stopped
    assert budget.held == 0
    # A good one, past the spool's memory: served whole from its file, with its length.
    served = await asyncio.to_thread(whole, SENTENCE, ATTACKER)
    assert served.status_code == 200 and int(served.headers["content-length"]) == len(served.content) > 64 << 10
    assert served.content[:4] == b"RIFF" and budget.spilled >= 1
    await wait_until(lambda: budget.held == 0)                              # given back once sent


@pytest.mark.hardening
async def test_a_spool_budget_refuses_past_an_owner_and_past_everyone():
    from vox_ws.engine import ErrorKind, Refused
    from vox_ws.transports.spool import Spool, SpoolBudget

    budget = SpoolBudget(per_owner=100, total=150)
    first, second, other = Spool(budget, "a"), Spool(budget, "a"), Spool(budget, "b")
    await first.write(b"x" * 60)
    with pytest.raises(Refused) as beside:                    # within its own bound, not beside the first
        await second.write(b"x" * 50)
    assert beside.value.kind is ErrorKind.BUSY and beside.value.retry_after_s
    with pytest.raises(Refused) as alone:                     # over the bound on its own
        await first.write(b"x" * 41)
    assert alone.value.kind is ErrorKind.TOO_LARGE
    await other.write(b"y" * 90)
    with pytest.raises(Refused) as everyone:
        await other.write(b"y" * 10)                          # 60 + 90 + 10 > 150
    assert everyone.value.kind is ErrorKind.BUSY
    assert b"".join([piece async for piece in first.pieces()]) == b"x" * 60
    assert b"".join([piece async for piece in other.pieces()]) == b"y" * 90
    for spool in (first, second, other):
        await spool.close()
    assert budget.held == 0
