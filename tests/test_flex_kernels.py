"""Which FlexAttention kernel inductor's CUDA lowering takes for each graph that attends in place
(`vox_ws/engines/voxcpm/flex_kernels.py`), asked on this CPU of the graphs' own shapes: the
decoding kernel (a static batch) in every graph that serves, and the general kernel where a
batch is symbolic, as the whole step's graph for buckets from 2 had it."""

from __future__ import annotations

import pytest
import torch

from conftest import tiny_runner
from vox_ws.engines.voxcpm.flex_kernels import DECODING, GENERAL, kernels_of, summary


@pytest.fixture(scope="module")
def runner(tiny_model):
    torch.set_num_threads(1)
    runner = tiny_runner(tiny_model, 4)
    yield runner
    runner.close()


@pytest.mark.slow
@pytest.mark.timeout(900)     # a dynamo trace of the whole step per graph: seconds each, on shared cores
def test_every_graph_of_the_whole_step_attending_in_place_gets_the_decoding_kernel(runner, tmp_path):
    """The whole step's graphs as a GPU runner builds them (its VAE unfolded, decoding in the
    step; and without the decode), each bucket's shapes and symbolic sizes as `WholeSteps`
    marks them: every attention of every graph is flex decoding. Traced with the batch symbolic
    instead, as every bucket from 2 was before, the same step gets the general kernel."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep
    from vox_ws.engines.voxcpm.runner import _padding_step
    from vox_ws.engines.voxcpm.vae import BatchedStreamingVAE
    from vox_ws.engines.voxcpm.whole_step import WholeSteps, step_function, symbolic_sizes

    store = CompiledStep(runner.model, (1, 2, 64), cache_dir=tmp_path / "cache").store
    gpu_decoder = BatchedStreamingVAE(runner.model.audio_vae, runner.slots + 1, fold_depthwise=False)
    whole = WholeSteps(store, runner.model, gpu_decoder, (1, 2, 64), in_place=True)
    layers = len(runner.model.base_lm.layers) + len(runner.model.residual_lm.layers)
    for decode, bucket in ((True, 1), (True, 2), (True, 64), (False, 2)):
        given = _padding_step(runner, bucket, 2)._replace(decoder=gpu_decoder)
        assert whole.attention_kernels(10, decode, given) == [DECODING] * layers, (decode, bucket)
    symbolic = {**symbolic_sizes(False, gpu_decoder, in_place=False)}
    assert "rows" in symbolic
    given = _padding_step(runner, 4, 2)
    assert kernels_of(step_function(10, False, in_place=True), (runner.model, *given), symbolic) == [GENERAL] * layers
    # Through the gather there is no FlexAttention at all, and a symbolic batch costs nothing.
    assert kernels_of(step_function(10, False, in_place=False), (runner.model, *given), symbolic) == []


@pytest.mark.slow
def test_the_compiled_advance_attending_in_place_gets_the_decoding_kernel(runner, tmp_path):
    """The step's pieces (what serves other timesteps, LoRA slots, and a background compile's
    buckets): the advance's graph per bucket, its caches' slot count symbolic."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep

    compiled = CompiledStep(runner.model, (1, 8), cache_dir=tmp_path / "cache")
    assert compiled.in_place
    for rows in (1, 8):
        kernels = compiled.attention_kernels(runner.base_kv, runner.residual_kv, rows)
        assert kernels and set(kernels) == {DECODING}, (rows, kernels)


def test_the_attention_benchmark_times_the_kernel_the_step_gets():
    """`benchmarks.attention --in-place` compiles the in-place attention as the step's graphs
    have it (a static batch): the decoding kernel, which the device check times."""
    from benchmarks.attention import IN_PLACE_DYNAMIC, _in_place_attention, in_place_inputs

    for batch in (1, 8):
        _, in_place_args = in_place_inputs(batch, 100, 256, torch.device("cpu"), torch.float32)
        assert kernels_of(_in_place_attention, in_place_args, IN_PLACE_DYNAMIC) == [DECODING]
    assert summary([DECODING, DECODING]) == DECODING and summary([]) == "none"
    assert summary([GENERAL, DECODING, GENERAL]) == f"2 {GENERAL}, 1 {DECODING}"
