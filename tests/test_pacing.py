"""`service/pacing.py`: back-pressure and the playback clock, heard by real-time players: a
lookahead held, a reader that stops reading paused then cancelled, three-minute texts whole."""

from __future__ import annotations

import asyncio
import socket

import msgpack
import pytest
from websockets.asyncio.client import connect

from conftest import HostedEngine, assert_good_stream, connect_client, wait_until
from helpers import LONG, SENTENCE, service_on
from vox_ws.engines.piper import PiperEngine


@pytest.mark.hardening
async def test_a_lookahead_keeps_the_stream_within_it_of_a_real_time_clock(start_server):
    """Taken as fast as the consumer can: the audio handed over never runs more than
    `lookahead_s` ahead of a real-time playback clock started at the first audio (a slower
    machine only keeps it further behind)."""

    from vox_ws.service import Audio, AudioOutput, Ended, StreamRequest

    hosted = HostedEngine(PiperEngine(), slots=2)
    scheduler = hosted.proxy
    service = await service_on(scheduler)
    lookahead = 0.5
    stream = service.open_stream(StreamRequest(LONG[:240], output=AudioOutput("s16", lookahead_s=lookahead)))
    loop = asyncio.get_running_loop()
    first_at, handed = None, 0.0
    async for event in stream:
        if isinstance(event, Audio):
            now = loop.time()
            first_at = first_at if first_at is not None else now
            assert handed - (now - first_at) <= lookahead + 1e-3, (handed, now - first_at)
            handed += event.seconds
        last = event
    assert isinstance(last, Ended) and handed > 3 * lookahead
    with pytest.raises(Exception, match="'lookahead_s' must be in"):
        service.open_stream(StreamRequest(SENTENCE, output=AudioOutput("s16", lookahead_s=0.0)))
    hosted.stop()
    await service.close()


@pytest.mark.hardening
@pytest.mark.slow
async def test_a_stock_websockets_client_playing_in_real_time_hears_a_three_minute_text(start_server):
    """Players that read a chunk, play it, read the next (a phone bridge at mu-law 8 kHz, a
    speaker at s16 22,050 Hz), written with `websockets`' defaults (its own 20 s pings): with
    `lookahead_s` the server stays a few seconds ahead of them, so their pongs are never stuck
    behind a minute of audio, and they hear the whole text."""
    import msgpack
    from websockets.asyncio.client import connect

    server = start_server(PiperEngine(), slots=2)
    text = " ".join([STORY] * 15)

    async def play(fmt: str, rate: int) -> tuple[dict, float]:
        async with connect(server.url) as ws:                 # every setting its default
            await ws.recv()                                   # hello
            await ws.send(msgpack.packb({"type": "start", "id": "p", "text": text, "format": fmt,
                                         "sample_rate": rate, "lookahead_s": 2.0}))
            received = 0
            while True:
                message = msgpack.unpackb(await ws.recv())
                if message["type"] == "chunk":
                    samples = len(message["audio"]) // {"s16": 2, "mulaw": 1}[fmt]
                    received += samples
                    await asyncio.sleep(samples / rate)        # playing it
                elif message["type"] in ("end", "error"):
                    return message, received / rate

    results = await asyncio.gather(play("mulaw", 8000), play("s16", 22050))
    for end, seconds in results:
        assert end["type"] == "end" and end["reason"] == "done", end
        assert end["audio_s"] >= 170 and abs(seconds - end["audio_s"]) < 0.01, (end, seconds)


STORY = ("The harbour was quiet that morning, and the boats rocked gently against the pier. "
         "An old fisherman mended his nets, humming a song his father had taught him, while gulls "
         "circled overhead and the tide crept slowly back toward the sea wall.")


# The paced readers' clock runs this much faster than real time, and the server's keepalive
# and stall time-outs are shorter by as much: the same scenario as a three-minute text played at
# 1x against the defaults' 10 s / 20 s pings, in a quarter of the time.
PLAYBACK_SPEEDUP = 4.0


@pytest.mark.hardening
@pytest.mark.slow
async def test_paced_readers_get_a_three_minute_text_whole(start_server):
    """Clients that play as they read (a phone bridge at mulaw 8 kHz, a player at s16 22 kHz):
    a chunk, a sleep of its duration, the next. Audio waits in the server until they read it;
    neither the stall timer nor the keepalive may cut them off."""
    server = start_server(PiperEngine(), ping_interval=10.0 / PLAYBACK_SPEEDUP,
                          ping_timeout=20.0 / PLAYBACK_SPEEDUP, write_stall_timeout_s=20.0 / PLAYBACK_SPEEDUP)
    text = " ".join([STORY] * 15)

    async def paced(fmt: str, rate: int) -> tuple[dict, float]:
        async with connect(server.url, max_size=None, ping_interval=None) as ws:
            await ws.recv()                                   # hello
            await ws.send(msgpack.packb({"type": "start", "id": "p", "text": text, "format": fmt,
                                         "sample_rate": rate}))
            received = 0
            while True:
                message = msgpack.unpackb(await asyncio.wait_for(ws.recv(), 60))
                if message["type"] == "chunk":
                    samples = len(message["audio"]) // {"s16": 2, "mulaw": 1}[fmt]
                    received += samples
                    await asyncio.sleep(samples / rate / PLAYBACK_SPEEDUP)
                elif message["type"] in ("end", "error"):
                    return message, received / rate

    results = await asyncio.gather(paced("mulaw", 8000), paced("s16", 22050))
    for end, seconds in results:
        assert end["type"] == "end" and end["reason"] == "done", end
        assert end["audio_s"] >= 170 and abs(seconds - end["audio_s"]) < 0.01, (end, seconds)


@pytest.mark.hardening
async def test_slow_reader_is_paused_then_cancelled_and_never_delays_others(start_server):
    # The slow client reads nothing until the end, so it cannot answer pings either: the
    # keepalive (not what is tested here) must outlast the scenario, which on a loaded machine
    # took longer than the fixtures' 10 s ping time-out and was then cut as it should be.
    server = start_server(PiperEngine(), max_buffered_audio_s=1.0, write_stall_timeout_s=1.5, slots=4,
                          ping_interval=60.0, ping_timeout=120.0)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    async with connect(server.url, sock=sock, max_queue=1, max_size=None) as slow:
        await slow.recv()                                                   # hello
        await slow.send(msgpack.packb({"type": "start", "id": "slow", "text": LONG * 3}))
        # Meanwhile another client is served, whole.
        async with connect_client(server) as fast:
            result = await fast.speak(LONG[:300], "fast")
        assert_good_stream(result, 3.0)
        # The stalled stream stops holding its slot.
        await wait_until(lambda: server.devices.stats()["active"] == 0)
        # When the slow client finally reads, the stream ended with slow_consumer.
        seen = []
        while True:
            message = msgpack.unpackb(await asyncio.wait_for(slow.recv(), 20))
            seen.append(message["type"])
            if message["type"] in ("end", "error"):
                break
        assert message["type"] == "error" and message["code"] == "slow_consumer" and message["retryable"]
        assert seen.count("chunk") >= 1
        await slow.send(msgpack.packb({"type": "start", "id": "again", "text": "Reading now."}))
        kinds = []
        while "end" not in kinds:
            kinds.append(msgpack.unpackb(await asyncio.wait_for(slow.recv(), 30))["type"])
