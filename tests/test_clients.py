"""What the clients self-hosters point at a TTS server need: a voice list Open WebUI reads, voices
named as the client names them (OpenAI's names, the uploader's own), several Piper voices, the
peers' request fields, languages, CORS for pages on other origins; each through the real client
(the `openai` SDK, Wyoming's own client, Chromium) against a real server with the Piper voice."""

from __future__ import annotations

import asyncio
import functools
import http.server
import io
import json
import logging
import os
import random
import subprocess
import sys
import threading
import wave
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from conftest import assert_good_stream, connect_client
from helpers import make_voice
from vox_ws.clients.v1 import MAX_RETRY_WAIT_S, retry_delay
from vox_ws.commands.cli import build_parser, config_from_args
from vox_ws.commands.logs import TEXT_FORMAT, JsonFormatter, TextFormatter
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.piper_voices import voice_set
from vox_ws.service.voices.aliases import (
    OPENAI_VOICES,
    Alias,
    check_aliases,
    default_aliases,
    default_voice_for,
    for_engine,
    load_aliases,
)
from vox_ws.voice_tags import voice_tag

SENTENCE = "Hello there, this is one of the voices speaking a sentence."
@pytest.fixture(scope="module")
def slow_voice(tmp_path_factory) -> Path:
    return make_voice(tmp_path_factory.mktemp("piper-voices"))


@pytest.fixture(scope="module")
def two_voices(start_server, slow_voice):
    """Piper with the bundled joe (the default) and a second voice file, named `slow`."""
    engine = PiperEngine(voices=voice_set([f"slow={slow_voice}"]))
    return start_server(engine, slots=2, wyoming="tcp://127.0.0.1:0")


def sdk(server, **kwargs) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0, **kwargs)


def wav_seconds(data: bytes) -> float:
    """A whole WAV file's length (a streamed one's header cannot know it: its data is read)."""
    with wave.open(io.BytesIO(data)) as w:
        return len(data[data.index(b"data") + 8:]) / (w.getsampwidth() * w.getframerate())


# ------------------------------------------------------------------------------ voices


def test_open_webui_lists_the_voices_and_speaks_with_each(two_voices):
    """As Open WebUI's audio router does: GET /audio/models and /audio/voices, `{v['id']: v['name']}`,
    then POST /audio/speech with the model and each voice id."""
    base = two_voices.http + "/v1"
    models = httpx.get(base + "/audio/models").json()["models"]
    assert [m["id"] for m in models] == ["piper:en_US-joe-medium"]
    data = httpx.get(base + "/audio/voices").json()
    voices = {voice["id"]: voice["name"] for voice in data["voices"]}
    assert {"joe", "slow", *OPENAI_VOICES} <= set(voices)
    lengths = {}
    for voice in ("joe", "slow", "alloy", "ash"):
        reply = httpx.post(base + "/audio/speech", json={"model": models[0]["id"], "input": SENTENCE, "voice": voice,
                                                         "response_format": "wav"}, timeout=60)
        assert reply.status_code == 200, reply.text
        lengths[voice] = wav_seconds(reply.content)
    # OpenAI's names fall on the served voices in turn: alloy is joe, ash the slow voice.
    assert lengths["slow"] > 1.3 * lengths["joe"] and lengths["ash"] > 1.3 * lengths["alloy"]


def test_several_piper_voices_are_listed_and_chosen_everywhere(two_voices):
    async def over_v1() -> dict:
        async with connect_client(two_voices) as c:
            assert c.hello["voices"] == ["joe", "slow"] and c.hello["languages"] == ["en_US", "en_GB"]
            joe = await c.speak(SENTENCE, "joe", voice="joe", format="s16")
            slow = await c.speak(SENTENCE, "slow", voice="slow", format="s16")
            unknown = await c.speak(SENTENCE, "nobody", voice="nobody")
        assert_good_stream(joe)
        assert_good_stream(slow)
        assert unknown.error["code"] == "bad_request" and "'nobody'" in unknown.error["message"]
        return {"joe": joe.seconds, "slow": slow.seconds}

    v1 = asyncio.run(over_v1())
    assert v1["slow"] > 1.3 * v1["joe"]
    listed = httpx.get(two_voices.http + "/v1/voices").json()["voices"]
    assert listed[:2] == [{"id": "joe", "kind": "builtin", "languages": ["en_US"]},
                          {"id": "slow", "kind": "builtin", "languages": ["en_GB"]}]
    info = two_voices.get("/v1/info")[1]
    assert info["voices"] == ["joe", "slow"] and info["languages"] == ["en_US", "en_GB"]
    assert info["aliases"]["alloy"] == {"voice": "joe"} and info["aliases"]["ash"] == {"voice": "slow"}


async def test_wyoming_describes_each_voice_with_its_language_and_speaks_it(two_voices):
    async def utterance_seconds(c: AsyncTcpClient, voice: SynthesizeVoice) -> float:
        await c.write_event(Synthesize(text=SENTENCE, voice=voice).event())
        samples, rate = 0, 0
        while True:
            event = await asyncio.wait_for(c.read_event(), 60)
            if event.type == "audio-start":
                rate = event.data["rate"]
            elif event.type == "audio-chunk":
                samples += len(event.payload) // 2
            elif event.type == "audio-stop":
                return samples / rate
            else:
                raise AssertionError(event)

    async with AsyncTcpClient("127.0.0.1", two_voices.server.wyoming.port) as c:
        await c.write_event(Describe().event())
        info = Info.from_event(await asyncio.wait_for(c.read_event(), 60))
        # The built-in voices first, each with its language (then the aliases).
        assert [(v.name, v.languages) for v in info.tts[0].voices][:2] == [("joe", ["en_US"]), ("slow", ["en_GB"])]
        joe = await utterance_seconds(c, SynthesizeVoice(name="joe"))
        slow = await utterance_seconds(c, SynthesizeVoice(name="slow"))
        # Home Assistant may name only a language: the voice that speaks it.
        british = await utterance_seconds(c, SynthesizeVoice(language="en_GB"))
        by_language_name = await utterance_seconds(c, SynthesizeVoice(name="en_GB"))
    assert slow > 1.3 * joe and british > 1.3 * joe and by_language_name > 1.3 * joe


def test_piper_voice_files_are_checked_at_start(tmp_path, slow_voice):
    args = build_parser().parse_args(["serve", "--piper-voice", f"slow={slow_voice}",
                                      "--piper-voice", str(slow_voice)])
    assert config_from_args(args).engine_settings["piper_voice"] == [f"slow={slow_voice}", str(slow_voice)]
    named = voice_set([str(slow_voice)])
    assert [(v.name, v.language) for v in named] == [("joe", "en_US"), ("en_GB-slow-medium", "en_GB")]
    with pytest.raises(ValueError, match="no such file"):
        voice_set([str(tmp_path / "missing.onnx")])
    lone = tmp_path / "lone.onnx"
    lone.write_bytes(b"onnx")
    with pytest.raises(ValueError, match="not beside it"):
        voice_set([str(lone)])
    with pytest.raises(ValueError, match="served already"):
        voice_set([f"joe={slow_voice}"])
    other_rate = make_voice(tmp_path / "rate", "low", rate=16000)
    with pytest.raises(ValueError, match="16000 Hz"):
        voice_set([str(other_rate)])


def test_openai_names_keep_their_voices_when_voices_come_and_go(tmp_path):
    """OpenAI's names were dealt over the built-in voices in turn: one more voice in the folder
    changed what almost every name sounded like (`ash` among them), and a German voice got some
    of them. Now a voice added takes only the names it ranks first for, a voice taken away gives
    up only its own, and the names fall on the voices of the default voice's language."""
    def dealt(voices: list[str]) -> dict[str, str]:
        return {name: default_voice_for(name, voices) for name in OPENAI_VOICES}

    voices = ["joe", "en_GB-alan-medium", "en_US-lessac-medium", "en_US-ryan-high"]
    before = dealt(voices)
    assert len(set(before.values())) > 1
    added = dealt([*voices[:2], "en_US-amy-medium", *voices[2:]])
    assert all(added[name] in (before[name], "en_US-amy-medium") for name in OPENAI_VOICES)
    assert "en_US-amy-medium" in added.values()
    gone = dealt([voice for voice in voices if voice != "en_GB-alan-medium"])
    assert all(gone[name] == before[name] for name in OPENAI_VOICES if before[name] != "en_GB-alan-medium")

    make_voice(tmp_path, "en_GB-slow-medium")
    make_voice(tmp_path, "de_DE-slow-medium", language="de_DE")
    aliases = default_aliases(PiperEngine(voices=voice_set([], str(tmp_path))))
    assert {alias.voice for alias in aliases.values()} == {"joe", "en_GB-slow-medium"}


@pytest.mark.slow
def test_aliases_from_a_file_name_voices_and_a_bad_one_is_left_out(start_server, slow_voice, tmp_path, caplog):
    aliases = tmp_path / "aliases.toml"
    aliases.write_text('narrator = "slow"\nalloy = "joe"\necho = false\n[ghost]\nvoice = "nobody"\n')
    assert set(load_aliases(str(aliases))) == {"narrator", "alloy", "echo", "ghost"}
    server = start_server(PiperEngine(voices=voice_set([f"slow={slow_voice}"])), voice_aliases=str(aliases))
    with caplog.at_level(logging.ERROR, "vox_ws.service"):
        listed = httpx.get(server.http + "/v1/audio/voices").json()["voices"]
    # The file's names over the defaults (it replaced them all: Open WebUI lost OpenAI's names);
    # `echo = false` takes one away; the bad one is left out.
    assert {v["id"] for v in listed if v["kind"] == "alias"} == {"narrator", *OPENAI_VOICES} - {"echo"}
    assert "'ghost'" in caplog.text and "'nobody'" in caplog.text
    client = sdk(server)
    said = client.audio.speech.create(model="tts-1", voice="narrator", input=SENTENCE, response_format="wav")
    plain = client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format="wav")
    assert wav_seconds(said.content) > 1.3 * wav_seconds(plain.content)
    assert len(client.audio.speech.create(model="tts-1", voice="nova", input=SENTENCE, response_format="pcm").content)
    with pytest.raises(openai.BadRequestError) as unknown:
        client.audio.speech.create(model="tts-1", voice="echo", input=SENTENCE)
    assert unknown.value.body["code"] == "voice_not_found"
    bad = tmp_path / "bad.json"
    bad.write_text('{"x": {"voice": "joe", "pitch": 2}}')
    with pytest.raises(ValueError, match="unknown field 'pitch'"):
        load_aliases(str(bad))


def test_the_documented_aliases_file_serves_piper_and_voxcpm_without_an_error(start_server, slow_voice,
                                                                              tiny_voxcpm, tmp_path, caplog):
    """docs/PROTOCOL.md's aliases file, as written: its `[nova]`, a voice designed from words, is
    VoxCPM2's, and on Piper it was logged as an ERROR at every start. Marked `engine = "voxcpm"`,
    Piper leaves it out with an info line and keeps its default `nova`; VoxCPM2 serves it."""
    protocol = (Path(__file__).resolve().parents[1] / "docs" / "PROTOCOL.md").read_text()
    example = protocol.split("## Voice names", 1)[1].split("```toml\n", 1)[1].split("```", 1)[0]
    aliases = tmp_path / "aliases.toml"
    aliases.write_text(example)
    assert load_aliases(str(aliases))["nova"].engine == "voxcpm"
    server = start_server(PiperEngine(voices=voice_set([f"alan={slow_voice}"])), voice_aliases=str(aliases))
    with caplog.at_level(logging.INFO, "vox_ws.service"):
        listed = {v["id"]: v for v in httpx.get(server.http + "/v1/audio/voices").json()["voices"]}
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []
    assert "nova for another engine than piper: left out" in caplog.text
    info = httpx.get(server.http + "/v1/info").json()["aliases"]
    assert info["nova"]["voice"] in ("joe", "alan") and "instructions" not in info["nova"]     # the default
    assert info["narrator"]["voice"] == "alan"
    assert {"narrator", "slow-joe", "nova"} <= set(listed) and "echo" not in listed
    assert len(sdk(server).audio.speech.create(model="tts-1", voice="nova", input=SENTENCE,
                                               response_format="pcm").content)
    voxcpm = tiny_voxcpm.server.engine
    configured, elsewhere = for_engine(load_aliases(str(aliases)), voxcpm)
    assert elsewhere == [] and configured["nova"].instructions
    assert check_aliases({"nova": configured["nova"]}, voxcpm) == []


@pytest.mark.hardening
def test_an_aliases_file_nested_too_deeply_is_refused_in_one_line(tmp_path):
    """`--voice-aliases` holding 200,000 nested arrays (JSON, or TOML's inline arrays): the
    start exited 1 with a RecursionError traceback. It is refused as any bad aliases file is:
    exit 2 and one line naming the file; a good file is read after it."""
    nested = "[" * 200_000 + "]" * 200_000
    for deep in (tmp_path / "deep.json", tmp_path / "deep.toml"):
        deep.write_text(nested if deep.suffix == ".json" else f"a = {nested}\n")
        run = subprocess.run([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0",
                              "--voice-aliases", str(deep)], capture_output=True, text=True, timeout=120,
                             env={**os.environ, "HOME": str(tmp_path)})
        assert run.returncode == 2, run.stderr
        assert run.stderr.endswith(f"vox-ws serve: {deep}: nested too deeply\n"), run.stderr
        assert "Traceback" not in run.stderr and run.stderr.count("vox-ws serve:") == 1
    good = tmp_path / "good.json"
    good.write_text('{"narrator": "joe", "echo": false}')
    assert load_aliases(str(good)) == {"narrator": Alias("narrator", "joe"), "echo": None}


def test_openai_dated_model_names_are_the_served_model(piper_server):
    client = sdk(piper_server)
    for model in ("gpt-4o-mini-tts-2025-12-15", "gpt-4o-mini-tts-2025-03-20", "tts-1-1106", "tts-1-hd-1106"):
        reply = client.audio.speech.create(model=model, voice="alloy", input="Dated.", response_format="pcm")
        assert len(reply.content) > 0
        assert client.models.retrieve(model).id == "piper:en_US-joe-medium"
    # A name it does not know is served too, and said ignored (a client set up for another server).
    other = client.audio.speech.with_raw_response.create(model="gpt-4o-mini-tts-latest", voice="alloy",
                                                         input="Yes.", response_format="pcm")
    assert other.headers["x-ignored-parameters"].split(",")[0] == "model"


# ------------------------------------------------------------------------------ the peers' fields


def test_the_peers_fields_are_taken_or_refused_by_name(piper_server):
    client = sdk(piper_server)
    for extra in ({"language": "en-US"}, {"lang_code": "a"}, {"lang_code": "en_US"}, {"volume_multiplier": 0.5},
                  {"volume": 1.5}):
        assert len(client.audio.speech.create(model="tts-1", voice="alloy", input="Fields.", response_format="pcm",
                                              extra_body=extra).content) > 0, extra
    reply = client.audio.speech.with_raw_response.create(
        model="tts-1", voice="alloy", input="Fields.", response_format="pcm",
        extra_body={"normalization_options": {"normalize": True, "url_normalization": False}})
    # Piper has no normalisation option; Kokoro's URL normalisation is not made here: both named.
    assert (set(reply.headers["x-ignored-parameters"].split(","))
            == {"normalize", "normalization_options.url_normalization"})
    for extra, param in (({"language": "not a tag!"}, "language"), ({"volume": 9}, "volume"),
                         ({"volume": "loud"}, "volume"), ({"stream": "yes"}, "stream"),
                         ({"normalization_options": {"bogus": True}}, "normalization_options.bogus"),
                         ({"stream": False, "stream_format": "sse"}, "stream"), ({"emotion": "happy"}, "emotion")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.audio.speech.create(model="tts-1", voice="alloy", input="No.", extra_body=extra)
        assert refused.value.body["param"] == param, extra
    # The server goes on serving.
    assert len(client.audio.speech.create(model="tts-1", voice="alloy", input="Still here.",
                                          response_format="pcm").content) > 0


def test_stream_false_answers_one_whole_file_with_its_length(piper_server):
    reply = httpx.post(piper_server.http + "/v1/audio/speech", timeout=60,
                       json={"input": SENTENCE, "voice": "alloy", "response_format": "wav", "stream": False})
    assert reply.status_code == 200 and int(reply.headers["content-length"]) == len(reply.content)
    assert "chunked" not in reply.headers.get("transfer-encoding", "")
    assert wav_seconds(reply.content) > 1.5
    # Its sizes are true (they said "unknown", 0xFFFFFFFF: `wave` read 2,147,483,647 frames of a
    # 1 s file), as Python's `wave` reads them; a streamed WAV keeps the open-ended header.
    with wave.open(io.BytesIO(reply.content)) as whole:
        data_at = reply.content.index(b"data") + 8
        assert whole.getnframes() == (len(reply.content) - data_at) // 2
        assert int.from_bytes(reply.content[4:8], "little") == len(reply.content) - 8
    streamed = httpx.post(piper_server.http + "/v1/audio/speech", timeout=60,
                          json={"input": SENTENCE, "voice": "alloy", "response_format": "wav"})
    assert streamed.content[4:8] == b"\xff\xff\xff\xff"


def test_volume_scales_the_audio_and_never_clips(tiny_voxcpm):
    async def speak(**fields) -> np.ndarray:
        async with connect_client(tiny_voxcpm) as c:
            result = await c.speak("Loud and soft.", "v", options={"seed": 5, "max_len": 6}, **fields)
        assert_good_stream(result, reason="max_len")
        return result.pcm()

    plain, half, loud = asyncio.run(speak()), asyncio.run(speak(volume=0.5)), asyncio.run(speak(volume=4.0))
    np.testing.assert_allclose(half, plain * 0.5, atol=1e-6)
    assert np.max(np.abs(loud)) <= 1.0 + 1e-6 and np.max(np.abs(loud)) > np.max(np.abs(plain))

    async def refused() -> dict:
        async with connect_client(tiny_voxcpm) as c:
            return (await c.speak("No.", "bad", volume=-1)).error
    assert "volume" in asyncio.run(refused())["message"]


def test_language_in_v1_cuts_the_text_by_its_rules(piper_server):
    """German abbreviates "beziehungsweise" with a period ("bzw."): with `language` the sentence stays whole."""
    async def segments(**fields) -> list[str]:
        async with connect_client(piper_server) as c:
            await c.send({"type": "start", "id": "s", "stream_input": True, "segment_events": True, **fields})
            await c.send({"type": "chunk", "id": "s", "text": "Wir sehen uns um 8 Uhr bzw. später. Ja."})
            await c.send({"type": "end", "id": "s"})
            texts = []
            while True:
                message = await c.recv_where(lambda m: m.get("id") == "s")
                if message["type"] == "segment":
                    texts.append(message["text"])
                elif message["type"] in ("end", "error"):
                    assert message["type"] == "end", message
                    return texts

    whole = ["Wir sehen uns um 8 Uhr bzw. später.", "Ja."]
    assert asyncio.run(segments(language="de")) == whole and asyncio.run(segments(lang_code="de-DE")) == whole
    assert asyncio.run(segments()) == ["Wir sehen uns um 8 Uhr bzw.", "später.", "Ja."]   # the voice's: English

    async def refused() -> dict:
        async with connect_client(piper_server) as c:
            return (await c.speak("No.", "bad", language="???")).error
    error = asyncio.run(refused())
    assert error["code"] == "bad_request" and "language" in error["message"]


# ------------------------------------------------------------------------------ CORS


class _Page(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def page_origin(tmp_path_factory):
    """A page served from another origin (another port of loopback)."""
    folder = tmp_path_factory.mktemp("page")
    (folder / "index.html").write_text("<!doctype html><title>another origin</title>")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Page, directory=str(folder)))
    thread = threading.Thread(target=server.serve_forever, name="test-page", daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


FETCH_SPEECH = """async ([url, token]) => {
  try {
    const r = await fetch(url + "/v1/audio/speech", {method: "POST",
      headers: {"Content-Type": "application/json", "Authorization": "Bearer " + token},
      body: JSON.stringify({input: "From another origin.", voice: "alloy", response_format: "pcm"})});
    const body = await r.arrayBuffer();
    return {status: r.status, bytes: body.byteLength, requestId: r.headers.get("X-Request-Id"),
            rate: r.headers.get("X-Sample-Rate")};
  } catch (err) { return {error: String(err)}; }
}"""


@pytest.mark.browser
def test_a_page_on_another_origin_calls_the_api_in_chromium(start_server, page_origin):
    from playwright.sync_api import sync_playwright

    from helpers import CHROMIUM, LAUNCH_ARGS

    server = start_server(PiperEngine(), tokens=["page-token"], cors_origins=[page_origin])
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = browser.new_page()
            page.goto(page_origin + "/")
            answer = page.evaluate(FETCH_SPEECH, [server.http, "page-token"])
            assert answer["status"] == 200 and answer["bytes"] > 0, answer
            assert answer["requestId"] and answer["rate"] == "24000"          # exposed headers
            refused = page.evaluate(FETCH_SPEECH, [server.http, "wrong"])
            assert refused["status"] == 401, refused                            # read, not hidden
            # A page the server does not name cannot read the answer.
            other = start_server(PiperEngine(), tokens=["page-token"], cors_origins=["https://elsewhere.example"])
            blocked = page.evaluate(FETCH_SPEECH, [other.http, "page-token"])
            assert "error" in blocked and "Failed to fetch" in blocked["error"], blocked
        finally:
            browser.close()


@pytest.mark.slow
def test_preflight_and_the_rules_of_cors(start_server):
    server = start_server(PiperEngine(), cors_origins=["*"])
    preflight = httpx.options(server.http + "/v1/audio/speech", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "*"
    assert "POST" in preflight.headers["access-control-allow-methods"]
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in preflight.headers
    answered = httpx.get(server.http + "/v1/audio/voices", headers={"Origin": "https://app.example"})
    assert answered.headers["access-control-allow-origin"] == "*"
    assert "Retry-After" in answered.headers["access-control-expose-headers"]
    # CORS that contradicts --allow-origin is refused at start.
    with pytest.raises(ValueError, match="allow-origin"):
        start_server(PiperEngine(), wait=False, allow_origins=["https://a.example"], cors_origins=["*"])
    with pytest.raises(ValueError, match="not among"):
        start_server(PiperEngine(), wait=False, allow_origins=["https://a.example"],
                     cors_origins=["https://b.example"])


def test_no_cors_headers_without_cors_origins(piper_server):
    answered = httpx.get(piper_server.http + "/v1/audio/voices", headers={"Origin": "https://app.example"})
    assert answered.status_code == 200 and "access-control-allow-origin" not in answered.headers
    preflight = httpx.options(piper_server.http + "/v1/audio/speech", headers={
        "Origin": "https://app.example", "Access-Control-Request-Method": "POST"})
    assert "access-control-allow-origin" not in preflight.headers


# ------------------------------------------------------------------------------ small things


def test_json_log_lines_hold_the_streams_fields(piper_server, caplog):
    async def speak() -> None:
        async with connect_client(piper_server) as c:
            assert_good_stream(await c.speak("Logged.", "logged", language="en-US"))

    with caplog.at_level(logging.INFO, "vox_ws.stream"):
        asyncio.run(speak())
    record = next(r for r in caplog.records if r.name == "vox_ws.stream" and r.fields.get("language") == "en-US")
    line = json.loads(JsonFormatter().format(record))
    assert line["logger"] == "vox_ws.stream" and line["level"] == "info" and line["event"] == "stream"
    assert line["language"] == "en-US" and line["reason"] == "done" and line["chunks"] > 0


def test_a_json_log_line_is_one_line_to_any_reader_and_keeps_a_failures_message():
    """Hardening V, 13: a client's text with Unicode line separators split a record for readers
    that split the Unicode way, and a failed stream's message was dropped (the line's own
    `message` key won)."""
    fields = {"event": "stream", "text": "one\u2028two\u0085three\u009bfour", "error": "invalid",
              "error_message": "bad \u2029 input"}
    record = logging.LogRecord("vox_ws.stream", logging.INFO, __file__, 1, "x", None, None)
    record.fields = fields
    text = JsonFormatter().format(record)
    assert text.isascii() and len(text.splitlines()) == 1
    line = json.loads(text)
    assert line["text"] == fields["text"] and line["error_message"] == "bad \u2029 input"
    assert line["message"] == "stream"


@pytest.mark.hardening
def test_no_log_line_names_a_registered_voice_by_its_id(tiny_voxcpm, caplog):
    """Hardening VI, 13: each stream's log line named its voice by its id: for a voice registered
    without a name, the capability that speaks with it from anywhere. The line names a registered
    voice by its tag now, in either format, and whatever else a line echoes (an error message, a
    file name in a traceback) says the tag for an id too; the voices speak as before."""
    from helpers import tone_wav

    async def register_and_speak() -> tuple[list[str], list]:
        async with connect_client(tiny_voxcpm) as c:
            ids = []
            for n, name in enumerate((None, "logged")):
                await c.send({"type": "voice", "id": f"r{n}", "audio": tone_wav(1.0, pitch=205 + 10 * n),
                              **({"name": name} if name else {})})
                ids.append((await c.recv_where(lambda m, n=n: m.get("id") == f"r{n}"))["voice"])
            try:
                spoken = [await c.speak("Spoken in a stored voice.", f"s{n}", voice=voice,
                                        options={"seed": 3, "max_len": 3})
                          for n, voice in enumerate([*ids, "logged"])]
            finally:
                for n, voice in enumerate(ids):
                    await c.send({"type": "voice_delete", "id": f"d{n}", "voice": voice})
                    assert (await c.recv_where(lambda m, n=n: m.get("id") == f"d{n}"))["deleted"] is True
        return ids, spoken

    with caplog.at_level(logging.INFO, "vox_ws"):
        ids, spoken = asyncio.run(register_and_speak())
    assert [s.end["reason"] for s in spoken] == ["max_len"] * 3          # the voices speak
    streams = [r for r in caplog.records if r.name == "vox_ws.stream" and r.fields.get("engine") == "voxcpm"]
    tags = [voice_tag(ids[0]), voice_tag(ids[1]), voice_tag(ids[1])]      # the named one by id, then by name
    assert [r.fields["voice"] for r in streams[-3:]] == tags
    formatters = (JsonFormatter(), TextFormatter(TEXT_FORMAT))
    for record in caplog.records:
        assert not any(voice in record.getMessage() for voice in ids)
        assert not any(voice in f.format(record) for voice in ids for f in formatters)
    # A line that echoes an id (a failure's message, a traceback's file name): the tag in its place.
    try:
        raise FileNotFoundError(2, "No such file", f"/voices/{ids[0]}.audio")
    except OSError:
        record = logging.LogRecord("vox_ws.service", logging.ERROR, __file__, 1, "voice %s failed", (ids[0],),
                                   sys.exc_info())
    record.fields = {"event": "stream", "error": "invalid", "error_message": f"unknown voice {ids[0]!r}"}
    for formatter in formatters:
        line = formatter.format(record)
        assert ids[0] not in line and voice_tag(ids[0]) in line


def test_retries_wait_as_the_server_says_with_jitter_and_a_cap():
    rng = random.Random(7)
    told = [retry_delay(0.2, 2.0, rng) for _ in range(50)]
    assert all(2.0 <= d <= 2.5 for d in told) and len({round(d, 6) for d in told}) > 40
    assert all(0.2 <= retry_delay(0.2, None, rng) <= 0.25 for _ in range(20))     # its own back-off
    assert retry_delay(0.2, 3600.0, rng) == MAX_RETRY_WAIT_S


def test_openai_names_are_distinct_designed_voices_on_voxcpm(tiny_voxcpm):
    """VoxCPM2 has no built-in voice here: OpenAI's names are voices designed from words, each
    with its seed, so one name sounds the same every time and two names differ."""
    listed = {v["id"]: v for v in httpx.get(tiny_voxcpm.http + "/v1/audio/voices").json()["voices"]}
    assert {name for name, v in listed.items() if v["kind"] == "alias"} == set(OPENAI_VOICES)
    assert listed["nova"]["instructions"] and listed["nova"]["options"]["seed"] != listed["alloy"]["options"]["seed"]
    client = sdk(tiny_voxcpm)

    def say(voice: str, **extra) -> bytes:
        return client.audio.speech.create(model="tts-1", voice=voice, input="Designed.", response_format="pcm",
                                          extra_body={"max_len": 4, **extra}).content

    nova, again, alloy = say("nova"), say("nova"), say("alloy")
    assert nova == again and nova != alloy
    # The request's own options and instructions come before the alias's.
    assert say("nova", seed=1) == say("alloy", seed=1, instructions=listed["nova"]["instructions"])
    assert say("nova", seed=1) != say("alloy", seed=1)          # the instructions are what differ

    async def hello() -> dict:
        async with connect_client(tiny_voxcpm) as c:
            return c.hello
    languages = asyncio.run(hello())["languages"]
    assert len(languages) == 30 and {"en", "zh", "ja", "ar", "hi", "th"} <= set(languages)


def test_a_voice_registered_over_v1_keeps_its_name_and_is_spoken_by_it(tiny_voxcpm):
    from helpers import tone_wav

    async def run() -> None:
        async with connect_client(tiny_voxcpm) as c:
            await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0, pitch=180.0), "name": "Großmutter"})
            reply = await c.recv_where(lambda m: m.get("id") == "r")
            assert reply["type"] == "voice" and reply["name"] == "Großmutter" and reply["voice"].startswith("v_")
            by_name = await c.speak("In her voice.", "n", voice="Großmutter", options={"seed": 2, "max_len": 3})
            by_id = await c.speak("In her voice.", "i", voice=reply["voice"], options={"seed": 2, "max_len": 3})
            assert_good_stream(by_name, reason="max_len")
            assert np.array_equal(by_name.pcm(), by_id.pcm())
            for name, why in (("", "name"), ("x/y", "name"), ("alloy", "voice of the server"),
                              (reply["voice"], "name")):
                await c.send({"type": "voice", "id": "bad", "audio": tone_wav(1.0), "name": name})
                error = await c.recv_where(lambda m: m.get("id") == "bad" or m["type"] == "error")
                assert error["type"] == "error" and error["code"] == "bad_request" and why in error["message"], name
            await c.send({"type": "voice_delete", "id": "d", "voice": "Großmutter"})
            assert (await c.recv_where(lambda m: m.get("id") == "d"))["deleted"] is True
            gone = await c.speak("Gone.", "g", voice="Großmutter")
            assert gone.error["code"] == "bad_request" and "'Großmutter'" in gone.error["message"]

    asyncio.run(run())


@pytest.mark.browser
def test_the_demo_offers_each_piper_voice_and_speaks_the_one_chosen(two_voices):
    from playwright.sync_api import sync_playwright

    from helpers import CHROMIUM, LAUNCH_ARGS

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=LAUNCH_ARGS)
        try:
            page = browser.new_page()
            page.goto(two_voices.http + "/")
            page.wait_for_function("window.voxDemo && window.voxDemo.state.ready", timeout=30_000)
            offered = page.eval_on_selector_all("#voice optgroup[label=voices] option",
                                                "options => options.map(o => o.value)")
            assert offered == ["joe", "slow"]
            # Each of OpenAI's names is offered too, as an alias of one of them.
            aliases = page.eval_on_selector_all("#voice optgroup[label=aliases] option",
                                                "options => options.map(o => o.textContent)")
            assert "alloy" in [label.split(" · ")[0] for label in aliases], aliases
            assert all(label.split(" · alias of ")[-1] in ("joe", "slow") for label in aliases), aliases
            seconds = {}
            for voice in ("joe", "slow"):
                page.select_option("#voice", voice)
                page.fill("#text", SENTENCE)
                page.click("#speak")
                page.wait_for_function("window.voxDemo.state.stream && window.voxDemo.state.stream.ended",
                                       timeout=60_000)
                end = page.evaluate("window.voxDemo.state.lastEnd")
                assert end["reason"] == "done", end
                seconds[voice] = end["audio_s"]
                page.wait_for_function("window.voxDemo.state.drained", timeout=60_000)
            assert seconds["slow"] > 1.3 * seconds["joe"]
        finally:
            browser.close()


@pytest.mark.slow
async def test_wyoming_describes_voxcpm_by_its_languages(start_server, tiny_model):
    from vox_ws.engines.voxcpm.engine import LANGUAGES, VoxCPMEngine

    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1)
    # Normalisation has Chinese and English grammars: a German text is spoken as written.
    needs_preparing = engine.text.needs_preparing
    assert needs_preparing({"normalize": True}, None) and needs_preparing({"normalize": True}, "zh-CN")
    assert not needs_preparing({"normalize": True}, "de") and not needs_preparing({}, "en")
    server = start_server(engine, slots=1, wyoming="tcp://127.0.0.1:0")
    async with AsyncTcpClient("127.0.0.1", server.server.wyoming.port) as c:
        await c.write_event(Describe().event())
        info = Info.from_event(await asyncio.wait_for(c.read_event(), 60))
        # OpenAI's names (designed voices) are for OpenAI's clients: no aliases file names them here.
        (voice,) = info.tts[0].voices
        assert voice.name == "default" and voice.languages == list(LANGUAGES) and len(LANGUAGES) == 30
        await c.write_event(Synthesize(text="Hallo.", voice=SynthesizeVoice(name="default", language="de")).event())
        first = await asyncio.wait_for(c.read_event(), 60)
        assert first.type == "audio-start", first


def test_a_voice_file_named_with_a_space_is_left_out_saying_how_to_name_it(tmp_path, caplog):
    """A voice copied in as `my voice.onnx` was left out of the folder with "no such file
    'my voice=/.../my voice.onnx'": its name and path read as one path. The line now names the
    file, says why its name is none, and gives one that is; --piper-voice refuses it alike."""
    folder = tmp_path / "voices"
    make_voice(folder, "my voice")
    make_voice(folder, "en_GB-slow-medium")
    with caplog.at_level(logging.ERROR, "vox_ws.engine"):
        voices = voice_set([], str(folder))
    assert [v.name for v in voices] == ["joe", "en_GB-slow-medium"]
    (line,) = [r.getMessage() for r in caplog.records]
    assert line == ("--piper-voices-dir: piper voice 'my voice.onnx': its name 'my voice' is not one: 1-64 letters, "
                    "digits, '_', '.' or '-' (rename it 'my_voice': my_voice.onnx and my_voice.onnx.json, or "
                    "--piper-voice my_voice=PATH): left out"), line
    with pytest.raises(ValueError, match=r"its name 'my voice' is not one: .* \(rename it 'my_voice'"):
        voice_set([str(folder / "my voice.onnx")])
    assert [v.name for v in voice_set([f"my_voice={folder / 'my voice.onnx'}"])] == ["joe", "my_voice"]


def test_a_voices_folder_serves_each_voice_by_its_file_name(start_server, tmp_path, caplog):
    """Every other voice was a file passed with its own --piper-voice. A folder serves them all,
    by their files' names; one at another rate is left out with a log line, not the start."""
    folder = tmp_path / "voices"
    make_voice(folder, "en_GB-slow-medium")
    make_voice(folder, "en_US-quick-medium", language="en_US", length_scale=1.0)
    make_voice(folder, "de_DE-low-x_low", language="de_DE", rate=16000)
    with caplog.at_level(logging.ERROR, "vox_ws.engine"):
        voices = voice_set([], str(folder))
    assert [v.name for v in voices] == ["joe", "en_GB-slow-medium", "en_US-quick-medium"]
    assert "de_DE-low-x_low" in caplog.text and "16000 Hz" in caplog.text
    # --piper-voice NAME names a voice of the folder (under that name, once).
    assert [v.name for v in voice_set(["en_US-quick-medium"], str(folder))][1] == "en_US-quick-medium"
    with pytest.raises(ValueError, match="no such file"):
        voice_set(["nobody-here"], str(folder))
    server = start_server(PiperEngine(voices=voices))
    listed = {v["id"] for v in httpx.get(server.http + "/v1/voices").json()["voices"] if v["kind"] == "builtin"}
    assert listed == {"joe", "en_GB-slow-medium", "en_US-quick-medium"}
    client = sdk(server)
    slow = client.audio.speech.create(model="tts-1", voice="en_GB-slow-medium", input=SENTENCE, response_format="wav")
    plain = client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format="wav")
    assert wav_seconds(slow.content) > 1.3 * wav_seconds(plain.content)
