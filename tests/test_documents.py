"""Whole documents from the command line (`vox-ws say --file`), captions, and the OpenAI door's
timings: real servers (Piper, the tiny VoxCPM2), the real `vox-ws` process, the files parsed
back with PyAV and webvtt-py."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import wave
from pathlib import Path

import httpx
import msgpack
import pytest
import webvtt

from attackers import hostile_server
from conftest import WAIT_TIMEOUT
from helpers import decode_file, flac_streaminfo
from vox_ws.clients.captions import MAX_CUE_CHARS, MAX_CUE_S, Cue, cues_from_segments, cues_from_words, write_captions
from vox_ws.engines.piper import PiperEngine

# The full lane runs these, not the quick one: together they took a minute or more of it (CONTRIBUTING.md, "Tests").
pytestmark = pytest.mark.slow

PARAGRAPH = ("The lighthouse keeper climbed the stairs every evening. He lit the lamp, wound the clock, and "
             "watched the ships pass far out at sea. Some nights the fog rolled in, thick and grey, and he "
             "sounded the horn until morning. ")


def run_say(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vox_ws", "say", *args], input=stdin, capture_output=True,
                          text=True, timeout=WAIT_TIMEOUT * 3)


def wav_seconds(path: Path) -> float:
    with wave.open(str(path)) as w:
        return w.getnframes() / w.getframerate()


def start_s(cue: webvtt.Caption) -> float:
    return seconds(cue.start_time)


def end_s(cue: webvtt.Caption) -> float:
    return seconds(cue.end_time)


def seconds(stamp) -> float:
    """A webvtt-py timestamp in seconds with its milliseconds (its `in_seconds` drops them)."""
    return stamp.hours * 3600 + stamp.minutes * 60 + stamp.seconds + stamp.milliseconds / 1000


def words_of(text: str) -> list[str]:
    return text.split()


@pytest.fixture(scope="module")
def small_piper(start_server):
    """Piper with a small text bound: a document is many times what the server holds at once."""
    return start_server(PiperEngine(), slots=2, max_text_chars=300)


def test_a_document_many_times_the_text_bound_is_one_file_with_word_captions(small_piper, tmp_path):
    document = tmp_path / "story.txt"
    text = PARAGRAPH * 6                                      # 1,300 characters against a bound of 300
    document.write_text(text)
    out, captions = tmp_path / "story.wav", tmp_path / "story.srt"
    said = run_say("--file", str(document), "-o", str(out), "--captions", str(captions), "--url", small_piper.url)
    assert said.returncode == 0, said.stderr
    spoken = sum(1 for c in text if not c.isspace())
    assert f"{spoken} of {spoken} characters spoken" in said.stderr
    length = wav_seconds(out)
    assert length > 40
    cues = list(webvtt.from_srt(str(captions)))
    # Piper's word timings: every word of the text, in order, each cue a readable line.
    assert [w for cue in cues for w in cue.text.split()] == words_of(text)
    starts = [start_s(cue) for cue in cues]
    assert starts == sorted(starts) and start_s(cues[0]) >= 0
    assert all(len(cue.text) <= MAX_CUE_CHARS or " " not in cue.text for cue in cues)
    assert all(end_s(cue) - start_s(cue) <= MAX_CUE_S + 0.01 for cue in cues)
    assert end_s(cues[-1]) <= length + 0.05 and end_s(cues[-1]) > length - 2.0


def test_standard_input_in_a_codec_with_word_captions_on_voxcpm(tiny_voxcpm, tmp_path):
    import av

    out, captions = tmp_path / "piped.flac", tmp_path / "piped.vtt"
    text = "First sentence of the pipe. Second sentence here. And a third one to end."
    said = run_say("--file", "-", "-o", str(out), "--format", "flac", "--captions", str(captions), "--url",
                   tiny_voxcpm.url, stdin=text)
    assert said.returncode == 0, said.stderr
    with av.open(str(out)) as container:
        rate = container.streams.audio[0].codec_context.sample_rate
        length = sum(frame.samples for frame in container.decode(audio=0)) / rate
    cues = list(webvtt.read(str(captions)))
    # VoxCPM2's words, timed by the aligner, in order (random weights: a word placed over
    # seconds is cut into pieces of a cue's length).
    assert "".join(cue.text for cue in cues).replace(" ", "") == text.replace(" ", "")
    assert len(cues) >= len(words_of(text))
    assert start_s(cues[0]) == 0 and end_s(cues[-1]) == pytest.approx(length, abs=0.05)
    assert all(end_s(a) <= start_s(b) + 1e-3 for a, b in zip(cues, cues[1:]))


def test_an_interrupted_run_says_how_far_it_got_and_its_file_is_whole(small_piper, tmp_path):
    document = tmp_path / "long.txt"
    document.write_text(PARAGRAPH * 40)
    out = tmp_path / "long.wav"
    # Ctrl-C as a terminal delivers it: a test runner started in the background has SIGINT
    # ignored, and a child would inherit that, so the child takes it as Python does by default.
    interruptible = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
                     "sys.argv[0] = 'vox-ws'; runpy.run_module('vox_ws', run_name='__main__')")
    proc = subprocess.Popen([sys.executable, "-c", interruptible, "say", "--file", str(document), "-o", str(out),
                             "--url", small_piper.url], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + WAIT_TIMEOUT
        # Some audio written (a second of it, at 22.05 kHz 16-bit) before the interruption.
        while not (out.exists() and out.stat().st_size > 44 + 44_100):
            assert time.monotonic() < deadline and proc.poll() is None, "no audio was written"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, stderr = proc.communicate(timeout=WAIT_TIMEOUT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, stderr
    assert "interrupted after" in stderr and f"of {sum(1 for c in PARAGRAPH * 40 if not c.isspace())}" in stderr
    assert wav_seconds(out) > 1.0                      # the header was patched: the file is whole
    # What it says the file holds is what the file holds (it said where the last sentence ended).
    held = float(re.search(r"long\.wav holds ([0-9.]+) s", stderr).group(1))
    assert held == pytest.approx(wav_seconds(out), abs=0.05), stderr


def test_on_a_terminal_a_progress_bar_shows_characters_audio_and_the_real_time_factor(small_piper, tmp_path):
    import fcntl
    import pty
    import struct
    import termios

    document = tmp_path / "bar.txt"
    document.write_text(PARAGRAPH * 3)
    controller, terminal = pty.openpty()
    # A terminal 100 columns wide, as a real one has a size (tqdm draws nothing in 0 columns).
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 30, 100, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "vox_ws", "say", "--file", str(document), "-o",
                             str(tmp_path / "bar.wav"), "--url", small_piper.url], stderr=terminal,
                            stdout=subprocess.DEVNULL,
                            # conftest quiets the libraries' bars with tqdm's TQDM_DISABLE; a user's shell has none.
                            env={k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"})
    os.close(terminal)
    shown = b""
    try:
        while True:
            try:
                data = os.read(controller, 4096)
            except OSError:                        # the terminal closed: the process has exited
                break
            if not data:
                break
            shown += data
    finally:
        os.close(controller)
        proc.wait(timeout=WAIT_TIMEOUT)
    assert proc.returncode == 0
    text = shown.decode(errors="replace")
    total = sum(1 for c in PARAGRAPH * 3 if not c.isspace())
    assert "speaking" in text and f"/{total}" in text and "RTF" in text and "s audio" in text
    assert f"{total} of {total} characters spoken" in text          # the closing report


def test_say_refuses_what_it_cannot_do(tmp_path, piper_server):
    assert run_say("-o", str(tmp_path / "x.wav"), "--url", piper_server.url).returncode == 2      # no text
    assert run_say("Hi.", "--file", "-", "-o", "x.wav").returncode == 2                            # both
    assert run_say("--file", str(tmp_path / "missing.txt"), "-o", "x.wav").returncode == 2
    refused = run_say("Hi.", "-o", str(tmp_path / "x.wav"), "--captions", str(tmp_path / "x.txt"))
    assert refused.returncode == 2 and ".srt or .vtt" in refused.stderr
    contradiction = run_say("Hi.", "-o", str(tmp_path / "x.mp3"), "--format", "wav", "--url", piper_server.url)
    assert contradiction.returncode == 2 and "contradicts" in contradiction.stderr
    assert not (tmp_path / "x.mp3").exists()


@pytest.mark.skipif(not shutil.which("aplay"), reason="ALSA's aplay is installed by the full lane (scripts/test.sh)")
def test_say_play_without_a_sound_card_fails_saying_so(piper_server):
    """`--play` with no sound card exited 0; ALSA's own player (no card here, nor in CI) fails,
    and `say` says so and exits 1."""
    done = run_say("Hello there, nobody is listening.", "--play", "--url", piper_server.url)
    assert done.returncode == 1, done.stderr
    assert "aplay could not play" in done.stderr


@pytest.mark.parametrize("name, magic", [("out.mp3", (b"\xff\xf3", b"\xff\xfb", b"\xff\xf2", b"ID3")),
                                         ("out.ogg", (b"OggS",)), ("out.opus", (b"OggS",)), ("out.flac", (b"fLaC",)),
                                         ("out.aac", (b"\xff\xf1", b"\xff\xf9")), ("out.wav", (b"RIFF",)),
                                         ("out", (b"RIFF",))])
def test_say_writes_the_format_its_output_is_named_for(tmp_path, piper_server, name, magic):
    """`say -o out.mp3` wrote WAV bytes into the file and exited 0; the extension names the
    format now (WAV for a name without one), unless --format says otherwise."""
    done = run_say("Hello there.", "-o", str(tmp_path / name), "--url", piper_server.url)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / name).read_bytes().startswith(magic)


@pytest.mark.parametrize("name", ["out.flac", "out.wav"])
def test_say_files_are_read_by_soundfile_with_the_length_the_server_sent(tmp_path, piper_server, name):
    """`say -o x.flac` wrote the stream as it came: its STREAMINFO, sent first, said 0 samples, and
    soundfile.read failed (`ValueError: array is too big`). The server's `end` now carries the
    header the muxer wrote once the length was known, and say writes it over the file's start:
    soundfile reads every sample the server sent (FLAC: its MD5 theirs)."""
    import hashlib

    import soundfile

    path = tmp_path / name
    done = run_say(PARAGRAPH, "-o", str(path), "--url", piper_server.url)
    assert done.returncode == 0, done.stderr
    pcm, rate = soundfile.read(path, dtype="int16")
    decoded, decoded_rate = decode_file(path.read_bytes())
    assert decoded_rate == rate and len(pcm) == decoded.size > 5 * rate
    held = float(re.search(r"holds ([\d.]+) s", done.stderr).group(1))       # as the server's `end` says
    assert len(pcm) / rate == pytest.approx(held, abs=0.05)
    if name.endswith(".flac"):
        md5 = hashlib.md5(pcm.astype("<i2").tobytes()).digest()
        assert flac_streaminfo(path.read_bytes()) == (len(pcm), md5)


def test_say_refuses_an_extension_it_cannot_write_and_writes_raw_pcm_by_name(tmp_path, piper_server):
    """`say -o x.m4a` (.webm, .pcm, .raw, .ulaw) wrote WAV under the name and exited 0. A name
    say cannot write is refused in one line, before anything is spoken; .pcm and .raw are 16-bit
    PCM, .ulaw G.711 µ-law, raw at the stream's rate, as the server sends them."""
    for name in ("x.m4a", "x.webm"):
        refused = run_say("Hi.", "-o", str(tmp_path / name), "--url", piper_server.url)
        assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
        assert f"cannot write a {name[1:]} file" in refused.stderr and not (tmp_path / name).exists()
    for name, fmt, width in (("x.pcm", "s16", 2), ("x.raw", "s16", 2), ("x.ulaw", "mulaw", 1)):
        done = run_say("Hello there.", "-o", str(tmp_path / name), "--url", piper_server.url)
        assert done.returncode == 0, done.stderr
        data = (tmp_path / name).read_bytes()
        rate = piper_server.engine.sample_rate
        assert f"({len(data)} bytes of {fmt} at {rate} Hz)" in done.stderr and not data.startswith(b"RIFF")
        assert len(data) % width == 0 and len(data) / width > 0.5 * rate


# ------------------------------------------------------------------------------ captions


def test_word_cues_are_readable_lines_that_close_at_sentence_ends():
    words = [(f"word{i}.", i * 0.5, i * 0.5 + 0.4) if i % 9 == 8 else (f"word{i}", i * 0.5, i * 0.5 + 0.4)
             for i in range(40)]
    cues = cues_from_words(words)
    assert [w for cue in cues for w in cue.text.split()] == [w for w, _, _ in words]
    assert all(len(cue.text) <= MAX_CUE_CHARS and cue.end_s - cue.start_s <= MAX_CUE_S for cue in cues)
    assert all(cue.text.split()[-1].endswith(".") or len(cue.text) + 7 > MAX_CUE_CHARS
               or cue.end_s - cue.start_s + 0.5 > MAX_CUE_S or cue is cues[-1] for cue in cues)


def test_captions_keep_angle_brackets_and_long_words_within_the_bounds(tmp_path):
    """`<https://fsf.org/>` was written raw into .vtt (a player drops it as a tag), the .srt lost
    `<info@example.org>`, a cue of one long word ran to 8.7 s and 48 characters, and the .srt had
    no final newline."""
    import html

    words = [("See", 0.0, 0.3), ("<https://fsf.org/>", 0.3, 1.0), ("or", 1.0, 1.1), ("<info@example.org>", 1.1, 1.9),
             ("a", 1.9, 2.0), ("<", 2.0, 2.1), ("b", 2.1, 2.2), ("&", 2.2, 2.3), ("c.", 2.3, 2.5),
             ("Rindfleischetikettierungsueberwachungsaufgaben", 2.5, 11.2)]
    cues = cues_from_words(words)
    assert all(len(cue.text) <= MAX_CUE_CHARS and cue.end_s - cue.start_s <= MAX_CUE_S + 0.001 for cue in cues)
    long_word = [cue.text for cue in cues][[cue.text.endswith("c.") for cue in cues].index(True) + 1:]
    assert len(long_word) == 2 and "".join(long_word) == "Rindfleischetikettierungsueberwachungsaufgaben"
    assert cues[-1].end_s == pytest.approx(11.2)
    write_captions(cues, tmp_path / "c.vtt")
    write_captions(cues, tmp_path / "c.srt")
    vtt = (tmp_path / "c.vtt").read_text()
    assert "<https" not in vtt and "&lt;https://fsf.org/&gt;" in vtt and "a &lt; b &amp; c." in vtt
    # What a WebVTT reader shows once it decodes the text is what was said.
    assert [html.unescape(c.text) for c in webvtt.read(str(tmp_path / "c.vtt"))] == [c.text for c in cues]
    srt = (tmp_path / "c.srt").read_text()
    assert " ".join(cue.text for cue in cues[:-2]) == "See <https://fsf.org/> or <info@example.org> a < b & c."
    assert all(f"\n{cue.text}\n" in srt for cue in cues) and srt.endswith("\n")


def test_segment_cues_share_the_time_by_length_and_cut_cjk_at_the_width(tmp_path):
    cues = cues_from_segments([("A short one.", 0.0, 1.0), ("我们今天去公园散步天气非常好" * 5, 1.0, 11.0)])
    assert cues[0] == Cue(0.0, 1.0, "A short one.")
    assert all(len(cue.text) <= MAX_CUE_CHARS for cue in cues) and len(cues) == 3
    assert cues[-1].end_s == pytest.approx(11.0) and cues[1].start_s == pytest.approx(1.0)
    write_captions(cues, tmp_path / "c.vtt")
    assert [c.text for c in webvtt.read(str(tmp_path / "c.vtt"))] == [c.text for c in cues]
    with pytest.raises(ValueError, match=".srt or .vtt"):
        write_captions(cues, tmp_path / "c.txt")


# ------------------------------------------------------------------------------ the OpenAI door's timings


def sse_events(server, **body) -> tuple[httpx.Headers, list[dict]]:
    events = []
    with httpx.stream("POST", server.http + "/v1/audio/speech", timeout=60,
                      json={"input": PARAGRAPH, "voice": "alloy", "response_format": "pcm", "stream_format": "sse",
                            **body}) as reply:
        assert reply.status_code == 200, reply.read()
        for line in reply.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
    return reply.headers, events


def test_sse_carries_word_timings_on_piper_and_on_voxcpm_by_the_aligner(piper_server, tiny_voxcpm):
    headers, events = sse_events(piper_server, timestamps="word")
    assert headers["x-timestamps"] == "word"
    words = [w for e in events if e["type"] == "speech.audio.words" for w in e["words"]]
    assert [w["word"] for w in words] == words_of(PARAGRAPH)
    assert all(a["end_s"] <= b["start_s"] + 1e-3 for a, b in zip(words, words[1:]))
    audio_s = sum(len(__import__("base64").b64decode(e["audio"])) for e in events
                  if e["type"] == "speech.audio.delta") / 2 / 24000
    assert words[-1]["end_s"] <= audio_s + 0.05
    # VoxCPM2 knows no word times: the aligner gives them, every word once, in order, before the end.
    headers, events = sse_events(tiny_voxcpm, timestamps="word", max_len=4)
    assert headers["x-timestamps"] == "word"
    words = [w for e in events if e["type"] == "speech.audio.words" for w in e["words"]]
    assert [w["word"] for w in words] == words_of(PARAGRAPH)
    assert all(a["start_s"] <= a["end_s"] <= b["start_s"] + 1e-3 for a, b in zip(words, words[1:]))
    assert events[-1]["type"] == "speech.audio.done"
    # Without timestamps, no such events; asked without SSE, a 400 naming the field.
    _, plain = sse_events(piper_server)
    assert {e["type"] for e in plain} == {"speech.audio.delta", "speech.audio.done"}
    refused = httpx.post(piper_server.http + "/v1/audio/speech", json={"input": "x", "timestamps": "word"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "timestamps"


def test_the_reader_sends_pieces_the_server_may_hold(tmp_path):
    """Files are read as they come and sent in pieces of at most the limit, cut after a space,
    each run of whitespace one character; a word longer than a piece is cut at the limit."""
    import asyncio

    from vox_ws.clients.say import READ_BYTES, pieces, read_blocks

    path = tmp_path / "t.txt"
    text = "héllo   wörld\n\n  " * 3000 + "x" * 250
    path.write_text(text)

    async def read(limit: int) -> list[str]:
        return [piece async for piece in pieces(read_blocks(str(path), None), limit)]
    sent = asyncio.run(read(100))
    assert "".join(sent) == "héllo wörld\n" * 3000 + "x" * 250
    assert max(map(len, sent)) <= 100 and sent[-3:] == ["x" * 100, "x" * 100, "x" * 50]
    # Cut after a space, except where a block read ended (what was read is sent at once).
    blocks = -(-os.path.getsize(path) // READ_BYTES)
    assert blocks > 1 and sum(not p[-1].isspace() for p in sent[:-3]) < blocks


def test_cue_text_never_holds_a_timing_arrow_or_a_blank_line(tmp_path):
    """Hardening V, 14: a document holding "-->" ended `say --captions x.vtt` in a traceback
    with no captions, and .srt got the arrow raw. Cue text is one line without the arrow."""
    cues = [Cue(0.0, 1.0, "if a --> b then"), Cue(1.0, 2.0, "one\n\ntwo ---> three")]
    assert [cue.text for cue in cues] == ["if a \u2192 b then", "one two \u2192 three"]
    for suffix, read in ((".vtt", webvtt.read), (".srt", webvtt.from_srt)):
        write_captions(cues, tmp_path / f"c{suffix}")
        assert [c.text for c in read(str(tmp_path / f"c{suffix}"))] == [cue.text for cue in cues]
        assert "-->" not in "".join(line for line in (tmp_path / f"c{suffix}").read_text().splitlines()
                                    if not line[:1].isdigit())


HELLO = {"type": "hello", "protocol": 1, "sample_rate": 22050, "features": ["word_timestamps"],
         "limits": {"max_text_chars": 1000}}


def test_say_refuses_a_start_that_names_no_usable_sample_rate(tmp_path):
    """Hardening V, 14: a server answering `start` with `sample_rate: 0` caused a wave.Error
    traceback. A server that does so here (a real WebSocket server on loopback, speaking v1's
    hello and start) gets a one-line refusal and exit 1."""
    async def answer(ws) -> None:
        await ws.send(msgpack.packb({"type": "hello", "protocol": 1, "sample_rate": 0, "features": [],
                                     "limits": {"max_text_chars": 1000}}))
        start = msgpack.unpackb(await ws.recv())
        await ws.send(msgpack.packb({"type": "start", "id": start["id"], "sample_rate": 0, "format": "s16"}))
        await ws.wait_closed()

    with hostile_server(answer) as url:
        said = run_say("Hello.", "-o", str(tmp_path / "x.wav"), "--url", url)
    assert said.returncode == 1 and "sample rate of 0 Hz" in said.stderr and "Traceback" not in said.stderr


# What a hostile server says after a good segment and its words (field: value), and what `say`
# names of it.
BAD_TIMES = {
    "a segment ending at NaN": ({"type": "segment", "start_s": 1.0, "end_s": float("nan")}, "end_s nan"),
    "a segment ending at infinity": ({"type": "segment", "start_s": 1.0, "end_s": float("inf")}, "end_s inf"),
    "a segment starting before 0": ({"type": "segment", "start_s": -1.0, "end_s": 2.0}, "start_s -1.0"),
    "a segment ending before its start": ({"type": "segment", "start_s": 2.0, "end_s": 1.5},
                                          "start_s 2.0 after its end_s 1.5"),
    "a segment starting before the previous one": ({"type": "segment", "start_s": 0.2, "end_s": 2.0},
                                                   "start_s 0.2 before the previous one's 0.5"),
    "a segment's time as text": ({"type": "segment", "start_s": "1", "end_s": 2.0}, "start_s '1'"),
    "a word ending at NaN": ({"type": "words", "words": [{"word": "there", "start_s": 1.0,
                                                          "end_s": float("nan")}]}, "end_s nan"),
    "a word before the previous one": ({"type": "words", "words": [{"word": "there", "start_s": 0.1,
                                                                    "end_s": 0.2}]},
                                       "start_s 0.1 before the previous one's 0.5"),
    "an end with NaN seconds of audio": ({"type": "end", "reason": "done", "audio_s": float("nan")},
                                         "audio_s nan"),
}


@pytest.mark.hardening
def test_say_refuses_a_server_whose_times_are_not_times(tmp_path, piper_server):
    """Hardening VI, 16: a segment with `end_s: NaN` crashed `say --captions` with a traceback
    (the cue's clock). Every time the server sends is checked by the client (v1.py): finite, at
    least 0, a start not after its end nor before the one before it. A server that sends one
    that is not (a real WebSocket server on loopback, after a good segment and its words) gets
    one line naming what it sent, exit 1, no captions written or claimed; a real server then
    speaks with captions."""
    def answer_with(bad: dict):
        async def answer(ws) -> None:
            await ws.send(msgpack.packb(HELLO))
            start = msgpack.unpackb(await ws.recv())
            sid = start["id"]
            for message in ({"type": "start", "id": sid, "sample_rate": 22050, "format": "s16"},
                            {"type": "chunk", "id": sid, "seq": 0, "audio": bytes(22050)},
                            {"type": "words", "id": sid,
                             "words": [{"word": "Hello", "start_s": 0.5, "end_s": 0.9}]},
                            {"type": "segment", "id": sid, "text": "Hello.", "start_s": 0.5, "end_s": 1.0},
                            {**bad, "id": sid, **({"text": "there."} if bad["type"] == "segment" else {})}):
                await ws.send(msgpack.packb(message))
            await ws.wait_closed()
        return answer

    for attack, (bad, named) in BAD_TIMES.items():
        captions = tmp_path / "bad.vtt"
        with hostile_server(answer_with(bad)) as url:
            said = run_say("Hello there.", "-o", str(tmp_path / "bad.wav"), "--captions", str(captions),
                           "--url", url)
        assert said.returncode == 1, (attack, said.stderr)
        assert "Traceback" not in said.stderr, (attack, said.stderr)
        assert f"protocol_violation: the server's {bad['type']}" in said.stderr and named in said.stderr, \
            (attack, said.stderr)
        assert not captions.exists() and "captions in" not in said.stderr, (attack, said.stderr)
    good = run_say("Hello there.", "-o", str(tmp_path / "good.wav"), "--captions", str(tmp_path / "good.vtt"),
                   "--url", piper_server.url)
    assert good.returncode == 0, good.stderr
    assert [c.text for c in webvtt.read(str(tmp_path / "good.vtt"))] == ["Hello there."]


# What a hostile server sends once a stream has started, and what `say` names of it.
CLIENT_BOMBS = {
    "an 8 MB frame of empty arrays": (b"\xdd" + (8 << 20).to_bytes(4, "big") + b"\x90" * (8 << 20),
                                      "a frame over 1048576 bytes"),
    "a frame within the bytes of 480,000 empty arrays": (
        msgpack.packb({"type": "words", "words": [[[]] * 16_000] * 30}), "more than 16384 maps or arrays"),
    "a chunk of 5 s of s16 audio": (None, "more than 4 s of s16 at 22050 Hz"),
}


@pytest.mark.hardening
def test_say_refuses_a_server_frame_past_what_the_protocol_allows(tmp_path, piper_server):
    """Hardening VII, 4: the client connected with no frame bound (`max_size=None`) and decoded
    whatever came: one 8 MB frame of empty arrays took `vox-ws say` from 45 to 611 MB. A
    server's frame is now bounded (1 MiB: a chunk holds at most 1 s of the engine's audio, 4 s
    of output at the slowest speed: 768 KB of f32 at 48 kHz) and so are its decode's maps and
    arrays (16,384), and a chunk of more than that of its stream's audio is refused too: each a
    protocol violation in one line, exit 1. A real server then speaks."""
    def answer_with(bomb: bytes | None):
        async def answer(ws) -> None:
            await ws.send(msgpack.packb(HELLO))
            sid = msgpack.unpackb(await ws.recv())["id"]
            await ws.send(msgpack.packb({"type": "start", "id": sid, "sample_rate": 22050, "format": "s16"}))
            five_seconds = {"type": "chunk", "id": sid, "seq": 0, "audio": bytes(5 * 2 * 22050)}
            await ws.send(bomb if bomb is not None else msgpack.packb(five_seconds))
            await ws.wait_closed()
        return answer

    for attack, (bomb, named) in CLIENT_BOMBS.items():
        with hostile_server(answer_with(bomb)) as url:
            said = run_say("Hello.", "-o", str(tmp_path / "x.wav"), "--url", url)
        assert said.returncode == 1 and "Traceback" not in said.stderr, (attack, said.stderr)
        assert "protocol_violation" in said.stderr and named in said.stderr, (attack, said.stderr)
    good = run_say("Hello.", "-o", str(tmp_path / "good.wav"), "--url", piper_server.url)
    assert good.returncode == 0 and wav_seconds(tmp_path / "good.wav") > 0.3, good.stderr


@pytest.mark.hardening
def test_say_gives_up_on_a_server_that_says_nothing(tmp_path, piper_server):
    """Hardening VI, 16: a server that accepted and then said nothing held `say` for good. The
    client gives up once the server has said nothing for `--timeout` seconds while it waits on
    it (here 0.5 s; these servers never answer, so the machine's speed does not matter): no
    hello, or a hello and a `start` and then no audio. One line, exit 1; a real server then
    speaks with the same time-out."""
    async def silent(ws) -> None:
        await ws.wait_closed()

    async def silent_after_start(ws) -> None:
        await ws.send(msgpack.packb(HELLO))
        start = msgpack.unpackb(await ws.recv())
        await ws.send(msgpack.packb({"type": "start", "id": start["id"], "sample_rate": 22050,
                                     "format": "s16"}))
        await ws.wait_closed()

    for answer in (silent, silent_after_start):
        with hostile_server(answer) as url:
            said = run_say("Hello.", "-o", str(tmp_path / "x.wav"), "--timeout", "0.5", "--url", url)
        assert said.returncode == 1 and "Traceback" not in said.stderr, said.stderr
        assert "vox-ws say: server_silent: the server" in said.stderr and "said nothing for 0.5 s" in said.stderr, \
            said.stderr
    refused = run_say("Hi.", "-o", str(tmp_path / "x.wav"), "--timeout", "0", "--url", piper_server.url)
    assert refused.returncode == 2 and "--timeout is seconds" in refused.stderr
    good = run_say("Hello.", "-o", str(tmp_path / "good.wav"), "--timeout", "30", "--url", piper_server.url)
    assert good.returncode == 0 and wav_seconds(tmp_path / "good.wav") > 0.3, good.stderr
