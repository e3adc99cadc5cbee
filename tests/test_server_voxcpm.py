"""VoxCPM2 end to end over WebSocket: the tiny random-weight model through voxcpm's real
loading path (hub switched off), the batched scheduler, voices, options and LoRA."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed

import helpers
from benchmarks.equivalence import package_noise
from conftest import WAIT_TIMEOUT, connect_client, wait_until
from conftest import assert_good_stream as _assert_good_stream
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.engines.voxcpm.loading import import_voxcpm
from vox_ws.engines.voxcpm.prompt import prompt_positions
from vox_ws.scheduling.loop import EngineLoop

ADMIN = "admin-secret"


def assert_good_stream(result, min_seconds: float = 0.1, reason: str = "max_len"):
    """The tiny model's stop head never stops: a complete stream ends at its length cap."""
    _assert_good_stream(result, min_seconds, reason)
CHUNK_SAMPLES = 7680          # 4 latent frames x 1920 = 160 ms at 48 kHz


def tone_wav(seconds: float, rate: int = 16000, pitch: float = 200.0, fmt: str = "WAV") -> bytes:
    """This module's reference audio: a 200 Hz tone by default."""
    return helpers.tone_wav(seconds, rate, pitch, fmt)


@pytest.fixture(scope="module")
def voxcpm_server(start_server, tiny_model, tmp_path_factory):
    voices = tmp_path_factory.mktemp("builtin-voices")
    (voices / "narrator.wav").write_bytes(tone_wav(1.0, pitch=150))
    (voices / "narrator.txt").write_text("This is the narrator.")
    lora_dir = tmp_path_factory.mktemp("lora")
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=4, voices_dir=str(voices), lora_rank=4,
                          lora_dir=str(lora_dir))
    return start_server(engine, slots=4, max_streams=8, admin_tokens=[ADMIN])


def reference(tiny_model, text: str, seed: int, **options) -> np.ndarray:
    tts = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False, device="cpu")
    with package_noise(seed):       # the server's noise for that seed
        return np.concatenate(list(tts.generate_streaming(text=text, retry_badcase=False, **options)))


def assert_each_is_the_packages(tiny_model, plan, results) -> None:
    """Each stream's audio equals the package's output for that request alone."""
    for (text, seed, max_len), result in zip(plan, results):
        assert_good_stream(result)
        want = reference(tiny_model, text, seed, max_len=max_len)
        got = result.pcm()
        assert got.shape == want.shape
        assert np.max(np.abs(got - want)) < 1e-4


async def test_hello_and_info_describe_the_model(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        hello = c.hello
    assert hello["engine"] == "voxcpm" and hello["sample_rate"] == 48000 and hello["voices"] == ["narrator"]
    assert set(hello["options"]) == {"cfg_value", "inference_timesteps", "min_len", "max_len", "normalize", "seed"}
    status, info = voxcpm_server.get("/v1/info")
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["slots"] == 4
    # The engine's own peaks, as its process measured them (no GPU: no allocator's figure).
    assert info["memory"]["peak_rss_mb"] > 0 and "peak_gpu_mb" not in info["memory"]
    assert info["lora"]["configured"] is True and info["lora"]["adapters"] == [] and info["lora"]["default"] is None


async def test_streams_160ms_chunks_at_48khz(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        result = await c.speak("Hello from the tiny model.", "a", options={"max_len": 8, "seed": 1})
    assert_good_stream(result, min_seconds=1.0)
    assert [len(ch["audio"]) // 4 for ch in result.chunks] == [CHUNK_SAMPLES] * 8


@pytest.mark.slow
async def test_concurrent_streams_are_batched_and_match_the_package(voxcpm_server, tiny_model):
    """Several streams on several connections, joining at different steps of the first: every
    step batches them, and each stream's audio equals the package's output for that request
    alone. The joins are certain whatever the machine's speed: after the first stream's step 1,
    and again after step 4, the engine thread waits until the test has queued the next stream."""
    (scheduler,) = voxcpm_server.engine_loops
    plan = [("First stream, longest text of all of them.", 101, 20),
            ("Second one.", 202, 14),
            ("Third stream joins later.", 303, 10)]
    loop = asyncio.get_running_loop()
    batch_sizes: list[int] = []
    gates = {1: threading.Event(), 4: threading.Event()}       # steps after which the engine waits
    reached = {step: asyncio.Event() for step in gates}
    observe = scheduler.on_step                                 # the server's metrics

    def on_step(size: int, seconds: float) -> None:            # on the engine thread
        observe(size, seconds)
        batch_sizes.append(size)
        step = len(batch_sizes)
        if step in gates:
            loop.call_soon_threadsafe(reached[step].set)
            gates[step].wait(120)

    async def one(i, text, seed, max_len):
        async with connect_client(voxcpm_server) as c:
            return await c.speak(text, f"s{i}", options={"seed": seed, "max_len": max_len})

    scheduler.on_step = on_step
    try:
        tasks = [asyncio.create_task(one(0, *plan[0]))]
        for step, joining in zip(gates, plan[1:]):
            await asyncio.wait_for(reached[step].wait(), 120)
            tasks.append(asyncio.create_task(one(len(tasks), *joining)))
            await wait_until(lambda: scheduler.stats()["queued"] == 1)
            gates[step].set()
        results = await asyncio.gather(*tasks)
    finally:
        for gate in gates.values():
            gate.set()
        scheduler.on_step = observe
    assert batch_sizes[:5] == [1, 2, 2, 2, 3], batch_sizes
    assert_each_is_the_packages(tiny_model, plan, results)


@pytest.mark.slow
async def test_with_more_slots_than_rows_each_stream_is_still_the_packages(start_server, tiny_model):
    """Four KV slots, two rows a step: every stream is open at once, each step carries two of
    them (those whose listeners are closest to running out), and each stream's audio still
    equals the package's output for that request alone. `hello`, `/v1/load` and `/v1/info`
    report both numbers."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=4, step_rows=2), slots=4)
    (scheduler,) = server.engine_loops
    sizes: list[int] = []
    observe = scheduler.on_step

    def on_step(size: int, seconds: float) -> None:            # on the engine thread
        observe(size, seconds)
        sizes.append(size)

    plan = [("One stream of four.", 11, 12), ("Another one.", 22, 9), ("A third here.", 33, 10),
            ("And the fourth.", 44, 8)]
    async def one(i: int, text: str, seed: int, max_len: int):
        async with connect_client(server) as c:
            assert (c.hello["slots"], c.hello["step_rows"]) == (4, 2)
            return await c.speak(text, f"s{i}", options={"seed": seed, "max_len": max_len})

    scheduler.on_step = on_step
    try:
        results = await asyncio.gather(*(one(i, *each) for i, each in enumerate(plan)))
    finally:
        scheduler.on_step = observe
    assert max(sizes) == 2 and sum(sizes) >= sum(n for *_, n in plan), sizes
    assert_each_is_the_packages(tiny_model, plan, results)
    _, load = server.get("/v1/load")
    _, info = server.get("/v1/info")
    assert (load["slots"], load["step_rows"]) == (4, 2)
    assert (info["slots"], info["step_rows"], info["devices"][0]["step_rows"]) == (4, 2, 2)


async def test_same_seed_same_audio_other_seed_other_audio(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        one = await c.speak("Reproducible.", "a", options={"seed": 7, "max_len": 4})
        two = await c.speak("Reproducible.", "b", options={"seed": 7, "max_len": 4})
        three = await c.speak("Reproducible.", "c", options={"seed": 8, "max_len": 4})
    assert np.array_equal(one.pcm(), two.pcm())
    assert not np.allclose(one.pcm(), three.pcm())


async def test_options_map_onto_the_model(voxcpm_server, tiny_model_stops):
    async with connect_client(voxcpm_server) as c:
        capped = await c.speak("Capped by max_len.", "cap", options={"max_len": 3, "cfg_value": 1.0,
                                                                       "inference_timesteps": 2})
        assert capped.end["reason"] == "max_len" and len(capped.chunks) == 3
        # The package's text-length cap: 6 steps per token + 10.
        tiny = await c.speak("Hi", "textcap")
        tokens = len(voxcpm_server.engine.tts.tts_model.text_tokenizer("Hi"))
        assert tiny.end["reason"] == "max_len" and len(tiny.chunks) == 6 * tokens + 10
        rates = await c.speak("Resampled for telephony.", "rate", format="s16", sample_rate=8000,
                              options={"max_len": 5})
        assert_good_stream(rates)
        assert rates.seconds == pytest.approx(5 * 0.16, abs=0.01)


@pytest.mark.slow
async def test_stop_head_ends_with_done_after_min_len(start_server, tiny_model_stops):
    server = start_server(VoxCPMEngine(model=str(tiny_model_stops), device="cpu", slots=2), slots=2)
    async with connect_client(server) as c:
        result = await c.speak("The stop head says stop.", "s", options={"min_len": 4})
    assert result.end["reason"] == "done"
    assert len(result.chunks) == 6          # the package stops at the first step past min_len


async def test_cancel_frees_the_slot_before_the_next_step(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        await c.send({"type": "start", "id": "long", "text": "A long request that we interrupt.",
                      "options": {"max_len": 400}})
        await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "long")
        await c.send({"type": "cancel", "id": "long"})
        end = await c.recv_where(lambda m: m["type"] == "end" and m["id"] == "long")
        assert end["reason"] == "cancelled"
        for _ in range(200):
            if voxcpm_server.devices.stats()["active"] == 0:
                break
            await asyncio.sleep(0.01)
        assert voxcpm_server.devices.stats()["active"] == 0
        assert sorted(voxcpm_server.engine.runner._free_slots) == [0, 1, 2, 3]
        assert_good_stream(await c.speak("Next.", "next", options={"max_len": 3}))


@pytest.mark.parametrize("mode, transcript, fmt", [
    ("reference", None, "WAV"),
    ("continuation", "this is my voice", "FLAC"),
    ("both", "this is my voice", "WAV"),
])
async def test_register_a_voice_and_speak_with_it(voxcpm_server, mode, transcript, fmt):
    async with connect_client(voxcpm_server) as c:
        message = {"type": "voice", "id": "v", "audio": tone_wav(1.2, rate=22050, fmt=fmt), "mode": mode}
        if transcript:
            message["transcript"] = transcript
        await c.send(message)
        reply = await c.recv_where(lambda m: m.get("id") == "v")
        assert reply["type"] == "voice", reply
        assert reply["mode"] == mode and reply["audio_s"] == pytest.approx(1.2, abs=0.01)
        voice = reply["voice"]
        assert voice.startswith("v_") and len(voice) > 10
        cloned = await c.speak("Speaking in the new voice.", "s", voice=voice, options={"max_len": 4, "seed": 3})
        plain = await c.speak("Speaking in the new voice.", "p", options={"max_len": 4, "seed": 3})
        assert_good_stream(cloned)
        assert not np.allclose(cloned.pcm(), plain.pcm()), "the voice prompt must change the audio"
    # The voice id works from another connection too, until it is deleted.
    async with connect_client(voxcpm_server) as c:
        assert_good_stream(await c.speak("Same voice elsewhere.", "s", voice=voice, options={"max_len": 2}))
        await c.send({"type": "voice_delete", "id": "d", "voice": voice})
        assert (await c.recv_where(lambda m: m.get("id") == "d"))["deleted"] is True
        await c.send({"type": "start", "id": "gone", "text": "Hi", "voice": voice})
        assert (await c.error("gone"))["code"] == "bad_request"


async def test_builtin_voice_from_the_voices_dir(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        assert_good_stream(await c.speak("Narrated.", "n", voice="narrator", options={"max_len": 3}))


@pytest.mark.parametrize("message, code", [
    ({"type": "voice", "id": "x", "audio": b"definitely not audio"}, "bad_request"),
    ({"type": "voice", "id": "x", "audio": "text, not bytes"}, "bad_request"),
    ({"type": "voice", "id": "x", "audio": b"RIFF", "mode": "continuation"}, "bad_request"),  # no transcript
    ({"type": "voice", "id": "x", "audio": b"RIFF", "mode": "karaoke"}, "bad_request"),
    ({"type": "voice", "id": "x", "audio": tone_wav(0.05)}, "bad_request"),                  # too short
    ({"type": "voice", "id": "x", "audio": tone_wav(31.0, rate=8000)}, "too_large"),
    ({"type": "start", "id": "x", "text": "Hi", "voice": "v_doesnotexist"}, "bad_request"),
    ({"type": "start", "id": "x", "text": "Hi", "options": {"denoise": True}}, "bad_request"),
    ({"type": "start", "id": "x", "text": "Hi", "options": {"inference_timesteps": 500}}, "bad_request"),
    ({"type": "start", "id": "x", "text": "Hi", "options": {"cfg_value": -1}}, "bad_request"),
    ({"type": "start", "id": "x", "text": " \n\t "}, "bad_request"),
])
async def test_bad_voice_and_option_requests(voxcpm_server, message, code):
    async with connect_client(voxcpm_server) as c:
        await c.send(message)
        err = await c.error("x")
        assert err["code"] == code, err
        assert_good_stream(await c.speak("Still serving.", "ok", options={"max_len": 2}))


async def test_long_text_fits_with_a_small_max_len(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        assert_good_stream(await c.speak("x" * 300, "ok", options={"max_len": 2}))


LONG_TEXT = " ".join(f"Sentence {n} of a long text, which goes on for a while before it stops." for n in range(1, 80))


async def test_a_4000_character_text_is_spoken_whole_in_continuing_segments(voxcpm_server):
    text = LONG_TEXT[:4000]
    assert len(text) == 4000
    async with connect_client(voxcpm_server) as c:
        result = await c.speak(text, "long", options={"max_len": 3, "seed": 5})
    # The tiny model never stops by itself: every segment ends at its cap, reported in `end`.
    assert_good_stream(result, reason="max_len")
    segments = result.end["segments"]
    assert len(segments) >= 4
    assert " ".join(s["text"] for s in segments) == text
    assert result.end["audio_s"] == pytest.approx(len(segments) * 3 * 0.16, abs=1e-3)
    assert all(b["start_s"] == a["end_s"] for a, b in zip(segments, segments[1:]))


def test_long_texts_are_cut_where_each_piece_fits_its_own_length_rule(voxcpm_server):
    engine = voxcpm_server.engine
    model = engine.tts.tts_model
    text = LONG_TEXT[:4000]
    pieces = engine.text.split(text, {}, None)
    assert len(pieces) > 20 and " ".join(pieces) == text
    for piece in pieces:
        # Each piece fits with the package's own step cap (6 steps a token + 10).
        positions, tokens = prompt_positions(model, piece, None)
        assert engine.runner.fits(positions, tokens, 4096)
    # One enormous "word" is cut at characters rather than refused.
    assert all(engine.runner.fits(*prompt_positions(model, piece, None), 4096)
               for piece in engine.text.split("x" * 2000, {}, None))
    # A text that fits is one piece, as before.
    assert engine.text.split("Short text.", {}, None) == ["Short text."]


@pytest.mark.parametrize("speed", [0.5, 2.0])
async def test_speed_stretches_the_duration(voxcpm_server, speed):
    async with connect_client(voxcpm_server) as c:
        plain = await c.speak("Speed test.", "a", options={"max_len": 12, "seed": 3})
        changed = await c.speak("Speed test.", "b", options={"max_len": 12, "seed": 3}, speed=speed)
    assert_good_stream(changed)
    assert changed.seconds == pytest.approx(changed.end["audio_s"], abs=1e-3)
    assert changed.seconds / plain.seconds == pytest.approx(1 / speed, rel=0.05)


async def test_instructions_reach_the_model_as_voxcpm2_voice_design(voxcpm_server, tiny_model):
    async with connect_client(voxcpm_server) as c:
        result = await c.speak("Hi there.", "a", options={"seed": 11, "max_len": 6},
                               instructions="A calm, low voice")
        assert "ignored_options" not in result.start
        # A voice with a transcript continues its own prompt: instructions are named as ignored.
        ignored = await c.speak("Hi there.", "b", voice="narrator", options={"seed": 11, "max_len": 2},
                                instructions="A calm, low voice")
        assert ignored.start["ignored_options"] == ["instructions"]
    want = reference(tiny_model, "(A calm, low voice)Hi there.", 11, max_len=6)
    assert np.max(np.abs(result.pcm() - want)) < 1e-4


async def test_lora_needs_the_admin_token(voxcpm_server):
    async with connect_client(voxcpm_server) as c:
        await c.send({"type": "lora", "id": "l", "op": "load", "name": "bright"})
        assert (await c.error("l"))["code"] == "unauthorized"
    async with connect_client(voxcpm_server, additional_headers={"Authorization": "Bearer wrong"}) as c:
        await c.send({"type": "lora", "id": "l", "op": "load", "name": "bright"})
        assert (await c.error("l"))["code"] == "unauthorized"


# ------------------------------------------------------------------ loading


async def test_hub_id_not_in_the_local_cache_fails_load_clearly(start_server, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    server = start_server(VoxCPMEngine(model="openbmb/VoxCPM2", device="cpu"), wait=False)
    assert server.devices.ready_event.wait(60)
    status, body = server.get("/readyz")
    assert status == 503 and body["status"] == "failed"
    assert "local Hugging Face cache" in body["error"]


@pytest.mark.slow
async def test_hub_id_resolves_from_the_local_cache_offline(start_server, tiny_model, monkeypatch, tmp_path):
    """A hub id is served from a prepared HF cache with HF_HUB_OFFLINE=1."""
    cache = tmp_path / "hub" / "models--openbmb--VoxCPM2"
    snapshot = cache / "snapshots" / "0123456789abcdef0123456789abcdef01234567"
    shutil.copytree(tiny_model, snapshot)
    (cache / "refs").mkdir()
    (cache / "refs" / "main").write_text(snapshot.name)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path / "hub"))
    server = start_server(VoxCPMEngine(model="openbmb/VoxCPM2", device="cpu", slots=1), slots=1)
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("From the cache.", "a", options={"max_len": 2}))


@pytest.mark.slow
async def test_a_misnamed_tensor_is_caught_at_load(start_server, tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["stop_head.weight_renamed"] = weights.pop("stop_head.weight")
    save_file(weights, str(broken / "model.safetensors"))
    server = start_server(VoxCPMEngine(model=str(broken), device="cpu"), wait=False)
    assert server.devices.ready_event.wait(60)
    status, body = server.get("/readyz")
    assert status == 503 and "did not load cleanly" in body["error"] and "stop_head.weight" in body["error"]


async def test_denoiser_without_its_dependencies_fails_load_clearly(start_server, tiny_model):
    server = start_server(VoxCPMEngine(model=str(tiny_model), device="cpu", load_denoiser=True), wait=False)
    assert server.devices.ready_event.wait(60)
    status, body = server.get("/readyz")
    assert status == 503 and "modelscope" in body["error"]


def test_voxcpm_1_checkpoints_are_refused_clearly(tiny_model, tmp_path):
    v1 = tmp_path / "v1"
    shutil.copytree(tiny_model, v1)
    config = json.loads((v1 / "config.json").read_text())
    config["architecture"] = "voxcpm"
    (v1 / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="VoxCPM2 only"):
        VoxCPMEngine(model=str(v1), device="cpu").load()


# ------------------------------------------------------------------ the decoder process


@pytest.fixture
def two_cpus(monkeypatch):
    """The engine starts its decoder process only with a CPU to spare for it (on one core it
    decodes in the engine thread): these tests give it two, whatever the machine has."""
    from vox_ws.engines.voxcpm import runner

    monkeypatch.setattr(runner, "_usable_cpus", lambda: 2)


@pytest.mark.slow
def test_the_decoder_process_starts_with_the_engine_and_ends_with_the_scheduler(tiny_model, two_cpus):
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    scheduler = EngineLoop(engine, slots=2)
    scheduler.start()
    assert scheduler.ready_event.wait(WAIT_TIMEOUT) and scheduler.status == "ready"
    process = engine.runner.decoding.process._proc
    assert process.poll() is None, "ready means the decoder process is up and warm"
    scheduler.stop()
    assert process.wait(10) == 0


def _decoder_processes() -> list[int]:
    """The decoder processes this test's process has running (read from Linux's /proc)."""
    pids = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command = (entry / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue                      # gone meanwhile
        if parent == os.getpid() and b"voxcpm.decoder_main" in command:
            pids.append(int(entry.name))
    return pids


@pytest.mark.slow
def test_a_runners_decoder_process_serves_the_next_runner_and_says_the_same(tiny_model, two_cpus):
    """How `--slots auto` keeps the process it started while the model loaded: the runner
    that timed the steps hands it to the one that serves."""
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    others = set(_decoder_processes())          # other tests' servers, up until the session ends
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    engine.load()
    try:
        model = engine.tts.tts_model
        first = engine.runner
        assert first.decodes_in_process and set(_decoder_processes()) - others == {first.decoding.process.pid}
        decoder = first.take_decoder()
        first.close()                                   # leaves the process running
        second = BatchedVoxCPM2(model, 2, decoder=decoder)
        engine.runner = second
        assert second.decodes_in_process and set(_decoder_processes()) - others == {decoder.pid}
        said = dict(text="Handed over, the same voice.", seed=5, min_len=6, max_len=7)    # seven patches
        handed_over = helpers.speak_through(second, **said)
        inline = BatchedVoxCPM2(model, 2, decode_process=False)
        np.testing.assert_allclose(handed_over, helpers.speak_through(inline, **said), atol=1e-5)
    finally:
        engine.close()
    assert set(_decoder_processes()) - others == set()


@pytest.mark.slow
async def test_a_load_that_fails_stops_the_decoder_process_it_started(start_server, tiny_model, tmp_path, two_cpus):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    weights = load_file(str(broken / "model.safetensors"))
    weights["stop_head.weight_renamed"] = weights.pop("stop_head.weight")
    save_file(weights, str(broken / "model.safetensors"))
    others = set(_decoder_processes())
    server = start_server(VoxCPMEngine(model=str(broken), device="cpu"), wait=False)
    assert server.devices.ready_event.wait(WAIT_TIMEOUT)
    assert server.devices.status == "failed"
    assert set(_decoder_processes()) - others == set()      # started with the load, stopped with its failure


@pytest.mark.slow
async def test_decoder_process_death_fails_every_stream_and_stops_the_server(start_server, tiny_model, two_cpus):
    """The engine cannot decode without it (`EngineFailure`): every stream gets `unavailable`,
    connections close with 1011 and the server exits with code 3."""
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    server = start_server(engine, slots=2)
    async with connect_client(server) as c:
        await c.send({"type": "start", "id": "victim", "text": "A long text that takes many steps to say."})
        await c.recv_where(lambda m: m["type"] == "chunk" and m["id"] == "victim")
        os.kill(engine.runner.decoding.process.pid, signal.SIGKILL)
        error = await c.recv_where(lambda m: m["type"] == "error")
        assert error["id"] == "victim" and error["code"] == "unavailable"
        assert "decoder process" in error["message"], error
        with pytest.raises(ConnectionClosed):
            while True:
                await c.recv(timeout=20)
        assert c.ws.close_code == 1011
    assert server.devices.status == "failed"
    assert server.server.exit_code == 3
