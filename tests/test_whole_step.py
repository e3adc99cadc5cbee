"""The whole step as one graph (`vox_ws/engines/voxcpm/whole_step.py`): it compiles with
`fullgraph=True` (no graph break, no host sync: what a CUDA graph captures), attending in place
over the KV cache (`kv.attend_in_place`), and a runner stepping through it speaks as the eager
runner (which gathers) does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import eager_speech, speak_rows, tiny_runner

TEXTS = ["One sentence here.", "Another, a bit longer sentence.", "Third."]


@pytest.mark.slow
@pytest.mark.timeout(900)     # a compile of the whole step per bucket: minutes on two shared cores
def test_the_whole_step_compiles_as_one_graph_and_speaks_as_the_eager_step(tiny_model, tmp_path):
    """Three rows in a bucket of four: the step compiled whole (`GraphStore` compiles with
    `fullgraph=True`: a graph break is an error), every step of theirs through it, their audio
    the eager runner's."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep
    from vox_ws.engines.voxcpm.whole_step import WholeSteps

    torch.set_num_threads(1)
    want = eager_speech(tiny_model, TEXTS, 4)
    runner = tiny_runner(tiny_model, 4)
    try:
        compiled = CompiledStep(runner.model, (4,), cache_dir=tmp_path / "cache")
        runner.compile_whole(compiled)
        assert runner.whole.ready == {(4, 10, True)} and compiled.store.compiled == 1
        assert runner.whole.in_place, "this CPU's compiler has FlexAttention's kernel: the step attends in place"
        calls = []
        call = WholeSteps.__call__
        runner.whole.__class__ = type("Counted", (WholeSteps,), {
            "__call__": lambda self, *args: calls.append(args[:2]) or call(self, *args)})
        got = speak_rows(runner, TEXTS)
    finally:
        runner.close()
    assert calls and set(calls) == {(10, True)}, "every step must have gone through the whole step's graph"
    for a, b in zip(want, got):
        assert a.shape == b.shape and np.max(np.abs(a - b)) < 1e-4


@pytest.mark.slow
@pytest.mark.timeout(900)     # a compile of the whole step: minutes on two shared cores
def test_the_whole_step_without_its_decode_is_one_graph_for_every_bucket_of_two_or_more(tiny_model, tmp_path):
    """The step a CPU compiles (its decode in the decoder process): buckets of 2 and 4 rows
    through one graph with a symbolic batch, compiled once, each stepping as the eager step does
    (its outputs and the state it writes); a step decoding through the CPU's folded VAE stays a
    graph per bucket (its convolutions' groups grow with the batch)."""
    from vox_ws.engines.voxcpm.compiled import CompiledStep
    from vox_ws.engines.voxcpm.whole_step import StepInputs, WholeSteps, step_function

    torch.set_num_threads(1)
    runner = tiny_runner(tiny_model, 4)
    try:
        store = CompiledStep(runner.model, (2, 4), cache_dir=tmp_path / "cache").store
        # Attending through the gather: a CPU's in-place attention takes a graph per bucket.
        whole = WholeSteps(store, runner.model, runner.vae, (2, 4), in_place=False)
        assert runner.vae.fold_depthwise and whole._graphs[(10, True)]._symbolic is None
        assert whole._graphs[(10, False)]._symbolic is not None
        whole.warm_up(lambda bucket: _placed(runner, bucket, 2), decode=False)
        assert whole.ready == {(2, 10, False), (4, 10, False)} and store.compiled == 1
        state = runner._caches + runner._buffers
        for rows in (2, 3, 4):
            before = [t.clone() for t in state]
            with torch.inference_mode():
                got = whole(10, False, _placed(runner, rows, 5))
                got_state = [t.clone() for t in state]
                for t, saved in zip(state, before):
                    t.copy_(saved)
                given = _placed(runner, rows, 5)
                want = step_function(10, False)(runner.model, *StepInputs(*given))
            for a, b in zip(got + tuple(got_state), want + tuple(state)):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    finally:
        runner.close()


def _placed(runner, rows: int, length: int):
    """A whole step's inputs of `rows` rows in slots 0.., attending over `length` positions."""
    from vox_ws.engines.voxcpm.whole_step import StepInputs

    placed = torch.tensor([[slot, length - 1, slot] for slot in range(rows)], dtype=torch.long)
    return StepInputs(runner.vae, runner._caches, runner._buffers, placed, torch.arange(length))
