"""Word timings by forced alignment (`vox_ws.alignment`): the text spelled as it is heard, the
aligner's words against Piper's own on the same audio, VoxCPM2's words over v1 and a barge-in's
`heard` (over the OpenAI door and in captions: test_documents.py), and what a failing aligner
costs (the words, never the audio). The aligner runs in processes of its own: pocketsphinx is
never loaded in this one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from concurrent.futures import Future

import numpy as np
import pytest

from attackers import ATTACKER
from conftest import WAIT_TIMEOUT, assert_good_stream, child_processes, connect_client, wait_until
from vox_ws.alignment.pool import WordAligner
from vox_ws.alignment.spelling import AlignmentText, spoken_words, written_times
from vox_ws.alignment.sphinx import letters_to_phones
from vox_ws.engines.piper import PiperEngine
from vox_ws.service.text_plan import CLOSE_S
from vox_ws.service.word_timings import WordTimings

TEXT = "Doctor Smith paid $3.50 for the tickets on Tuesday. The show started at 8, and it was wonderful."
# Piper speaking without its random noise: the same text gives the same audio, the same times.
STILL = {"noise_scale": 0.0, "noise_w_scale": 0.0}


async def stream_words(server, text: str, source: str | None = None,
                       **fields) -> tuple[list[dict], list[dict], dict, dict]:
    """(words, chunks, start, end) of one stream over v1, in the order they came; from the
    address `source` where given."""
    async with connect_client(server, **({"local_addr": (source, 0)} if source else {})) as c:
        await c.send({"type": "start", "id": "w", "text": text, "format": "s16", "word_timestamps": True, **fields})
        return await read_words(c)


async def read_words(c, sid: str = "w") -> tuple[list[dict], list[dict], dict, dict]:
    words, chunks, start = [], [], None
    while True:
        message = await c.recv_where(lambda m: m.get("id") == sid)
        if message["type"] == "start":
            start = message
        elif message["type"] == "words":
            words += message["words"]
        elif message["type"] == "chunk":
            chunks.append(message)
        elif message["type"] in ("end", "error"):
            return words, chunks, start, message


def ordered(words: list[dict], audio_s: float) -> bool:
    return (all(0 <= w["start_s"] <= w["end_s"] <= audio_s + 1e-3 for w in words)
            and all(a["end_s"] <= b["start_s"] + 1e-3 for a, b in zip(words, words[1:])))


# ------------------------------------------------------------------------------ the text as heard


def test_numbers_money_symbols_and_abbreviations_are_spelled_as_said():
    assert spoken_words("$3.50") == ["three", "dollars", "fifty", "cents"]
    assert spoken_words("£12") == ["twelve", "pounds"]
    assert spoken_words("1999") == ["nineteen", "ninety", "nine"]
    assert spoken_words("2,024") == ["two", "thousand", "twenty", "four"]
    assert spoken_words("R&D,") == ["r", "and", "d"]
    assert spoken_words("50%") == ["fifty", "percent"]
    assert spoken_words("Dr.") == ["doctor"] and spoken_words("dr") == ["dr"]
    assert spoken_words("3-day") == ["three", "day"]
    assert spoken_words("isn’t") == ["isn't"]
    assert spoken_words("—") == []


def test_the_spoken_words_belong_to_the_words_the_client_wrote():
    """The engine was given a normalised text: its words are timed, and each belongs to the
    written word it says; a written word said as nothing is still there."""
    text = AlignmentText.of("Dr. Smith paid $3.50 — twice.", "Doctor Smith paid three dollars fifty cents, twice.")
    assert text.written == ("Dr.", "Smith", "paid", "$3.50", "—", "twice.")
    assert text.words == ("doctor", "smith", "paid", "three", "dollars", "fifty", "cents", "twice")
    assert [text.written[i] for i in text.owner] == ["Dr.", "Smith", "paid", "$3.50", "$3.50", "$3.50", "$3.50",
                                                    "twice."]


def test_a_word_not_placed_is_estimated_between_its_neighbours_never_dropped():
    text = AlignmentText.of("one two three four", "one two three four")
    timed = written_times(text, [(0.0, 0.5), None, None, (1.6, 2.0)], 2.0)
    assert [w[0] for w in timed] == ["one", "two", "three", "four"]
    assert [w[3] for w in timed] == [False, True, True, False]
    assert timed[1][1] == 0.5 and timed[2][2] == pytest.approx(1.6)
    assert timed[1][2] == pytest.approx(timed[2][1])
    # Nothing placed (audio the aligner could not follow): shared over the segment by length.
    nothing = written_times(text, [None] * 4, 3.0)
    assert all(w[3] for w in nothing) and nothing[0][1] == 0.0 and nothing[-1][2] == pytest.approx(3.0)


def test_a_word_out_of_the_dictionary_is_spelled_by_rule():
    assert letters_to_phones("zorblax") == "Z AO R B L AE K S"
    assert letters_to_phones("shakespeare").split()[0] == "SH"
    assert letters_to_phones("'''") == "AH"


# ------------------------------------------------------------------------------ the aligner itself


@pytest.fixture                     # a process of its own, 110-190 MB: not kept for the module's servers
def aligner():
    aligner = WordAligner(workers=1)
    yield aligner
    aligner.close()


def test_audio_too_short_for_its_words_gets_estimated_times(aligner):
    timed = aligner.align(np.zeros(1600, np.int16), "far too many words for a tenth of a second",
                          "far too many words for a tenth of a second").result(WAIT_TIMEOUT)
    assert [w[0] for w in timed] == "far too many words for a tenth of a second".split()
    assert all(w[3] for w in timed) and timed[-1][2] == pytest.approx(0.1)


def test_a_process_that_dies_costs_its_segment_and_the_next_is_aligned(aligner):
    aligner.start()
    aligner.align(np.zeros(16000, np.int16), "hello", "hello").result(WAIT_TIMEOUT)   # started
    os.kill(aligner.pids()[0], signal.SIGKILL)
    for _ in range(3):      # the process is found dead at a submit (then replaced) or when it runs
        try:
            timed = aligner.align(np.zeros(16000, np.int16), "hello", "hello").result(WAIT_TIMEOUT)
            break
        except Exception:
            continue
    assert [w[0] for w in timed] == ["hello"]


@pytest.mark.hardening
def test_closing_the_aligner_kills_a_process_that_will_not_finish_within_its_grace():
    """Hardening VI, 17: the shutdown keeps its bound (`--drain-timeout` + 4 s) only if every
    helper process ends within what is left: an aligner process stopped (SIGSTOP) in the middle
    of a segment finished nothing, and the close waited for it for ever. With no grace left it
    is killed at once; a new aligner then aligns."""
    stuck = WordAligner(workers=1)
    stuck.start()
    stuck.align(np.zeros(16000, np.int16), "hello", "hello").result(WAIT_TIMEOUT)      # started
    pid = stuck.pids()[0]
    os.kill(pid, signal.SIGSTOP)
    held = stuck.align(np.zeros(16000, np.int16), "hello", "hello")                    # being aligned
    stuck.close(grace_s=0.0)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)                                         # killed and reaped
    with pytest.raises(Exception):
        held.result(WAIT_TIMEOUT)
    fresh = WordAligner(workers=1)
    try:
        assert [w[0] for w in fresh.align(np.zeros(16000, np.int16), "hello", "hello").result(WAIT_TIMEOUT)] \
            == ["hello"]
    finally:
        fresh.close()


# ------------------------------------------------------------------------------ VoxCPM2 over every door


async def test_voxcpm_streams_carry_a_time_for_every_word_in_english(tiny_voxcpm):
    async with connect_client(tiny_voxcpm) as c:
        assert "word_timestamps" in c.hello["features"]
    assert tiny_voxcpm.get("/v1/info")[1]["word_timings"] == {"source": "aligner", "languages": ["en"]}
    text = "First, a short clause. Then a second sentence follows it, and a third one ends it all."
    words, chunks, start, end = await stream_words(tiny_voxcpm, text, options={"max_len": 12})
    assert end["type"] == "end" and end["reason"] in ("done", "max_len"), end
    assert "ignored_options" not in start
    assert [w["word"] for w in words] == text.split()
    assert ordered(words, end["audio_s"])
    # Each segment's words lie in that segment's audio (random weights: placed by length).
    for segment in end["segments"]:
        inside = [w for w in words if segment["start_s"] - 1e-3 <= w["start_s"] <= segment["end_s"] + 1e-3]
        assert [w["word"] for w in inside][:len(segment["text"].split())] == segment["text"].split()
    assert all(set(w) <= {"word", "start_s", "end_s", "estimated"} for w in words)


@pytest.fixture
def voxcpm_normalising(start_server, tiny_model):
    """The tiny VoxCPM2 with its defaults, for streams that start its text normaliser (a
    process stopped with the server). One test's: stopped when it ends, not held to the module's."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    engine.given = []
    prefill_many = engine.prefill_many

    def recorded(requests):          # the texts the engine is given
        engine.given.extend(r.text for r in requests)
        return prefill_many(requests)

    engine.prefill_many = recorded
    return start_server(engine, slots=2)


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_words_are_those_sent_when_the_engine_was_given_others(voxcpm_normalising):
    """Normalised ("$3.50" said as "three dollars fifty cents") and respelled ("SQL" said
    "sequel"): the aligner hears what the engine was given, the client gets back what it sent."""
    text = "The SQL course costs $3.50 on 3 May."
    words, _, _, end = await stream_words(voxcpm_normalising, text, pronunciations=[{"match": "SQL", "say": "sequel"}],
                                          options={"max_len": 20, "normalize": True})
    assert end["type"] == "end", end
    assert [w["word"] for w in words] == text.split()
    assert ordered(words, end["audio_s"])
    given = voxcpm_normalising.engine.given[-1]
    assert "sequel" in given and "$" not in given            # what the engine spoke


# A sentence in each language, sent without `language`.
NOT_ENGLISH = {"fr": "Le petit chat dort sur la chaise de la cuisine.",
               "de": "Der kleine Hund schläft heute in der Küche.",
               "zh": "今天的天气很好，我们去公园散步吧。"}


@pytest.fixture(scope="module")
def english_speech(piper_server) -> tuple[str, np.ndarray]:
    """A sentence and Piper's speech of it, as the aligner takes audio (16-bit, 16 kHz)."""
    import httpx

    text = "The quick brown fox jumps over the lazy dog."
    spoken = httpx.post(piper_server.http + "/v1/audio/speech", timeout=60,
                        json={"input": text, "response_format": "pcm", "sample_rate": 16000, **STILL})
    assert spoken.status_code == 200, spoken.text
    return text, np.frombuffer(spoken.content, "<i2").copy()


@pytest.mark.parametrize("language", sorted(NOT_ENGLISH))
def test_text_without_a_language_is_aligned_only_if_it_is_english(aligner, english_speech, language):
    """VoxCPM2 reads the language from the text, and its streams come without `language`: the
    aligner forced French or German words onto its English model, with times that looked
    aligned. A segment that is not English gets a share of its audio for each word, every one
    `estimated`; English is aligned; a stream's `language` is taken as given."""
    english, audio = english_speech
    aligned = aligner.align(audio, english, english).result(WAIT_TIMEOUT)
    assert [w[0] for w in aligned] == english.split() and not any(w[3] for w in aligned), aligned
    foreign = NOT_ENGLISH[language]
    estimated = aligner.align(audio, foreign, foreign).result(WAIT_TIMEOUT)
    assert [w[0] for w in estimated] == foreign.split() and all(w[3] for w in estimated), estimated
    assert estimated[-1][2] == pytest.approx(len(audio) / 16000, abs=1e-3)   # shares of the whole
    # The stream's language, where it has one, is taken as given.
    assert not any(w[3] for w in aligner.align(audio, english, english, "en-US").result(WAIT_TIMEOUT))
    assert all(w[3] for w in aligner.align(audio, english, english, language).result(WAIT_TIMEOUT))
    assert "py3langid" not in sys.modules          # told apart in the aligner's processes


@pytest.mark.parametrize(("text", "english"), [
    ("The quick brown fox jumps over the lazy dog.", True),
    ("Hi.", True), ("Yes.", True), ("Okay.", True), ("Hello world.", True), ("I paid $3.50 in 1999.", True),
    ("42", True), ("", True),
    ("Le chat est sur la table.", False), ("Bonjour, comment allez-vous ?", False),
    ("Das ist ein Test.", False), ("Guten Morgen.", False), ("Buenos días.", False), ("Dank je wel.", False),
    ("你好", False), ("Привет, как дела?", False), ("こんにちは", False),
])
def test_which_texts_read_as_english(text, english):
    """Short English is English though langid's best guess for it is another language ("Hi."
    -> Serbian); another language's sentence or greeting is not; a word or two that English
    shares (`Hallo.`, `Merci.`) would be aligned as English, where a wrong time costs least."""
    from vox_ws.alignment.english import reads_as_english

    assert reads_as_english(text) is english


async def test_another_language_names_word_timestamps_ignored(tiny_voxcpm):
    words, _, start, end = await stream_words(tiny_voxcpm, "你好，世界。", language="zh", options={"max_len": 4})
    assert end["type"] == "end" and words == []
    assert "word_timestamps" in start["ignored_options"]


async def test_voxcpm_words_scale_with_the_speed_and_come_before_the_end(tiny_voxcpm):
    text = "Slow and steady wins the race."
    plain, _, _, end = await stream_words(tiny_voxcpm, text, options={"max_len": 10, "seed": 7})
    faster, _, _, fast_end = await stream_words(tiny_voxcpm, text, options={"max_len": 10, "seed": 7}, speed=2.0)
    assert [w["word"] for w in faster] == text.split()
    assert fast_end["audio_s"] == pytest.approx(end["audio_s"] / 2, abs=0.05)
    for a, b in zip(plain, faster):
        assert b["start_s"] == pytest.approx(a["start_s"] / 2, abs=0.02)


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_a_barge_in_hears_the_aligned_words_wholly_taken(tiny_voxcpm):
    """An agent's reply streams in and plays in real time (a lookahead: the server hands over
    audio no faster than it plays); the listener barges in once its first sentence is whole
    and timed by the aligner, while the reply goes on: `heard` names that sentence's words
    that ended in what was taken."""
    first = " ".join(["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"] * 2) + "."
    async with connect_client(tiny_voxcpm) as c:
        # 100 steps, 16 s: far longer than it takes to make and align it, or than the 10 s
        # the server holds ahead of a listener (max_buffered_audio_s).
        await c.send({"type": "start", "id": "b", "stream_input": True, "format": "s16", "word_timestamps": True,
                      "lookahead_s": 0.5, "options": {"max_len": 100}})
        await c.recv_where(lambda m: m["type"] == "start")
        await c.send({"type": "chunk", "id": "b", "text": first + " "})
        await c.send({"type": "flush", "id": "b"})
        listening = asyncio.ensure_future(c.recv_where(lambda m: m["type"] == "end"))   # plays as it comes
        service = tiny_voxcpm.server.service
        await wait_until(lambda: any(g._timed_words for g in list(service._live)))
        timed = next(g._timed_words for g in list(service._live) if g._timed_words)
        await c.send({"type": "cancel", "id": "b"})
        end = await listening
    assert end["reason"] == "cancelled"
    heard = end["heard"]
    assert 0 < heard["audio_s"] < 16.0
    partial = heard["partial"]
    assert partial["text"] == first
    assert partial["words"] == [w.word for w in timed if w.end_s <= heard["audio_s"] + CLOSE_S]
    assert 0 < len(partial["words"]) < len(first.split())
    assert partial["words"] == first.split()[:len(partial["words"])]


# ------------------------------------------------------------------------------ a failing aligner


class FailingAligner(WordAligner):
    """An aligner whose every segment fails, as a crashed process's would."""

    def start(self) -> None:
        pass

    def align(self, audio, written, spoken, language=None, owner="") -> Future:
        failed: Future = Future()
        failed.set_exception(RuntimeError("the aligner crashed"))
        return failed


async def test_a_failing_aligner_costs_the_stream_its_words_never_its_audio(start_server, tiny_model):
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2,
                          word_timings="engine")
    server.server.service.word_timings = WordTimings(FailingAligner(1))
    text = "The audio still comes. Every second of it."
    words, chunks, start, end = await stream_words(server, text, options={"max_len": 10})
    assert end["type"] == "end" and words == [] and len(end["segments"]) >= 1
    assert "word_timestamps" not in start.get("ignored_options", [])
    assert sum(len(c["audio"]) for c in chunks) / 2 / start["sample_rate"] == pytest.approx(end["audio_s"], abs=1e-3)
    # The server goes on: the next stream is served whole.
    async with connect_client(server) as c:
        result = await c.speak("And the next one too.", "n", format="s16", options={"max_len": 10})
    assert_good_stream(result, min_seconds=0.5, reason=result.end["reason"])
    # An aligner that never answers (a hung process, or one far behind under load): the end
    # waits for its words no longer than the aligner's time (none here), then sends them
    # estimated, every one marked, and comes (Hardening VII, found on the way: they were dropped).
    server.server.service.word_timings = WordTimings(HangingAligner(1, answer_within_s=0.0))
    words, chunks, start, end = await stream_words(server, text, options={"max_len": 10})
    spoken = " ".join(segment["text"] for segment in end["segments"]).split()
    assert end["type"] == "end" and [w["word"] for w in words] == spoken and spoken
    assert all(w["estimated"] for w in words) and words[-1]["end_s"] <= end["audio_s"] + 1e-3
    assert sum(len(c["audio"]) for c in chunks) / 2 / start["sample_rate"] == pytest.approx(end["audio_s"], abs=1e-3)


class HangingAligner(FailingAligner):
    def align(self, audio, written, spoken, language=None, owner="") -> Future:
        return Future()                 # never answered


# ------------------------------------------------------------------------------ any engine's words, aligned


@pytest.fixture
def aligned_piper(start_server):
    """Piper whose words come from the aligner (`--word-timings aligned`), to measure it. One
    test's: stopped when it ends, not held to the module's."""
    return start_server(PiperEngine(), slots=2, word_timings="aligned")


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_word_timings_aligned_times_piper_by_the_aligner_close_to_its_own(aligned_piper, piper_server):
    assert aligned_piper.get("/v1/info")[1]["word_timings"] == {"source": "aligner", "languages": ["en"]}
    assert piper_server.get("/v1/info")[1]["word_timings"] == {"source": "engine"}
    aligned, _, _, end = await stream_words(aligned_piper, TEXT, options=STILL)
    own, _, _, own_end = await stream_words(piper_server, TEXT, options=STILL)
    assert end["audio_s"] == pytest.approx(own_end["audio_s"], abs=0.01)       # the same speech
    assert [w["word"] for w in aligned] == [w["word"] for w in own] == TEXT.split()
    assert ordered(aligned, end["audio_s"]) and not any(w.get("estimated") for w in aligned)
    errors = [abs(a[k] - b[k]) for a, b in zip(aligned, own) for k in ("start_s", "end_s")]
    assert np.mean(errors) < 0.1, errors
    # Aligned by pocketsphinx (no word estimated), which was never loaded in this process: not on
    # the event loop, not on the engine's thread, but in the aligner's own processes.
    assert "pocketsphinx" not in sys.modules
    pids = aligned_piper.server.service.word_timings.aligner.pids()
    assert pids and os.getpid() not in pids


def test_word_timings_takes_three_modes():
    with pytest.raises(ValueError, match="auto, aligned, engine"):
        WordTimings.for_mode("always")
    assert WordTimings.for_mode("engine").aligner is None


def test_aligned_words_go_out_in_the_order_spoken_however_the_processes_answer():
    from vox_ws.service.events import Word
    from vox_ws.service.word_timings import AlignedInOrder

    order = AlignedInOrder()
    first, second, third = (Word("a", 0, 1),), (Word("b", 1, 2),), (Word("c", 2, 3),)
    for segment in "xyz":
        order.expect(segment)
    assert order.answer("z", third) == [] and order.answer("y", None) == []      # y failed: no words
    assert order.answer("x", first) == [first, third] and not order.waiting
    assert order.answer("elsewhere", second) == []


def test_hostile_texts_cost_the_aligner_little():
    """A 4,999-digit number is read digit by digit (inflect is never given it), and a segment
    with far more words than its audio could hold is not searched: its words are estimated."""
    from vox_ws.alignment.sphinx import SphinxAligner

    assert spoken_words("7" * 4999) == ["seven"] * 4999
    assert "trillion" in spoken_words("1" * 15) and len(spoken_words("1" * 16)) == 16
    aligner = SphinxAligner.__new__(SphinxAligner)       # no decoder needed: it is never searched
    assert aligner.align(np.zeros(16000, np.int16), ("seven",) * 100) == [None] * 100


# ------------------------------------------------------------------------------ the aligner's processes

ONE = "Hello there, my good friend."
# Three segments: streamed in, each sentence is one (a text sent whole is one segment).
THREE = ("The first sentence is here.", "The second one follows it.", "And the third ends the text.")


async def stream_in(c, sid: str, sentences: tuple[str, ...]) -> None:
    """A stream whose text comes in sentence by sentence, with word times."""
    await c.send({"type": "start", "id": sid, "stream_input": True, "format": "s16", "word_timestamps": True})
    for sentence in sentences:
        await c.send({"type": "chunk", "id": sid, "text": sentence + " "})
    await c.send({"type": "end", "id": sid})


def started_since(before: set[int]) -> set[int]:
    """This test process's descendants started since `before`, other than Python's own (its
    resource tracker, started with the first spawned process)."""
    return {pid for pid, command in child_processes().items()
            if pid not in before and "multiprocessing.resource_tracker" not in command}


@pytest.fixture(scope="module")
def piper_for_aligners(start_server):
    """Piper timed by the aligner (`--word-timings aligned`); each test below gives it an
    aligner of its own (`own_aligner`)."""
    return start_server(PiperEngine(), slots=2, word_timings="aligned")


@contextlib.contextmanager
def own_aligner(server, aligner: WordAligner):
    """`aligner` times the server's words for the block, and is closed after it."""
    service = server.server.service
    before = service.word_timings
    service.word_timings = WordTimings(aligner, always_aligned=True)
    try:
        yield aligner
    finally:
        service.word_timings = before
        aligner.close()


@pytest.mark.hardening
def test_the_aligners_are_their_setting_never_more_than_the_cgroup_quota(tmp_path, monkeypatch):
    """A host of 8 CPUs, which had 8 aligner processes (one per CPU it may run on), has
    `--aligners` (2 by default) at most, and a container's CPU quota, which its affinity does
    not show, bounds them too; made, an aligner starts no process."""
    from vox_ws.commands.cli import build_parser, config_from_args
    from vox_ws.engines.cpus import cpu_limit

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    root, membership = tmp_path / "cgroup", tmp_path / "membership"
    root.mkdir()
    membership.write_text("0::/\n")
    assert config_from_args(build_parser().parse_args(["serve"])).aligners == 2
    assert WordAligner(2, cpus=cpu_limit(root, membership)).workers == 2
    assert WordAligner(16, cpus=cpu_limit(root, membership)).workers == 8        # the CPUs it may run on
    (root / "cpu.max").write_text("150000 100000\n")                            # 1.5 CPUs
    assert WordAligner(8, cpus=cpu_limit(root, membership)).workers == 2
    monkeypatch.setenv("VOX_WS_ALIGNERS", "3")
    assert config_from_args(build_parser().parse_args(["serve"])).aligners == 3
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--aligners", "0"])
    aligner = WordTimings.for_mode("aligned", 2).aligner
    assert aligner.workers == 2 and aligner.processes == 0
    aligner.close()


@pytest.mark.hardening
async def test_a_word_time_stream_starts_the_one_aligner_it_needs_not_one_per_cpu(piper_for_aligners):
    """The issue's attack: a client without a token asks for word times where the aligner may
    have 8 processes (before: all 8 started at once, 1,045 MB). One starts, the stream's one
    segment needs no other; the next stream is served by the same; close stops it."""
    before = set(child_processes())
    with own_aligner(piper_for_aligners, WordAligner(8, cpus=8)) as aligner:
        words, _, _, end = await stream_words(piper_for_aligners, ONE, source=ATTACKER)
        assert end["type"] == "end" and [w["word"] for w in words] == ONE.split()
        started = started_since(before)
        assert aligner.processes == 1 and started == set(aligner.pids()), (started, aligner.pids())
        words, _, _, end = await stream_words(piper_for_aligners, ONE)
        assert end["type"] == "end" and [w["word"] for w in words] == ONE.split()
        assert aligner.aligned == 2 and started_since(before) == started
    assert not set(child_processes()) & started                 # closed: stopped


@pytest.mark.hardening
async def test_a_client_that_leaves_has_its_queued_segments_dropped_unaligned(piper_for_aligners):
    """Segments of a client that asked for word times and left wait for no one: they leave the
    aligner's queue unaligned, ahead of nobody's. Held in the queue by `hold` (no process takes
    them) until the client has gone."""
    aligner = WordAligner(1, answer_within_s=WAIT_TIMEOUT)
    aligner.hold()
    with own_aligner(piper_for_aligners, aligner):
        async with connect_client(piper_for_aligners, local_addr=(ATTACKER, 0)) as c:
            await stream_in(c, "a", THREE)
            await wait_until(lambda: aligner.queued == 3)
        await wait_until(lambda: aligner.queued == 0)
        assert aligner.dropped == 3 and aligner.aligned == 0
        aligner.release()
        words, _, _, end = await stream_words(piper_for_aligners, ONE)
        assert end["type"] == "end" and [w["word"] for w in words] == ONE.split()
        assert not any(w.get("estimated") for w in words) and aligner.aligned == 1


@pytest.mark.hardening
async def test_a_segment_past_the_aligner_queue_gets_estimated_words_the_next_aligned(piper_for_aligners):
    """A queue full (here 2 segments, held) refuses the next segment: its words come at once,
    every one `estimated`, in their place after the aligned ones; the next stream is aligned."""
    aligner = WordAligner(1, answer_within_s=WAIT_TIMEOUT, queue=2)
    aligner.hold()
    with own_aligner(piper_for_aligners, aligner):
        async with connect_client(piper_for_aligners, local_addr=(ATTACKER, 0)) as c:
            await stream_in(c, "w", THREE)
            await wait_until(lambda: aligner.refused == 1)
            assert aligner.queued == 2
            aligner.release()
            words, _, _, end = await read_words(c)
        assert end["type"] == "end" and [w["word"] for w in words] == " ".join(THREE).split()
        assert ordered(words, end["audio_s"])
        third = len(THREE[-1].split())
        assert not any(w.get("estimated") for w in words[:-third])
        assert all(w["estimated"] for w in words[-third:])
        assert aligner.aligned == 2
        words, _, _, end = await stream_words(piper_for_aligners, ONE)
        assert end["type"] == "end" and [w["word"] for w in words] == ONE.split()
        assert not any(w.get("estimated") for w in words) and aligner.aligned == 3 and aligner.refused == 1


@pytest.mark.hardening
def test_the_aligners_queue_is_shared_by_owners_in_turns_and_places():
    """Hardening VII (found on the way): the aligner's queue was one FIFO for every client, so
    one client's flood of segments delayed every other stream's words behind it and took every
    place (the others' then estimated). Free processes now take the owners' segments in turns
    (oldest first within each), and a full queue makes room for an owner holding fewer than the
    one holding most, whose newest segment is pushed out (its future fails AlignerBusy: its
    words are estimated). Held (no process takes a segment): nothing here waits."""
    from vox_ws.alignment.pool import AlignerBusy

    aligner = WordAligner(1, cpus=1, queue=4)
    aligner.hold()
    audio = np.zeros(1600, dtype=np.int16)
    try:
        flood = [aligner.align(audio, "a", "a", "en", owner="flooder") for _ in range(4)]
        assert aligner.queued == 4
        first = aligner.align(audio, "b", "b", "en", owner="other")            # the flooder's newest goes
        assert isinstance(flood[3].exception(timeout=0), AlignerBusy) and aligner.queued == 4
        second = aligner.align(audio, "b", "b", "en", owner="other")           # 3 against 1: again
        assert isinstance(flood[2].exception(timeout=0), AlignerBusy)
        with pytest.raises(AlignerBusy):                                          # 2 against 2: no more
            aligner.align(audio, "b", "b", "en", owner="other")
        with pytest.raises(AlignerBusy):
            aligner.align(audio, "a", "a", "en", owner="flooder")
        with aligner._lock:
            order = [aligner._next_waiting()[0] for _ in range(4)]
        assert order == [flood[0], first, flood[1], second]                     # in turns
        assert aligner.refused == 4
    finally:
        aligner.close(grace_s=0)
