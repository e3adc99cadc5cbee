"""`BackgroundCompile` with its child stood in for (what a child says, scripted): the child gets
compile workers for the container's CPUs; a bucket a child found in the cache but that does not
load here starts a second child that does not trust the cache's record."""

from __future__ import annotations

import io
import json

import pytest

from vox_ws.engines.voxcpm import background
from vox_ws.engines.voxcpm.background import BackgroundCompile
from vox_ws.engines.voxcpm.compile_workers import ENV, compile_workers

SETTINGS = {"model": "/nowhere", "device": "cpu", "threads": 1, "buckets": [1], "cache": "/nowhere",
            "lora_rank": 0, "lora_alpha": 0, "max_loras": 1}


class Child:
    """A child process that has said `events` and ended."""

    def __init__(self, args, events, **kwargs):
        self.args, self.kwargs = args, kwargs
        self.settings = json.loads(args[-1])
        self.stdout = io.StringIO("".join(json.dumps(e) + "\n" for e in events))
        self.stdin = io.StringIO()
        self.pid, self.returncode = 4242, 0

    def wait(self, timeout=None):
        return 0

    def poll(self):
        return 0


def scripted(monkeypatch, *runs):
    """Each child started says the next of `runs`; returns the children started."""
    started: list[Child] = []

    def popen(args, **kwargs):
        started.append(Child(args, runs[len(started)], **kwargs))
        return started[-1]
    monkeypatch.setattr(background.subprocess, "Popen", popen)
    monkeypatch.setattr("vox_ws.engines.voxcpm.compiled.warm_compiler", lambda device: None)
    return started


def test_the_child_compiles_with_a_worker_per_cpu_of_the_container(monkeypatch):
    monkeypatch.setenv(ENV, "1")          # as a serving process has it
    started = scripted(monkeypatch, [{"event": "done"}])
    compile = BackgroundCompile(SETTINGS)
    compile.close()
    assert started[0].kwargs["env"][ENV] == str(compile_workers())
    assert started[0].settings["fresh"] is False


def test_a_cached_bucket_that_does_not_load_here_is_compiled_again_by_a_fresh_child(monkeypatch):
    cached = [{"event": "started", "priority": "SCHED_IDLE"}, {"event": "bucket", "rows": 1, "seconds": 0.0,
                                                                "cached": True},
              {"event": "decode", "seconds": 0.0, "cached": True}, {"event": "done", "cached": True}]
    fresh = [{"event": "started", "priority": "SCHED_IDLE"}, {"event": "bucket", "rows": 1, "seconds": 2.0},
             {"event": "decode", "seconds": 1.0}, {"event": "done", "cached": False}]
    started = scripted(monkeypatch, cached, fresh)
    prepared = []

    def prepare(rows):
        prepared.append(rows)
        if len(prepared) == 1:
            raise RuntimeError("compiled graph velocity for 1 rows is not in the cache")

    compile = BackgroundCompile(SETTINGS, prepare)
    compile._reader.join()
    compile.close()
    assert [child.settings["fresh"] for child in started] == [False, True]
    assert prepared == [1, 1]
    assert compile.status == "done" and compile.compiled == [1] and compile.cached is False
    # The seconds the fresh child took, for a reader in another process (the device check's).
    assert compile.describe()["compile_s"] == {"1": 2.0}
    events = compile.arrived()
    assert [e["event"] for e in events].count("done") == 1      # the stale child's end is not told


def test_a_cached_compile_says_so(monkeypatch):
    scripted(monkeypatch, [{"event": "bucket", "rows": 1, "seconds": 0.0, "cached": True},
                           {"event": "decode", "seconds": 0.0, "cached": True},
                           {"event": "done", "cached": True}])
    compile = BackgroundCompile(SETTINGS, lambda rows: None)
    compile._reader.join()
    compile.close()
    described = compile.describe()
    assert described["status"] == "done" and described["cached"] is True and described["compiled"] == [1]
    assert described["compile_s"] == {"1": 0.0} and described["started_at"] == round(compile.started_at, 3)


def test_the_decode_is_prepared_on_the_reader_thread_before_the_engine_hears_of_it(monkeypatch):
    """The decode's graphs are loaded and run where the background compile reads its child,
    never on the thread that steps, which only hears of them once they are ready."""
    import threading

    scripted(monkeypatch, [{"event": "started", "priority": "SCHED_IDLE"},
                           {"event": "bucket", "rows": 1, "seconds": 2.0}, {"event": "decode", "seconds": 1.0},
                           {"event": "done", "cached": False}])
    threads, preparing, release = [], threading.Event(), threading.Event()

    def prepare_decode() -> None:
        threads.append(threading.get_ident())
        preparing.set()
        assert release.wait(30), "the test never let the prepare end"

    compile = BackgroundCompile(SETTINGS, lambda rows: None, prepare_decode)
    try:
        assert preparing.wait(30)
        # While the decode is being prepared, the engine has heard of the bucket, not the decode.
        assert [e["event"] for e in compile.arrived()] == ["started", "bucket"]
        release.set()
        compile._reader.join()
    finally:
        release.set()
        compile.close()
    assert threads == [compile._reader.ident] and threads[0] != threading.get_ident()
    assert [e["event"] for e in compile.arrived()] == ["decode", "done"]


@pytest.mark.slow
def test_prepared_decode_graphs_are_switched_in_with_no_load_on_the_thread_that_decodes(tiny_model, tmp_path,
                                                                                           monkeypatch):
    """A decode compiled into a cache (as the background child does), then loaded, run once and
    compared with eager by another thread (`CompiledStep.prepare_decode`): the runner's `adopt`
    only switches to them, reading nothing from the disk and comparing nothing, and decodes as
    eager does."""
    import threading

    import numpy as np
    import torch

    from vox_ws.engines.voxcpm import graph_check
    from vox_ws.engines.voxcpm.compiled import CompiledStep
    from vox_ws.engines.voxcpm.graphs import GraphStore
    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    torch.set_num_threads(1)
    voxcpm = import_voxcpm()

    def runner() -> BatchedVoxCPM2:
        model = voxcpm.VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                              device="cpu").tts_model
        return BatchedVoxCPM2(model, slots=2, decode_process=False, warm_rows=1)

    def speak(serving: BatchedVoxCPM2) -> np.ndarray:
        row = serving.prefill(PrefillInput(build_prompt(serving.model, "Hello there.", None), seed=3, cfg_value=2.0,
                                           timesteps=4, min_len=2, max_len=4))
        audio = []
        while row.end_reason is None:
            ((chunk, _),) = serving.step([row])
            audio.append(chunk)
        serving.release(row)
        return np.concatenate(audio)

    cache = tmp_path / "cache"
    writer = runner()
    writer.vae.compile((1,), writer.model.patch_size, CompiledStep(writer.model, (1,), cache_dir=cache).store)
    want = speak(writer)
    writer.close()

    serving = runner()
    compiled = CompiledStep(serving.model, (1,), cache_dir=cache, load_only=True)
    loads, compared = [], []
    load = GraphStore._load
    monkeypatch.setattr(GraphStore, "_load", lambda self, *a, **k: loads.append(threading.get_ident()) or load(
        self, *a, **k))
    check = graph_check.check_decode
    monkeypatch.setattr(graph_check, "check_decode", lambda *a, **k: compared.append(threading.get_ident()) or check(
        *a, **k))

    reader = threading.Thread(target=compiled.prepare_decode, args=(serving.vae,))
    reader.start()
    reader.join()
    assert loads == compared == [reader.ident] and compiled.verdicts == {"decode": None}
    serving.adopt(compiled, decode=True)
    # Switched in on this thread: nothing loaded nor compared here.
    assert loads == compared == [reader.ident] and serving.vae.buckets == (1,) and compiled.mismatched == {}
    got = speak(serving)
    serving.close()
    assert got.shape == want.shape and np.max(np.abs(got - want)) < 1e-4
