"""What agents are told of their use and of when to come back: `usage` at the end of every
stream (protocol v1's `end`, OpenAI's SSE `speech.audio.done`) adding up to what the client
received; usage per owner in /metrics, hashed and bounded; retry hints (`retry_after_s`,
`Retry-After`) computed from the queue's measured pace, shrinking as the queue moves."""

from __future__ import annotations

import base64
import json
import math
import threading
import time

import pytest

from conftest import WAIT_TIMEOUT, assert_good_stream, bytes_to_pcm, connect_client, wait_until
from vox_ws.engine import GenerationRequest, Refused
from vox_ws.engines.piper import PiperEngine
from vox_ws.scheduling.queue import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, QueuePace
from vox_ws.service.metrics import MAX_OWNER_SERIES, Metrics, owner_label
from vox_ws.testing.tone import ToneEngine

TEXT = "Usage adds up. It counts what was sent."


def chunk_seconds(chunks: list[dict], fmt: str, rate: int) -> float:
    return sum(len(bytes_to_pcm(c["audio"], fmt)) for c in chunks) / rate


def assert_usage_is_what_was_received(result, characters: int) -> None:
    usage = result.end["usage"]
    assert usage["characters"] == characters
    assert usage["chunks"] == len(result.chunks)
    sent = chunk_seconds(result.chunks, result.start["format"], result.start["sample_rate"])
    assert abs(usage["audio_s"] - sent) < 1e-3


def metric(server, name: str, owner: str) -> float:
    status, text = server.get("/metrics")
    assert status == 200
    for line in text.splitlines():
        if line.startswith(f'{name}{{owner="{owner}"}}'):
            return float(line.split()[-1])
    return 0.0


SECRET = "usage-test-secret"


@pytest.fixture(scope="module")
def piper(start_server):
    return start_server(PiperEngine(), slots=2, metrics_secret=SECRET)


async def test_usage_over_v1_adds_up_for_one_shot_streamed_and_cancelled_text(piper):
    owner = owner_label("address:127.0.0.1", SECRET.encode())
    characters_before = metric(piper, "voxws_owner_characters_total", owner)
    audio_before = metric(piper, "voxws_owner_audio_seconds_total", owner)
    async with connect_client(piper) as c:
        one_shot = await c.speak(TEXT, "one")
        assert_good_stream(one_shot)
        assert_usage_is_what_was_received(one_shot, len(TEXT))

        pieces = ["Streamed in ", "three pieces, ", "then ended."]
        await c.send({"type": "start", "id": "in", "stream_input": True})
        for piece in pieces:
            await c.send({"type": "chunk", "id": "in", "text": piece})
        await c.send({"type": "end", "id": "in"})
        streamed = await c.collect("in")
        assert_good_stream(streamed)
        assert_usage_is_what_was_received(streamed, sum(map(len, pieces)))

        # Cancelled at its first chunk: usage is what was sent, not what was generated.
        long_text = "A long text that will be cut off at its first chunk, long before its end. " * 8
        await c.send({"type": "start", "id": "cut", "text": long_text})
        first = await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "cut")
        await c.send({"type": "cancel", "id": "cut"})
        cut = await c.collect("cut")
        cut.chunks.insert(0, first)
        assert cut.end["reason"] == "cancelled"
        assert_usage_is_what_was_received(cut, len(long_text))
        assert cut.end["usage"]["audio_s"] == cut.end["heard"]["audio_s"]
    # Per owner in /metrics: the address, hashed.
    used = one_shot.end["usage"], streamed.end["usage"], cut.end["usage"]
    assert metric(piper, "voxws_owner_characters_total", owner) - characters_before == sum(u["characters"]
                                                                                            for u in used)
    assert metric(piper, "voxws_owner_audio_seconds_total", owner) - audio_before == \
        pytest.approx(sum(u["audio_s"] for u in used), abs=1e-3)


def test_usage_in_openais_sse_done_event_adds_up(piper):
    import openai

    client = openai.OpenAI(base_url=piper.http + "/v1", api_key="unused", max_retries=0)
    deltas, done = [], None
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format="pcm", stream_format="sse") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.delta":
                    deltas.append(base64.b64decode(event["audio"]))
                elif event["type"] == "speech.audio.done":
                    done = event
    usage = done["usage"]
    assert usage["characters"] == len(TEXT) and usage["chunks"] == len(deltas)
    assert usage["audio_s"] == pytest.approx(sum(len(d) for d in deltas) / 2 / 24_000, abs=1e-3)
    assert (usage["input_tokens"] == len(TEXT)
            and usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"])


async def test_usage_on_the_tiny_voxcpm(tiny_voxcpm):
    async with connect_client(tiny_voxcpm) as c:
        result = await c.speak(TEXT, "v", options={"max_len": 6}, phoneme_timestamps=True)
        assert result.end["reason"] == "max_len"
        assert_usage_is_what_was_received(result, len(TEXT))
        # VoxCPM2 knows no phoneme times: it says so, and sends none.
        assert "phoneme_timestamps" in result.start["ignored_options"]
        assert "phoneme_timestamps" not in c.hello["features"]
        assert not [m for m in c.log if m[0] == "phonemes"]


def test_usage_series_per_owner_are_bounded_and_kept_by_the_owners_seen_last():
    metrics = Metrics(b"k")
    metrics.count_usage("address:10.0.0.1", 5, 1.0)                # early, and busy again later
    for n in range(MAX_OWNER_SERIES + 10):
        metrics.count_usage(f"address:10.1.{n // 256}.{n % 256}", 10, 1.0)
        if n == MAX_OWNER_SERIES // 2:
            metrics.count_usage("address:10.0.0.1", 5, 1.0)
    text = metrics.exposition().decode()
    series = [line for line in text.splitlines() if line.startswith("voxws_owner_characters_total{")]
    assert len(series) == MAX_OWNER_SERIES + 1              # and the evicted owners' "other"
    assert f'voxws_owner_characters_total{{owner="{owner_label("address:10.0.0.1", b"k")}"}} 10.0' in series
    # The ones unseen the longest gave their series up; the newest have theirs.
    assert owner_label("address:10.1.0.0", b"k") not in text
    assert owner_label(f"address:10.1.1.{MAX_OWNER_SERIES + 9 - 256}", b"k") in text


def test_the_sum_of_usage_only_grows_when_owners_are_evicted():
    """Hardening V, 12: 256 one-word requests evicted a client's series, and the sum over the
    series went down from 2,218 to 768 characters. Evicted usage moves into "other"."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics = Metrics(b"k")
    metrics.count_usage("address:192.0.2.1", 1450, 90.0)
    sums = []
    for n in range(MAX_OWNER_SERIES + 1):
        metrics.count_usage(f"address:10.2.{n // 256}.{n % 256}", 3, 0.25)
        families = {f.name: f for f in text_string_to_metric_families(metrics.exposition().decode())}
        sums.append(sum(s.value for s in families["voxws_owner_characters"].samples if s.name.endswith("_total")))
    assert sums == sorted(sums) and sums[-1] == 1450 + 3 * (MAX_OWNER_SERIES + 1)
    text = metrics.exposition().decode()
    assert owner_label("address:192.0.2.1", b"k") not in text
    assert 'voxws_owner_characters_total{owner="other"} 1453.0' in text
    assert 'voxws_owner_audio_seconds_total{owner="other"} 90.25' in text


def test_owner_labels_are_keyed_so_no_one_without_the_secret_can_tell_whose():
    import hashlib

    address = "address:192.0.2.7"
    label = owner_label(address, b"server secret")
    assert label == owner_label(address, b"server secret") != owner_label(address, b"another secret")
    # Hashing guesses finds nothing: not the bare hash of the owner (what /metrics used to show).
    assert label not in hashlib.sha256(b"vox-ws owner\0" + address.encode()).hexdigest()
    assert label not in hashlib.sha256(address.encode()).hexdigest()


# ------------------------------------------------------------------ retry hints


def test_the_pace_says_when_the_next_slot_frees_and_how_long_each_place_after_takes():
    pace = QueuePace()
    assert pace.wait_s([0.2], slots=1) == pytest.approx(QueuePace.UNMEASURED_HOLD_S - 0.2)
    for held in (4.0, 4.0):
        pace.observe(held)
    assert pace.hold_s == 4.0 and pace.observed == 2
    pace.observe(9.0)                                     # a moving mean: a fifth of the newest
    assert pace.hold_s == pytest.approx(5.0)
    # Two slots held 1 s and 3 s: the second frees in 2 s; two places after it take 5 s each
    # over two slots.
    assert pace.wait_s([1.0, 3.0], slots=2) == pytest.approx(2.0)
    assert pace.wait_s([1.0, 3.0], slots=2, after=2) == pytest.approx(7.0)
    assert pace.wait_s([1.0], slots=2) == MIN_RETRY_AFTER_S         # a slot is free now
    assert pace.wait_s([9.0], slots=1) == MIN_RETRY_AFTER_S         # overdue: any moment
    assert pace.wait_s([0.0], slots=1, after=100) == MAX_RETRY_AFTER_S


class HeldTone(ToneEngine):
    """The tone engine, whose steps wait while the test holds its gate."""

    def __init__(self) -> None:
        super().__init__(slots=1)
        self.gate = threading.Event()
        self.gate.set()

    def step(self, batch):
        assert self.gate.wait(WAIT_TIMEOUT)
        return super().step(batch)


async def test_busy_refusals_carry_a_retry_hint_from_the_queues_pace_that_shrinks_as_it_moves(start_server):
    # One slot, one queue place; while the gate is held, the stream in the slot keeps it.
    engine = HeldTone()
    server = start_server(engine, slots=1, max_queue=1, max_queue_wait_s=None)
    scheduler = server.engine_loops[0]
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("Measured first.", "first"))        # a hold is measured
    await wait_until(lambda: scheduler.queue.pace.observed >= 1)
    assert scheduler.stats()["slot_hold_s"] is not None
    scheduler.queue.pace.hold_s = 30.0          # a pace the checks below can tell from their own time
    engine.gate.clear()
    async with connect_client(server) as holder, connect_client(server) as c:
        sent_at = time.monotonic()        # the holder is admitted after this
        await holder.send({"type": "start", "id": "hold", "text": "I hold the slot."})
        await wait_until(lambda: scheduler.stats()["active"] == 1)
        await c.send({"type": "start", "id": "waits", "text": "I wait in the queue."})
        queued = await c.recv_where(lambda m: m["type"] == "start")
        assert queued["queued"] == 1
        before = scheduler.retry_after_s()
        await c.send({"type": "start", "id": "refused", "text": "No room for me."})
        refused = await c.error("refused")
        after = scheduler.retry_after_s()
        assert refused["code"] == "busy" and refused["retryable"] is True
        # The slot frees when the holder has held it 30 s, so the hint is what is left of that
        # (in hundredths: on a fast machine little enough has passed that it is still 30.0).
        left = 30.0 - (time.monotonic() - sent_at)
        assert round(left, 2) <= after <= refused["retry_after_s"] <= before <= 30.0
        # As the holder's time passes, the hint shrinks.
        await wait_until(lambda: scheduler.retry_after_s() < refused["retry_after_s"])
        await c.send({"type": "start", "id": "later", "text": "Nor for me."})
        later = await c.error("later")
        assert later["retry_after_s"] < refused["retry_after_s"]
        # HTTP says the same in whole seconds (the `openai` SDK, not retrying).
        import openai

        sdk = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
        before = scheduler.retry_after_s()
        with pytest.raises(openai.RateLimitError) as full:
            await sdk.audio.speech.create(model="tts-1", voice="alloy", input="Over HTTP.")
        after = scheduler.retry_after_s()
        assert full.value.status_code == 429 and full.value.body["code"] == "busy"
        assert math.ceil(after) <= int(full.value.response.headers["Retry-After"]) <= math.ceil(before)
        await sdk.close()
        engine.gate.set()
        assert_good_stream(await holder.collect("hold"))
        waited = await c.collect("waits")
        waited.start = queued
        assert_good_stream(waited)


def test_a_voice_store_that_is_down_and_a_loading_engine_say_when_to_retry():
    from vox_ws.engine import Readiness
    from vox_ws.scheduling.loop import LOADING_RETRY_AFTER_S, EngineLoop, not_ready
    from vox_ws.service.voices.store import STORE_RETRY_AFTER_S, StoreUnavailable

    assert StoreUnavailable("put", OSError("refused")).retry_after_s == STORE_RETRY_AFTER_S
    loading = EngineLoop(ToneEngine())
    with pytest.raises(Refused) as refused:
        loading.submit(GenerationRequest(text="Too soon.", sink=None))
    assert refused.value.retry_after_s == LOADING_RETRY_AFTER_S
    assert not_ready(Readiness.COMPILING).retry_after_s == LOADING_RETRY_AFTER_S
    assert not_ready(Readiness.FAILED, "load failed").retry_after_s is None     # trying again will not help


@pytest.mark.slow
async def test_usage_per_token_is_under_the_label_vox_ws_owner_prints(start_server, capsys, monkeypatch):
    import logging

    from vox_ws.commands.cli import main

    # `main` points the root logger at this test's captured standard error, closed after it:
    # the handlers are put back, so later tests' log lines do not go to a closed file.
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))
    monkeypatch.setattr(root, "level", root.level)

    server = start_server(PiperEngine(), tokens=["team-a-token"], metrics_secret="shared by the replicas")
    async with connect_client(server, additional_headers={"Authorization": "Bearer team-a-token"}) as c:
        result = await c.speak(TEXT, "t")
    assert main(["owner", "--token", "team-a-token"]) == 2               # no secret: no label to give
    assert "--metrics-secret" in capsys.readouterr().err
    assert main(["owner", "--token", "team-a-token", "--metrics-secret", "shared by the replicas"]) == 0
    label = capsys.readouterr().out.strip()
    assert "team-a-token" not in label and len(label) == 24
    assert metric(server, "voxws_owner_characters_total", label) == result.end["usage"]["characters"]
    assert metric(server, "voxws_owner_audio_seconds_total", label) == pytest.approx(result.end["usage"]["audio_s"],
                                                                                     abs=1e-3)
