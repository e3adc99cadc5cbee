"""The whole step as one graph (`vox_ws/engines/voxcpm/whole_step.py`): it compiles with
`fullgraph=True` (no graph break, no host sync: what a CUDA graph captures) and a runner stepping
through it speaks as the eager runner does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import eager_speech, speak_rows, tiny_runner

TEXTS = ["One sentence here.", "Another, a bit longer sentence.", "Third."]


@pytest.mark.slow
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
