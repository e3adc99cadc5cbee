"""Piper's native code runs in a worker process: a crash there (espeak-ng segfaults on some
texts) costs the request in flight, not the server; the known trigger never reaches espeak.

A real espeak crash is not deterministic (the same text crashed a fresh worker 7 times in 8 and
a warm one 0 times in 8 here), so the tests that need a crash give the real worker a real
SIGSEGV while it is speaking."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import signal
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import openai
import psutil
import pytest
from wyoming.client import AsyncTcpClient
from wyoming.info import Describe, Info

from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, start_serve
from helpers import LONG, SENTENCE
from vox_ws.engines import piper_worker
from vox_ws.engines.piper import PiperEngine, defuse_letter_runs
from vox_ws.engines.piper_voices import MAX_CONFIG_BYTES, VoiceSource, bundled, voice_set
from vox_ws.engines.piper_worker import MAX_PHONEMES, PiperWorker, WorkerCrashed

TRIGGERS = ["a." * 100, "b." * 100, "A.B." * 50]
CUE = "#crash "


def segfault_soon(pid: int, after: float = 0.1) -> None:
    threading.Timer(after, os.kill, (pid, signal.SIGSEGV)).start()


class CrashOnCue(PiperEngine):
    """The real voice; the worker gets SIGSEGV while it speaks a text with the cue."""

    def step(self, batch):
        if CUE in batch[0].text:
            self.crash_next_piece = True
        return super().step(batch)

    def _speak(self, state, phonemes, owners):
        if getattr(self, "crash_next_piece", False):
            self.crash_next_piece = False
            # The whole text's phonemes as one piece: seconds of work, killed 0.1 s in.
            phonemes = [ph for piece, _ in self._worker.phonemize(LONG)[1] for ph in piece + [" "]]
            owners = [-1] * len(phonemes)
            segfault_soon(self.worker_pid)
        return super()._speak(state, phonemes, owners)


def test_letter_runs_are_spaced_out_and_other_text_is_left_alone():
    assert defuse_letter_runs("a." * 8) == " ".join(["a."] * 8)
    assert defuse_letter_runs("The U.S.A. is big. e.g. this.") == "The U.S.A. is big. e.g. this."
    assert defuse_letter_runs("x" * 10 + "." * 10) == "x" * 10 + "." * 10


def test_the_worker_times_its_speech_in_wall_and_cpu_time():
    """What `--slots auto` sizes Piper by (`speed_slots`): the start's measure, and a piece
    measured again while serving, each timed in the worker (its wall and its CPU time)."""
    worker = PiperWorker(threads=1, voices=[bundled()])
    worker.start()
    try:
        speech, wall, cpu = worker.measured
        assert speech > 0 and wall > 0 and cpu > 0 and worker.speed == speech / wall
        piece = worker.phonemize(SENTENCE)[1][0][0]
        speech, wall, cpu = worker.measure_piece(piece)
        assert speech > 0 and wall > 0 and cpu > 0
    finally:
        worker.close()


def test_voices_of_one_model_file_share_its_session_and_keep_their_configs(tmp_path):
    """Voices that differ in their config alone (a speed, a language, a speaker) load their
    model once: a session of the bundled voice holds about 170 MB. The same file by another
    name (a link) is the same model; a copy is another."""
    joe = bundled()
    linked, copied = tmp_path / "linked.onnx", tmp_path / "copied.onnx"
    linked.symlink_to(joe.model_path)
    shutil.copyfile(joe.model_path, copied)
    slow = {**joe.config, "inference": {**joe.config["inference"], "length_scale": 2.0}}
    sessions: dict = {}
    first, _, _ = piper_worker._load(1, joe.model_path, joe.config, sessions)
    second, _, _ = piper_worker._load(1, str(linked), slow, sessions)
    third, _, _ = piper_worker._load(1, str(copied), joe.config, sessions)
    assert second.session is first.session and len(sessions) == 2
    assert third.session is not first.session
    assert (first.config.length_scale, second.config.length_scale) == (joe.config["inference"]["length_scale"], 2.0)
    piece = piper_worker.phonemize(first, SENTENCE)[1][0][0]
    quick, _ = piper_worker.speak(first, piece, True)
    slower, _ = piper_worker.speak(second, piece, True)
    assert len(slower) > 1.5 * len(quick)               # the shared model speaks by each one's config


@pytest.mark.hardening                   # a fault: the full lane's
def test_a_crash_in_the_worker_raises_and_the_next_text_gets_a_new_worker():
    worker = PiperWorker(threads=1, voices=[bundled()])
    worker.start()
    try:
        first, speed = worker.pid, worker.speed
        assert speed > 1.0                            # measured by the first worker
        everything = [ph for piece, _ in worker.phonemize(LONG * 2)[1] for ph in piece + [" "]]
        segfault_soon(first)
        with pytest.raises(WorkerCrashed, match="signal 11"):
            worker.speak(everything)                  # seconds of work in one piece
        audio = np.concatenate([worker.speak(piece)[0] for piece, _ in worker.phonemize(SENTENCE)[1]])
        assert len(audio) / worker.sample_rate > 1.0 and worker.pid != first and worker.restarts == 1
        assert worker.speed == speed                  # not measured again by the new one
    finally:
        worker.close()
    assert not worker.alive


@pytest.mark.slow
@pytest.mark.parametrize("text", TRIGGERS)
async def test_the_known_triggers_are_spoken(piper_server, text):
    async with connect_client(piper_server) as c:
        assert_good_stream(await c.speak(text, "t", format="s16"), 1.0)


@pytest.mark.hardening                   # a fault: the full lane's
async def test_a_crash_fails_only_its_stream(start_server):
    engine = CrashOnCue()
    server = start_server(engine, slots=4)
    first_worker = engine.worker_pid
    async with connect_client(server) as victim, connect_client(server) as other:
        await other.send({"type": "start", "id": "long", "text": LONG})
        crashed = await victim.speak(CUE + LONG, "bomb")
        assert crashed.error["code"] == "internal" and "signal 11" in crashed.error["message"]
        assert_good_stream(await other.collect("long"), 5.0)
        # The same connection speaks again, on a new worker.
        assert_good_stream(await victim.speak(SENTENCE, "after"))
    assert engine.worker_pid != first_worker
    assert server.devices.status == "ready" and server.get("/readyz")[0] == 200


@pytest.mark.slow
def test_dense_text_is_spoken_in_short_pieces():
    """A segment's work is bounded by the audio it makes: 240 CJK characters (read letter by
    letter, 85 s of speech as one segment) or a 200-digit number come in pieces of at most
    MAX_PHONEMES phonemes, cut between words, and nothing is lost."""
    voice, rate, aligned = piper_worker._load(1, bundled().model_path, bundled().config)
    for text in ("我们今天去公园散步天气非常好" * 17, "7" * 200, LONG):
        pieces = [phonemes for phonemes, _ in piper_worker.phonemize(voice, text)[1]]
        spoken = [ph for piece in pieces for ph in piece if ph != " "]
        assert spoken == [ph for s in voice.phonemize(text) for ph in s if ph != " "]
        assert len(pieces) > 2 and all(len(piece) <= MAX_PHONEMES for piece in pieces)
        # Pieces end between words, except where a sentence ends, or before a stressed syllable
        # inside one very long word (espeak reads a run of digits as one word).
        assert all(piece[-1] == " " or piece is pieces[-1] or later[0] in "ˈˌ" or piece[-1] in ".!?。"
                   for piece, later in zip(pieces, pieces[1:] + [[" "]]))
        longest = max(len(piper_worker.speak(voice, piece, aligned)[0]) for piece in pieces[:4]) / rate
        assert longest < 4.5, (text[:20], longest)
    # A sentence that fits in one piece stays whole; short sentences share one.
    assert len(piper_worker.phonemize(voice, SENTENCE)[1]) == 1
    assert len(piper_worker.phonemize(voice, "a. " * 30)[1]) < 5


# ------------------------------------------------------------------- a voices folder's bad files


def _voice(folder: Path, stem: str, config: bytes | None = None, model: bytes | None = None,
           length_scale: float = 1.0) -> None:
    """`stem`.onnx and its config in `folder`: the bundled model and config, or the bytes given."""
    joe = bundled()
    if config is None:
        settings = json.loads(Path(joe.config_path).read_text())
        settings["inference"]["length_scale"] = length_scale
        config = json.dumps(settings).encode()
    (folder / f"{stem}.onnx.json").write_bytes(config)
    if model is None:
        (folder / f"{stem}.onnx").symlink_to(joe.model_path)
    else:
        (folder / f"{stem}.onnx").write_bytes(model)


LFS_POINTER = (b"version https://git-lfs.github.com/spec/v1\n"
               b"oid sha256:" + b"5e" * 32 + b"\nsize 63201294\n")


def _speech(port: int, voice: str) -> httpx.Response:
    return httpx.post(f"http://127.0.0.1:{port}/v1/audio/speech", timeout=60,
                      json={"input": SENTENCE, "voice": voice, "response_format": "pcm"})


@pytest.mark.hardening
def test_a_voices_folder_with_bad_files_serves_the_good_voices_and_names_the_bad(tmp_path):
    """`vox-ws serve` with the pulled-voices folder (served by default) holding a config of
    200,000 nested arrays, a 4 KB random model, an empty model, a Git LFS pointer for a model,
    and a FIFO for a config, beside a good voice: it exited 1 (RecursionError), or the worker
    could not start (503 for good). Each bad file is left out with a log line naming it; the
    server is ready, and joe and the good voice speak."""
    folder = tmp_path / "home" / ".local" / "share" / "vox-ws" / "piper-voices"
    folder.mkdir(parents=True)
    # Sorted by name: a voice left out by the worker comes before the good one, whose number moves.
    _voice(folder, "en_US-broken-medium", model=random.Random(4).randbytes(4096))
    _voice(folder, "en_US-empty-medium", model=b"")
    _voice(folder, "en_US-evil-medium", config=b"[" * 200_000 + b"]" * 200_000)
    _voice(folder, "en_US-fifo-medium", config=b"")
    (folder / "en_US-fifo-medium.onnx.json").unlink()
    os.mkfifo(folder / "en_US-fifo-medium.onnx.json")
    _voice(folder, "en_US-good-medium", length_scale=1.6)
    _voice(folder, "en_US-lfs-medium", model=LFS_POINTER)
    log = tmp_path / "server.log"
    home = {**os.environ, "HOME": str(tmp_path / "home"), "PYTHONUNBUFFERED": "1"}
    serve = [sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0"]
    proc, port = start_serve(serve, log, env=home)
    try:
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/voices").json()["voices"]
        assert [v["id"] for v in listed if v["kind"] == "builtin"] == ["joe", "en_US-good-medium"]
        joe, good = _speech(port, "joe"), _speech(port, "en_US-good-medium")
        assert joe.status_code == good.status_code == 200
        assert len(good.content) > 1.3 * len(joe.content)            # the good voice's own (slower) config
        for bad in ("broken", "empty", "evil", "fifo", "lfs"):
            refused = _speech(port, f"en_US-{bad}-medium")
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "voice_not_found"
        assert "cannot be loaded" in _speech(port, "en_US-broken-medium").json()["error"]["message"]
        text = log.read_text()
        for bad, why in (("broken", "DecodeError"), ("empty", "an empty file"), ("evil", "nested too deeply"),
                         ("fifo", "not a regular file"), ("lfs", "a Git LFS pointer")):
            line = next(line for line in text.splitlines() if f"en_US-{bad}-medium.onnx" in line)
            assert "left out" in line and why in line, line
        assert "Traceback" not in text
        assert _speech(port, "joe").status_code == 200
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.hardening
def test_a_worker_started_again_serves_the_voices_left_in_numbered_as_before(tmp_path):
    """A folder's voice left out at the first start (its 4 KB random model) is not loaded again by
    a worker started after a crash, and the voices after it keep their numbers."""
    folder = tmp_path / "voices"
    folder.mkdir()
    _voice(folder, "en_US-broken-medium", model=random.Random(4).randbytes(4096))
    _voice(folder, "en_US-good-medium", length_scale=1.6)
    voices = voice_set([], str(folder))
    worker = PiperWorker(threads=1, voices=voices)
    try:
        worker.start()
        assert list(worker.left_out) == [1] and "en_US-broken-medium.onnx" in worker.left_out[1]
        phonemes = worker.phonemize(SENTENCE)[1][0][0]
        joe, good = len(worker.speak(phonemes, 0)[0]), len(worker.speak(phonemes, 1)[0])
        assert good > 1.3 * joe                       # number 1 is now the good voice
        first = worker.pid
        os.kill(first, signal.SIGKILL)
        worker._proc.wait()
        assert len(worker.speak(phonemes, 1)[0]) == pytest.approx(good, rel=0.1)
        assert worker.pid != first and worker.restarts == 1 and list(worker.left_out) == [1]
    finally:
        worker.close()


@pytest.mark.hardening
def test_a_bad_model_the_operator_named_fails_the_start_naming_it(tmp_path):
    """The default voice (or a --piper-voice) whose model cannot be loaded is no voice to leave
    out: the start fails, naming the file; a good worker starts after it."""
    bad = tmp_path / "joe.onnx"
    bad.write_bytes(random.Random(4).randbytes(4096))
    worker = PiperWorker(threads=1, voices=[replace(bundled(), model_path=str(bad))])
    with pytest.raises(RuntimeError, match=f"voice 'joe': its model '{bad}' cannot be loaded"):
        worker.start()
    worker.close()
    empty = tmp_path / "en_US-empty-medium.onnx"
    empty.write_bytes(b"")
    shutil.copyfile(bundled().config_path, tmp_path / "en_US-empty-medium.onnx.json")
    with pytest.raises(ValueError, match=f"its model '{empty}': an empty file"):
        voice_set([str(empty)])
    worker = PiperWorker(threads=1, voices=voice_set([]))
    try:
        worker.start()
        assert worker.left_out == {} and len(worker.speak(worker.phonemize(SENTENCE)[1][0][0])[0]) > 0
    finally:
        worker.close()


@pytest.mark.hardening
async def test_a_voice_config_is_read_once_within_a_bound(tmp_path, start_server, caplog):
    """A 2 MiB config (a 210 MB one added 400 MB to the start's peak: read whole three times)
    is refused by its size, unread; a good voice's config is read once, when the voices are
    chosen: the engine and its worker take the parsed config, so the file is not needed after."""
    folder = tmp_path / "voices"
    folder.mkdir()
    settings = json.loads(Path(bundled().config_path).read_text())
    _voice(folder, "en_US-huge-medium", config=json.dumps({**settings, "pad": "x" * (2 << 20)}).encode())
    _voice(folder, "en_US-good-medium", length_scale=1.6)
    with caplog.at_level(logging.ERROR, "vox_ws.engine"):
        voices = voice_set([], str(folder))
    assert [v.name for v in voices] == ["joe", "en_US-good-medium"]
    assert "en_US-huge-medium.onnx.json" in caplog.text and f"over {MAX_CONFIG_BYTES} bytes" in caplog.text
    for config in folder.glob("*.json"):
        config.unlink()                 # read once: neither the engine nor the worker reads it again
    server = start_server(PiperEngine(voices=voices))
    async with connect_client(server) as c:
        joe = await c.speak(SENTENCE, "joe", format="s16")
        good = await c.speak(SENTENCE, "good", voice="en_US-good-medium", format="s16")
    assert_good_stream(joe)
    assert_good_stream(good)
    assert good.seconds > 1.3 * joe.seconds


def _listed(server) -> list[str]:
    """The built-in voices as Open WebUI lists them (`GET /v1/audio/voices`)."""
    voices = httpx.get(f"{server.http}/v1/audio/voices", timeout=30).json()["voices"]
    return [v["id"] for v in voices if v["kind"] == "builtin"]


def _on_server(server, coroutine):
    """A coroutine run on the server's own event loop, awaited from the test's."""
    return asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, server.loop))


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_a_voice_added_to_the_folder_is_served_after_sighup_and_one_removed_is_refused(
        tmp_path, start_server, caplog):
    """The voices folder read again on SIGHUP (`VoxServer.reload`, what the signal runs): a voice
    copied in is listed (`/v1/audio/voices`, Wyoming's `describe`) and speaks in its own config;
    one removed is no longer listed and refused as `voice_not_found`, while a stream that
    started in it before goes on to its end; a bad model copied in is left out with a log line
    naming its file, and the rest is served. The worker that spoke the voices before stops with
    its last stream."""
    folder = tmp_path / "voices"
    folder.mkdir()
    _voice(folder, "en_US-first-medium")
    engine = PiperEngine(source=VoiceSource(directory=str(folder)))
    # The client below reads one chunk and then nothing for a while: its stream waits for it.
    server = start_server(engine, wyoming="tcp://127.0.0.1:0", max_buffered_audio_s=1.0,
                          write_stall_timeout_s=WAIT_TIMEOUT)
    assert _listed(server) == ["joe", "en_US-first-medium"]

    async def aliased() -> set[str | None]:
        return {alias.voice for alias in server.server.service.voices.aliases().values()}

    assert "en_US-first-medium" in await _on_server(server, aliased())     # some of OpenAI's names
    first_worker = engine.worker_pid
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "long", "text": LONG * 3, "voice": "en_US-first-medium",
                      "format": "s16"})
        first_chunk = await c.recv_where(lambda m: m.get("id") == "long" and m["type"] == "chunk")
        _voice(folder, "en_US-second-medium", length_scale=1.6)
        _voice(folder, "en_US-broken-medium", model=random.Random(4).randbytes(4096))
        for path in folder.glob("en_US-first-medium.*"):
            path.unlink()
        with caplog.at_level(logging.ERROR, "vox_ws.engines.piper"):
            changes = await _on_server(server, server.server.reload())
        assert changes == [{"added": ["en_US-second-medium"], "removed": ["en_US-first-medium"],
                            "left_out": ["en_US-broken-medium"]}]
        line = next(r.getMessage() for r in caplog.records if "en_US-broken-medium.onnx" in r.getMessage())
        assert "left out" in line and "DecodeError" in line, line
        assert _listed(server) == ["joe", "en_US-second-medium"]
        assert "en_US-first-medium" not in await _on_server(server, aliased())   # no name stands for it now
        async with AsyncTcpClient("127.0.0.1", server.server.wyoming.port) as wyoming:
            await wyoming.write_event(Describe().event())
            (program,) = Info.from_event(await asyncio.wait_for(wyoming.read_event(), WAIT_TIMEOUT)).tts
        described = {voice.name for voice in program.voices}
        assert "en_US-second-medium" in described and "en_US-first-medium" not in described
        # The new voice speaks in its own (slower) config; the removed and the bad are refused.
        joe, second = _speech(server.port, "joe"), _speech(server.port, "en_US-second-medium")
        assert joe.status_code == second.status_code == 200
        assert len(second.content) > 1.3 * len(joe.content)
        for gone in ("en_US-first-medium", "en_US-broken-medium"):
            refused = _speech(server.port, gone)
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["code"] == "voice_not_found"
        assert "cannot be loaded" in _speech(server.port, "en_US-broken-medium").json()["error"]["message"]
        assert psutil.pid_exists(first_worker) and engine.worker_pid != first_worker
        long = await c.collect("long")                           # its voice removed, its worker kept
        long.chunks.insert(0, first_chunk)
        assert_good_stream(long, min_seconds=60)
    assert not psutil.pid_exists(first_worker)                # with its last stream (released before `end`)


@pytest.mark.slow                        # over 4.5 s: the full lane's
async def test_a_voice_copied_into_the_folder_is_served_without_a_signal(tmp_path, start_server):
    """`--piper-voices-poll`: the folder looked at every so often; a voice copied in is served
    once the folder has settled, and one deleted is no longer, to the OpenAI SDK. The test waits
    on the rescans themselves (`until_done`), never on time."""
    folder = tmp_path / "voices"
    folder.mkdir()
    engine = PiperEngine(source=VoiceSource(directory=str(folder)), rescan_every_s=0.05)
    server = start_server(engine)
    rescans = server.server.service.voice_rescans
    openai_client = openai.AsyncOpenAI(base_url=server.http + "/v1", api_key="unused", max_retries=0)

    async def until(listed: bool) -> None:
        done = rescans.done
        while ("en_US-copied-medium" in _listed(server)) != listed:
            done += 1
            await asyncio.wait_for(_on_server(server, rescans.until_done(done)), WAIT_TIMEOUT)

    assert _listed(server) == ["joe"]
    _voice(folder, "en_US-copied-medium", length_scale=1.6)
    await until(listed=True)
    speech = await openai_client.audio.speech.create(model="tts-1", voice="en_US-copied-medium",
                                                     input=SENTENCE, response_format="pcm")
    assert len(speech.content) > 22050
    for path in folder.glob("en_US-copied-medium.*"):
        path.unlink()
    await until(listed=False)
    with pytest.raises(openai.BadRequestError) as refused:
        await openai_client.audio.speech.create(model="tts-1", voice="en_US-copied-medium", input=SENTENCE)
    assert refused.value.code == "voice_not_found"


@pytest.mark.slow                        # over 4.5 s: the full lane's
def test_vox_ws_serve_serves_a_first_pulled_voice_on_sighup(tmp_path):
    """`vox-ws serve` without a voices folder, then a first voice placed where `models pull
    piper:NAME` puts it (the folder made then) and SIGHUP: the voice is served without a
    restart (the pulled voices' folder is watched before it exists)."""
    home = tmp_path / "home"
    home.mkdir()
    log = tmp_path / "server.log"
    env = {**os.environ, "HOME": str(home), "PYTHONUNBUFFERED": "1"}
    env.pop("VOX_WS_PIPER_VOICES_DIR", None)
    serve = [sys.executable, "-m", "vox_ws", "serve", "--engine", "piper", "--port", "0",
             "--piper-voices-poll", "0"]
    proc, port = start_serve(serve, log, env=env)
    try:
        voices = httpx.get(f"http://127.0.0.1:{port}/v1/voices").json()["voices"]
        assert [v["id"] for v in voices if v["kind"] == "builtin"] == ["joe"]
        folder = home / ".local" / "share" / "vox-ws" / "piper-voices"
        folder.mkdir(parents=True)
        _voice(folder, "en_US-pulled-medium", length_scale=1.6)
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + WAIT_TIMEOUT                 # a hang detector, not a measure
        while "en_US-pulled-medium" not in httpx.get(f"http://127.0.0.1:{port}/v1/voices").text:
            assert time.monotonic() < deadline and proc.poll() is None, log.read_text()[-3000:]
            time.sleep(0.05)
        assert _speech(port, "en_US-pulled-medium").status_code == 200
        assert "piper voices read again: ['en_US-pulled-medium'] added" in log.read_text()
    finally:
        proc.terminate()
        proc.wait(30)
