"""Pronunciations: a server lexicon (JSON or TSV, reloaded on SIGHUP and by an admin call, a bad
file reported and the old lexicon kept) and a request's own entries. A respelling changes what
Piper phonemizes and the text the tiny VoxCPM2 is given; IPA is Piper's own phoneme input; the
client is told its own text back. Bad entries are typed errors naming them."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import httpx
import pytest

from conftest import assert_good_stream, connect_client, wait_until
from vox_ws.engine import ErrorKind, Refused
from vox_ws.engines.lexicon import (
    MAX_ENTRY_CHARS,
    MAX_LEXICON_BYTES,
    MAX_LEXICON_ENTRIES,
    MAX_REQUEST_ENTRIES,
    Lexicon,
    combined,
    entry,
    parse_lexicon,
    request_entries,
    respell,
)

TOMATO_IPA = "təmˈɑːtoʊ"


def phonemes_of(word: dict, phonemes: list[dict]) -> list[str]:
    return [p["phoneme"] for p in phonemes
            if word["start_s"] - 1e-3 <= p["start_s"] and p["end_s"] <= word["end_s"] + 1e-3]


async def speak_timed(server, text: str, **fields) -> tuple[list[dict], list[dict], dict]:
    """The words, the phonemes and the end of one stream."""
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "p", "text": text, "format": "s16", "word_timestamps": True,
                      "phoneme_timestamps": True, **fields})
        words, phonemes = [], []
        while True:
            message = await c.recv_where(lambda m: m.get("id") == "p")
            if message["type"] == "words":
                words += message["words"]
            elif message["type"] == "phonemes":
                phonemes += message["phonemes"]
            elif message["type"] in ("end", "error"):
                return words, phonemes, message


# ------------------------------------------------------------------ the lexicon


def test_a_lexicon_reads_json_or_tsv_and_reports_its_bad_lines():
    lexicon, problems = parse_lexicon(json.dumps([{"match": "SQL", "say": "sequel"},
                                                  {"match": "US", "say": "U S", "case_sensitive": True},
                                                  {"match": "New York", "ipa": "nuː jɔːk"}]).encode(), "a.json")
    assert not problems and len(lexicon) == 3
    assert len(parse_lexicon(b'{"SQL": "sequel", "GIF": "jif"}', "b.json")[0]) == 2
    tsv = "# comment\nSQL\tsequel\ntomato\t/" + TOMATO_IPA + "/\n\nno tab here\n\tno match\n"
    lexicon, problems = parse_lexicon(tsv.encode(), "c.tsv")
    assert len(lexicon) == 2 and [e.ipa for e in lexicon.entries] == [None, TOMATO_IPA]
    assert len(problems) == 2 and "c.tsv line 5" in problems[0] and "c.tsv line 6" in problems[1]
    assert parse_lexicon(b"[{", "d.json")[1][0].startswith("d.json: not JSON")
    assert "over" in parse_lexicon(b"x\ty\n" * (MAX_LEXICON_BYTES // 4 + 1), "big.tsv")[1][0]
    many = "".join(f"w{n}\tsay {n}\n" for n in range(MAX_LEXICON_ENTRIES + 1)).encode()
    assert f"{MAX_LEXICON_ENTRIES + 1} entries, over" in parse_lexicon(many, "many.tsv")[1][-1]
    assert "not UTF-8" in parse_lexicon(b"\xff\xfe", "e.tsv")[1][0]


def test_entries_match_whole_words_the_longest_phrase_first_and_keep_the_punctuation():
    lexicon = Lexicon([entry({"match": "New York", "say": "Noo Yawk"}, "x"), entry({"match": "new", "say": "gnu"}, "x"),
                       entry({"match": "US", "say": "U S", "case_sensitive": True}, "x")])
    assert respell("New York, new us, US. Newer.", lexicon) == "Noo Yawk, gnu us, U S. Newer."
    assert [(a, b) for a, b, _ in lexicon.find("in new york".split())] == [(1, 3)]
    # A request's entries come before the server's, which stay in use for the other words.
    mine = combined([entry({"match": "new", "say": "knew"}, "x")], lexicon)
    assert respell("new car in New York", mine) == "knew car in knew York" and len(mine) == 4


@pytest.mark.parametrize("value, kind, named", [
    ([{"match": "x"}], ErrorKind.INVALID, "one of 'say' and 'ipa'"),
    ([{"match": "x", "say": "y", "ipa": "z"}], ErrorKind.INVALID, "one of"),
    ([{"match": "x", "say": "y", "loud": True}], ErrorKind.INVALID, "'loud'"),
    ([{"match": "...", "say": "y"}], ErrorKind.INVALID, "words"),
    ([{"match": "x", "say": "y" * (MAX_ENTRY_CHARS + 1)}], ErrorKind.TOO_LARGE, "'say'"),
    ([{"match": "x", "say": "y"}] * (MAX_REQUEST_ENTRIES + 1), ErrorKind.TOO_LARGE, "entries"),
    ("SQL=sequel", ErrorKind.INVALID, "a list"),
])
def test_bad_entries_are_typed_errors_naming_them(value, kind, named):
    with pytest.raises(Refused) as refused:
        request_entries(value)
    assert refused.value.kind == kind and named in refused.value.message


# ------------------------------------------------------------------ Piper


async def test_piper_says_a_respelling_and_ipa_and_reports_the_clients_words(piper_server):
    text = "I like tomato soup and SQL."
    words, phonemes, end = await speak_timed(piper_server, text)
    plain = {w["word"]: phonemes_of(w, phonemes) for w in words}
    entries = [{"match": "tomato", "ipa": TOMATO_IPA}, {"match": "sql", "say": "sequel"}]
    words, phonemes, end = await speak_timed(piper_server, text, pronunciations=entries)
    assert end["type"] == "end", end
    assert [w["word"] for w in words] == text.split()                    # the client's words, as sent
    assert end["segments"][0]["text"] == text
    said = {w["word"]: phonemes_of(w, phonemes) for w in words}
    assert said["tomato"] == [ph for ph in TOMATO_IPA if ph not in "ˈˌ"]  # the IPA, phoneme by phoneme
    assert said["SQL."] != plain["SQL."] and said["SQL."][0] == "s"        # "sequel", not "S Q L"
    assert said["like"] == plain["like"]


async def test_a_bad_pronunciation_is_an_error_and_the_connection_serves_on(piper_server):
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "x", "text": "Hi.", "pronunciations": [{"match": "hi", "ipa": "hЖ"}]})
        error = await c.error("x")
        assert error["code"] == "bad_request" and "'hi'" in error["message"] and "Ж" in error["message"]
        await c.send({"type": "start", "id": "y", "text": "Hi.", "pronunciations": [{"match": "hi"}]})
        assert (await c.error("y"))["code"] == "bad_request"
        assert_good_stream(await c.speak("Still here.", "ok"))


@pytest.mark.parametrize("fields", [{"text": "a " * 120},                             # one-shot: in all
                                    {"stream_input": True}])                            # streamed: a segment
async def test_pronunciations_cannot_multiply_a_text_past_max_text_chars(piper_server, fields):
    """One entry saying a one-letter word as 100 characters made 240 characters of text 9.5
    times the audio: what max_text_chars bounds is the text as it will be said."""
    entries = [{"match": "a", "say": "x" * MAX_ENTRY_CHARS}]
    limit = piper_server.config.limits.max_text_chars
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "big", "pronunciations": entries, **fields})
        if fields.get("stream_input"):
            # Spoken a segment at a time: it ends once the segments have grown by the bound.
            for _ in range(limit // (MAX_ENTRY_CHARS * 8) + 2):
                await c.send({"type": "chunk", "id": "big", "text": "a a a a a a a a. "})
        refused = await c.error("big")
        assert refused["code"] == "too_large" and f"over max_text_chars={limit}" in refused["message"], refused
        if not fields.get("stream_input"):
            assert ("chunk", "big") not in c.log                    # refused before a sound
        assert_good_stream(await c.speak("A small text.", "ok", pronunciations=entries[:0]))


def test_pronunciations_over_openais_api(piper_server):
    import openai

    client = openai.OpenAI(base_url=piper_server.http + "/v1", api_key="unused", max_retries=0)
    audio = client.audio.speech.create(model="tts-1", voice="alloy", input="SQL.", response_format="pcm",
                                       extra_body={"pronunciations": [{"match": "SQL", "say": "sequel"}]}).content
    assert len(audio) > 4800
    with pytest.raises(openai.BadRequestError) as refused:
        client.audio.speech.create(model="tts-1", voice="alloy", input="SQL.",
                                   extra_body={"pronunciations": [{"match": "SQL", "say": ""}]})
    assert refused.value.body["param"] == "pronunciations"


# ------------------------------------------------------------------ VoxCPM2: the text it is given


async def test_the_tiny_voxcpm_is_given_the_respelled_text_and_the_client_its_own(tiny_voxcpm):
    server, given = tiny_voxcpm, tiny_voxcpm.engine.given
    async with connect_client(server) as c:
        result = await c.speak("Ask the VoxWS team.", "v", options={"max_len": 4, "normalize": False},
                               pronunciations=[{"match": "voxws", "say": "vox double-u ess"}])
        assert result.end is not None, result.error
        assert given[-1] == "Ask the vox double-u ess team."
        assert result.end["segments"][0]["text"] == "Ask the VoxWS team."
        await c.send({"type": "start", "id": "i", "text": "Hi.", "pronunciations": [{"match": "hi", "ipa": "haɪ"}]})
        error = await c.error("i")
        assert error["code"] == "unsupported" and "'hi'" in error["message"]
    # The same over OpenAI's API, the entries in the SDK's extra_body.
    import openai

    client = openai.OpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)
    await asyncio.to_thread(lambda: client.audio.speech.create(
        model="tts-1", voice="alloy", input="Ask the VoxWS team.", response_format="pcm",
        extra_body={"max_len": 4, "normalize": False,
                    "pronunciations": [{"match": "VoxWS", "say": "vox double-u ess"}]}).content)
    assert given[-1] == "Ask the vox double-u ess team."


# ------------------------------------------------------------------ the server's lexicon


@pytest.mark.slow
async def test_the_server_lexicon_reloads_by_an_admin_call_and_keeps_the_old_one_on_errors(start_server, tmp_path):
    from vox_ws.engines.piper import PiperEngine

    path = tmp_path / "lexicon.tsv"
    path.write_text("tomato\t/" + TOMATO_IPA + "/\n", encoding="utf-8")
    server = start_server(PiperEngine(), lexicon=str(path), admin_tokens=["admin-secret"])
    words, phonemes, _ = await speak_timed(server, "A tomato.")
    assert phonemes_of(words[1], phonemes) == [ph for ph in TOMATO_IPA if ph not in "ˈˌ"]

    admin = {"Authorization": "Bearer admin-secret"}
    async with httpx.AsyncClient(base_url=server.http) as http:
        assert (await http.post("/v1/lexicon")).status_code in (401, 403)
        path.write_text("tomato\t/" + TOMATO_IPA + "/\nSQL\tsequel\n", encoding="utf-8")
        reloaded = await http.post("/v1/lexicon", headers=admin)
        assert reloaded.status_code == 200 and reloaded.json()["entries"] == 2
        path.write_text("SQL\tsequel\nbroken line\n", encoding="utf-8")
        bad = await http.post("/v1/lexicon", headers=admin)
        assert bad.status_code == 400 and "line 2" in bad.json()["error"]["problems"][0]
        assert (await http.get("/v1/info")).json()["lexicon"]["entries"] == 2          # the old one kept
    words, phonemes, _ = await speak_timed(server, "A tomato.")
    assert phonemes_of(words[1], phonemes) == [ph for ph in TOMATO_IPA if ph not in "ˈˌ"]


@pytest.mark.slow
async def test_a_lexicon_file_that_is_a_fifo_or_too_large_is_refused_unread_and_the_old_one_kept(start_server,
                                                                                                     tmp_path):
    """A FIFO in the lexicon's place would block a read for good (and the server's shutdown); a
    huge file would be read whole before its size was checked. Both are refused at once."""
    from vox_ws.engines.piper import PiperEngine

    path = tmp_path / "lexicon.tsv"
    path.write_text("SQL\tsequel\n", encoding="utf-8")
    server = start_server(PiperEngine(), lexicon=str(path), admin_tokens=["admin-secret"])
    admin = {"Authorization": "Bearer admin-secret"}
    async with httpx.AsyncClient(base_url=server.http) as http:
        path.unlink()
        os.mkfifo(path)                                   # no writer: a blocking read never returns
        fifo = await http.post("/v1/lexicon", headers=admin)
        assert fifo.status_code == 400 and "not a regular file" in fifo.json()["error"]["problems"][0]
        path.unlink()
        with open(path, "wb") as f:                       # sparse: its size, not its bytes, refuses it
            f.truncate(200 << 20)
        huge = await http.post("/v1/lexicon", headers=admin)
        assert huge.status_code == 400 and f"over {MAX_LEXICON_BYTES} bytes" in huge.json()["error"]["problems"][0]
        assert (await http.get("/v1/info")).json()["lexicon"]["entries"] == 1          # the old one kept
    words, _, _ = await speak_timed(server, "SQL.")
    assert words


def test_matching_walks_a_phrase_at_most_per_word_whatever_the_entries():
    """2,000 phrases that all start with "the" and a text of "the" 1,250 times (the attack that
    held the loop 1.6-2.3 s): the same matches as ever, now from a trie walked at most
    MAX_PHRASE_WORDS words from each word."""
    from vox_ws.engines.lexicon import MAX_PHRASE_WORDS

    phrases = [entry({"match": f"the the word{n}", "say": f"x{n}"}, "x") for n in range(2000)]
    lexicon = Lexicon([*phrases, entry({"match": "the the", "say": "both"}, "x")])
    assert respell("the " * 1250, lexicon) == "both " * 625
    assert respell("so the the word1999 and the the word7.", lexicon) == "so x1999 and x7."
    assert len(max(lexicon.find(["the"] * 20), key=lambda m: m[1] - m[0])[2].words) <= MAX_PHRASE_WORDS


@pytest.mark.slow
async def test_pronunciations_are_found_off_the_event_loop(start_server):
    from vox_ws.engines.piper import PiperEngine

    """Matching a lexicon against a text is linear, but still some 35 ms for 20,000 phrases over
    5,000 characters: it never runs on the event loop, whether the entries are the server's or
    the request's."""
    threads: list[str] = []

    class Watched(Lexicon):
        def _longest(self, folded, exact, i):                  # the request's entries are looked up over it
            threads.append(threading.current_thread().name)
            return super()._longest(folded, exact, i)

    server = start_server(PiperEngine(), slots=1)
    server.server.service.lexicon = Watched([entry({"match": "vox", "say": "box"}, "x")])
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("Vox speaks. Then vox again.", "a"))
        assert_good_stream(await c.speak("Vox once more.", "b", pronunciations=[{"match": "once", "say": "twice"}]))
    # The respelling on the thread that prepares texts, and, for Piper, which takes phonemes,
    # the entries its text matches, found there too: they cross to the engine with the request
    # (the engine looks up only those). Never on the server's event loop.
    assert any(name.startswith("vox-ws-prepare") for name in threads), threads
    assert server._thread.name not in threads and threading.current_thread().name not in threads, threads


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _info(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/info", timeout=5) as response:
        return json.loads(response.read())


@pytest.mark.slow
def test_vox_ws_serve_reloads_its_lexicon_on_sighup_and_refuses_to_start_with_a_bad_one(tmp_path):
    """The engine in its own process: it says how it takes text once built, before its load, and
    the start checks the lexicon against that (Piper says IPA in its voices' phonemes: an entry
    in one none speaks stops the start, as a file that is no lexicon does)."""
    path = tmp_path / "lexicon.json"
    entries = [{"match": "SQL", "say": "sequel"}, {"match": "tomato", "ipa": TOMATO_IPA}]
    path.write_text(json.dumps(entries), encoding="utf-8")
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "serve.log", "w+")
    serve = subprocess.Popen([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", str(port),
                              "--lexicon", str(path)], stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert serve.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if _info(port)["status"] == "ready":
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)
        assert _info(port)["lexicon"]["entries"] == 2
        path.write_text(json.dumps([*entries, {"match": "GIF", "say": "jif"}]), encoding="utf-8")
        serve.send_signal(signal.SIGHUP)
        asyncio.run(wait_until(lambda: _info(port)["lexicon"]["entries"] == 3))
    finally:
        serve.terminate()
        serve.wait(60)
        log.close()
    for bad, said in (('[{"match": "SQL"}]', "entry 0"),
                      ('[{"match": "hi", "ipa": "hЖ"}]', "phonemes this voice does not speak: Ж")):
        path.write_text(bad, encoding="utf-8")
        failed = subprocess.run([sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port",
                                 str(_free_port()), "--lexicon", str(path)], capture_output=True, text=True, env=env,
                                timeout=120)
        assert failed.returncode != 0 and said in failed.stderr + failed.stdout, failed.stderr + failed.stdout
