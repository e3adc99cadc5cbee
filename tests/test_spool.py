"""`transports/spool.py`: whole responses held within their bounds, per owner and in all."""

from __future__ import annotations

import asyncio
import json
import logging
import threading

import httpx
import pytest

from attackers import ATTACKER, attacker_socket, speech_headers
from conftest import WAIT_TIMEOUT, wait_until
from helpers import LONG, SENTENCE
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


# A whole file of about 1 MB (1.0-1.1: Piper's noise varies its length): far more than a stopped
# reader's buffers (the server's 64 KB, its own 4 KB, the kernel's send buffer between them).
SLOWED = {"input": SENTENCE, "voice": "alloy", "response_format": "wav", "stream": False, "speed": 0.25,
          "sample_rate": 48000}


def trickle(port: int, source: str, answered: list[str], resume: threading.Event) -> tuple[int, int]:
    """A `stream: false` request whose reader takes 2 KB (the answer's head: the whole file is
    spooled, and held, by then; noted in `answered`) and then nothing until `resume` (a rate of
    zero, under any floor however fast the machine); then the rest until the server closes:
    (Content-Length, bytes of the body received)."""
    body = json.dumps(SLOWED).encode()
    with attacker_socket(port, rcvbuf=4096, source=source) as sock:
        sock.sendall(speech_headers(len(body)) + body)
        sock.settimeout(WAIT_TIMEOUT)
        received = sock.recv(2048)
        answered.append(source)
        resume.wait(WAIT_TIMEOUT)
        try:
            while piece := sock.recv(65536):
                received += piece
        except ConnectionResetError:
            pass
    head, _, content = received.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head[:200]
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    return length, len(content)


@pytest.mark.hardening
async def test_whole_responses_read_slower_than_the_floor_are_closed_and_give_their_budget_back(start_server,
                                                                                                 caplog):
    """Hardening VI, 11: two owners reading their whole files 2 KB every 4 s held the budget of
    every whole response for as long as they liked (the write stall time-out sees progress): a
    third owner got 429. Now a whole response must be taken at `whole_min_rate` bytes a second
    on average (after `write_stall_timeout_s`, the most it may bank): the stopped readers are
    closed before they have their files, their bytes are given back, and the third owner is
    served. The floor (64 KB/s, 5 s banked at most) is far under what a reader that reads at
    once takes on any machine, and the tricklers take nothing at all once started. Hardening VII,
    7: each cut also logged uvicorn's ERROR "Exception in ASGI application" with a traceback
    (`_StreamBroke`); now it is the one intended warning per cut, and no ERROR."""
    server = start_server(PiperEngine(), write_stall_timeout_s=5.0, whole_min_rate=float(64 << 10))
    budget = server.server.state.spools

    def whole(source: str) -> httpx.Response:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=WAIT_TIMEOUT) as client:
            return client.post(server.http + "/v1/audio/speech", json=SLOWED)

    size = len((await asyncio.to_thread(whole, "127.0.0.4")).content)
    assert size > 1 << 19
    await wait_until(lambda: budget.held == 0)
    budget.total = size * 5 // 2                 # two such files fit in all (lengths vary a bit), not three
    # The attack: two owners that stop reading their files.
    answered: list[str] = []
    resume = threading.Event()
    tricklers = asyncio.gather(*(asyncio.to_thread(trickle, server.port, source, answered, resume)
                                 for source in (ATTACKER, "127.0.0.3")))
    try:
        await wait_until(lambda: len(answered) == 2)                    # both files spooled and held
        await wait_until(lambda: budget.held == 0)                      # both cut, both given back
    finally:
        resume.set()
    for length, received in await tricklers:
        assert received < length, (length, received)                    # closed before the end
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len([r for r in caplog.records if "whole response taken slower" in r.getMessage()]) == 2
    # A third owner: served whole.
    served = await asyncio.to_thread(whole, "127.0.0.1")
    assert served.status_code == 200
    assert len(served.content) == int(served.headers["content-length"]) > 1 << 19
    await wait_until(lambda: budget.held == 0)


def test_a_send_clock_earns_time_by_the_bytes_taken_and_banks_at_most_its_grace():
    from vox_ws.transports.spool import SendClock

    clock = SendClock(min_rate=1000.0, grace_s=20.0, now=0.0)
    assert clock.left_s(0.0) == 20.0
    clock.taken(5000, now=1.0)                  # 5 s earned, but never over 20 s beyond now
    assert clock.deadline == 21.0
    clock.taken(100, now=15.0)                  # a trickle earns a trickle: 0.1 s
    assert clock.deadline == pytest.approx(21.1) and clock.left_s(30.0) == 0.0
    assert SendClock(min_rate=0.0, grace_s=20.0, now=0.0).left_s(1e9) is None      # no floor


@pytest.mark.parametrize("memory_bytes", [1 << 20, 100])
async def test_a_spools_rewrites_stand_over_what_was_written_in_memory_or_in_its_file(monkeypatch, memory_bytes):
    """A header that learns the file's length at the end (FLAC's STREAMINFO, WAV's sizes: the
    stream's `Ended.rewrites`) is written over what the spool holds, across its pieces, whether
    it is still in memory or in its temporary file; one outside what was written is refused."""
    from vox_ws.transports import spool as spool_module
    from vox_ws.transports.spool import Spool, SpoolBudget

    monkeypatch.setattr(spool_module, "MEMORY_BYTES", memory_bytes)
    monkeypatch.setattr(spool_module, "WRITE_BYTES", 64)
    monkeypatch.setattr(spool_module, "SEND_BYTES", 10)
    budget = SpoolBudget(per_owner=1 << 20, total=1 << 20)
    whole = Spool(budget, "a")
    written = bytes(range(256)) * 2
    for start in range(0, len(written), 50):
        await whole.write(written[start:start + 50])
    whole.rewrite(8, b"STREAMINFO")                    # across the first two pieces
    whole.rewrite(4, b"SIZE")
    whole.rewrite(len(written) - 3, b"end")            # the very end
    with pytest.raises(ValueError):
        whole.rewrite(len(written) - 2, b"past")
    sent = b"".join([piece async for piece in whole.pieces()])
    expected = bytearray(written)
    expected[8:18], expected[4:8], expected[-3:] = b"STREAMINFO", b"SIZE", b"end"
    assert sent == bytes(expected) and whole.size == len(written)
    assert budget.spilled == (memory_bytes < len(written))
    await whole.close()


@pytest.mark.hardening
async def test_a_whole_responses_floor_is_its_own_byte_rate_where_that_is_higher():
    """Hardening VII (found on the way): at the default floor (16 KiB/s) eight owners reading
    at 17 KiB/s could hold the whole 1 GiB budget for about two hours each (128 MB apiece, by
    the documented figures). A whole response must now be taken no slower than it plays: the
    floor is its own byte rate (its size over its audio's seconds) where that is higher, so
    128 MB of 48 kHz f32 (699 s of audio) is held about 12 minutes at most (its audio, plus the
    grace). The clock is driven with made-up times: nothing here waits."""
    from vox_ws.transports.spool import SendClock, Spool, SpoolBudget

    budget = SpoolBudget(per_owner=1 << 30, total=1 << 30)
    whole = Spool(budget, "a", floor=(float(16 << 10), 20.0))
    await whole.write(bytes(192_000 * 10))                            # 10 s of f32 at 48 kHz
    rate, grace = whole.send_floor(10.0)
    assert rate == 192_000 and grace == 20.0
    assert whole.send_floor(None) == (16 << 10, 20.0)                  # no figure: the configured floor
    assert whole.send_floor(1e9)[0] == 16 << 10                         # a low byte rate: the floor
    assert Spool(budget, "b", floor=(0.0, 20.0)).send_floor(10.0) == (0.0, 20.0)    # no floor stays none
    # The attack's reader, 17 KiB/s, against each floor: behind the byte rate's within a minute.
    for floor, cut in ((16 << 10, False), (rate, True)):
        clock, now, taken = SendClock(floor, grace, 0.0), 0.0, 0
        while taken < len(bytes(192_000 * 10)) and clock.left_s(now) > 0:
            now += 1.0
            taken += 17 << 10
            clock.taken(17 << 10, now)
        assert (clock.left_s(now) == 0) is cut and (not cut or now < 60), (floor, now)
    await whole.close()
