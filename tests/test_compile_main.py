"""The background compile's child: where a record in the cache names graphs that are all there,
it says every bucket is there without loading the model; a record missing a graph, for other
settings, or without the timings asked for is not used."""

from __future__ import annotations

import io
import json

import pytest

from vox_ws.engines.voxcpm import compile_main
from vox_ws.engines.voxcpm.compile_main import CacheRecord, compile_all


class Loaded(Exception):
    """The model would have been loaded."""


def never_load(settings):
    raise Loaded(settings["model"])


@pytest.fixture(autouse=True)
def threads():
    """The child sets torch's threads for the process: put back after."""
    import torch

    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.fixture
def said(monkeypatch):
    """What the child says on its standard output (its events, parsed)."""
    out = io.StringIO()
    monkeypatch.setattr(compile_main, "_events", out)
    return lambda: [json.loads(line) for line in out.getvalue().splitlines()]


@pytest.fixture
def settings(tiny_model, tmp_path):
    return {"model": str(tiny_model), "device": "cpu", "threads": 1, "buckets": [1, 2],
            "cache": str(tmp_path / "c"), "lora_rank": 0, "lora_alpha": 0, "max_loras": 1, "measure": False}


def fill(settings, measured=None):
    """The record a run with `settings` leaves, and its graphs' files."""
    record = CacheRecord(settings)
    graphs = record.directory.parent / "graphs"
    graphs.mkdir(parents=True, exist_ok=True)
    names = ["velocity-a.pt2", "advance-b.pt2", "decode-c.pt2"]
    for name in names:
        (graphs / name).write_bytes(b"graph")
    record.write(names, measured or {"1": {}, "2": {}})
    return graphs, names


def test_with_every_graph_in_the_cache_no_model_is_loaded(settings, said):
    fill(settings)
    assert compile_all(settings, load=never_load) is True
    assert said() == [{"event": "bucket", "rows": 1, "seconds": 0.0, "cached": True},
                      {"event": "bucket", "rows": 2, "seconds": 0.0, "cached": True},
                      {"event": "decode", "seconds": 0.0, "cached": True}]


def test_the_timings_a_run_measured_are_said_again(settings, said):
    timings = {"1": {"eager_ms": 5.0, "compiled_ms": 4.0}, "2": {"eager_ms": 7.0, "compiled_ms": 8.0}}
    fill(settings, timings)
    assert compile_all({**settings, "measure": True}, load=never_load) is True
    assert [e.get("compiled_ms") for e in said()] == [4.0, 8.0, None]


@pytest.mark.parametrize("change", ["a graph gone", "other buckets", "timings wanted", "fresh"])
def test_a_record_that_does_not_hold_loads_the_model(settings, said, change):
    graphs, names = fill(settings)
    if change == "a graph gone":
        (graphs / names[1]).unlink()
    elif change == "other buckets":
        settings = {**settings, "buckets": [1, 2, 4]}
    elif change == "timings wanted":
        settings = {**settings, "measure": True}
    else:
        settings = {**settings, "fresh": True}
    with pytest.raises(Loaded):
        compile_all(settings, load=never_load)
    assert said() == []


@pytest.mark.parametrize("device, untimed", [("cuda:0", True), ("cpu", False)])
def test_a_gpus_background_compile_makes_kernels_that_need_no_timing_at_their_first_call(settings, said,
                                                                                        monkeypatch, device,
                                                                                        untimed):
    """Its graphs are loaded and first run beside the serving process: inductor's deterministic
    mode (no benchmark to pick a reduction's or a template's configuration) and pointwise
    autotuning off, before the model is loaded; a CPU's kernels are never timed anyway."""
    from torch._inductor import config

    monkeypatch.setattr(compile_main, "record_key", lambda given: "no-gpu-here")
    with config.patch({"deterministic": False, "triton.autotune_pointwise": True}):      # put back after
        with pytest.raises(Loaded):
            compile_all({**settings, "device": device}, load=never_load)
        assert config.deterministic is untimed and config.triton.autotune_pointwise is not untimed
