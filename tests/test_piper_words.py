"""True word and phoneme timings: Piper's durations, per word and per phoneme, over protocol v1
(`words` and `phonemes` messages), and their absence where an engine has none (the tone engine
here, VoxCPM2 in production)."""

from __future__ import annotations

import threading

import pytest

from conftest import WAIT_TIMEOUT, connect_client
from vox_ws.engines.piper_words import NO_WORD, phoneme_spans, word_owners, word_spans
from vox_ws.testing.tone import ToneEngine
from vox_ws.text import text_words

TEXT = "Hello there, my friend. It is 1999 and I want to go to the shop."


async def read_stream(c, sid: str, phonemes: list | None = None) -> tuple[list[dict], list[dict], list[dict], dict]:
    """A stream's words, segments and chunks, and its `end` (or `error`); its phonemes into
    `phonemes`, if given."""
    words, segments, chunks = [], [], []
    while True:
        message = await c.recv_where(lambda m: m.get("id") == sid)
        kind = message["type"]
        if kind in ("end", "error"):
            return words, segments, chunks, message
        if kind == "words":
            words.extend(message["words"])
        elif kind == "phonemes":
            assert phonemes is not None, "phonemes sent unasked"
            phonemes.extend(message["phonemes"])
        elif kind == "segment":
            segments.append(message)
        elif kind == "chunk":
            chunks.append(message)


async def speak_with_words(server, text: str, **fields) -> tuple[list[dict], list[dict], dict]:
    """The words messages, the chunks and the end of one stream."""
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "w", "text": text, "format": "s16", "word_timestamps": True, **fields})
        words, _, chunks, end = await read_stream(c, "w")
        return words, chunks, end


async def test_hello_and_info_say_piper_gives_word_timings(piper_server):
    async with connect_client(piper_server) as c:
        assert "word_timestamps" in c.hello["features"]
    assert piper_server.get("/v1/info")[1]["word_timestamps"] is True


async def test_every_word_is_timed_in_order_within_the_audio(piper_server):
    words, chunks, end = await speak_with_words(piper_server, TEXT)
    assert end["type"] == "end" and end["reason"] == "done"
    assert [w["word"] for w in words] == TEXT.split()
    for word in words:
        assert 0 <= word["start_s"] < word["end_s"] <= end["audio_s"] + 1e-3
    assert all(a["end_s"] <= b["start_s"] + 1e-3 for a, b in zip(words, words[1:]))
    # "1999" is said as three words and lasts longer than "to".
    length = {w["word"]: w["end_s"] - w["start_s"] for w in words}
    assert length["1999"] > 3 * length["to"]
    # The second sentence's words come after the first sentence's pause.
    assert words[4]["start_s"] - words[3]["end_s"] > 0.05


async def test_words_espeak_says_nothing_for_keep_their_place(piper_server):
    """Lone `<` and `>` (espeak reads them as nothing) vanished from the words, and so from
    captions; now every written word is there, in order, an unspoken one taking no time."""
    text = "Is a < b or a > b? Write it down <"
    words, _, end = await speak_with_words(piper_server, text)
    assert end["reason"] == "done"
    assert [w["word"] for w in words] == text.split()
    assert all(a["end_s"] <= b["start_s"] + 1e-3 for a, b in zip(words, words[1:]))
    assert all(w["start_s"] <= w["end_s"] <= end["audio_s"] + 1e-3 for w in words)


async def test_words_follow_the_speed_and_the_segments(piper_server):
    normal, _, end1 = await speak_with_words(piper_server, "One two three four five.")
    fast, _, end2 = await speak_with_words(piper_server, "One two three four five.", speed=2.0)
    assert [w["word"] for w in fast] == [w["word"] for w in normal]
    assert fast[-1]["end_s"] <= end2["audio_s"] + 1e-3
    assert end2["audio_s"] < 0.7 * end1["audio_s"]
    async with connect_client(piper_server) as c:
        await c.send({"type": "start", "id": "i", "stream_input": True, "segment_events": True, "format": "s16",
                      "word_timestamps": True})
        await c.send({"type": "chunk", "id": "i", "text": "First part here. "})
        await c.send({"type": "chunk", "id": "i", "text": "Second part there."})
        await c.send({"type": "end", "id": "i"})
        words, segments, _, end = await read_stream(c, "i")
        assert end["type"] == "end"
    assert [w["word"] for w in words] == "First part here. Second part there.".split()
    assert len(segments) == 2
    first, second = words[:3], words[3:]
    assert all(segments[0]["start_s"] <= w["start_s"] and w["end_s"] <= segments[0]["end_s"] + 1e-3 for w in first)
    assert all(segments[1]["start_s"] - 1e-3 <= w["start_s"] and w["end_s"] <= segments[1]["end_s"] + 1e-3
               for w in second)


async def test_no_words_unless_asked(piper_server):
    async with connect_client(piper_server) as c:
        result = await c.speak("Nothing timed.", "n", format="s16")
        assert not [m for m in c.log if m[0] == "words"]
    assert result.end["reason"] == "done"


async def test_a_cancel_reports_the_words_heard_of_the_cut_segment(piper_server):
    """The cut falls inside the text by construction: the first step's audio and words are
    delivered, and the engine thread waits after the second step (before delivering it) until
    the test has cancelled."""
    text = "This one long sentence goes on and on for quite a while so that it is cut short in the middle."
    (scheduler,) = piper_server.engine_loops
    observe = scheduler.on_step                                # the server's metrics
    held = threading.Event()
    steps = []

    def on_step(size: int, seconds: float) -> None:           # on the engine thread
        observe(size, seconds)
        steps.append(size)
        if len(steps) == 2:
            held.wait(WAIT_TIMEOUT)

    scheduler.on_step = on_step
    try:
        async with connect_client(piper_server) as c:
            await c.send({"type": "start", "id": "b", "text": text, "format": "s16", "word_timestamps": True})
            words, received = [], 0.0
            rate = (await c.recv_where(lambda m: m["type"] == "start"))["sample_rate"]
            while not words:                                   # the first piece's words follow its audio
                message = await c.recv_where(lambda m: m.get("id") == "b")
                if message["type"] == "chunk":
                    received += len(message["audio"]) / 2 / rate
                elif message["type"] == "words":
                    words.extend(message["words"])
                else:
                    pytest.fail(f"ended early: {message}")
            await c.send({"type": "cancel", "id": "b"})
            while True:
                message = await c.recv_where(lambda m: m.get("id") == "b")
                if message["type"] == "chunk":
                    received += len(message["audio"]) / 2 / rate
                elif message["type"] == "words":
                    words.extend(message["words"])
                elif message["type"] == "end":
                    break
    finally:
        held.set()
        scheduler.on_step = observe
    heard = message["heard"]
    assert heard["audio_s"] == pytest.approx(received, abs=1e-3)
    partial = heard["partial"]
    assert partial is not None and partial["text"] == text
    # The words wholly sent: a prefix of the text, exactly those whose times end in what was sent.
    assert partial["words"] == text.split()[:len(partial["words"])]
    assert partial["words"] == [w["word"] for w in words if w["end_s"] <= heard["audio_s"] + 1e-3]
    assert 0 < len(partial["words"]) < len(text.split())


async def test_an_engine_without_word_timings_says_so_and_sends_none(start_server):
    """With `--word-timings engine` (no aligner): by default the aligner times its words."""
    server = start_server(ToneEngine(), word_timings="engine")
    async with connect_client(server) as c:
        assert "word_timestamps" not in c.hello["features"] and "phoneme_timestamps" not in c.hello["features"]
        await c.send({"type": "start", "id": "t", "text": "No times here.", "format": "s16", "word_timestamps": True,
                      "phoneme_timestamps": True})
        start = await c.recv_where(lambda m: m["type"] == "start")
        assert {"word_timestamps", "phoneme_timestamps"} <= set(start["ignored_options"])
        result = await c.collect("t")
    assert result.end["reason"] == "done"
    assert not [m for m in c.log if m[0] in ("words", "phonemes")]


async def test_phoneme_times_lie_inside_their_words_in_order(piper_server):
    async with connect_client(piper_server) as c:
        assert "phoneme_timestamps" in c.hello["features"]
        await c.send({"type": "start", "id": "p", "text": TEXT, "format": "s16", "word_timestamps": True,
                      "phoneme_timestamps": True, "speed": 1.25})
        phonemes: list[dict] = []
        words, _, _, end = await read_stream(c, "p", phonemes)
    assert end["type"] == "end" and end["reason"] == "done"
    assert len(phonemes) > 3 * len(words)
    assert all(p["phoneme"] and p["phoneme"] not in " ˈˌ.,!?" for p in phonemes)
    for a, b in zip(phonemes, phonemes[1:]):
        assert a["start_s"] < a["end_s"] <= b["start_s"] + 1e-3
    assert phonemes[-1]["end_s"] <= end["audio_s"] + 1e-3          # scaled with the speed, as words are
    # Every phoneme lies inside one word, and every word has phonemes.
    inside = [[p for p in phonemes if w["start_s"] - 1e-3 <= p["start_s"] and p["end_s"] <= w["end_s"] + 1e-3]
              for w in words]
    assert all(inside) and sum(map(len, inside)) == len(phonemes)


def test_phoneme_spans_give_stress_to_the_next_phoneme_and_no_time_to_pauses():
    phonemes = ["h", "ə", "l", "ˈ", "o", "ʊ", " ", ",", "w"]
    samples = [10, 20, 30, 5, 40, 50, 60, 70, 80]
    assert phoneme_spans(phonemes, 100, samples) == [
        ("h", 100, 110), ("ə", 110, 130), ("l", 130, 160), ("o", 160, 205), ("ʊ", 205, 255), ("w", 385, 465)]


def test_words_are_matched_to_phonemes_even_where_espeak_merges_or_splits_them():
    """"of the" is one phoneme word in context, "1999" three: each text word still gets its own
    phonemes, in order, and word spans follow the phoneme durations."""
    alone = {"Of": [["ʌ", "v"]], "the": [["ð", "ə"]], "1999": [list("nˈaɪntiːn"), list("nˈaɪnti")],
             "go.": [list("ɡˈoʊ.")]}
    sentence = list("ʌvðə nˈaɪntiːn nˈaɪnti ɡˈoʊ.")
    words = ["Of", "the", "1999", "go."]
    (owners,) = word_owners(words, [sentence], lambda w: alone[w])
    spoken = {i: "".join(ph for ph, o in zip(sentence, owners) if o == i) for i in range(4)}
    assert spoken == {0: "ʌv", 1: "ðə", 2: "nˈaɪntiːnnˈaɪnti", 3: "ɡˈoʊ"}
    assert owners[sentence.index(" ")] == NO_WORD
    spans = word_spans(owners, 10, [100] * len(sentence))
    assert [i for i, _, _ in spans] == [0, 1, 2, 3]
    assert spans[0] == (0, 10, 210) and spans[1] == (1, 210, 410)
    assert text_words(" a  b,c ") == ["a", "b,c"]
