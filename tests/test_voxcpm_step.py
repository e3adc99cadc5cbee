"""The decode step's pieces in the form a GPU wants, each equal to what it replaced: the
attention with grouped heads folded into the query length, `cfg` kept in float32 as the package
keeps it, the step's small inputs copied without blocking; and the released model's structure
in the model the tests build."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vox_ws.engine import GenerationRequest
from vox_ws.engines.voxcpm.compiled import cfm_solve
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.engines.voxcpm.kv import attend, attention_kernel
from vox_ws.engines.voxcpm.loading import import_voxcpm
from vox_ws.engines.voxcpm.transfer import to_device


def test_the_folded_attention_equals_the_grouped_query_call_it_replaced():
    """Rows at different lengths (the mask), 8 query heads per KV head as the released LM has."""
    torch.manual_seed(0)
    batch, heads, kv_heads, dim, length = 5, 16, 2, 32, 40
    q = torch.randn(batch, heads, 1, dim)
    keys, values = torch.randn(batch, kv_heads, length, dim), torch.randn(batch, kv_heads, length, dim)
    lengths = torch.tensor([1, 7, 40, 23, 2])
    mask = (torch.arange(length).view(1, -1) < lengths.view(-1, 1)).view(batch, 1, 1, length)
    before = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)
    after = attend(q, keys, values, mask)
    assert after.shape == (batch, heads, dim)
    torch.testing.assert_close(after, before.view(batch, heads, dim), rtol=1e-5, atol=1e-6)
    # A query head reads its own KV head: swapping the KV heads changes every row.
    assert not torch.allclose(attend(q, keys.flip(1), values.flip(1), mask), after)


def test_the_kernel_the_attention_runs_on_is_named(tiny_model):
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    # On a CPU, PyTorch's flash kernel for CPUs takes a mask; on a GPU the fold lets the
    # memory-efficient kernel take it (the device check records which).
    assert attention_kernel(model.base_lm, torch.device("cpu"), torch.float32) == "flash_attention"


def test_cfg_is_applied_in_float32_as_the_package_applies_it(tmp_path):
    """A bfloat16 model's CFM solve at cfg 2.2 equals the package's bit for bit; the same
    guidance in bfloat16 (2.203125) would not."""
    from vox_ws.testing.tiny_voxcpm import build

    tts = import_voxcpm().VoxCPM.from_pretrained(str(build(tmp_path / "bf16", dtype="bfloat16")),
                                                 load_denoiser=False, optimize=False, device="cpu")
    cfm = tts.tts_model.feat_decoder
    dtype = next(cfm.parameters()).dtype
    assert dtype == torch.bfloat16
    torch.manual_seed(1)
    rows, patch = 3, 4
    mu = torch.randn(rows, tts.tts_model.lm_to_dit_proj.out_features * 2, dtype=dtype)
    cond = torch.randn(rows, cfm.in_channels, patch, dtype=dtype)
    torch.manual_seed(2)
    expected = cfm(mu, 10, patch, cond, cfg_value=2.2)
    torch.manual_seed(2)
    noise = torch.randn(rows, cfm.in_channels, patch, dtype=dtype)
    with torch.inference_mode():
        got = cfm_solve(cfm, mu, cond, noise, 10, torch.full((rows,), 2.2))
        in_bfloat16 = cfm_solve(cfm, mu, cond, noise, 10, torch.full((rows,), 2.2, dtype=dtype))
    assert got.dtype == dtype
    assert torch.equal(got, expected)
    assert not torch.equal(in_bfloat16, expected)


def test_the_steps_small_inputs_arrive_as_given():
    assert to_device([3, 1, 2], torch.device("cpu")).tolist() == [3, 1, 2]
    assert to_device([2.2, 1.5], torch.device("cpu"), torch.float32).dtype == torch.float32
    if torch.cuda.is_available():
        on_gpu = to_device([3, 1, 2], torch.device("cuda"))
        assert on_gpu.is_cuda and on_gpu.tolist() == [3, 1, 2]


def test_optimize_is_refused_before_anything_loads():
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    with pytest.raises(ValueError, match="--compile"):
        VoxCPMEngine(model="/nonexistent", optimize=True)


def test_the_test_model_has_the_released_structure(tiny_model):
    from vox_ws.testing.tiny_voxcpm import make_config

    config = json.loads((tiny_model / "config.json").read_text())
    assert config["residual_lm_no_rope"] is True
    lm = config["lm_config"]
    assert lm["use_mup"] is False       # as released: scale_emb and scale_depth unused
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    assert model.residual_lm.rope_emb is None and model.base_lm.rope_emb is not None
    real = make_config("real", 300, "bfloat16")
    assert real["encoder_config"]["num_layers"] == 12 and real["dit_config"]["num_layers"] == 12
    assert real["lm_config"]["vocab_size"] == 73448
    assert real["lm_config"]["max_position_embeddings"] == 32768
    assert real["residual_lm_no_rope"] is True


def test_prompts_prefilled_together_equal_each_prefilled_alone(tiny_model):
    """Three prompts of different lengths (a voice's reference audio in one) right-padded into one
    call: each row's slot, hidden states and condition as a prefill of that prompt alone gives."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput, _prefill_groups

    torch.set_num_threads(1)
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    runner = BatchedVoxCPM2(model, slots=6, decode_process=False)
    reference = {"mode": "reference", "ref_audio_feat": torch.randn(9, model.patch_size, model.feat_dim)}
    prompts = [build_prompt(model, "A sentence of some length, with a clause or two in it.", None),
               build_prompt(model, "Hi.", None),
               build_prompt(model, "Cloned.", reference)]
    assert len({p.text_tokens.shape[0] for p in prompts}) == 3
    inputs = [PrefillInput(p, seed=i, cfg_value=2.0, timesteps=4, min_len=0, max_len=20) for i, p in enumerate(prompts)]
    together = runner.prefill_many(inputs)
    alone = [runner.prefill_many([given])[0] for given in inputs]
    state = runner.state
    for a, b in zip(together, alone):
        assert a.position == b.position
        torch.testing.assert_close(state.lm_hidden[a.slot], state.lm_hidden[b.slot], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(state.residual_hidden[a.slot], state.residual_hidden[b.slot], rtol=1e-5, atol=1e-5)
        assert torch.equal(state.prefix_cond[a.slot], state.prefix_cond[b.slot])
        assert state.cfg[a.slot] == state.cfg[b.slot] == 2.0
        # The prompt's positions; past them a group's padding, which the row writes over (at its
        # position) before it attends to it.
        for kv in (runner.base_kv, runner.residual_kv):
            for layer in range(len(kv.k)):
                torch.testing.assert_close(kv.k[layer][a.slot, :, :a.position], kv.k[layer][b.slot, :, :a.position],
                                           rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(kv.v[layer][a.slot, :, :a.position], kv.v[layer][b.slot, :, :a.position],
                                           rtol=1e-5, atol=1e-5)
    assert not torch.allclose(state.lm_hidden[together[0].slot], state.lm_hidden[together[1].slot])
    assert len({r.slot for r in together + alone}) == 6
    runner.close()

    # Groups of similar length within the padded budget; one too long goes alone; lengths
    # too unlike to pad together (8 padded to 20) apart.
    assert _prefill_groups([10, 300, 12, 11], budget=40) == [[0, 3, 2], [1]]
    assert _prefill_groups([50], budget=40) == [[0]]
    assert _prefill_groups([20, 8, 19, 9], budget=1000) == [[1, 3], [2, 0]]


def test_a_segment_is_tokenized_once_from_its_cut_to_its_prefill(tiny_model):
    """Cut (does it fit?), checked as it is queued, built as it is prefilled: one tokenization."""
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    engine.load()
    try:
        model = engine.tts.tts_model
        tokenizer, asked = model.text_tokenizer, []
        model.text_tokenizer = lambda text: asked.append(text) or tokenizer(text)
        text = "One short segment, said once."
        (piece,) = engine.text.split(text, {}, None)
        request = GenerationRequest(text=piece, sink=None)
        engine.check(request)
        engine.prefill(request)
        engine.release(request)
        assert asked == [text]
        again = GenerationRequest(text="Another one.", sink=None)
        engine.check(again)
        engine.prefill(again)
        engine.release(again)
        assert asked == [text, "Another one."]
    finally:
        engine.close()


def _speak_alone_and_beside(model, neighbours: int, decode_process: bool) -> tuple:
    """One request (seed 7) alone, then the same request admitted two steps after `neighbours`
    others of other texts and seeds: its audio each time."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    runner = BatchedVoxCPM2(model, slots=neighbours + 1, decode_process=decode_process)

    def given(text: str, seed: int) -> PrefillInput:
        return PrefillInput(build_prompt(model, text, None), seed=seed, cfg_value=2.0, timesteps=6, min_len=2,
                            max_len=12)

    def run(rows: list, watched) -> np.ndarray:
        audio = []
        while rows:
            for row, (chunk, reason) in list(zip(rows, runner.step(rows))):
                if row is watched and chunk is not None:
                    audio.append(chunk)
                if reason is not None:
                    runner.release(row)
                    rows.remove(row)
        return np.concatenate(audio)

    try:
        watched = runner.prefill(given("The same words, with the same seed.", 7))
        alone = run([watched], watched)
        others = runner.prefill_many([given(f"Another text, number {i}, of its own length.", 100 + i)
                                      for i in range(neighbours)])
        runner.step(others)
        runner.step(others)
        watched = runner.prefill(given("The same words, with the same seed.", 7))
        beside = run(others + [watched], watched)
    finally:
        runner.close()
    return alone, beside


@pytest.mark.parametrize("decode_process", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_seed_gives_the_same_audio_alone_and_beside_seven_other_streams(tiny_model, decode_process):
    """A row's noise is a function of its seed and step (`noise.py`), not of a generator shared
    with its batch: the same request speaks the same alone and in a batch of eight it joined
    late, decoded here or in the decoder process."""
    torch.set_num_threads(1)
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    alone, beside = _speak_alone_and_beside(model, 7, decode_process)
    assert alone.shape == beside.shape and np.sqrt(np.mean(alone ** 2)) > 1e-4
    assert np.max(np.abs(alone - beside)) < 1e-4


def test_a_steps_operations_do_not_grow_with_its_rows(tiny_model):
    """The host work of a GPU step: the operations `runner.step` dispatches (each a kernel
    launch there) at 64 rows within 5 % of 1 row (benchmarks/step_ops.py; before the per-slot
    state, 8,983 against 2,236)."""
    from benchmarks.step_ops import step_operations

    torch.set_num_threads(1)
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    counted = step_operations(model, [1, 64], warm_up=1)
    one, many = counted["1"]["operations"], counted["64"]["operations"]
    assert many <= one * 1.05, counted
