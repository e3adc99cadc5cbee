"""vox-ws through LiveKit Agents' own TTS API (no LiveKit server needed): `synthesize()` and
`stream()` of `vox_ws.clients.livekit.TTS` against a real vox-ws server with Piper."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from livekit.agents import tts as lk_tts
from livekit.agents.types import USERDATA_TIMED_TRANSCRIPT

from conftest import wait_idle, wait_until
from vox_ws.clients.livekit import TTS
from vox_ws.engines.piper import PiperEngine
from vox_ws.wire import Speech

pytestmark = pytest.mark.frameworks

RATE = 24_000


@pytest.fixture(scope="module")
def server(start_server):
    return start_server(PiperEngine(), slots=2)


def samples(events: list[lk_tts.SynthesizedAudio]) -> np.ndarray:
    return np.concatenate([np.frombuffer(bytes(e.frame.data), np.int16) for e in events])


async def test_synthesize_gives_frames_at_the_rate_asked_for(server):
    voice = TTS(url=server.url, sample_rate=RATE)
    try:
        events = [e async for e in voice.synthesize("LiveKit asks for the whole text at once. It streams back.")]
        assert events and all(e.frame.sample_rate == RATE and e.frame.num_channels == 1 for e in events)
        assert events[-1].is_final and not any(e.is_final for e in events[:-1])
        pcm = samples(events)
        assert 2.0 < len(pcm) / RATE < 9.0
        assert np.sqrt(np.mean((pcm / 32768.0) ** 2)) > 0.01
        # Each frame's duration is its samples at the rate (LiveKit frames progressively, <= 200 ms).
        assert all(0 < e.frame.duration <= 0.2 + 1e-6 for e in events)
        assert abs(sum(e.frame.duration for e in events) - len(pcm) / RATE) < 1e-3
        # A second request reuses the pooled connection.
        again = [e async for e in voice.synthesize("Again.")]
        assert again
        _, info = server.get("/v1/info")
        assert info["sessions"] == 1
    finally:
        await voice.aclose()


async def test_stream_speaks_pushed_text_and_a_flush_closes_the_segment(server):
    """LiveKit 1.8 streams one segment per SynthesizeStream (more are deprecated and dropped):
    text pushed token by token is spoken before the input ends, and `flush()` closes the
    segment (its final frame) as soon as its audio is out, before `end_input()`."""
    voice = TTS(url=server.url, sample_rate=16_000)
    try:
        stream = voice.stream()
        events: list[lk_tts.SynthesizedAudio] = []
        final = asyncio.Event()

        async def read() -> None:
            async for event in stream:
                events.append(event)
                if event.is_final:
                    final.set()

        reader = asyncio.create_task(read())
        for token in ("The first ", "sentence is spoken. ", "And the second ", "one waits for "):
            stream.push_text(token)
            await asyncio.sleep(0.1)
        await wait_until(lambda: events)            # audio before the flush (or this is a hang)
        stream.push_text("the flush.")
        stream.flush()
        # The segment closes (its final frame) without waiting for end_input().
        await asyncio.wait_for(final.wait(), 60)
        stream.end_input()
        await asyncio.wait_for(reader, 60)
        await stream.aclose()
        assert all(e.frame.sample_rate == 16_000 for e in events)
        assert len({e.segment_id for e in events}) == 1
        assert [e.is_final for e in events].count(True) == 1 and events[-1].is_final
        assert 2.0 < len(samples(events)) / 16_000 < 9.0
    finally:
        await voice.aclose()
    assert (await wait_idle(server))["streams_open"] == 0


async def test_word_timestamps_become_an_aligned_transcript(server):
    """Piper's true word times go to LiveKit as TimedStrings on the frames; asked of an engine
    without them, the TTS would say aligned_transcript=False instead of inventing any."""
    voice = TTS(url=server.url, sample_rate=RATE, speech=Speech(word_timestamps=True))
    text = "Aligned words for LiveKit. They follow the audio."
    try:
        events = [e async for e in voice.synthesize(text)]
        assert voice.capabilities.aligned_transcript
        timed = [w for e in events for w in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
        assert [str(w).strip() for w in timed] == text.split()
        total = sum(e.frame.duration for e in events)
        assert all(0 <= w.start_time < w.end_time <= total + 1e-3 for w in timed)
        assert all(a.end_time <= b.start_time + 1e-3 for a, b in zip(timed, timed[1:]))
    finally:
        await voice.aclose()


async def test_aclose_mid_stream_cancels_the_server_stream(server):
    voice = TTS(url=server.url, sample_rate=RATE)
    try:
        stream = voice.synthesize("A long text that keeps the server busy for a good while. " * 8)
        got = 0
        async for _ in stream:
            got += 1
            if got == 2:
                break
        _, info = server.get("/v1/info")
        assert info["streams_open"] == 1
        await stream.aclose()
        info = await wait_idle(server)
        assert info["streams_open"] == 0 and info["active"] == 0, info
        # The connection went back to the pool and serves the next request.
        assert [e async for e in voice.synthesize("Next.")]
        _, info = server.get("/v1/info")
        assert info["sessions"] == 1
    finally:
        await voice.aclose()


async def test_an_unknown_voice_is_an_api_error(server):
    voice = TTS(url=server.url, voice="nobody")
    try:
        with pytest.raises(Exception) as caught:
            async with voice.synthesize("x") as stream:
                async for _ in stream:
                    pass
        assert "nobody" in str(caught.value) or "nobody" in str(caught.value.__cause__)
    finally:
        await voice.aclose()


async def test_pronunciations_reach_the_server_and_the_transcript_keeps_the_words_sent(server):
    voice = TTS(url=server.url, sample_rate=RATE,
                speech=Speech(word_timestamps=True, pronunciations=[{"match": "New York", "say": "Noo Yawk"}]))
    try:
        events = [e async for e in voice.synthesize("I love New York.")]
        timed = [str(w).strip() for e in events for w in e.frame.userdata.get(USERDATA_TIMED_TRANSCRIPT, [])]
        assert timed == ["I", "love", "New York."]          # the phrase said by one entry is one word
    finally:
        await voice.aclose()
