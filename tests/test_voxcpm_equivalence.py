"""The batched loop against the voxcpm package itself: for concurrent requests with different
texts, lengths, voices, options and start times, each request's audio must equal what the
package's own `generate_streaming` produces for it alone (same weights, same noise)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from benchmarks.equivalence import TOLERANCE, reference_audio, run_batched, scenario, voice_wavs
from vox_ws.engines.voxcpm.loading import import_voxcpm
from vox_ws.engines.voxcpm.prompt import build_prompt
from vox_ws.engines.voxcpm.runner import DecodeBalance

# The full lane runs these, not the quick one: together they took a minute or more of it (CONTRIBUTING.md, "Tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wavs(tmp_path_factory):
    return voice_wavs(tmp_path_factory.mktemp("voices"))


# The quick lane keeps the in-thread decode; the decoder process and the split decode are slow.
@pytest.mark.parametrize("decode", [pytest.param("process", marks=pytest.mark.slow),
                                    pytest.param("split", marks=pytest.mark.slow), "inline"])
def test_batched_loop_matches_the_package_request_by_request(tiny_model, wavs, decode, monkeypatch):
    """Every way of decoding: in the decoder process, a row's first patch here and the rest
    there, a step late (CPUs); some rows kept here by the balance (forced: every other row);
    every patch here, at once (GPUs). (`python -m benchmarks.equivalence` runs the same
    scenario on any device and dtype: benchmarks/device_check.py.)"""
    if decode == "split":
        turns = itertools.count()
        monkeypatch.setattr(DecodeBalance, "take_one", lambda self: next(turns) % 2 == 0)
    voxcpm = import_voxcpm()
    torch.set_num_threads(1)
    reference_model = voxcpm.VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                    device="cpu")
    batched_model = voxcpm.VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                  device="cpu")
    requests = scenario(wavs)
    expected = [reference_audio(reference_model, text, seed, voice, **opts)
                for text, seed, _, voice, opts in requests]
    got, batch_sizes, runner = run_batched(batched_model.tts_model, requests, decode_process=decode != "inline")
    if decode == "split":
        assert next(turns) > 2, "the balance must have placed several rows"

    assert max(batch_sizes) == 4, "the scenario must exercise a full batch"
    for i, want in enumerate(expected):
        assert got[i].shape == want.shape, (i, got[i].shape, want.shape)
        assert np.max(np.abs(got[i] - want)) < TOLERANCE["float32"], (i, float(np.max(np.abs(got[i] - want))))
        assert np.sqrt(np.mean(want ** 2)) > 1e-4, "reference audio should not be silent"
    # Every KV slot was returned.
    assert sorted(runner._free_slots) == list(range(runner.slots))


@pytest.mark.slow
def test_the_equivalence_check_as_scripts_run_it(tiny_model, tmp_path):
    from benchmarks.equivalence import compare

    result = compare(str(tiny_model), "cpu", tmp_path)
    assert result["equal"] and result["slots"] == 4 and result["slots_returned"]
    assert result["dtype"] == "float32" and max(result["max_abs_diff"]) < 1e-4


def test_rows_with_different_adapters_match_the_package_with_only_theirs(tiny_model, tmp_path):
    """Two adapters (one of rank 2 in rank-4 slots, with its own alpha) and none, in one batch:
    each request equals the package alone with only its adapter loaded (`load_lora_weights`),
    and each adapter changes its requests' audio far beyond the tolerance."""
    from benchmarks.equivalence import compare_loras

    torch.set_num_threads(1)
    result = compare_loras(str(tiny_model), "cpu", tmp_path)
    assert result["slots"] == 4, "the scenario must batch rows with different adapters"
    assert result["adapters_change_audio"], result["change_by_adapter"]
    assert result["equal"], result["max_abs_diff"]


@pytest.mark.slow
def test_the_compiled_step_matches_the_package_with_and_without_adapters(tiny_model, tmp_path):
    """The scenarios above with the step compiled (one bucket of 4 rows: every batch of the
    scenario padded up to it), each request within the float32 tolerance of the package."""
    from benchmarks.equivalence import compare, compare_loras

    torch.set_num_threads(1)
    (tmp_path / "plain").mkdir()
    (tmp_path / "loras").mkdir()
    plain = compare(str(tiny_model), "cpu", tmp_path / "plain", compiled_buckets=(4,))
    assert plain["compiled"] == [4] and plain["slots"] == 4
    assert plain["equal"], plain["max_abs_diff"]
    adapted = compare_loras(str(tiny_model), "cpu", tmp_path / "loras", compiled_buckets=(4,))
    assert adapted["adapters_change_audio"] and adapted["equal"], adapted["max_abs_diff"]


def test_prompt_positions_count_what_build_prompt_builds(tiny_model, wavs):
    from vox_ws.engines.voxcpm.prompt import prompt_positions

    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    path = str(wavs["a"])
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


def test_a_residual_lm_with_rotary_embeddings_matches_the_package_too(tmp_path):
    """The released model's residual LM has no rotary embeddings (the tiny model follows it);
    checkpoints whose residual LM has them take the step's other path, checked here."""
    from benchmarks.equivalence import compare
    from vox_ws.testing.tiny_voxcpm import build

    torch.set_num_threads(1)
    model = build(tmp_path / "rope", stop="never", variant="residual_rope")
    assert import_voxcpm().VoxCPM.from_pretrained(str(model), load_denoiser=False, optimize=False,
                                                  device="cpu").tts_model.residual_lm.rope_emb is not None
    (tmp_path / "work").mkdir()
    result = compare(str(model), "cpu", tmp_path / "work", decode_process=False)
    assert result["equal"] and result["slots"] == 4, result["max_abs_diff"]


def test_mup_scaling_matches_the_package_too(tmp_path):
    """The released model has muP off (the tiny model follows it); a checkpoint with it on
    scales the embedding and every residual branch, which the step reproduces, checked here."""
    from benchmarks.equivalence import compare
    from vox_ws.testing.tiny_voxcpm import build

    torch.set_num_threads(1)
    model = build(tmp_path / "mup", stop="never", variant="mup")
    assert import_voxcpm().VoxCPM.from_pretrained(str(model), load_denoiser=False, optimize=False,
                                                  device="cpu").tts_model.config.lm_config.use_mup
    (tmp_path / "work").mkdir()
    result = compare(str(model), "cpu", tmp_path / "work", decode_process=False)
    assert result["equal"] and result["slots"] == 4, result["max_abs_diff"]
