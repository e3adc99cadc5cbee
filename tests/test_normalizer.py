"""`engines/voxcpm/normalizer.py`: the text normaliser runs beside the engine, in a process of
its own, and gives up on hostile text."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from helpers import drain, service_on
from vox_ws.engine import EndReason, ErrorKind, Refused
from vox_ws.engines.voxcpm.normalizer import NORMALIZE_TIMEOUT_S
from vox_ws.service import Audio, Ended, Failed, StreamRequest


@pytest.mark.hardening
async def test_normalizing_runs_beside_the_engine_and_gives_up_on_hostile_text(voxcpm_loop):
    """The service prepares texts with the server's copy of the engine's text rules (the
    engine as declared: `EngineView.text`, VoxCPM2's portable rules), whose normaliser process
    is the server's own, beside the engine's process (here its thread, behind its stand-in)."""
    service = await service_on(voxcpm_loop)
    normalizer = service.engine.text.normalizer
    # The first use starts the normaliser's process (seconds): this stream waits, no other does.
    ok = await drain(service.open_stream(StreamRequest("I have 123 apples.",
                                                       options={"normalize": True, "max_len": 3})), 120)
    assert isinstance(ok[-1], Ended) and ok[-1].reason == EndReason.MAX_LEN
    # A text that takes seconds to normalise whole is cut into pieces that each fit a
    # generation (and normalise in a fraction of a second) and spoken whole.
    many_numbers = "我有12345个苹果，还有67890个梨。" * 150
    spoken = await drain(service.open_stream(StreamRequest(many_numbers,
                                                           options={"normalize": True, "max_len": 2})), 120)
    assert isinstance(spoken[-1], Ended) and spoken[-1].reason == EndReason.MAX_LEN, spoken[-1]
    assert len(spoken[-1].stats["segments"]) > 5
    # Normalised, a text several times longer than it was (digits spelled out) is cut again
    # where it no longer fits, not refused.
    counting = "I counted 123456789 stars. " * 40
    options = {"normalize": True, "max_len": 2}
    expanded = await drain(service.open_stream(StreamRequest(counting, options=options)), 120)
    assert isinstance(expanded[-1], Ended), expanded[-1]
    assert len(expanded[-1].stats["segments"]) > len(service.engine.text.split(counting, options))
    assert any("hundred" in segment["text"] for segment in expanded[-1].stats["segments"])
    # A text the normaliser cannot read (a number of 4500 digits) is refused as such.
    unreadable = await drain(service.open_stream(StreamRequest("１２３４５" * 900,
                                                               options={"normalize": True, "max_len": 2})), 120)
    assert isinstance(unreadable[-1], Failed) and unreadable[-1].kind == ErrorKind.INVALID, unreadable[-1]

    # Normalising runs beside the engine: with the normaliser held still (SIGSTOP: as slow as
    # any text could make it), another stream keeps getting audio, step after step.
    other = service.open_stream(StreamRequest("Keep talking.", options={"max_len": 400}))
    assert isinstance(await other.__anext__(), Audio)
    normalizer.timeout_s = 3600.0              # the hold, however long it takes here, is no time-out
    os.kill(normalizer.pid, signal.SIGSTOP)
    try:
        held = service.open_stream(StreamRequest("I have 456 pears.", options={"normalize": True, "max_len": 2}))
        before = other.chunks
        while other.chunks < before + 10:
            await asyncio.wait_for(other.__anext__(), 60)
        assert held.chunks == 0 and not held.done          # still waiting on the normaliser
    finally:
        os.kill(normalizer.pid, signal.SIGCONT)
        normalizer.timeout_s = NORMALIZE_TIMEOUT_S
    events = await drain(held, 120)
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.MAX_LEN, events[-1]
    other.cancel()
    await drain(other)

    # The time-out is the backstop for any text that still takes too long: a normaliser that
    # does not answer within it is replaced, and the text refused as too large.
    normalizer.timeout_s = 0.5
    stopped = normalizer.pid
    os.kill(stopped, signal.SIGSTOP)
    try:
        with pytest.raises(Refused) as caught:
            await service.prepare_text("我有" + "１２３４５" * 900, {"normalize": True})
    finally:
        normalizer.timeout_s = NORMALIZE_TIMEOUT_S
    assert caught.value.kind == ErrorKind.TOO_LARGE and "normalize" in caught.value.message
    assert "0.5s" in caught.value.message
    assert normalizer.pid != stopped or not normalizer.alive          # the held one was killed
    again = await drain(service.open_stream(StreamRequest("I have 789 plums.",
                                                          options={"normalize": True, "max_len": 2})), 120)
    assert isinstance(again[-1], Ended) and again[-1].reason == EndReason.MAX_LEN, again[-1]
    assert normalizer.pid != stopped
    await service.close()
