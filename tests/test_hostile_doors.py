"""Attacks on the HTTP, Wyoming and voice-store doors (issue: Hardening III), each run against a
real server, then a good request served. The attacker connects from 127.0.0.2, the victim
from 127.0.0.1, as in the outside run."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket

import httpx
import pytest
from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from test_server_piper import LONG, SENTENCE

from vox_ws.config import Limits
from vox_ws.engines.piper import PiperEngine
from vox_ws.transports.connections import BodyClock, HttpProtocol

pytestmark = pytest.mark.hardening

ATTACKER = "127.0.0.2"


def attacker_socket(port: int, rcvbuf: int | None = None, source: str = ATTACKER) -> socket.socket:
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.bind((source, 0))
    sock.connect(("127.0.0.1", port))
    return sock


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes (or resets) the connection."""
    sock.settimeout(WAIT_TIMEOUT)
    received = b""
    try:
        while piece := sock.recv(65536):
            received += piece
    except ConnectionResetError:
        pass
    return received


def send_until_answered(sock: socket.socket, piece: bytes, every_s: float) -> bytes:
    """Sends `piece` each `every_s` (or less often) until the server answers; its answer."""
    sock.settimeout(every_s)
    while True:
        try:
            answer = sock.recv(65536)
            return answer + read_until_closed(sock)
        except TimeoutError:
            pass
        try:
            sock.sendall(piece)
        except (BrokenPipeError, ConnectionResetError):
            return b""


def speech_headers(length: int | None, chunked: bool = False) -> bytes:
    framing = b"Transfer-Encoding: chunked\r\n" if chunked else b"Content-Length: %d\r\n" % length
    return (b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + framing + b"\r\n")


def http_connections(server, port: int | None = None) -> list[HttpProtocol]:
    """The server's HTTP connections (from the attacker's `port`, if given)."""
    return [c for c in server.server._uvicorn.server_state.connections
            if isinstance(c, HttpProtocol) and (port is None or (c.client and c.client[1] == port))]


def assert_speaks(server) -> None:
    """A good speech request from the victim's address is served whole."""
    response = httpx.post(server.http + "/v1/audio/speech", json={"input": SENTENCE, "response_format": "pcm"},
                          timeout=WAIT_TIMEOUT)
    assert response.status_code == 200 and len(response.content) > 4800, response.text[:300]


# ------------------------------------------------------------------ bodies that never finish


def test_a_body_has_its_time_and_earns_more_by_arriving():
    limits = Limits(body_timeout_s=20.0, body_min_rate=1000.0, body_max_s=120.0)
    clock = BodyClock(limits, now=100.0)
    assert clock.deadline() == 120.0
    clock.received = 30_000
    assert clock.deadline() == 150.0                       # 30 more seconds for 30 kB
    clock.received = 10_000_000
    assert clock.deadline() == 220.0                       # never past body_max_s


async def test_bodies_that_never_finish_are_bounded_per_address(start_server):
    # No body time-out in reach: the held requests stay in flight for the whole test.
    server = start_server(PiperEngine(), max_connections_per_address=4, body_timeout_s=3600.0)
    # Complete headers, 11 bytes of a 30,000-byte body, then nothing.
    holders = [attacker_socket(server.port) for _ in range(4)]
    for sock in holders:
        sock.sendall(speech_headers(30_000) + b'{"input": "')
    await wait_until(lambda: server.server.guard.requests_in_flight == 4)
    # One more from the same address is refused at once, 429 with Retry-After.
    extra = attacker_socket(server.port)
    extra.sendall(speech_headers(30_000) + b'{"input": "')
    refusal = await asyncio.to_thread(read_until_closed, extra)
    assert refusal.startswith(b"HTTP/1.1 429") and b"retry-after: 1" in refusal.lower(), refusal
    # The victim, from another address, is served meanwhile.
    assert server.get("/healthz")[0] == 200
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))
    await asyncio.to_thread(assert_speaks, server)
    for sock in holders:
        sock.close()
    await wait_until(lambda: server.server.guard.requests_in_flight == 0)


async def test_an_address_that_goes_on_after_429s_is_not_heard_and_another_is_served(start_server):
    """Refused requests cost the server their headers, routing and answer; past its budget of
    them an address's new connections are closed at accept, before any HTTP is read."""
    # A budget that does not refill within the test: one refusal (the least burst) and no more.
    server = start_server(PiperEngine(), max_connections_per_address=1, body_timeout_s=3600.0,
                          refused_requests_per_s=0.001)
    guard = server.server.guard
    holder = attacker_socket(server.port)
    holder.sendall(speech_headers(30_000) + b'{"input": "')
    await wait_until(lambda: guard.requests_in_flight == 1)
    refused = attacker_socket(server.port)
    refused.sendall(speech_headers(30_000) + b'{"input": "')
    assert (await asyncio.to_thread(read_until_closed, refused)).startswith(b"HTTP/1.1 429")
    # The budget spent: the next connection is closed before a byte of its request is read.
    unheard = attacker_socket(server.port)
    try:
        unheard.sendall(speech_headers(30_000) + b'{"input": "')
    except (BrokenPipeError, ConnectionResetError):
        pass
    assert await asyncio.to_thread(read_until_closed, unheard) == b""
    assert guard.unheard == 1 and not guard.heard(ATTACKER)
    # The victim's address is heard as before, over HTTP and WebSocket.
    assert guard.heard("127.0.0.1")
    await asyncio.to_thread(assert_speaks, server)
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))
    for sock in (holder, refused, unheard):
        sock.close()
    await wait_until(lambda: guard.requests_in_flight == 0)


def test_the_budget_of_refusals_refills_at_its_rate():
    from vox_ws.transports.connections import ConnectionGuard

    now = [1000.0]
    guard = ConnectionGuard(Limits(refused_requests_per_s=2.0), clock=lambda: now[0])   # bursts of 10
    for _ in range(9):
        guard.refused_request(ATTACKER)
    assert guard.heard(ATTACKER)
    guard.refused_request(ATTACKER)
    assert not guard.heard(ATTACKER) and guard.heard("127.0.0.1")
    now[0] += 0.5                                                     # one more at 2 a second
    assert guard.heard(ATTACKER)
    guard.refused_request(ATTACKER)
    assert not guard.heard(ATTACKER)
    assert guard.admit(object(), ATTACKER) is not None and guard.unheard == 1
    off = ConnectionGuard(Limits(refused_requests_per_s=0.0), clock=lambda: now[0])
    for _ in range(1000):
        off.refused_request(ATTACKER)
    assert off.heard(ATTACKER)


async def test_a_body_that_never_finishes_is_answered_408_when_its_time_runs_out(start_server):
    server = start_server(PiperEngine(), body_timeout_s=1.0)
    holder = attacker_socket(server.port)
    holder.sendall(speech_headers(30_000) + b'{"input": "')
    answer = await asyncio.to_thread(read_until_closed, holder)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "timeout"
    holder.close()
    await wait_until(lambda: server.server.guard.requests_in_flight == 0)
    await asyncio.to_thread(assert_speaks, server)


async def test_a_chunked_body_that_trickles_extensions_or_crawls_is_cut_off(start_server):
    server = start_server(PiperEngine(), body_timeout_s=1.0, body_min_rate=1000.0)
    # Chunk extensions, a byte at a time: the body never grows.
    trickler = attacker_socket(server.port)
    trickler.sendall(speech_headers(None, chunked=True) + b"5;name=")

    answer = await asyncio.to_thread(send_until_answered, trickler, b"a", 0.05)
    assert answer.startswith(b"HTTP/1.1 408"), answer
    # A body that comes at 500 bytes a second, half the minimum rate (any machine only makes it
    # slower): its deadline recedes half as fast as time passes, and it is cut off.
    crawler = attacker_socket(server.port)
    crawler.sendall(speech_headers(30_000))

    answer = await asyncio.to_thread(send_until_answered, crawler, b" " * 50, 0.1)   # 500 bytes/s at most
    assert answer.startswith(b"HTTP/1.1 408"), answer
    assert server.server.guard.requests_in_flight == 0
    await asyncio.to_thread(assert_speaks, server)


# ------------------------------------------------------------------ a reader that stops reading


async def test_a_speech_response_nobody_reads_ends_and_its_connection_closes(start_server, caplog):
    server = start_server(PiperEngine(), max_buffered_audio_s=1.0, write_stall_timeout_s=1.0, slots=2)
    body = json.dumps({"input": LONG * 3, "response_format": "pcm"}).encode()
    readers = [attacker_socket(server.port, rcvbuf=4096) for _ in range(3)]
    ports = [sock.getsockname()[1] for sock in readers]
    for sock in readers:
        sock.sendall(speech_headers(len(body)) + body)     # and never reads
    # Each stream ends slow_consumer, its slot goes to the next, and the connection is aborted.
    def aborted() -> set[int]:
        return {r.args[0][1] for r in caplog.records
                if r.name == "vox_ws.connections" and "read nothing for" in r.msg and isinstance(r.args[0], tuple)}
    await wait_until(lambda: aborted() >= set(ports))
    await wait_until(lambda: all(http_connections(server, port) == [] for port in ports))
    await wait_until(lambda: server.devices.stats()["active"] == 0)
    for sock in readers:
        received = await asyncio.to_thread(read_until_closed, sock)
        assert received.startswith(b"HTTP/1.1 200") and not received.endswith(b"0\r\n\r\n")   # cut short
        sock.close()
    await asyncio.to_thread(assert_speaks, server)


# ------------------------------------------------------------------ Wyoming


@pytest.fixture(scope="module")
def wyoming_server(start_server):
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0", idle_timeout_s=1.0,
                        body_timeout_s=1.0, stream_timeout_s=1.0)


@pytest.fixture(scope="module")
def wyoming_patient(start_server):
    """No idle or body time-out in reach: what a test sees is never cut short by one."""
    return start_server(PiperEngine(), slots=2, wyoming="tcp://127.0.0.1:0", idle_timeout_s=3600.0,
                        body_timeout_s=3600.0, max_connections_per_address=3)


async def wyoming_connection(server, source: str = ATTACKER) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", server.server.wyoming.port, local_addr=(source, 0))


async def next_event(reader: asyncio.StreamReader):
    from wyoming.event import async_read_event

    return await asyncio.wait_for(async_read_event(reader), WAIT_TIMEOUT)


async def expect_wyoming_error(reader: asyncio.StreamReader, code: str) -> str:
    from wyoming.error import Error

    event = await next_event(reader)
    assert event is not None and Error.is_type(event.type), event
    error = Error.from_event(event)
    assert error.code == code, error
    return error.text


async def assert_wyoming_speaks(server) -> None:
    from wyoming.audio import AudioStart, AudioStop
    from wyoming.event import async_write_event
    from wyoming.tts import Synthesize

    reader, writer = await wyoming_connection(server, "127.0.0.1")
    await async_write_event(Synthesize(text=SENTENCE).event(), writer)
    kinds = []
    while not kinds or not AudioStop.is_type(kinds[-1]):
        kinds.append((await next_event(reader)).type)
    assert AudioStart.is_type(kinds[0]) and len(kinds) > 2, kinds
    writer.close()


async def test_wyoming_frames_that_never_finish_and_requests_gone_quiet_are_closed(wyoming_server):
    from wyoming.event import async_write_event
    from wyoming.tts import SynthesizeStart

    # A header that declares a 1,000-byte payload, and 10 bytes of it.
    reader, writer = await wyoming_connection(wyoming_server)
    writer.write(json.dumps({"type": "ping", "payload_length": 1000}).encode() + b"\n" + b"x" * 10)
    assert "did not follow its header" in await expect_wyoming_error(reader, "timeout")
    assert await next_event(reader) is None
    writer.close()
    # synthesize-start, then silence: the stream times out, and the connection closes with it.
    reader, writer = await wyoming_connection(wyoming_server)
    await async_write_event(SynthesizeStart().event(), writer)
    await expect_wyoming_error(reader, "timeout")                     # the stream's input time-out
    assert await next_event(reader) is None
    writer.close()
    await wait_until(lambda: wyoming_server.server.wyoming.connections == 0)
    await assert_wyoming_speaks(wyoming_server)


async def test_wyoming_connections_are_capped_per_address(wyoming_patient):
    from wyoming.event import async_write_event
    from wyoming.ping import Ping, Pong

    held = [await wyoming_connection(wyoming_patient) for _ in range(3)]
    for reader, writer in held:                     # each is a live connection, kept busy
        await async_write_event(Ping().event(), writer)
        assert Pong.is_type((await next_event(reader)).type)
    reader, writer = await wyoming_connection(wyoming_patient)
    assert "your address" in await expect_wyoming_error(reader, "busy")
    assert await next_event(reader) is None
    writer.close()
    await assert_wyoming_speaks(wyoming_patient)    # another address is served meanwhile
    for _, writer in held:
        writer.close()


async def test_wyoming_bad_json_of_any_shape_is_an_error_and_the_connection_closes(wyoming_patient):
    data = b"{\"a\":" * 10_000 + b"1" + b"}" * 10_000
    for bad, said in ((b"[" * 50_000 + b"\n", ""),                  # a header nested past any parser
                      (json.dumps({"type": "ping", "data_length": len(data)}).encode() + b"\n" + data, ""),
                      (json.dumps({"type": "synthesize", "data": {"text": "Hello \ud800 world."}}).encode() + b"\n",
                       "Unicode")):
        reader, writer = await wyoming_connection(wyoming_patient)
        writer.write(bad)
        assert said in await expect_wyoming_error(reader, "bad_request")
        assert await next_event(reader) is None                       # closed, as wyoming-piper does
        writer.close()
    await assert_wyoming_speaks(wyoming_patient)


# ------------------------------------------------------------------ text and JSON of any shape


def test_deep_json_lone_surrogates_and_escaped_text_over_http(piper_server):
    url = piper_server.http + "/v1/audio/speech"
    for deep in (b"[" * 50_000, b'{"input": ' + b"[" * 30_000 + b"]" * 30_000 + b"}"):
        response = httpx.post(url, content=deep, headers={"Content-Type": "application/json"}, timeout=WAIT_TIMEOUT)
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json", response.text
    # Python's json.dumps escapes every character by default: 3,100 emoji (under max_text_chars)
    # are 37,239 bytes of body, and speak.
    emoji = json.dumps({"input": "Hello. " + "\U0001F600" * 3100, "response_format": "pcm"})
    assert emoji.isascii() and len(emoji) > 37_000
    response = httpx.post(url, content=emoji, headers={"Content-Type": "application/json"}, timeout=WAIT_TIMEOUT)
    assert response.status_code == 200, response.text[:300]
    for body in ({"input": "Hello \ud800 world."}, {"input": "Hello.", "instructions": "calm \udfff"}):
        response = httpx.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"},
                              timeout=WAIT_TIMEOUT)
        assert response.status_code == 400 and "Unicode" in response.json()["error"]["message"], response.text
    assert_speaks(piper_server)


async def test_text_that_is_not_unicode_is_a_bad_request_over_v1(piper_server):
    import msgpack

    async with connect_client(piper_server) as c:
        # msgpack carries UTF-8: a surrogate's bytes (CESU-8) are not UTF-8, and the frame is bad.
        frame = msgpack.packb({"type": "start", "id": "s", "text": "x"}).replace(b"\xa1x", b"\xa3\xed\xa0\x80")
        await c.send(frame)
        assert (await c.error())["code"] == "bad_frame"
        assert_good_stream(await c.speak(SENTENCE, "after"))


# ------------------------------------------------------------------ a store that refuses writes


async def test_a_redis_that_refuses_writes_is_not_ready_and_every_request_is_answered(start_server, tiny_model,
                                                                                        tmp_path, caplog):
    import redis.asyncio
    from conftest import RedisServer
    from test_stream_service import tone_wav
    from test_voice_store import register, speak, tiny_server

    store = RedisServer(str(tmp_path))
    try:
        server = tiny_server(start_server, tiny_model, store.url)
        voice_id, doomed = await register(server), await register(server, pitch=230)
        admin = redis.asyncio.from_url(store.url)
        # OOM at maxmemory (writes refused, reads served), then READONLY (a replica after a
        # fail-over: its master here is a port nobody listens on).
        refusals = [("config", "set", "maxmemory", "1"), ("replicaof", "127.0.0.1", "1")]
        undo = [("config", "set", "maxmemory", "0"), ("replicaof", "no", "one")]
        for refuse, restore in zip(refusals, undo):
            await admin.execute_command(*refuse)
            async with connect_client(server) as c:
                await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=260)})
                error = await c.recv_where(lambda m: m.get("id") == "r")
                assert error["type"] == "error" and error["code"] == "not_ready" and error["retryable"], error
                if refuse[0] == "replicaof":            # (at maxmemory, deleting is allowed)
                    await c.send({"type": "voice_delete", "id": "d", "voice": doomed})
                    error = await c.recv_where(lambda m: m.get("id") == "d")
                    assert error["type"] == "error" and error["code"] == "not_ready", error
            response = await asyncio.to_thread(httpx.post, server.http + "/v1/voices", content=tone_wav(1.0, pitch=270),
                                               headers={"Content-Type": "audio/wav"}, timeout=WAIT_TIMEOUT)
            assert response.status_code == 503 and response.headers["Retry-After"], response.text
            assert response.json()["error"]["code"] == "not_ready"
            spoken = await speak(server, voice_id)                     # reads are still served
            assert spoken.error is None and spoken.end["reason"] == "max_len", spoken.error
            await admin.execute_command(*restore)
        assert await register(server, pitch=280)                       # writes again
        await admin.aclose()
    finally:
        store.stop()
    unhandled = [r for r in caplog.records if r.exc_info or "Traceback" in r.getMessage()]
    assert unhandled == [], [r.getMessage() for r in unhandled]


def test_piper_refuses_a_voice_upload_before_reading_its_body(piper_server):
    sock = socket.create_connection(("127.0.0.1", piper_server.port))
    sock.sendall(b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\nContent-Length: 2000000\r\n\r\n")
    sock.settimeout(WAIT_TIMEOUT)
    answer = http.client.HTTPResponse(sock)                             # not a byte of the body sent
    answer.begin()
    assert answer.status == 501
    assert json.loads(answer.read())["error"]["code"] == "unsupported"
    sock.close()


def _answer(sock: socket.socket) -> http.client.HTTPResponse:
    sock.settimeout(WAIT_TIMEOUT)
    answer = http.client.HTTPResponse(sock)
    answer.begin()
    answer.read()
    return answer


async def test_bodies_answered_before_they_are_read_are_dropped_within_a_budget_then_cut_off(start_server):
    """A refused upload's body is read and dropped, so that its client reads the answer and
    may send its next request on the connection; but only up to the address's budget (one
    `max_frame_bytes` bodies, then `discard_bytes_per_s`): beyond, the connection is closed and
    the kernel drops the rest, so a client that sends refused bodies again and again costs the
    server their headers, not their megabytes."""
    from vox_ws.transports.connections import DISCARD_BURST_FRAMES

    server = start_server(PiperEngine(), discard_bytes_per_s=1.0)       # the burst, then next to nothing
    burst = DISCARD_BURST_FRAMES * server.config.limits.max_frame_bytes
    upload = b"POST /v1/voices HTTP/1.1\r\nHost: x\r\nContent-Type: audio/wav\r\nContent-Length: %d\r\n\r\n"
    size = burst * 3 // 4
    first = attacker_socket(server.port)
    first.sendall(upload % size)
    answer = _answer(first)                                  # answered before a byte of the body
    assert answer.status == 501 and answer.getheader("connection") is None
    first.sendall(b"\0" * size)                             # dropped within the budget ...
    first.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(first).status == 200                      # ... and the connection goes on
    first.close()

    second = attacker_socket(server.port)                     # the budget has a quarter left
    second.sendall(upload % size)
    assert _answer(second).status == 501
    try:
        second.sendall(b"\0" * size + b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    except (BrokenPipeError, ConnectionResetError):
        pass                                                 # closed while the body was coming
    assert read_until_closed(second) == b""                  # no answer to the next request: closed
    await wait_until(lambda: not http_connections(server, second.getsockname()[1]))
    second.close()
    # Another address has its own budget, and the server serves on.
    assert_speaks(server)


# ------------------------------------------------------------------ every door asks the store


async def test_the_openai_door_speaks_a_stored_voice_this_process_never_built(start_server, tiny_model, tmp_path):
    import openai
    from test_voice_store import register, speak, tiny_server

    store = f"dir:{tmp_path / 'voices'}"
    first = tiny_server(start_server, tiny_model, store)
    voice_id = await register(first)
    reference = await speak(first, voice_id)
    first.stop()
    second = tiny_server(start_server, tiny_model, store)                 # as after a restart
    assert not second.server.devices.engines[0].voices.has(voice_id)
    client = openai.OpenAI(base_url=second.http + "/v1", api_key="unused")

    def say(voice: str) -> bytes:
        with client.audio.speech.with_streaming_response.create(
                model="tts-1", voice=voice, input="Speak in the stored voice.", response_format="pcm",
                extra_body={"seed": 9, "max_len": 4, "sample_rate": 16_000}) as response:
            return response.read()
    audio = await asyncio.to_thread(say, voice_id)
    assert reference.seconds > 0 and abs(len(audio) / 2 / 16_000 - reference.seconds) < 0.01
    with pytest.raises(openai.BadRequestError) as caught:
        await asyncio.to_thread(say, "v_" + "a" * 32)
    assert caught.value.body["param"] == "voice" and caught.value.body["code"] == "voice_not_found"


# ------------------------------------------------------------------ a replica's voices follow the store


def test_the_built_voices_are_a_cache_the_least_recently_used_leave(monkeypatch):
    from vox_ws.engines.voxcpm import voices

    monkeypatch.setattr(voices, "MAX_VOICES", 3)
    book = voices.VoiceBook()
    book.add({"n": "builtin"}, name="narrator")
    for n in range(3):
        book.add({"n": n}, voice_id=f"v{n}")
    assert book.get("v0") == {"n": 0}                     # used: now the most recent
    book.add({"n": 3}, voice_id="v3")
    assert book.get("v1") is None and len(book) == 3      # the least recently used left
    assert [book.get(v)["n"] for v in ("v0", "v2", "v3")] == [0, 2, 3]
    for n in range(4, 10):
        book.add({"n": n}, voice_id=f"v{n}")
    assert len(book) == 3 and book.get("narrator") == {"n": "builtin"}     # built-ins stay


async def test_voice_churn_through_one_replica_never_fills_another(start_server, tiny_model, redis_server,
                                                                  monkeypatch):
    import redis.asyncio
    from test_voice_store import register, speak, tiny_server

    from vox_ws.engines.voxcpm import voices

    cap = 4
    monkeypatch.setattr(voices, "MAX_VOICES", cap)
    client = redis.asyncio.from_url(redis_server.url)
    await client.flushdb()
    await client.aclose()
    a = tiny_server(start_server, tiny_model, redis_server.url, max_voices_per_owner=2)
    b = tiny_server(start_server, tiny_model, redis_server.url, max_voices_per_owner=2)
    registered = []
    # Each cycle registers a new voice on A (which retires the owner's oldest beyond 2) and
    # speaks with it once on B: three times B's capacity.
    for cycle in range(3 * cap):
        registered.append(await register(a, pitch=150.0 + 10 * cycle))
        spoken = await speak(b, registered[-1])
        assert spoken.error is None and spoken.end["reason"] == "max_len", (cycle, spoken.error)
    engine_b = b.server.devices.engines[0]
    assert len(engine_b.voices.book) <= cap
    # A voice the store retired is refused on B too, whatever B had built.
    gone = await speak(b, registered[0])
    assert gone.error is not None and gone.error["code"] == "bad_request"
    # One still in the store that B dropped is built again from it.
    kept = await speak(b, registered[-2])
    assert kept.error is None and kept.end["reason"] == "max_len"


# ------------------------------------------------------------------ slow readers and slots


async def test_streams_waiting_on_slow_readers_give_their_slots_to_a_waiting_stream(start_server):
    import msgpack
    from websockets.asyncio.client import connect

    # Neither a stall time-out, nor a queue wait, nor the keepalive in reach: the victim can
    # speak only if the readers' slots are given back while they lag.
    server = start_server(PiperEngine(), slots=2, write_stall_timeout_s=3600.0, max_queue_wait_s=3600.0,
                          ping_interval=3600.0, ping_timeout=3600.0, max_buffered_audio_s=1.0)
    readers = []
    for address in (ATTACKER, "127.0.0.3"):             # two clients, one slot each: their share
        sock = attacker_socket(server.port, rcvbuf=4096, source=address)
        ws = await connect(server.url, sock=sock, max_queue=1)
        await ws.recv()                                  # hello
        await ws.send(msgpack.packb({"type": "start", "id": "slow", "text": LONG * 3}))
        readers.append(ws)
    await wait_until(lambda: server.devices.stats()["active"] + server.devices.stats()["parked"] == 2)
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))
    assert server.devices.stats()["parked"] >= 1        # still lagging: still parked
    # A reader that catches up gets its slot back and its stream goes on to the end.
    ws = readers[0]
    kinds = []
    while "end" not in kinds:
        kinds.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), WAIT_TIMEOUT))["type"])
    assert "error" not in kinds
    for ws in readers:
        ws.transport.abort()


async def test_a_stream_parked_while_its_reader_lags_holds_no_place_in_the_queue():
    """One slot, a queue of one: two readers that take nothing rest parked, and a third stream
    still finds room in the queue (it is not refused `busy` for streams that wait on nobody)."""
    from test_stream_service import drain, loaded_scheduler, service_on

    from vox_ws.engine import EndReason
    from vox_ws.service import Ended, StreamRequest

    scheduler = loaded_scheduler(PiperEngine(), slots=1, max_queue=1)
    service = await service_on(scheduler, max_buffered_audio_s=1.0, write_stall_timeout_s=3600.0,
                               max_queue_wait_s=3600.0)
    lagging = [service.open_stream(StreamRequest(LONG), owners=(f"address:{n}", f"connection:{n}")) for n in (1, 2)]
    # The first lags (nobody reads it), the second claims its slot: the first rests parked; then
    # the second lags with nobody waiting, and keeps the slot.
    await wait_until(lambda: scheduler.stats()["parked"] == 1 and lagging[1].backlogged())
    assert scheduler.stats()["queued"] == 0
    third = service.open_stream(StreamRequest(SENTENCE), owners=("address:3", "connection:3"))
    assert third.queued == 1
    events = await drain(third)
    assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
    for stream in lagging:
        stream.cancel()
    scheduler.stop()
    await service.close()


# ------------------------------------------------------------------ real-time players with stock clients


async def test_a_lookahead_keeps_the_stream_within_it_of_a_real_time_clock(start_server):
    """Taken as fast as the consumer can: the audio handed over never runs more than
    `lookahead_s` ahead of a real-time playback clock started at the first audio (a slower
    machine only keeps it further behind)."""
    from test_stream_service import service_on

    from vox_ws.scheduling.loop import EngineLoop
    from vox_ws.service import Audio, AudioOutput, Ended, StreamRequest

    scheduler = EngineLoop(PiperEngine(), slots=2)
    scheduler.start()
    assert scheduler.ready_event.wait(WAIT_TIMEOUT)
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
    with pytest.raises(Exception, match="lookahead_s must be in"):
        service.open_stream(StreamRequest(SENTENCE, output=AudioOutput("s16", lookahead_s=0.0)))
    scheduler.stop()
    await service.close()


@pytest.mark.slow
async def test_a_stock_websockets_client_playing_in_real_time_hears_a_three_minute_text(start_server):
    """Players that read a chunk, play it, read the next (a phone bridge at mu-law 8 kHz, a
    speaker at s16 22,050 Hz), written with `websockets`' defaults (its own 20 s pings): with
    `lookahead_s` the server stays a few seconds ahead of them, so their pongs are never stuck
    behind a minute of audio, and they hear the whole text."""
    import msgpack
    from test_adversarial import STORY
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


# ------------------------------------------------------------------ voice uploads: bounded, fair


async def test_registrations_wait_bounded_and_the_owner_served_longest_ago_goes_first():
    from vox_ws.engine import Refused
    from vox_ws.service.registrations import RegistrationQueue

    queue = RegistrationQueue(per_owner=3, total=5)
    order: list[str] = []
    release = {name: asyncio.Event() for name in ("a1", "a2", "a3", "b1", "c1")}

    async def register(name: str) -> None:
        registration = queue.admit(name[0])
        try:
            async with registration:
                order.append(name)
                await release[name].wait()
        finally:
            registration.release()

    tasks = [asyncio.create_task(register(name)) for name in ("a1", "a2", "a3")]
    await wait_until(lambda: order == ["a1"])
    with pytest.raises(Refused, match="of yours"):
        queue.admit("a")                                      # its fourth
    tasks += [asyncio.create_task(register(name)) for name in ("b1", "c1")]
    await wait_until(lambda: queue.pending == 5)
    with pytest.raises(Refused, match="5 voice registrations are waiting"):
        queue.admit("d")
    for name in ("a1", "b1", "c1", "a2", "a3"):
        release[name].set()
    await asyncio.gather(*tasks)
    assert order == ["a1", "b1", "c1", "a2", "a3"]           # a's burst waits behind the others
    assert queue.pending == 0


class GatedVoxCPM:
    """The tiny VoxCPM2's voice builds, held until the test lets them go (in the order made)."""

    def __init__(self, engine) -> None:
        import threading

        self.gate = threading.Event()
        self.built: list[str] = []
        self._register = engine.voices.register
        engine.voices.register = self

    def __call__(self, *args, **kwargs):
        self.gate.wait(WAIT_TIMEOUT)
        self.built.append(args[-1])
        return self._register(*args, **kwargs)


async def test_an_owner_flooding_voice_uploads_is_refused_429_and_another_owner_is_served(start_server, tiny_model):
    from test_stream_service import tone_wav
    from test_voice_store import tiny_server

    server = tiny_server(start_server, tiny_model, "memory")
    gated = GatedVoxCPM(server.server.devices.engines[0])
    service = server.server.service

    def upload(pitch: float, source: str) -> httpx.Response:
        transport = httpx.HTTPTransport(local_address=source)
        with httpx.Client(transport=transport, timeout=WAIT_TIMEOUT) as client:
            return client.post(server.http + "/v1/voices", content=tone_wav(1.0, pitch=pitch),
                               headers={"Content-Type": "audio/wav"})

    flood = [asyncio.create_task(asyncio.to_thread(upload, 200.0 + n, ATTACKER)) for n in range(6)]
    # Two of the attacker's are admitted (one building, held; one waiting); the other four are
    # refused at once, before their bodies are read.
    refused = []
    for task in asyncio.as_completed(flood):
        response = await task
        assert response.status_code == 429 and response.headers["Retry-After"], response.text
        assert response.json()["error"]["code"] == "busy"
        refused.append(response)
        if len(refused) == 4:
            break
    assert service.voices.registrations.pending == 2
    victim = asyncio.create_task(asyncio.to_thread(upload, 330.0, "127.0.0.1"))
    await wait_until(lambda: service.voices.registrations.pending == 3)
    gated.gate.set()
    answered = await victim
    assert answered.status_code == 201, answered.text
    kept = [await task for task in flood if not task.done() or task.result().status_code != 429]
    assert [r.status_code for r in kept] == [201, 201]
    # The victim's voice was built before the attacker's second.
    assert gated.built.index(answered.json()["voice"]) == 1


# ------------------------------------------------------------------ codec streams free FFmpeg at once


async def test_cancelled_codec_streams_free_their_ffmpeg_threads_without_the_garbage_collector():
    import gc
    import os
    import threading

    from test_stream_service import service_on

    from vox_ws.scheduling.loop import EngineLoop
    from vox_ws.service import Audio, AudioOutput, StreamRequest

    def threads() -> int:
        """Native threads of this process that are not Python's (FFmpeg's, here)."""
        python = {str(t.native_id) for t in threading.enumerate()}
        return len(set(os.listdir("/proc/self/task")) - python)

    scheduler = EngineLoop(PiperEngine(), slots=4)
    scheduler.start()
    assert scheduler.ready_event.wait(WAIT_TIMEOUT)
    service = await service_on(scheduler)
    warm = service.open_stream(StreamRequest(SENTENCE, output=AudioOutput("mp3", speed=1.5)))
    async for _ in warm:
        pass
    gc.collect()
    gc.disable()                        # what is freed now is freed by its owner, not by the collector
    try:
        before = threads()
        for n in range(12):
            output = AudioOutput(("mp3", "opus", "aac")[n % 3], speed=1.5)
            stream = service.open_stream(StreamRequest(LONG, output=output))
            async for event in stream:
                if isinstance(event, Audio):
                    break
            if n % 2:
                stream.cancel()
                async for _ in stream:
                    pass
            else:
                stream.close()          # the consumer went away
        await wait_until(lambda: threads() <= before)
    finally:
        gc.enable()
    scheduler.stop()
    await service.close()


async def test_one_client_over_wyoming_and_v1_is_one_owner_to_the_fair_shares(wyoming_patient):
    from wyoming.event import async_write_event
    from wyoming.tts import Synthesize

    reader, writer = await wyoming_connection(wyoming_patient, "127.0.0.1")
    await async_write_event(Synthesize(text=LONG).event(), writer)
    async with connect_client(wyoming_patient) as c:
        await c.send({"type": "start", "id": "v1", "text": LONG})
        scheduler = wyoming_patient.server.devices.loops[0]

        def owners() -> list[str]:
            with scheduler._cond:
                return [r.owners[0] for held in scheduler.queue._lists.values() for r in held]
        await wait_until(lambda: len(owners()) == 2)
        assert owners() == ["address:127.0.0.1"] * 2
        await c.send({"type": "cancel", "id": "v1"})
    writer.close()


# ------------------------------------------------------------------ hostile multipart


async def test_hostile_multipart_bodies_are_parsed_in_another_process(start_server, tiny_model):
    import os

    from test_stream_service import tone_wav
    from test_voice_store import tiny_server

    server = tiny_server(start_server, tiny_model, "memory")
    boundary = b"vox" * 20
    near = b"\r\n--" + boundary[:-1] + b"X"                   # almost the boundary, over and over
    body = (b"--" + boundary + b'\r\nContent-Disposition: form-data; name="audio"; filename="a.wav"\r\n'
            b"Content-Type: audio/wav\r\n\r\n" + near * ((2 << 20) // len(near) - 100) + b"\r\n--" + boundary
            + b"--\r\n")
    headers = {"Content-Type": "multipart/form-data; boundary=" + boundary.decode()}

    def post(content: bytes, source: str) -> httpx.Response:
        with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=WAIT_TIMEOUT) as client:
            return client.post(server.http + "/v1/voices", content=content, headers=headers)

    answers = await asyncio.gather(*(asyncio.to_thread(post, body, ATTACKER) for _ in range(2)))
    for answer in answers:                                    # the "audio" is not audio
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "bad_request", answer.text
    executor = server.server.state.multipart._executor
    assert executor is not None and all(pid != os.getpid() for pid in executor._processes)
    def lowest_priority(pid: int) -> bool:                    # SCHED_IDLE (Linux), else nice 19
        if hasattr(os, "SCHED_IDLE"):
            return os.sched_getscheduler(pid) == os.SCHED_IDLE
        return os.getpriority(os.PRIO_PROCESS, pid) == 19
    assert all(lowest_priority(pid) for pid in executor._processes)
    good = httpx.post(server.http + "/v1/voices", files={"audio": ("ref.wav", tone_wav(1.0), "audio/wav")},
                      timeout=WAIT_TIMEOUT)
    assert good.status_code == 201, good.text


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
