"""A compiled or loaded bucket is compared with the eager step before it serves
(`vox_ws/engines/voxcpm/graph_check.py`): every piece it could get wrong is caught, and a bucket
that differs is never adopted."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import WAIT_TIMEOUT
from vox_ws.engines.voxcpm.compiled import EagerStep
from vox_ws.engines.voxcpm.graph_check import check_decode, check_step
from vox_ws.engines.voxcpm.loading import import_voxcpm
from vox_ws.engines.voxcpm.lora import NO_ADAPTER


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
        self.verdicts, self.prepared_decode = {}, None

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
            base_kv.k[-1][at.slots[0], :, 0] += 1.0
        return stop, hidden, residual


@pytest.fixture(scope="module")
def runner(model):
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    runner = BatchedVoxCPM2(model, slots=4, decode_process=False, warm_rows=1)
    yield runner
    runner.close()


@pytest.mark.parametrize("wrong, said", [("solve", "the CFM solve"), ("stop", "stop flags"),
                                         ("residual", "residual hidden state"), ("written", "written K")])
def test_each_piece_a_graph_could_get_wrong_is_caught(model, runner, wrong, said):
    eager = EagerStep(model)
    assert check_step(eager, eager, model, 4, runner.serving_state()) is None
    why = check_step(Off(model, wrong), eager, model, 4, runner.serving_state())
    assert why is not None and said in why and "4 rows" in why


class Recorded(EagerStep):
    """The eager step, recording the caches each advance is given."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.given: list[tuple] = []

    def advance(self, base_kv, residual_kv, pred_feat, lm_hidden, at, adapter_slots):
        self.given.append((base_kv, at.slots.tolist()))
        return super().advance(base_kv, residual_kv, pred_feat, lm_hidden, at, adapter_slots)


def test_the_compiled_side_is_checked_on_the_serving_caches_and_eager_on_a_few_hundred_positions(model, runner):
    """The candidate attends over the serving's own caches (their whole key length, as a step
    does), writing only the check slot, which no request is given; eager, which gathers each
    row's prefix, on a cache of its own of the checked length: no second copy of the serving's.
    A request's slot is left as it was."""
    from vox_ws.engines.voxcpm.graph_check import CHECK_LENGTH
    from vox_ws.engines.voxcpm.kv import slot_positions
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import PrefillInput

    row = runner.prefill(PrefillInput(build_prompt(model, "Held.", None), seed=0, cfg_value=2.0, timesteps=10,
                                      min_len=2, max_len=8))
    try:
        held = [cache[row.slot].clone() for cache in runner._caches]
        candidate, eager = Recorded(model), Recorded(model)
        assert check_step(candidate, eager, model, 4, runner.serving_state()) is None
        assert runner.check_slot not in runner._free_slots and runner.check_slot != row.slot
        assert all(kv is runner.base_kv and set(slots) == {runner.check_slot} for kv, slots in candidate.given)
        assert all(kv is not runner.base_kv and kv.k[0].shape[0] == 2 for kv, _ in eager.given)
        assert max(kv.k[0].shape[2] for kv, _ in eager.given) == slot_positions(CHECK_LENGTH)
        assert all(torch.equal(cache[row.slot], before) for cache, before in zip(runner._caches, held))
    finally:
        runner.release(row)


def test_a_stop_flag_within_the_tolerance_of_a_tie_agrees_and_a_clear_flip_does_not(model, runner):
    """The stop head's two logits a hair apart (every row a near-tie): a candidate deciding every
    row the other way agrees, as a bfloat16 kernel may; with the head as it was, the same flip is
    a difference."""
    from vox_ws.engines.voxcpm.graph_check import stops_agree

    logits = torch.tensor([[1.0, 1.00001], [0.0, 5.0]])
    want = logits.argmax(dim=-1)
    assert stops_agree(torch.tensor([0, 1]), want, logits, 1e-3)           # the near-tie, flipped
    assert not stops_agree(torch.tensor([1, 0]), want, logits, 1e-3)       # the clear one, flipped
    eager = EagerStep(model)
    head = model.stop_head
    saved = (head.weight.detach().clone(), head.bias.detach().clone() if head.bias is not None else None)
    try:
        with torch.no_grad():
            head.weight[1] = head.weight[0]
            if head.bias is not None:
                head.bias[1] = head.bias[0] + 1e-6
        assert check_step(Off(model, "stop"), eager, model, 4, runner.serving_state()) is None
    finally:
        with torch.no_grad():
            head.weight.copy_(saved[0])
            if saved[1] is not None:
                head.bias.copy_(saved[1])
    assert "stop flags" in check_step(Off(model, "stop"), eager, model, 4, runner.serving_state())


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


def test_a_background_adoption_compares_off_the_thread_that_steps_and_adopts_only_what_agreed(model, caplog,
                                                                                             monkeypatch):
    """As a background compile's buckets arrive: each is loaded, run once and compared with eager
    on the reader's thread (`CompiledStep.prepare`); the thread that steps compares nothing: it
    records what differed and switches in what agreed (`runner.adopt`)."""
    from vox_ws.engines.voxcpm import compiled, graph_check
    from vox_ws.engines.voxcpm.compiled import CompiledStep
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    compared_on = []
    check = graph_check.check_step

    def recorded(*args, **kwargs):
        compared_on.append(threading.get_ident())
        return check(*args, **kwargs)
    monkeypatch.setattr(graph_check, "check_step", recorded)
    monkeypatch.setattr(compiled, "check_step", recorded)
    runner = BatchedVoxCPM2(model, slots=4, decode_process=False, warm_rows=1)
    good, bad = Off(model, "none"), Off(model, "residual")

    def read() -> None:          # what the background compile's reader does with each bucket
        CompiledStep.prepare(good, (1, 2), runner.eager, runner.serving_state())
        CompiledStep.prepare(bad, (2, 4), runner.eager, runner.serving_state())

    try:
        reader = threading.Thread(target=read)
        reader.start()
        reader.join()
        assert compared_on == [reader.ident] * 4
        assert good.ready == bad.ready == set() and good.mismatched == bad.mismatched == {}
        with caplog.at_level("ERROR", logger="vox_ws.engines.voxcpm"):
            runner.adopt(good, (1, 2))
            runner.adopt(bad, (2, 4))
        assert compared_on == [reader.ident] * 4               # nothing compared on the thread that steps
        assert good.ready == {1, 2} and good.mismatched == {}
        assert bad.ready == set() and set(bad.mismatched) == {2, 4} and "residual hidden state" in bad.mismatched[2]
        assert runner._step_for(4) is runner.eager
        assert any("not used" in r.getMessage() and "stay eager" in r.getMessage() for r in caplog.records)
    finally:
        runner.close()


def test_a_decode_that_differs_is_found_off_the_thread_that_decodes_and_never_switched_in(model):
    """The decode's graphs compared with eager where they were loaded (`decode_mismatch` on the
    reader's thread, as `CompiledStep.prepare_decode` does); `runner.adopt` never switches to a
    decode that differed, and says why where `/v1/info` reads it."""
    from vox_ws.engines.voxcpm.graph_check import decode_mismatch
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2
    from vox_ws.engines.voxcpm.vae import streaming_decode

    def louder(decoder, vae, latents, carried):     # a miscompiled decode: 10% too loud
        audio, carried = streaming_decode(decoder, vae, latents, carried)
        return audio * 1.1, carried

    runner = BatchedVoxCPM2(model, slots=2, decode_process=False, warm_rows=1)
    stand_in = Off(model, "none")
    stand_in.prepared_decode = (louder, (1, 2))
    try:
        reader = threading.Thread(target=lambda: stand_in.verdicts.update(
            decode=decode_mismatch(runner.vae, model.patch_size, stand_in.prepared_decode)))
        reader.start()
        reader.join()
        assert "decode for 1 rows" in stand_in.verdicts["decode"]
        runner.adopt(stand_in, decode=True)
        assert runner.vae.buckets == () and stand_in.mismatched == {"decode": stand_in.verdicts["decode"]}
    finally:
        runner.close()


def test_a_comparison_off_the_thread_that_steps_never_mixes_its_adapter_rows_with_a_steps(tiny_model):
    """With LoRA slots every adapted layer reads one shared row selection (`RowAdapters`): the
    comparison on the reader's thread selects rows of its own, so while one of its calls runs,
    no step's call can select (or read) rows, and the other way round: they take turns."""
    from voxcpm.model.voxcpm2 import LoRAConfig

    from vox_ws.engines.voxcpm.lora import install_row_lora
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    lora = LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=4, alpha=8)
    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu", lora_config=lora).tts_model
    adapters, layers = install_row_lora(model, 2, 4)
    layer = next(layer for name, layer in layers.items() if name.startswith("feat_decoder"))
    eager = EagerStep(model, adapters)
    inside, go, verdicts = threading.Event(), threading.Event(), []

    def held(module, args) -> None:        # the reader's first adapted call waits here
        if threading.current_thread() is reader and not inside.is_set():
            inside.set()
            assert go.wait(WAIT_TIMEOUT), "the test never let the comparison go on"

    hook = layer.register_forward_pre_hook(held)
    runner = BatchedVoxCPM2(model, slots=2, decode_process=False, warm_rows=1, adapters=adapters)
    reader = threading.Thread(target=lambda: verdicts.append(check_step(eager, eager, model, 2,
                                                                        runner.serving_state())))
    try:
        reader.start()
        assert inside.wait(WAIT_TIMEOUT)
        # The reader is inside one of its calls: the step cannot select its rows meanwhile.
        assert not adapters._selecting.acquire(blocking=False)
    finally:
        go.set()
        reader.join()
        hook.remove()
        runner.close()
    assert verdicts == [None]
    with adapters.rows([0, NO_ADAPTER], gathered=True):     # and the step selects its own once it has ended
        assert adapters.row_slots.tolist() == [0, adapters.slots]
