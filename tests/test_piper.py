"""End to end over a real WebSocket against a real server with the real Piper voice."""

import asyncio
import math

import httpx
import msgpack
import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from conftest import assert_good_stream, connect_client, wait_until
from helpers import LONG, SENTENCE, GatedPiper
from vox_ws.engines.piper import PiperEngine, slots_for_speed
from vox_ws.engines.speed_slots import RemeasurePolicy
from vox_ws.scheduling.loop import LOADING_RETRY_AFTER_S


async def test_hello_publishes_engine_formats_and_limits(piper_server):
    async with connect_client(piper_server) as c:
        hello = c.hello
    assert hello["protocol"] == 1 and hello["engine"] == "piper" and hello["status"] == "ready"
    assert hello["sample_rate"] == 22050 and hello["voices"] == ["joe"]
    assert set(hello["formats"]) >= {"f32", "s16"}
    assert {"max_frame_bytes", "max_text_chars", "max_streams", "idle_timeout_s"} <= set(hello["limits"])


async def test_one_shot_synthesis_streams_real_audio(piper_server):
    async with connect_client(piper_server) as c:
        result = await c.speak(SENTENCE + " " + SENTENCE, "one")
    assert_good_stream(result, min_seconds=2.0)
    assert result.start == {"type": "start", "id": "one", "sample_rate": 22050, "format": "f32", "channels": 1}
    # ~18 words at a normal speaking rate: between 2 and 12 seconds of audio.
    assert 2.0 < result.seconds < 12.0
    assert result.end["ttfa_ms"] > 0 and result.end["rtf"] > 0
    assert len(result.chunks) >= 2, "two sentences should arrive as at least two chunks"


@pytest.mark.parametrize("fmt, rate", [("s16", 22050), ("s16", 16000), ("f32", 48000), ("s16", 8000)])
async def test_formats_and_resampled_rates(piper_server, fmt, rate):
    async with connect_client(piper_server) as c:
        result = await c.speak(SENTENCE, f"{fmt}-{rate}", format=fmt, sample_rate=rate)
        reference = await c.speak(SENTENCE, "ref")
    assert_good_stream(result)
    assert result.start["sample_rate"] == rate and result.start["format"] == fmt
    bytes_per_sample = 2 if fmt == "s16" else 4
    assert all(len(ch["audio"]) % bytes_per_sample == 0 for ch in result.chunks)
    # Same text at another rate: same duration (Piper is stochastic, so within 20%).
    assert result.seconds == pytest.approx(reference.seconds, rel=0.2)


@pytest.mark.slow
async def test_two_streams_on_one_connection_interleave(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "a", "text": LONG[:300]})
        await c.send({"type": "start", "id": "b", "text": LONG[:300]})
        a = await c.collect("a")
        b = await c.collect("b")
    assert_good_stream(a, 3.0)
    assert_good_stream(b, 3.0)
    # Round-robin: b's audio starts before a is finished, and a's before b is finished.
    assert c.log.index(("chunk", "b")) < c.log.index(("end", "a"))
    assert c.log.index(("chunk", "a")) < c.log.index(("end", "b"))


@pytest.mark.slow
async def test_eight_connections_at_once_all_complete(piper_server):
    async def one(i):
        async with connect_client(piper_server) as c:
            return await c.speak(f"Connection number {i} says hello. {SENTENCE}", f"c{i}", format="s16")

    results = await asyncio.gather(*(one(i) for i in range(8)))
    for result in results:
        assert_good_stream(result, 1.0)


async def test_stream_id_is_assigned_when_absent(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "text": "Hi."})
        start = await c.recv_where(lambda m: m["type"] == "start")
        result = await c.collect(start["id"])
    assert start["id"] and result.end["reason"] == "done"


async def test_cancel_mid_stream_ends_with_cancelled_and_no_chunk_after(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "long", "text": LONG})
        await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "long")
        await c.send({"type": "cancel", "id": "long"})
        end = await c.recv_where(lambda m: m["type"] in ("end", "error") and m["id"] == "long")
        assert end["type"] == "end" and end["reason"] == "cancelled"
        # Nothing more for that stream: the next stream's messages come, none of `long`.
        good = await c.speak("Still here.", "after")
        assert_good_stream(good)
        after_end = c.log[c.log.index(("end", "long")) + 1:]
        assert ("end", "after") in after_end
        assert not [entry for entry in after_end if entry[1] == "long"]
    await wait_until(lambda: piper_server.devices.stats()["active"] == 0)


async def test_cancel_of_queued_stream_and_of_unknown_stream(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "cancel", "id": "ghost"})
        err = await c.error("ghost")
        assert err["code"] == "unknown_stream" and err["retryable"] is False
        assert_good_stream(await c.speak("Good after a bad cancel.", "ok"))


async def test_disconnect_mid_stream_frees_the_slot(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "gone", "text": LONG})
        await c.recv_where(lambda m: m["type"] == "chunk")
        assert piper_server.devices.stats()["active"] == 1
    await wait_until(lambda: piper_server.devices.stats()["active"] == 0
                   and piper_server.get("/v1/info")[1]["streams_open"] == 0)


async def test_max_len_option_ends_with_reason_max_len(piper_server):
    async with connect_client(piper_server) as c:
        result = await c.speak(LONG, "short", options={"max_len": 1, "cfg_value": 2.5})
    assert result.end["reason"] == "max_len" and len(result.chunks) >= 1
    assert result.start["ignored_options"] == ["cfg_value"]


BAD_INPUTS = [
    ("text frame", "hello", None, "bad_frame"),
    ("not msgpack", b"\xc1\xc1", None, "bad_frame"),
    ("not a map", msgpack.packb([1, 2, 3]), None, "bad_frame"),
    ("no type", {"text": "x"}, None, "bad_request"),
    ("unknown type", {"type": "sing", "id": "x"}, "x", "bad_request"),
    ("missing text", {"type": "start", "id": "x"}, "x", "bad_request"),
    ("ill-typed text", {"type": "start", "id": "x", "text": 42}, "x", "bad_request"),
    ("bad format", {"type": "start", "id": "x", "text": "hi", "format": "ogg"}, "x", "bad_request"),
    ("bad rate", {"type": "start", "id": "x", "text": "hi", "sample_rate": 96000}, "x", "bad_request"),
    ("option out of range", {"type": "start", "id": "x", "text": "hi", "options": {"cfg_value": 99}}, "x",
     "bad_request"),
    ("unknown option", {"type": "start", "id": "x", "text": "hi", "options": {"speed": 2}}, "x", "bad_request"),
    ("unknown voice", {"type": "start", "id": "x", "text": "hi", "voice": "nobody"}, "x", "bad_request"),
    ("text too long", {"type": "start", "id": "x", "text": "a" * 5001}, "x", "too_large"),
    ("frame too large", msgpack.packb({"type": "start", "id": "x", "text": "b" * 3_000_000}), None, "too_large"),
    ("unknown stream cancel", {"type": "cancel", "id": "nope"}, "nope", "unknown_stream"),
    ("chunk without stream", {"type": "chunk", "id": "nope", "text": "x"}, "nope", "unknown_stream"),
    ("ill-typed segment_events", {"type": "start", "id": "x", "text": "hi", "segment_events": "yes"}, "x",
     "bad_request"),
]


@pytest.mark.parametrize("name, frame, sid, code", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
async def test_bad_input_gets_typed_error_and_session_keeps_working(piper_server, name, frame, sid, code):
    async with connect_client(piper_server) as c:
        await c.send(frame)
        err = await c.recv()
        assert err["type"] == "error", err
        assert err["code"] == code, err
        assert err.get("id") == sid
        assert err["message"]
        assert_good_stream(await c.speak("Still working.", "good"))


async def test_duplicate_id_and_chunk_on_plain_stream(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "d", "text": LONG})
        await c.send({"type": "start", "id": "d", "text": "again"})
        err = await c.error("d")
        assert err["code"] == "duplicate_stream"
        await c.send({"type": "chunk", "id": "d", "text": "more"})
        err = await c.error("d")
        assert err["code"] == "bad_request" and "stream_input" in err["message"]
        await c.send({"type": "cancel", "id": "d"})
        assert (await c.collect("d")).end["reason"] == "cancelled"
        assert_good_stream(await c.speak("Fine.", "d"))   # the id is free again


async def test_too_many_streams(piper_server):
    limit = piper_server.config.limits.max_streams
    async with connect_client(piper_server) as c:
        for i in range(limit):
            await c.send({"type": "start", "id": f"m{i}", "text": LONG})
        await c.send({"type": "start", "id": "over", "text": "hi"})
        err = await c.error("over")
        assert err["code"] == "too_many_streams"
        for i in range(limit):
            await c.send({"type": "cancel", "id": f"m{i}"})
        for i in range(limit):
            assert (await c.collect(f"m{i}")).end["reason"] == "cancelled"
        assert_good_stream(await c.speak("Room again.", "over"))


async def test_http_endpoints(piper_server):
    assert piper_server.get("/healthz") == (200, "ok\n")
    assert piper_server.get("/readyz") == (200, {"status": "ready"})
    status, info = piper_server.get("/v1/info")
    assert status == 200
    assert info["engine"] == "piper" and info["device"] == "cpu" and info["sample_rate"] == 22050
    assert info["slots"] == 4 == info["max_batch"] and {"sessions", "active", "queued", "streams_open"} <= set(info)
    # old name, one release
    assert [d["slots"] for d in info["devices"]] == [d["max_batch"] for d in info["devices"]] == [4]
    assert info["slots_measure"] is None               # --slots 4: nothing measured sizes them
    assert piper_server.get("/nope")[0] == 404


# ------------------------------------------------------------------ dedicated servers


async def test_readiness_before_and_after_load(start_server):
    engine = GatedPiper()
    server = start_server(engine, wait=False)
    status, body = server.get("/readyz")
    assert status == 503 and body["status"] == "loading"
    speech = httpx.post(server.http + "/v1/audio/speech", json={"input": "hi"})
    assert speech.status_code == 503 and speech.json()["error"]["code"] == "not_ready"
    assert speech.headers["retry-after"] == str(math.ceil(LOADING_RETRY_AFTER_S))
    async with connect_client(server) as c:
        assert c.hello["status"] == "loading"
        await c.send({"type": "start", "id": "early", "text": "hi"})
        err = await c.error("early")
        assert err["code"] == "not_ready" and err["retryable"] is True
        assert err["retry_after_s"] == LOADING_RETRY_AFTER_S
        engine.gate.set()
        server.wait_ready()
        assert server.get("/readyz")[0] == 200
        assert_good_stream(await c.speak("Now I am ready.", "late"))


async def test_failed_load_reports_503_with_reason(start_server):
    engine = GatedPiper(fail=True)
    engine.gate.set()
    server = start_server(engine, wait=False)
    await wait_until(lambda: server.devices.status == "failed")
    status, body = server.get("/readyz")
    assert status == 503 and body["status"] == "failed" and "weights are corrupt" in body["error"]


class FaultyPiper(PiperEngine):
    """The real Piper voice with a fault injected into any request whose text asks for one."""

    def step(self, batch):
        if "#fail" in batch[0].text:
            raise RuntimeError("injected fault")
        return super().step(batch)


@pytest.mark.hardening                   # a fault: the full lane's
async def test_engine_exception_in_one_stream_leaves_others_intact(start_server):
    server = start_server(FaultyPiper(), slots=4)
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "ok1", "text": LONG[:200]})
        await c.send({"type": "start", "id": "bad", "text": "This one will #fail now."})
        await c.send({"type": "start", "id": "ok2", "text": LONG[:200]})
        ok1, bad, ok2 = [await c.collect(sid) for sid in ("ok1", "bad", "ok2")]
        assert bad.error["code"] == "internal" and "injected fault" in bad.error["message"]
        assert bad.end is None
        assert_good_stream(ok1, 2.0)
        assert_good_stream(ok2, 2.0)
        assert_good_stream(await c.speak("And the next one works.", "next"))
    assert server.devices.status == "ready"


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_slots_measured_on_a_busy_machine_are_measured_again_and_follow_the_new_measure(start_server):
    """`--slots auto` on the real Piper worker: a start's measure taken on a busy machine (here:
    under a threshold no measure can reach, as the test cannot make the machine busy at will)
    is kept, measured again once its back-off is over (the test's clock) and the engine is
    idle; one still busy keeps the best; one on a quiet machine is final and sizes the slots,
    which /v1/info, /v1/load and the queue then all say."""
    clock = Clock()
    policy = RemeasurePolicy(contended_below=2.0, backoff_s=(30.0, 60.0, 120.0), clock=clock)
    engine = PiperEngine(remeasure=policy)
    server = start_server(engine, slots=None)
    (loop,) = server.engine_loops
    info = server.get("/v1/info")[1]
    first = info["slots_measure"]
    assert first["contended"] and first["remeasures"] == 0 and first["next_at"] is not None
    assert first == info["devices"][0]["slots_measure"]
    assert info["slots"] == slots_for_speed(engine.slot_sizing.chosen.speed)[0]
    assert "on a busy machine" in info["slots_reason"] and "measured again when idle" in info["slots_reason"]

    clock.now = 30.0                        # still busy, by the threshold
    loop.wake()
    await wait_until(lambda: server.get("/v1/info")[1]["slots_measure"]["remeasures"] == 1)
    info = server.get("/v1/info")[1]
    assert info["slots_measure"]["contended"]
    assert info["slots_measure"]["speed"] >= first["speed"]         # the best kept
    assert "the best of 2 measures" in info["slots_reason"]

    policy.contended_below = 0.0            # quiet now
    clock.now = 30.0 + 60.0
    loop.wake()
    await wait_until(lambda: server.get("/v1/info")[1]["slots_measure"]["remeasures"] == 2)
    info = server.get("/v1/info")[1]
    measure = info["slots_measure"]
    assert measure["contended"] is False and measure["next_at"] is None
    assert measure["measured_at"] > first["measured_at"]
    slots = slots_for_speed(engine.slot_sizing.chosen.speed)[0]
    assert info["slots"] == slots == info["devices"][0]["slots"] == loop.queue.slots
    assert server.get("/v1/load")[1]["slots"] == slots
    assert "measured again at" in info["slots_reason"] and "set aside" in info["slots_reason"]
    async with connect_client(server) as c:
        assert c.hello["slots"] == slots
        assert_good_stream(await c.speak(SENTENCE, "after"))


async def test_queue_position_and_busy(start_server):
    server = start_server(PiperEngine(), slots=1, max_queue=1)
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "a", "text": LONG})
        await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "a")
        await c.send({"type": "start", "id": "b", "text": "Second."})
        start_b = await c.recv_where(lambda m: m["type"] == "start" and m["id"] == "b")
        assert start_b["queued"] == 1
        await c.send({"type": "start", "id": "c", "text": "Third."})
        err = await c.error("c")
        assert err["code"] == "busy" and err["retryable"] is True
        await c.send({"type": "cancel", "id": "a"})
        b = await c.collect("b")
        b.start = start_b
        assert_good_stream(b)


@pytest.mark.slow
async def test_idle_connection_is_reaped_with_documented_code(start_server):
    server = start_server(PiperEngine(), idle_timeout_s=0.6)
    async with connect_client(server) as c:
        # A stream keeps the connection alive past the idle timeout...
        assert_good_stream(await c.speak(SENTENCE, "busy"))
        # ... then, quiet, it is closed (the receive's own time-out is many idle time-outs).
        with pytest.raises(ConnectionClosed):
            await c.recv(timeout=60)
        assert c.ws.close_code == 4000 and c.ws.close_reason == "idle timeout"


async def test_frame_beyond_transport_limit_closes_with_1009(piper_server):
    # A bare connection: the server drops it mid-frame, which the client's context manager
    # exit does not expect.
    ws = await connect(piper_server.url, max_size=None)
    await ws.recv()
    await ws.send(b"\x00" * (piper_server.config.limits.max_frame_bytes * 4 + 1))
    with pytest.raises(ConnectionClosed):
        await asyncio.wait_for(ws.recv(), 10)
    assert ws.close_code == 1009
    async with connect_client(piper_server) as c:
        assert_good_stream(await c.speak("The server is fine.", "after"))


async def test_voice_and_lora_are_refused_clearly_by_piper(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "voice", "id": "v1", "audio": b"RIFF....", "transcript": "hi"})
        err = await c.error("v1")
        assert err["code"] == "unsupported"
        await c.send({"type": "lora", "id": "l1", "op": "load", "name": "x"})
        err = await c.error("l1")
        assert err["code"] == "unauthorized"
        await c.send({"type": "start", "id": "adapted", "text": "Hi.", "lora": "x"})
        err = await c.error("adapted")
        assert err["code"] == "unsupported" and "no LoRA support" in err["message"]
        assert_good_stream(await c.speak("Still fine.", "after"))


def added_silence_s(pcm, rate: int) -> float:
    """Seconds of the audio in runs of exact zeros of 1 s or more: silence added to the speech
    (the voice's own pauses are never that long, nor digital zeros)."""
    import numpy as np

    zero = np.concatenate([[0], (np.asarray(pcm) == 0).astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(zero))
    runs = edges[1::2] - edges[::2]
    return float(runs[runs >= rate].sum()) / rate


@pytest.mark.hardening
async def test_added_silence_is_one_bound_however_it_is_asked_for(piper_server):
    """Hardening VI, 10: `sentence_silence` escaped the 30 s bound SSML breaks had (990
    characters of short sentences at 5 s: 501 s of silence), the bound on breaks was counted
    before the speed stretched them (30 s heard as 120 s at 0.25), and speed 0.25 with
    `length_scale` 4 made speech 16 times slower (330 characters: 1,156 s of audio). Now every
    kind of added silence counts, as heard, against one 30 s bound: a one-shot text over it is
    refused `too_large` before any audio, streamed input ends `too_large` at the segment that
    would pass it (having had 30 s); and speed and `length_scale` together slow speech at most
    4 times (`bad_request`)."""
    import io
    import wave

    import numpy as np

    short = "Yes, now. " * 99                                      # 990 characters, 99 sentences
    rate = 22050
    async with connect_client(piper_server) as c:
        # One-shot: over the bound as asked, refused before any audio.
        refused = await c.speak(short, "silent", options={"sentence_silence": 5.0})
        assert refused.error["code"] == "too_large" and not refused.chunks, refused.error
        assert "sentence silence" in refused.error["message"]
        breaks = "<speak>" + '<break time="10s"/>Yes. ' * 3 + "</speak>"       # 30 s, heard 120 s
        slowed_breaks = await c.speak(breaks, "breaks", speed=0.25)
        assert slowed_breaks.error["code"] == "too_large" and not slowed_breaks.chunks
        stretched = await c.speak(short[:330], "slow", speed=0.25, options={"length_scale": 4.0})
        assert stretched.error["code"] == "bad_request" and "16 times slower" in stretched.error["message"]
        # Streamed input: 7 sentences at 5 s each; 6 are spoken with their 30 s, the 7th ends it.
        await c.send({"type": "start", "id": "fed", "stream_input": True, "format": "f32",
                      "options": {"sentence_silence": 5.0}})
        await c.send({"type": "chunk", "id": "fed", "text": "Yes, now. " * 7})
        await c.send({"type": "end", "id": "fed"})
        fed = await c.collect("fed")
        assert fed.error is not None and fed.error["code"] == "too_large", fed.error
        assert added_silence_s(fed.pcm(), rate) == pytest.approx(30.0, abs=0.05)
        # Good requests: silence within the bound, exactly as asked (3 sentences, 2 s each).
        good = await c.speak("Yes, now. " * 3, "good", options={"sentence_silence": 2.0})
        assert_good_stream(good)
        assert added_silence_s(good.pcm(), rate) == pytest.approx(6.0, abs=0.05)
        assert_good_stream(await c.speak(short[:330], "paced", speed=0.5, options={"length_scale": 2.0}))

    def post(**fields) -> httpx.Response:
        return httpx.post(piper_server.http + "/v1/audio/speech", timeout=120, json={
            "voice": "alloy", "response_format": "wav", "stream": False, **fields})

    # The OpenAI door: the same request refused, the same bound on the slowing, a good one served.
    over = await asyncio.to_thread(post, input=short, sentence_silence=5.0)
    assert over.status_code == 413 and over.json()["error"]["code"] == "too_large", over.text
    slow = await asyncio.to_thread(post, input=short[:330], speed=0.25, length_scale=4.0)
    assert slow.status_code == 400 and slow.json()["error"]["param"] == "speed", slow.text
    just_over = await asyncio.to_thread(post, input=short[:310], sentence_silence=1.0)
    assert just_over.status_code == 413, just_over.text                    # 31 sentences, 31 s
    served = await asyncio.to_thread(post, input=short[:300], sentence_silence=1.0, sample_rate=rate)
    assert served.status_code == 200, served.text                          # 30 sentences: 30 s, the bound
    with wave.open(io.BytesIO(served.content)) as w:
        pcm = np.frombuffer(w.readframes(w.getnframes()), "<i2")
    assert added_silence_s(pcm, rate) == pytest.approx(30.0, abs=0.05)
