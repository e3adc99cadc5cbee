"""How compiled steps attend (`vox_ws/engines/voxcpm/attention_choice.py`): in place where the
device's compiler has FlexAttention's kernel and, where the device is probed (a GPU), one small
compile of it passed; through the gather where that probe fails, logged, in `/v1/info`, and in
what the background compile is told, so the start never fails on it."""

from __future__ import annotations

import logging

import pytest
import torch

from vox_ws.engines.voxcpm import attention_choice
from vox_ws.engines.voxcpm.loading import import_voxcpm


@pytest.fixture(scope="module")
def model(tiny_model):
    torch.set_num_threads(1)
    return import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                  device="cpu").tts_model


@pytest.fixture
def probed(monkeypatch):
    """A probe for this CPU (where none runs by default), recording what it is asked; what it
    raises is `probed.error`."""
    class Probe:
        error: Exception | None = None
        asked: list[tuple] = []

        def __call__(self, device, lm, dtype):
            self.asked.append((device.type, lm.config.num_attention_heads, dtype))
            if self.error is not None:
                raise self.error
            return "flex_decoding"

    probe = Probe()
    probe.asked = []
    monkeypatch.setitem(attention_choice.PROBES, "cpu", probe)
    monkeypatch.setattr(attention_choice, "_PROBED", {})
    monkeypatch.setattr(attention_choice, "_TAKEN", {})
    return probe


@pytest.mark.slow
def test_a_failing_probe_leaves_the_compiled_step_to_the_gather_and_says_why(model, probed, tmp_path, caplog):
    from vox_ws.engines.voxcpm.compiled import CompiledStep, adapted_advance
    from vox_ws.engines.voxcpm.vae import BatchedStreamingVAE
    from vox_ws.engines.voxcpm.whole_step import WholeSteps

    probed.error = RuntimeError("triton: LLVM ERROR: out of shared memory")
    with caplog.at_level(logging.WARNING, logger="vox_ws.engines.voxcpm"):
        compiled = CompiledStep(model, (1,), cache_dir=tmp_path / "cache")
    assert not compiled.in_place and compiled._advance.fn is adapted_advance
    assert compiled.attention.describe()["in_place"] is False
    assert "out of shared memory" in compiled.attention.why_not
    assert compiled._advance.context.endswith("attention gathered")
    assert any("attend through the gather" in r.getMessage() and "out of shared memory" in r.getMessage()
               for r in caplog.records)
    whole = WholeSteps(compiled.store, model, BatchedStreamingVAE(model.audio_vae, 2), (1,))
    assert not whole.in_place
    asked = len(probed.asked)
    assert CompiledStep(model, (2,), cache_dir=tmp_path / "cache").attention == compiled.attention
    assert len(probed.asked) == asked, "probed once per process and shape"


def test_a_passing_probe_keeps_the_in_place_attention_and_names_its_kernel(model, probed, tmp_path):
    from vox_ws.engines.voxcpm.compiled import CompiledStep, adapted_advance_in_place

    compiled = CompiledStep(model, (1,), cache_dir=tmp_path / "cache")
    assert compiled.in_place and compiled._advance.fn is adapted_advance_in_place
    assert compiled.attention.describe() == {"in_place": True, "why_not": None, "kernel": "flex_decoding"}
    assert probed.asked and all(kind == "cpu" and dtype == torch.float32 for kind, _, dtype in probed.asked)
    # The server's choice, given to a process that compiles for it, is not probed again there.
    asked = len(probed.asked)
    attention_choice.take_choice("cpu", False)
    assert CompiledStep(model, (1,), cache_dir=tmp_path / "cache").in_place is False
    assert len(probed.asked) == asked


@pytest.mark.slow
def test_the_probe_compiles_and_runs_the_in_place_attention_and_agrees_with_the_gather(model):
    """What a GPU runs at start, here on the CPU's kernel: one compile at the LM's heads,
    compared with the gather; no CUDA lowering here, so no kernel is named."""
    for lm in (model.base_lm, model.residual_lm):
        assert attention_choice.probe_in_place(torch.device("cpu"), lm, torch.float32) is None


@pytest.mark.slow
@pytest.mark.timeout(900)      # the step's pieces compiled at start: a minute or more on shared cores
def test_a_start_that_compiles_first_whose_probe_fails_starts_compiled_through_the_gather(tiny_model, probed,
                                                                                          tmp_path):
    """`--compile-wait`: the step compiled at start, through the gather, instead of a failed
    start; `/v1/info`'s compile section says how it attends and why."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    probed.error = RuntimeError("flex lowering: NYI")
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="on", compile_wait=True,
                          compile_cache=str(tmp_path / "cache"), compile_buckets=(1,))
    engine.load()
    try:
        info = engine.describe()["compile"]
        assert info["compiled"] is True and info["buckets"] == [1], info
        assert info["attention"]["in_place"] is False and "flex lowering: NYI" in info["attention"]["why_not"]
    finally:
        engine.close()


@pytest.mark.slow
def test_a_background_compile_is_told_how_the_server_attends(tiny_model, probed, tmp_path):
    """A default start compiles in a child process, which must make the graphs this process will
    look for: it is given the server's choice, not left to probe its own."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    probed.error = RuntimeError("flex lowering: NYI")
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="on", compile_wait=False,
                          compile_cache=str(tmp_path / "cache"), compile_buckets=(1,))
    engine.load()
    try:
        assert engine.background is not None and engine.background._settings["in_place"] is False
        assert engine.describe()["compile"]["attention"]["in_place"] is False
    finally:
        engine.close()
