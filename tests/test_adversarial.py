"""Attacks an adversarial client made, each kept here with what must hold (issue: Hardening II)."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request

import msgpack
import numpy as np
import pytest
import soundfile
from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from test_hostile_doors import read_until_closed
from test_server_piper import LONG, SENTENCE
from test_engine_loop import HeldTone
from test_stream_service import audio_of, drain, loaded_scheduler, service_on, tone_wav
from websockets.asyncio.client import connect
from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Close, Opcode
from websockets.uri import parse_uri

from vox_ws.engine import EndReason, ErrorKind, Refused
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.voxcpm.normalizer import NORMALIZE_TIMEOUT_S
from vox_ws.scheduling.loop import EngineLoop
from vox_ws.service import ANY_OWNER, Audio, Ended, Failed, StreamRequest
from vox_ws.transports.connections import WRITE_BUFFER_HIGH

pytestmark = pytest.mark.hardening

STORY = ("The harbour was quiet that morning, and the boats rocked gently against the pier. "
         "An old fisherman mended his nets, humming a song his father had taught him, while gulls "
         "circled overhead and the tide crept slowly back toward the sea wall.")


async def test_frames_that_are_cheap_to_send_and_costly_to_decode_are_refused_at_once(piper_server):
    two_million_maps = b"\xdd" + (2_000_000).to_bytes(4, "big") + b"\x80" * 2_000_000
    wide_and_deep = msgpack.packb([[{} for _ in range(60)] for _ in range(60)])
    deep = b"\x91" * 3000 + b"\xc0"
    async with connect_client(piper_server) as c:
        for frame in (two_million_maps, wide_and_deep, deep):
            await c.send(frame)
            error = await c.error()
            assert error["code"] == "bad_frame", error
        # Ten of the first kind, back to back: the session answers each and goes on serving.
        for _ in range(10):
            await c.send(two_million_maps)
        for _ in range(10):
            assert (await c.error())["code"] == "bad_frame"
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


# ------------------------------------------------------------------ pings and paced readers


def _paused_writers(server) -> list:
    """The server's WebSocket connections whose writes wait on a client that reads nothing."""
    from vox_ws.transports.connections import WebSocketProtocol

    return [c for c in server.server._uvicorn.server_state.connections
            if isinstance(c, WebSocketProtocol) and not c.writable.is_set()]


def _raw_websocket(port: int) -> tuple[socket.socket, ClientProtocol]:
    """A WebSocket opened by hand, for a client that writes frames and never reads."""
    sock = socket.create_connection(("127.0.0.1", port))
    proto = ClientProtocol(parse_uri(f"ws://127.0.0.1:{port}/v1/stream"))
    proto.send_request(proto.connect())
    sock.sendall(b"".join(proto.data_to_send()))
    received = b""
    while b"\r\n\r\n" not in received:
        received += sock.recv(4096)
    proto.receive_data(received)
    return sock, proto


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def test_a_ping_flood_is_closed_as_a_message_flood_and_costs_no_memory(piper_server):
    def flood() -> tuple[int, int | None]:
        sock, proto = _raw_websocket(piper_server.port)
        proto.send_ping(b"p" * 125)
        ping = b"".join(proto.data_to_send())
        sock.settimeout(3.0)
        sent = 0
        try:
            while sent < 2_000_000:             # 250 MB of pings if nothing stopped them
                sock.sendall(ping * 100)
                sent += 100
        except OSError:                          # the server stopped reading, or closed
            pass
        code = None
        try:
            while code is None:
                data = sock.recv(65536)
                if not data:
                    break
                proto.receive_data(data)
                for event in proto.events_received():
                    if getattr(event, "opcode", None) == Opcode.CLOSE:
                        code = Close.parse(event.data).code
        except OSError:
            pass
        sock.close()
        return sent, code

    before = _rss_mb()
    sent, code = await asyncio.to_thread(flood)
    assert code == 1008                          # closed as a flood, and told so
    assert sent < 2_000_000
    assert _rss_mb() - before < 50
    async with connect_client(piper_server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


async def test_pings_while_not_reading_leave_one_pong_owed(start_server):
    """Pings within the rate from a client that reads nothing: what waits to be sent stays
    bounded (pongs are not queued one by one), and the client is answered once it reads."""
    server = start_server(PiperEngine(), max_messages_per_s=2000.0, ping_interval=60.0, ping_timeout=120.0)
    sock, proto = _raw_websocket(server.port)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    proto.send_ping(b"p" * 125)
    ping = b"".join(proto.data_to_send())
    for _ in range(40):                           # 16,000 pings: 2 MB of pongs if all were queued
        await asyncio.to_thread(sock.sendall, ping * 400)
        await asyncio.sleep(0.2)
    connections = [c for c in server.server._uvicorn.server_state.connections if hasattr(c, "conn")]
    assert len(connections) == 1 and not connections[0].transport.is_closing()
    assert connections[0].transport.get_write_buffer_size() <= WRITE_BUFFER_HIGH + 256
    # Reading now, the client gets pongs again, and the connection still serves.
    sock.settimeout(2.0)
    pongs = 0
    try:
        while True:
            proto.receive_data(await asyncio.to_thread(sock.recv, 65536))
            pongs += sum(1 for e in proto.events_received() if getattr(e, "opcode", None) == Opcode.PONG)
    except TimeoutError:
        pass
    assert 1 <= pongs < 16_000 // 10
    sock.close()


# The paced readers' clock runs this much faster than real time, and the server's keepalive
# and stall time-outs are shorter by as much: the same scenario as a three-minute text played at
# 1x against the defaults' 10 s / 20 s pings, in a quarter of the time.
PLAYBACK_SPEEDUP = 4.0


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


# ------------------------------------------------------------------ voice uploads


def _flac_bomb(seconds: int, channels: int = 8, rate: int = 48000, declare_length: bool = True) -> bytes:
    """Silence in FLAC: a few bytes a second, whatever the channels (the attack's file)."""
    buf = io.BytesIO()
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as f:
        block = np.zeros((rate, channels), dtype=np.int16)
        for _ in range(seconds):
            f.write(block)
    data = bytearray(buf.getvalue())
    if not declare_length:
        # STREAMINFO's 36-bit total sample count (file bytes 21.5-25) set to 0: "unknown".
        data[21] &= 0xF0
        data[22:26] = b"\0\0\0\0"
    return bytes(data)


@pytest.fixture(scope="module")
def voxcpm_service_scheduler(tiny_model):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    scheduler = loaded_scheduler(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2)
    yield scheduler
    scheduler.stop()


@pytest.mark.parametrize("declare_length", [True, False])
async def test_a_flac_bomb_is_refused_without_decoding_it_whole(voxcpm_service_scheduler, declare_length):
    bomb = _flac_bomb(600, declare_length=declare_length)        # 600 s x 8 channels: 880 MB as float32
    assert len(bomb) < 2 << 20
    service = await service_on(voxcpm_service_scheduler)
    before = _rss_mb()
    # Several at once, as the attack did (from four owners: one may have only two waiting):
    # they are decoded one at a time.
    results = await asyncio.gather(*(service.voices.register(bomb, owner=f"token:{n}") for n in range(4)),
                                   return_exceptions=True)
    assert all(isinstance(r, Refused) and r.kind == ErrorKind.TOO_LARGE for r in results), results
    assert _rss_mb() - before < 150
    await service.close()


async def test_voice_audio_outside_the_accepted_rates_and_channels_is_invalid(voxcpm_service_scheduler):
    service = await service_on(voxcpm_service_scheduler)
    for rate, channels in ((1_000_000, 1), (4000, 1), (16000, 9)):
        buf = io.BytesIO()
        soundfile.write(buf, np.zeros((rate // 2, channels), np.float32), rate, format="WAV")
        with pytest.raises(Refused) as info:
            await service.voices.register(buf.getvalue())
        assert info.value.kind == ErrorKind.INVALID, (rate, channels, info.value.message)
    await service.close()


# ------------------------------------------------------------------ voices belong to their owner


async def test_voices_belong_to_their_owner_and_no_one_evicts_another(voxcpm_service_scheduler):
    service = await service_on(voxcpm_service_scheduler, max_voices=4, max_voices_per_owner=2)
    alice = [(await service.voices.register(tone_wav(0.5, pitch=200 + n), owner="token:alice"))["voice"]
             for n in range(3)]
    bob = (await service.voices.register(tone_wav(0.5), owner="token:bob"))["voice"]
    # Alice's third retired her first, nobody else's.
    with pytest.raises(Refused):
        service.open_stream(StreamRequest("Hi.", voice=alice[0]))
    for voice in alice[1:] + [bob]:
        service.open_stream(StreamRequest("Hi.", voice=voice, options={"max_len": 1})).cancel()
    # Bob cannot delete Alice's voice (it looks like no voice at all); Alice and an admin can.
    assert await service.voices.delete(alice[1], owner="token:bob") is False
    assert await service.voices.delete(alice[1], owner="token:alice") is True
    assert await service.voices.delete(alice[2], owner=ANY_OWNER) is True
    # A full server refuses new owners' voices rather than dropping someone's.
    others = {name: (await service.voices.register(tone_wav(0.5), owner=f"token:{name}"))["voice"]
              for name in ("carol", "dave", "erin")}
    with pytest.raises(Refused) as info:
        await service.voices.register(tone_wav(0.5), owner="token:frank")
    # The same audio from the same owner is the same voice (no new one, even when full); the
    # same audio from another owner is another voice.
    assert (await service.voices.register(tone_wav(0.5), owner="token:erin"))["voice"] == others["erin"]
    assert len(set(others.values()) | {bob}) == 4
    assert info.value.kind == ErrorKind.BUSY
    service.open_stream(StreamRequest("Hi.", voice=bob, options={"max_len": 1})).cancel()
    await service.close()


async def test_a_queued_stream_keeps_its_voice_when_the_voice_is_deleted(voxcpm_service_scheduler):
    service = await service_on(voxcpm_service_scheduler)
    voice = (await service.voices.register(tone_wav(1.0), "A short reference.", owner="token:a"))["voice"]
    options = {"max_len": 4, "seed": 7}
    with_voice = audio_of(await drain(service.open_stream(StreamRequest("Hello there.", voice=voice,
                                                                         options=options))), "f32")
    default = audio_of(await drain(service.open_stream(StreamRequest("Hello there.", options=options))), "f32")
    # Both slots busy: the next stream waits in the queue, and its voice is deleted meanwhile.
    blockers = [service.open_stream(StreamRequest("Hold the slot.", options={"max_len": 2000})) for _ in range(2)]
    for blocker in blockers:
        assert isinstance(await blocker.__anext__(), Audio)
    queued = service.open_stream(StreamRequest("Hello there.", voice=voice, options=options))
    assert queued.queued
    assert await service.voices.delete(voice, owner="token:a") is True
    for blocker in blockers:
        blocker.cancel()
    events = await drain(queued)
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.MAX_LEN
    audio = audio_of(events, "f32")
    assert np.max(np.abs(audio - with_voice)) < 1e-4
    assert np.max(np.abs(audio - default)) > 1e-3      # the tiny random model barely hears voices
    await service.close()


async def test_another_token_cannot_delete_a_voice_over_the_wire(start_server, tiny_model):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), tokens=["alpha", "beta"])
    async with connect_client(server, additional_headers={"Authorization": "Bearer alpha"}) as alpha:
        await alpha.send({"type": "voice", "id": "r", "audio": tone_wav(0.5)})
        voice = (await alpha.recv_where(lambda m: m.get("id") == "r"))["voice"]
        async with connect_client(server, additional_headers={"Authorization": "Bearer beta"}) as beta:
            await beta.send({"type": "voice_delete", "id": "d", "voice": voice})
            assert (await beta.recv_where(lambda m: m.get("id") == "d"))["deleted"] is False
        status, _ = _delete(server, voice, "beta")
        assert status == 404
        await alpha.send({"type": "voice_delete", "id": "d", "voice": voice})
        assert (await alpha.recv_where(lambda m: m.get("id") == "d"))["deleted"] is True


def _delete(server, voice: str, token: str) -> tuple[int, bytes]:
    request = urllib.request.Request(f"{server.http}/v1/voices/{voice}", method="DELETE",
                                     headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


# ------------------------------------------------------------------ fair slots, bounded waits


async def test_a_client_holding_every_slot_gives_one_back_to_a_newcomer():
    scheduler = loaded_scheduler(PiperEngine(), slots=2)
    assert scheduler.queue.fair.max_share == 1
    # No stall time-out in reach: a stream whose reader takes nothing keeps its slot for good.
    service = await service_on(scheduler, write_stall_timeout_s=3600.0)
    hog = [service.open_stream(StreamRequest(LONG * 3), owners=("connection:1",)) for _ in range(2)]
    first = [await hog[0].__anext__(), await hog[1].__anext__()]
    assert all(isinstance(e, Audio) for e in first)
    newcomer = service.open_stream(StreamRequest(SENTENCE), owners=("connection:2",))
    assert newcomer.queued == 1
    # The hog reads nothing more, so its streams hold their slots for good: the newcomer speaks
    # only because one was given back (parked), not after the hog's long texts.
    events = await drain(newcomer)
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
    assert not any(s.done for s in hog)
    for stream in hog:
        stream.cancel()
    scheduler.stop()
    await service.close()


class UnparkedHeldTone(HeldTone):
    """The held tone engine, unable to park: a stream holds its slot until it ends."""

    can_park = False


async def test_a_stream_queued_too_long_ends_busy():
    """The one slot's holder is held in a step by the test until the waiter has waited past
    `max_wait_s`, on an engine that cannot park it: the next turn refuses the waiter, whatever
    the machine's speed. (With Piper the holder, once far ahead of its idle reader, was parked
    for the waiter, before the time-out on one machine and after it on another.)"""
    max_wait_s = 0.5
    engine = UnparkedHeldTone()
    scheduler = EngineLoop(engine, slots=1, max_queue=4, max_wait_s=max_wait_s)
    scheduler.start()
    assert scheduler.ready_event.wait(120)
    service = await service_on(scheduler)
    holder_text = "x" * 40
    holder = service.open_stream(StreamRequest(holder_text), owners=("connection:1",))
    await asyncio.to_thread(engine.inside_step)              # the holder has the slot, held
    waiter = service.open_stream(StreamRequest(SENTENCE), owners=("connection:1",))
    started = time.monotonic()
    await wait_until(lambda: time.monotonic() - started > max_wait_s)
    engine.go.release()                                      # one step; then the turn that refuses
    events = await drain(waiter, timeout=WAIT_TIMEOUT)
    assert isinstance(events[-1], Failed) and events[-1].kind == ErrorKind.BUSY, events[-1]
    assert not any(isinstance(e, Audio) for e in events)
    holder.cancel()
    for _ in holder_text:
        engine.go.release()                                  # whatever steps are left go through
    scheduler.stop()
    await service.close()


# ------------------------------------------------------------------ normalisation


async def test_normalizing_runs_beside_the_engine_and_gives_up_on_hostile_text(voxcpm_service_scheduler):
    service = await service_on(voxcpm_service_scheduler)
    normalizer = service.engine._normalizer
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


# ------------------------------------------------------------------ shutdown


async def test_shutdown_is_bounded_when_clients_do_not_read(start_server):
    from vox_ws.server import CLOSE_GRACE_S
    from vox_ws.transports.connections import SHUTDOWN_ABORT_S

    server = start_server(PiperEngine(), drain_timeout=1.0, ping_interval=60.0, ping_timeout=120.0)
    socks = []
    for n in range(3):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        ws = await connect(server.url, sock=sock, max_queue=1, max_size=None).__aenter__()
        await ws.recv()
        await ws.send(msgpack.packb({"type": "start", "id": "s", "text": LONG * 3, "format": "f32"}))
        socks.append(ws)
    # Their buffers fill, nobody reads: the server's writes to all three wait.
    await wait_until(lambda: len(_paused_writers(server)) == 3)
    started = time.monotonic()
    await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(server.server.shutdown(1.0), server.loop))
    elapsed = time.monotonic() - started
    assert elapsed < 1.0 + CLOSE_GRACE_S + SHUTDOWN_ABORT_S + 2.0, elapsed
    for ws in socks:
        ws.transport.abort()


# ------------------------------------------------------------------ half-open connections, errors


async def test_unfinished_requests_are_bounded_per_address_and_timed_out(start_server, monkeypatch, caplog):
    from vox_ws.transports import connections

    monkeypatch.setattr(connections, "REQUEST_HEADER_TIMEOUT_S", 3.0)
    server = start_server(PiperEngine(), max_connections_per_address=4)

    def closed_by_server(sock: socket.socket, within: float) -> bool:
        sock.settimeout(within)
        try:
            return sock.recv(1) == b""
        except (ConnectionResetError, BrokenPipeError):
            return True
        except TimeoutError:
            return False

    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    for sock in idle:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")       # headers never finished
    await wait_until(lambda: server.server.guard.pending == 4)
    extra = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(4)]
    assert all([await asyncio.to_thread(closed_by_server, sock, WAIT_TIMEOUT) for sock in extra])
    # Refused as they came (not closed later by the header time-out, as the others are).
    refused = [r for r in caplog.records if "too many unfinished connections" in r.getMessage()]
    assert len(refused) == 4, [r.getMessage() for r in caplog.records]
    # The unfinished ones are closed when their header time runs out; then clients get in.
    assert all([await asyncio.to_thread(closed_by_server, sock, WAIT_TIMEOUT) for sock in idle])
    assert server.server.guard.pending == 0
    for sock in idle + extra:
        sock.close()
    status, _ = server.get("/healthz")
    assert status == 200
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


def _handshake(path: str = "/", headers: list[tuple[str, str]] = ()) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", "Upgrade: websocket", "Connection: Upgrade",
             "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version: 13"]
    lines += [f"{name}: {value}" for name, value in headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@pytest.mark.parametrize("attack, status", [
    (_handshake(headers=[("X-Long", "a" * 9000)]), 431),                                  # a line over 8 KiB
    (_handshake(headers=[(f"X-H{n}", "1") for n in range(129)]), 431),                    # 129 lines and more
    (_handshake(headers=[("X-Long", "a" * 3_000_000)])[:-4], 431),                       # one line, never ended
    (_handshake(path="/?" + "a" * 9000), 400),                                            # websockets' own refusal
])
async def test_a_handshake_refused_for_its_headers_is_answered_and_closed(start_server, attack, status):
    """Hardening V, 4: a handshake with a header line over 8 KiB (or over 128 lines) was taken
    by httptools, refused by websockets' parser and never answered nor timed out; it counted
    nowhere, and one address held 1,100 of them. Now each is answered (431, or 400 for what
    websockets alone refuses) and closed; then a bystander is served."""
    server = start_server(PiperEngine(), max_connections_per_address=4)

    def attack_once() -> bytes:
        with socket.create_connection(("127.0.0.1", server.port)) as sock:
            try:
                sock.sendall(attack)
            except (BrokenPipeError, ConnectionResetError):
                pass                              # answered and closed before the rest was read
            return read_until_closed(sock)               # a hang (the attack before) fails as a time-out

    answers = []
    for _ in range(3):                            # 12 in all: 3x the per-address bound, each round at it
        answers += await asyncio.gather(*(asyncio.to_thread(attack_once) for _ in range(4)))
    for answer in answers:
        assert answer.startswith(b"HTTP/1.1 %d " % status), answer[:200]
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == \
            ("too_large" if status == 431 else "bad_request")
    assert server.server.guard.pending == 0
    status_now, _ = server.get("/healthz")
    assert status_now == 200
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "after"))


async def test_errors_do_not_keep_a_connection_alive_and_many_in_a_row_close_it(start_server):
    server = start_server(PiperEngine(), idle_timeout_s=2.0)
    async with connect(server.url) as ws:
        await ws.recv()
        started = time.monotonic()
        with pytest.raises(ConnectionClosed):
            while time.monotonic() - started < 10 * 2.0:               # ten idle time-outs
                await ws.send(b"\xc1")                                 # not msgpack: bad_frame
                await asyncio.sleep(0.5)
        assert ws.close_code == 4000
    async with connect(server.url) as ws:
        await ws.recv()
        for _ in range(60):
            await ws.send(b"\xc1")
        with pytest.raises(ConnectionClosed):
            while True:
                await asyncio.wait_for(ws.recv(), 10)
        assert ws.close_code == 1008


class RecordingPiper(PiperEngine):
    """The real voice, recording which request each step served."""

    def __init__(self):
        super().__init__()
        self.served: list[str] = []

    def step(self, batch):
        self.served.append(batch[0].text)
        return super().step(batch)


async def test_two_streams_of_dense_text_do_not_hold_up_a_newcomer():
    """Dense text on two streams (85 s of speech each, once one step) cannot hold up a third:
    the newcomer's client had the least of the engine, so its steps run back to back."""
    engine = RecordingPiper()
    scheduler = loaded_scheduler(engine, slots=4)
    service = await service_on(scheduler)
    dense = ("我们今天去公园散步，天气非常好。" * 15)[:240]
    hogs = [service.open_stream(StreamRequest(dense), owners=(f"connection:{n}",)) for n in (1, 2)]
    readers = [asyncio.create_task(drain(h, 120)) for h in hogs]
    # Both hogs served long enough for their clients' share of the engine to settle (it decays
    # by SERVICE_DECAY a step: after 20 steps each holds about its steady share).
    await wait_until(lambda: engine.served.count(dense) >= 20)
    newcomer_text = SENTENCE + " " + SENTENCE
    events = await drain(service.open_stream(StreamRequest(newcomer_text), owners=("connection:3",)))
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
    served = engine.served
    mine = [i for i, text in enumerate(served) if text == newcomer_text]
    assert len(mine) >= 2
    assert sum(1 for i in range(mine[0], mine[-1]) if served[i] != newcomer_text) == 0, served[mine[0]:mine[-1]]
    for hog in hogs:
        hog.cancel()
    await asyncio.gather(*readers)
    scheduler.stop()
    await service.close()


async def test_a_full_queue_makes_room_for_a_client_that_holds_less():
    scheduler = loaded_scheduler(PiperEngine(), slots=1, max_queue=2)
    service = await service_on(scheduler)
    flooder = [service.open_stream(StreamRequest(LONG), owners=("address:a", "connection:1")) for _ in range(3)]
    # Another connection of the same address is told apart by its connection.
    other = service.open_stream(StreamRequest(SENTENCE), owners=("address:a", "connection:2"))
    assert other.queued
    pushed = await drain(flooder[2], 30)
    assert isinstance(pushed[-1], Failed) and pushed[-1].kind == ErrorKind.BUSY and "pushed out" in pushed[-1].message
    # The flooder's next stream finds the queue full: it outweighs nobody.
    with pytest.raises(Refused) as info:
        service.open_stream(StreamRequest(SENTENCE), owners=("address:a", "connection:1"))
    assert info.value.kind == ErrorKind.BUSY
    # Another address is told apart by its address: the busiest connection of address a
    # (the flooder's, not the other's) gives way.
    third = service.open_stream(StreamRequest(SENTENCE), owners=("address:b", "connection:3"))
    pushed = await drain(flooder[1], 30)
    assert isinstance(pushed[-1], Failed) and pushed[-1].kind == ErrorKind.BUSY
    assert not other.done
    for stream in flooder + [other, third]:
        stream.cancel()
    scheduler.stop()
    await service.close()
