"""A compiled or loaded bucket is compared with the eager step before it serves
(`vox_ws/engines/voxcpm/graph_check.py`): every piece it could get wrong is caught, and a bucket
that differs is never adopted."""

from __future__ import annotations

import pytest
import torch

from vox_ws.engines.voxcpm.compiled import EagerStep
from vox_ws.engines.voxcpm.graph_check import check_decode, check_step
from vox_ws.engines.voxcpm.loading import import_voxcpm


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.set_num_threads(1)
    return import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                  device="cpu").tts_model


class Off(EagerStep):
    """The eager step with one thing wrong (`wrong`), as a miscompiled graph would have it."""

    def __init__(self, model, wrong: str) -> None:
        super().__init__(model)
        self.wrong = wrong
        # What `runner.adopt` reads of a `CompiledStep`.
        self.buckets, self.compile_s, self.ready, self.mismatched = (1, 2, 4), {1: 0.0, 2: 0.0, 4: 0.0}, set(), {}

    def warm_up(self, *args, **kwargs) -> None:
        pass

    def serves(self, rows: int) -> bool:
        return rows in self.ready

    def solve(self, mu, cond, noise, timesteps, cfg, adapter_slots):
        out = super().solve(mu, cond, noise, timesteps, cfg, adapter_slots)
        return out * 1.01 if self.wrong == "solve" else out

    def advance(self, base_kv, residual_kv, pred_feat, lm_hidden, at, adapter_slots):
        stop, hidden, residual = super().advance(base_kv, residual_kv, pred_feat, lm_hidden, at, adapter_slots)
        if self.wrong == "stop":
            stop = 1 - stop
        if self.wrong == "residual":
            residual = residual + 0.05 * residual.abs().max()
        if self.wrong == "written":     # a K written into the wrong position, as a bad scatter would
            base_kv.k[-1][0, :, 0] += 1.0
        return stop, hidden, residual


@pytest.mark.parametrize("wrong, said", [("solve", "the CFM solve"), ("stop", "stop flags"),
                                         ("residual", "residual hidden state"), ("written", "written K")])
def test_each_piece_a_graph_could_get_wrong_is_caught(model, wrong, said):
    eager = EagerStep(model)
    assert check_step(eager, eager, model, 4) is None
    why = check_step(Off(model, wrong), eager, model, 4)
    assert why is not None and said in why and "4 rows" in why


def test_a_decode_that_differs_is_caught(model):
    from vox_ws.engines.voxcpm.vae import BatchedStreamingVAE

    decoder = BatchedStreamingVAE(model.audio_vae, 2)
    assert check_decode(decoder, 2, model.patch_size) is None
    eager_step = decoder._step
    decoder._step = lambda latents, carried: (lambda a, c: (a * 1.1, c))(*eager_step(latents, carried))
    why = check_decode(decoder, 2, model.patch_size)
    assert why is not None and "decode for 2 rows" in why


def test_a_mismatching_bucket_is_never_adopted_and_the_others_are(model, caplog):
    """`runner.adopt`, as a background compile's buckets arrive: the bucket whose step differs
    stays eager and is named, with why, where `/v1/info` reads it."""
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    runner = BatchedVoxCPM2(model, slots=4, decode_process=False, warm_rows=1)
    try:
        good = Off(model, "none")
        runner.adopt(good, (1, 2))
        assert good.ready == {1, 2} and good.mismatched == {}
        bad = Off(model, "residual")
        with caplog.at_level("ERROR", logger="vox_ws.engines.voxcpm"):
            runner.adopt(bad, (2, 4))
        assert bad.ready == set() and set(bad.mismatched) == {2, 4}
        assert "residual hidden state" in bad.mismatched[2]
        assert runner._step_for(2) is runner.eager
        assert any("not used" in r.getMessage() and "stay eager" in r.getMessage() for r in caplog.records)
    finally:
        runner.close()
