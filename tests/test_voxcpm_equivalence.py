"""The batched loop against the voxcpm package itself: for concurrent requests with different
texts, lengths, voices, options and start times, each request's audio must equal what the
package's own `generate_streaming` produces for it alone (same weights, same noise)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import soundfile
import torch

from vox_ws.engines.voxcpm.loading import import_voxcpm
from vox_ws.engines.voxcpm.prompt import build_prompt
from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, DecodeBalance

TOLERANCE = 1e-4   # fp32 round-off between batched and single-row kernels; audio is in [-1, 1]


@pytest.fixture(scope="module")
def voice_wavs(tmp_path_factory):
    """Two reference recordings at the VAE's own rate (16 kHz), so no resampler differs."""
    folder = tmp_path_factory.mktemp("voices")
    rng = np.random.default_rng(1)
    paths = {}
    for name, seconds, pitch in (("a", 1.3, 180.0), ("b", 0.9, 260.0)):
        t = np.arange(int(seconds * 16000)) / 16000
        wav = 0.3 * np.sin(2 * np.pi * pitch * t) + 0.02 * rng.standard_normal(t.size)
        paths[name] = folder / f"{name}.wav"
        soundfile.write(paths[name], wav.astype(np.float32), 16000, subtype="FLOAT")
    return paths


def reference_audio(tts, text, seed, voice=None, **options) -> np.ndarray:
    """The package alone: its public streaming API, one request, seeded global RNG."""
    kwargs = {}
    if voice is not None:
        mode, path, transcript = voice
        if mode in ("reference", "both"):
            kwargs["reference_wav_path"] = str(path)
        if mode in ("continuation", "both"):
            kwargs.update(prompt_wav_path=str(path), prompt_text=transcript)
    torch.manual_seed(seed)
    chunks = list(tts.generate_streaming(text=text, retry_badcase=False, **kwargs, **options))
    return np.concatenate(chunks)


@pytest.mark.parametrize("decode", ["process", "split", "inline"])
def test_batched_loop_matches_the_package_request_by_request(tiny_model, voice_wavs, decode, monkeypatch):
    """Every way of decoding: in the decoder process, a row's first patch here and the rest
    there, a step late (CPUs); some rows kept here by the balance (forced: every other row);
    every patch here, at once (GPUs)."""
    if decode == "split":
        turns = itertools.count()
        monkeypatch.setattr(DecodeBalance, "take_one", lambda self: next(turns) % 2 == 0)
    voxcpm = import_voxcpm()
    torch.set_num_threads(1)
    reference_model = voxcpm.VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                    device="cpu")
    batched_model = voxcpm.VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                  device="cpu")
    model = batched_model.tts_model
    a, b = voice_wavs["a"], voice_wavs["b"]
    # (text, seed, joins at step, voice, options): different lengths, voices, cfg, timesteps.
    requests = [
        ("Hello world, this is the first request.", 11, 0, None,
         dict(max_len=24, cfg_value=2.0, inference_timesteps=10)),
        ("Short.", 22, 2, ("reference", a, None), dict(cfg_value=1.5, inference_timesteps=10)),
        ("A third one that joins later and speaks in a cloned voice.", 33, 5, ("both", b, "a prompt text"),
         dict(max_len=18, cfg_value=3.0, inference_timesteps=6)),
        ("Continuation only.", 44, 5, ("continuation", a, "hello there"),
         dict(max_len=12, cfg_value=2.5, inference_timesteps=4, min_len=3)),
        ("你好，世界。", 55, 9, None, dict(max_len=15, cfg_value=2.0, inference_timesteps=10)),
    ]
    expected = [reference_audio(reference_model, text, seed, voice, **opts)
                for text, seed, _, voice, opts in requests]

    caches = {}
    for _, _, _, voice, _ in requests:
        if voice is not None and voice[:2] not in caches:
            mode, path, transcript = voice
            caches[voice[:2]] = model.build_prompt_cache(
                prompt_text=transcript if mode != "reference" else None,
                prompt_wav_path=str(path) if mode != "reference" else None,
                reference_wav_path=str(path) if mode != "continuation" else None,
            )
    runner = BatchedVoxCPM2(model, max_batch=4, decode_process=decode != "inline")
    outputs = {i: [] for i in range(len(requests))}
    rows = {}
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    step = 0
    batch_sizes = []
    while pending or rows:
        while pending and requests[pending[0]][2] <= step and len(rows) < runner.max_batch:
            i = pending.pop(0)
            text, seed, _, voice, opts = requests[i]
            prompt = build_prompt(model, text, caches.get(voice[:2]) if voice else None)
            rows[i] = runner.prefill(prompt, seed=seed, cfg_value=opts.get("cfg_value", 2.0),
                                     timesteps=opts.get("inference_timesteps", 10), min_len=opts.get("min_len", 2),
                                     max_len=opts.get("max_len", 4096))
        if rows:
            ids = list(rows)
            batch_sizes.append(len(ids))
            for i, (audio, reason) in zip(ids, runner.step([rows[i] for i in ids])):
                if audio is not None:    # with the decoder process, a step's audio comes with the next
                    outputs[i].append(audio.numpy())
                if reason is not None:
                    runner.release(rows.pop(i))
        step += 1
    runner.close()
    if decode == "split":
        assert next(turns) > 2, "the balance must have placed several rows"

    assert max(batch_sizes) == 4, "the scenario must exercise a full batch"
    for i, want in enumerate(expected):
        got = np.concatenate(outputs[i])
        assert got.shape == want.shape, (i, got.shape, want.shape)
        assert np.max(np.abs(got - want)) < TOLERANCE, (i, float(np.max(np.abs(got - want))))
        assert np.sqrt(np.mean(want ** 2)) > 1e-4, "reference audio should not be silent"
    # Every KV slot was returned.
    assert sorted(runner._free_slots) == list(range(runner.max_batch))


def test_prompt_positions_count_what_build_prompt_builds(tiny_model, voice_wavs):
    from vox_ws.engines.voxcpm.prompt import prompt_positions

    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    path = str(voice_wavs["a"])
    caches = [
        None,
        model.build_prompt_cache(reference_wav_path=path),
        model.build_prompt_cache(prompt_text="hello there", prompt_wav_path=path),
        model.build_prompt_cache(prompt_text="hello there", prompt_wav_path=path, reference_wav_path=path),
    ]
    for cache in caches:
        for text in ("Hi.", "A longer sentence, with a clause.", "你好，世界。"):
            prompt = build_prompt(model, text, cache)
            assert prompt_positions(model, text, cache) == (prompt.text_tokens.shape[0], prompt.target_tokens)
