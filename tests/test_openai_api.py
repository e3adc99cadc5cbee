"""OpenAI's speech API, through the real `openai` SDK (and httpx for what the SDK hides):
every response format streams, decodes (PyAV) to the duration the server reports, and is not
silent; SSE events; errors in OpenAI's shape; a client that leaves frees its slot."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import io
import json
import threading
import wave

import av
import httpx
import msgpack
import numpy as np
import openai
import pytest
import soundfile
from websockets.sync.client import connect as connect_sync

from attackers import assert_speaks
from conftest import WAIT_TIMEOUT, wait_idle, wait_until
from helpers import flac_streaminfo, register, speak, tiny_server
from vox_ws.engines.piper import PiperEngine
from vox_ws.service.voices.aliases import OPENAI_VOICES

TEXT = "Streaming speech from an OpenAI client. It should start before the end."
TOKEN = "openai-secret"


def decode(data: bytes, fmt: str, rate: int = 24_000) -> tuple[np.ndarray, int]:
    """Audio bytes to float samples and their rate, with FFmpeg's decoders (PyAV)."""
    if fmt == "pcm":
        return np.frombuffer(data, "<i2").astype(np.float32) / 32767.0, rate
    container = av.open(io.BytesIO(data))
    frames = [frame.to_ndarray().reshape(-1) for frame in container.decode(audio=0)]
    out_rate = container.streams.audio[0].codec_context.sample_rate
    pcm = np.concatenate(frames).astype(np.float32)
    if np.issubdtype(frames[0].dtype, np.integer):
        pcm /= 32767.0
    return pcm, out_rate


def rms(pcm: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(pcm)))) if pcm.size else 0.0


@pytest.fixture(scope="module")
def client(piper_server):
    return openai.OpenAI(base_url=piper_server.http + "/v1", api_key="unused", max_retries=0)


LONG_TEXT = " ".join(f"This is sentence number {n} of a text that takes a while to speak." for n in range(1, 4))


def stream_speech(client: openai.OpenAI, text: str = TEXT, on_first=None, **fields) -> tuple[bytes, dict[str, str]]:
    """The body and headers of one request; `on_first()` runs when the first bytes arrive."""
    data = bytearray()
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=text,
                                                            **fields) as response:
        for piece in response.iter_bytes():
            if not data and piece and on_first is not None:
                on_first()
            data += piece
        headers = dict(response.headers)
    return bytes(data), headers


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_streams_and_decodes(client, piper_server, fmt):
    """The first bytes reach the client while the text is still being spoken: the engine
    thread is held before its second step until they have (whatever the machine's speed)."""
    (scheduler,) = piper_server.engine_loops
    second_step = threading.Event()
    steps = []

    observe = scheduler.on_step                                        # the server's metrics

    def hold_the_second_step(size: int, seconds: float) -> None:       # on the engine thread
        observe(size, seconds)
        steps.append(size)
        if len(steps) == 2:
            second_step.wait(WAIT_TIMEOUT)

    generating_at_first_bytes = []

    def first_bytes() -> None:
        generating_at_first_bytes.append((httpx.get(piper_server.http + "/v1/info").json()["streams_open"],
                                           len(steps)))
        second_step.set()

    scheduler.on_step = hold_the_second_step
    # A FLAC comes whole unless `stream` says otherwise (test_the_sdks_plain_create_saves_...).
    streamed = {"extra_body": {"stream": True}} if fmt == "flac" else {}
    try:
        data, headers = stream_speech(client, LONG_TEXT, on_first=first_bytes, response_format=fmt,
                                      **streamed)
    finally:
        second_step.set()
        scheduler.on_step = observe
    rate = int(headers["x-sample-rate"])
    assert rate == 24_000
    pcm, decoded_rate = decode(data, fmt, rate)
    assert decoded_rate in (24_000, 48_000)          # Ogg Opus always decodes at 48 kHz
    assert pcm.size / decoded_rate > 5 and rms(pcm) > 0.01
    ((open_then, steps_then),) = generating_at_first_bytes
    assert open_then == 1 and steps_then <= 2 < len(steps), "the first bytes came only once generation had ended"


def test_the_sdks_plain_create_saves_flac_and_wav_that_soundfile_reads_with_their_length(client, tmp_path):
    """OpenAI's SDK sends no `stream`, even from `create()`, which reads the body whole: a FLAC
    saved so said 0 samples (its STREAMINFO goes first, streamed) and soundfile.read failed,
    `ValueError: array is too big`. Without `stream` a FLAC now comes whole, its STREAMINFO
    written by the muxer at the end (length and MD5); `stream: false` gives a WAV its true sizes.
    A plain WAV and a FLAC asked for with `stream: true` stream open-ended, as documented."""

    for fmt, extra, whole in (("flac", None, True), ("wav", {"stream": False}, True), ("wav", None, False),
                              ("flac", {"stream": True}, False)):
        reply = client.audio.speech.with_raw_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                             response_format=fmt, extra_body=extra)
        path = tmp_path / f"saved.{fmt}"
        reply.parse().write_to_file(path)
        data = path.read_bytes()
        assert ("content-length" in reply.headers) == whole, (fmt, extra)
        if fmt == "flac" and not whole:
            assert flac_streaminfo(data) == (0, bytes(16))
            continue
        pcm, rate = soundfile.read(path, dtype="int16")
        decoded, decoded_rate = decode(data, fmt)
        assert rate == decoded_rate == 24_000 and len(pcm) == decoded.size and len(pcm) > rate, (fmt, extra)
        if fmt == "flac":
            assert flac_streaminfo(data) == (len(pcm), hashlib.md5(pcm.astype("<i2").tobytes()).digest())
        elif whole:
            with wave.open(str(path)) as saved:                   # the header's sizes, as `wave` trusts them
                assert saved.getnframes() == len(pcm)


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_every_format_over_sse_decodes_to_the_reported_duration(client, fmt):
    events = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format=fmt, stream_format="sse") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    data = b"".join(base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta")
    pcm, rate = decode(data, fmt)
    assert events[-1]["type"] == "speech.audio.done"
    assert pcm.size / rate == pytest.approx(events[-1]["usage"]["audio_s"], abs=0.0011)
    assert rms(pcm) > 0.01


def test_sse_events_are_openai_shaped(client):
    events = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=TEXT,
                                                            response_format="pcm", stream_format="sse") as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    deltas = events[:-1]
    assert len(deltas) >= 2 and all(set(e) == {"type", "audio"} and e["type"] == "speech.audio.delta" for e in deltas)
    assert events[-1]["type"] == "speech.audio.done"
    assert set(events[-1]["usage"]) >= {"input_tokens", "output_tokens", "total_tokens"}


def test_sample_rate_and_engine_options_in_the_body(client):
    data, headers = stream_speech(client, response_format="wav", extra_body={"sample_rate": 16000})
    pcm, rate = decode(data, "wav")
    assert rate == 16000 and headers["x-sample-rate"] == "16000" and pcm.size > 16000


def test_instructions_piper_cannot_follow_are_named_not_refused(client):
    data, headers = stream_speech(client, response_format="pcm", instructions="Whisper, slowly.",
                                  extra_body={"cfg_value": 2.5})
    assert headers["x-ignored-parameters"] == "instructions,cfg_value"
    assert len(data) > 24_000


def test_models_list_the_served_model(client, piper_server):
    models = client.models.list()
    ids = [m.id for m in models.data]
    assert ids == [piper_server.engine.model or piper_server.engine.name]
    assert client.models.retrieve("tts-1").id == ids[0]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


BAD_BODIES = [
    ({"input": ""}, 400, "input"),
    ({"input": "   "}, 400, "input"),
    ({"input": 5}, 400, "input"),
    ({"voice": "no-such-voice"}, 400, "voice"),
    ({"voice": 7}, 400, "voice"),
    ({"response_format": "ogg"}, 400, "response_format"),
    ({"speed": 0.1}, 400, "speed"),
    ({"speed": 4.5}, 400, "speed"),
    ({"speed": "fast"}, 400, "speed"),
    ({"stream_format": "chunks"}, 400, "stream_format"),
    ({"model": 7}, 400, "model"),
    ({"sample_rate": 1000}, 400, "sample_rate"),
    ({"response_format": "opus", "sample_rate": 22050}, 400, "sample_rate"),
    ({"noise_scale": "loud"}, 400, "noise_scale"),
    ({"colour": "blue"}, 400, "colour"),
    ({"input": "x" * 6000}, 413, "input"),
    ({"instructions": "x" * 600}, 413, "instructions"),
    ({"instructions": 5}, 400, "instructions"),
]


@pytest.mark.parametrize(("fields", "status", "param"), BAD_BODIES)
def test_bad_requests_get_openai_shaped_errors(piper_server, fields, status, param):
    body = {"model": "tts-1", "voice": "alloy", "input": "Hello.", **fields}
    response = httpx.post(piper_server.http + "/v1/audio/speech", json=body, timeout=30)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


@pytest.mark.parametrize("model", ["kokoro", "tts-1-hd", "gpt-4o-mini-tts-2025-12-15", "whisper-1", "my-tts"])
def test_any_model_name_a_client_was_set_up_with_speaks(piper_server, model):
    """Open WebUI set up by Kokoro-FastAPI's guide sends `model: "kokoro"` and got 400 on every
    utterance ("External: 400"). The names clients are set up with are the served model; any
    other is served too, and named in X-Ignored-Parameters."""
    body = {"model": model, "input": "Hello there.", "voice": "alloy", "response_format": "mp3"}   # Open WebUI's shape
    response = httpx.post(piper_server.http + "/v1/audio/speech", json=body, timeout=30)
    assert response.status_code == 200 and len(response.content) > 0, response.text
    ignored = response.headers.get("x-ignored-parameters", "").split(",")
    assert ("model" in ignored) == (model in ("whisper-1", "my-tts"))


def test_the_sdk_raises_its_own_errors(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.audio.speech.create(model="tts-1", voice="nobody", input="Hi.")
    assert caught.value.body["param"] == "voice"


def test_malformed_json_wrong_type_and_huge_bodies(piper_server):
    url = piper_server.http + "/v1/audio/speech"
    response = httpx.post(url, content=b"{not json", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
    response = httpx.post(url, content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    response = httpx.post(url, content=b"input=hi", headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert response.status_code == 415 and response.json()["error"]["type"] == "invalid_request_error"
    response = httpx.post(url, content=b" " * 100_000, headers={"Content-Type": "application/json"})
    assert response.status_code == 413
    # The server is unharmed.
    assert httpx.post(url, json={"input": "Still here.", "response_format": "pcm"}, timeout=30).status_code == 200


@pytest.fixture(scope="module")
def guarded(start_server):
    return start_server(PiperEngine(), tokens=[TOKEN], slots=1, max_queue=1, max_queue_wait_s=0.5)


def test_bad_token_is_401_and_good_token_works(guarded):
    bad = openai.OpenAI(base_url=guarded.http + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.audio.speech.create(model="tts-1", voice="alloy", input="Hi.")
    assert caught.value.status_code == 401 and caught.value.body["code"] == "invalid_api_key"
    good = openai.OpenAI(base_url=guarded.http + "/v1", api_key=TOKEN, max_retries=0)
    assert len(good.audio.speech.create(model="tts-1", voice="alloy", input="Hi.", response_format="pcm").content) > 0


def test_the_lists_a_client_reads_answer_without_a_key(guarded, start_server):
    """Open WebUI lists voices and models without a key: with `--token` it got 401 and fell back
    to OpenAI's six names silently. The server's own voices and model answer anyone it serves
    (uploaded voices stay their owner's); `--private-info` keeps them behind the token."""
    voices = httpx.get(guarded.http + "/v1/audio/voices", timeout=30)
    assert voices.status_code == 200 and voices.json()["uploaded_voices"] == []
    assert {"alloy"} <= {v["id"] for v in voices.json()["voices"]}
    models = httpx.get(guarded.http + "/v1/audio/models", timeout=30)
    assert models.status_code == 200 and models.json()["models"][0]["id"]
    assert httpx.post(guarded.http + "/v1/audio/speech", json={"input": "Hi.", "voice": "alloy"}).status_code == 401
    private = start_server(PiperEngine(), tokens=[TOKEN], private_info=True)
    for path in ("/v1/audio/voices", "/v1/audio/models"):
        assert httpx.get(private.http + path, timeout=30).status_code == 401
        assert httpx.get(private.http + path, headers={"Authorization": f"Bearer {TOKEN}"},
                         timeout=30).status_code == 200


async def test_a_full_queue_is_429_with_retry_after(guarded):
    headers = {"Authorization": f"Bearer {TOKEN}"}
    # The holder reads nothing: its stream pauses on back-pressure long before its text (some
    # 100 s of speech) is spoken, so it keeps the only slot however fast the voice is.
    body = {"input": "A long sentence that keeps the only slot busy for a while. " * 30, "response_format": "pcm"}
    async with httpx.AsyncClient(base_url=guarded.http, headers=headers, timeout=60) as http:
        async with http.stream("POST", "/v1/audio/speech", json=body) as holder:
            assert holder.status_code == 200
            # One slot (busy) and one queue place: a second request waits in the queue and
            # gives up after max_queue_wait; a third finds the queue full at once.
            waiting = asyncio.ensure_future(http.post("/v1/audio/speech", json=body))
            await wait_until(lambda: guarded.devices.stats()["queued"] == 1)
            full = await http.post("/v1/audio/speech", json=body)
            assert full.status_code == 429 and "retry-after" in full.headers
            assert full.json()["error"]["type"] == "rate_limit_error"
            waited = await waiting
            assert waited.status_code == 429 and waited.json()["error"]["code"] == "busy"


async def test_a_client_that_leaves_mid_stream_frees_its_slot(piper_server):
    body = {"input": "A long text to leave in the middle of. " * 20, "response_format": "mp3"}
    async with httpx.AsyncClient(base_url=piper_server.http, timeout=60) as http:
        async with http.stream("POST", "/v1/audio/speech", json=body) as response:
            assert response.status_code == 200
            # Hold the iterator: an abandoned one is closed by the loop, and so the connection.
            pieces = response.aiter_bytes()
            assert await anext(pieces)
            info = (await http.get("/v1/info")).json()
            assert info["streams_open"] == 1, info
            await pieces.aclose()
    # The connection is closed; the stream (and its slot) go before the next step.
    info = await wait_idle(piper_server)
    assert info["streams_open"] == 0 and info["active"] == 0, info


@pytest.mark.slow
def test_a_4000_character_text_is_spoken_whole_on_piper(client):
    text = " ".join(f"Paragraph {n} says a little more, so that the whole text is long." for n in range(1, 70))[:4000]
    events = []
    with client.audio.speech.with_streaming_response.create(model="tts-1", voice="alloy", input=text,
                                                            response_format="opus", stream_format="sse") as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    done = events[-1]
    assert done["type"] == "speech.audio.done" and done["usage"]["input_tokens"] == len(text)
    pcm, rate = decode(b"".join(base64.b64decode(e["audio"]) for e in events[:-1]), "opus")
    # Some 14 characters a second: the whole text is about 4.5 minutes of speech.
    assert pcm.size / rate > 200 and pcm.size / rate == pytest.approx(done["usage"]["audio_s"], abs=0.0011)


class FailingPiper(PiperEngine):
    """The real Piper voice, with a fault injected where the text asks for one: `#early` on its
    first step, `#late` on its second (after audio went out)."""

    def step(self, batch):
        request = batch[0]
        if "#early" in request.text or ("#late" in request.text and request.steps >= 1):
            raise RuntimeError("injected fault")
        return super().step(batch)


@pytest.fixture(scope="module")
def failing(start_server):
    return start_server(FailingPiper())


def test_an_engine_failure_before_any_audio_is_a_500(failing):
    response = httpx.post(failing.http + "/v1/audio/speech", json={"input": "#early Hello."}, timeout=30)
    assert response.status_code == 500
    assert response.json()["error"] == {"message": response.json()["error"]["message"], "type": "server_error",
                                         "param": None, "code": "internal"}


def test_a_failure_after_the_first_bytes_truncates_the_body(failing):
    long = "#late " + " ".join(f"Sentence {n} goes on for a while." for n in range(12))
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", failing.http + "/v1/audio/speech", json={"input": long, "response_format": "pcm"},
                          timeout=30) as response:
            assert response.status_code == 200
            for _ in response.iter_bytes():
                pass
    # Over SSE an error event says why before the connection drops.
    events = []
    with pytest.raises(httpx.RemoteProtocolError):
        with httpx.stream("POST", failing.http + "/v1/audio/speech",
                          json={"input": long, "response_format": "pcm", "stream_format": "sse"}, timeout=30) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
    assert events[0]["type"] == "speech.audio.delta"
    assert events[-1]["type"] == "error" and events[-1]["error"]["code"] == "internal"
    # The server goes on serving.
    assert httpx.post(failing.http + "/v1/audio/speech", json={"input": "Fine.", "response_format": "pcm"},
                      timeout=30).status_code == 200


def test_openai_shaped_voice_routes_on_an_engine_that_cannot_clone(client, piper_server):
    """Piper: `/v1/audio/voices` lists its built-in voice and no uploads; an upload is 501, as
    over `/v1/voices`."""
    listed = client.get("/audio/voices", cast_to=object)
    assert listed["uploaded_voices"] == [] and listed["voices"][0] == {"id": "joe", "name": "joe", "kind": "builtin",
                                                                       "languages": ["en_US"]}
    # OpenAI's names are aliases of the one voice there is.
    assert {(v["id"], v["kind"], v["voice"]) for v in listed["voices"][1:]} == \
        {(name, "alias", "joe") for name in OPENAI_VOICES}
    with pytest.raises(openai.APIStatusError) as refused:
        client.post("/audio/voices", cast_to=object, options={"headers": {"Content-Type": "multipart/form-data"}},
                    body={"name": "me"}, files=[("audio_sample", ("a.wav", b"RIFF", "audio/wav"))])
    assert refused.value.status_code == 501 and refused.value.body["code"] == "unsupported"


@pytest.mark.hardening
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


@pytest.mark.hardening
async def test_the_openai_door_speaks_a_stored_voice_this_process_never_built(start_server, tiny_model, tmp_path):
    import openai

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


def test_kokoro_fastapis_download_fields_are_taken_and_said_ignored(client):
    """Kokoro-FastAPI's clients send `download_format` and `return_download_link` (a copy kept on
    its server to fetch later); vox-ws answered 400 "Unrecognized request argument". They are
    taken: the speech comes, and X-Ignored-Parameters names them (no copy is kept here)."""
    data, headers = stream_speech(client, response_format="pcm",
                                  extra_body={"download_format": "mp3", "return_download_link": True})
    assert len(data) > 24_000
    assert headers["x-ignored-parameters"].split(",") == ["download_format", "return_download_link"]
    # Kokoro's defaults (no link asked for) change nothing, so nothing is said ignored.
    data, headers = stream_speech(client, response_format="pcm", extra_body={"return_download_link": False})
    assert len(data) > 24_000 and "x-ignored-parameters" not in headers


@pytest.mark.slow                        # over 4.5 s: the full lane's
def test_a_model_served_from_a_directory_is_named_by_it_not_by_its_path(tiny_voxcpm, tiny_model):
    """`/v1/audio/models` named a VoxCPM2 checkpoint served from a directory by its absolute path
    (where the server's files lie, and not the same on the next machine). It is named by the
    directory's name, in every list and v1's hello, and a client that sends that name is served it, not told
    the model was ignored."""
    sdk = openai.OpenAI(base_url=tiny_voxcpm.http + "/v1", api_key="unused", max_retries=0)
    audio_models = httpx.get(tiny_voxcpm.http + "/v1/audio/models", timeout=30).json()["models"]
    assert [(m["id"], m["name"]) for m in audio_models] == [(tiny_model.name, tiny_model.name)]
    assert [m.id for m in sdk.models.list().data] == [tiny_model.name]
    assert sdk.models.retrieve(tiny_model.name).id == tiny_model.name
    with connect_sync(tiny_voxcpm.url) as ws:                              # v1's hello names it so too
        assert msgpack.unpackb(ws.recv(timeout=30), raw=False)["model"] == tiny_model.name
    with sdk.audio.speech.with_streaming_response.create(model=tiny_model.name, voice="alloy", input="Hi.",
                                                         response_format="pcm") as response:
        assert response.read() and "x-ignored-parameters" not in response.headers
