"""The background compile (the default on a GPU, `--compile on` elsewhere): a start it never
holds, its graphs adopted between steps, `auto` measuring each bucket on a CPU, a cache that
already holds every graph, and a compile child that never outlives its server or its shutdown's
budget. (Split from tests/test_compiled.py so that the two run on both workers at once.)"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, wait_until
from helpers import BACKGROUND_BOUND_S
from vox_ws.engines.voxcpm.engine import VoxCPMEngine

# The full lane runs these, not the quick one (CONTRIBUTING.md, "Tests").
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def background_cache(tmp_path_factory):
    """One compile cache for the background compiles of this module: the first compiles into it,
    the next finds its graphs there."""
    return tmp_path_factory.mktemp("background-cache") / "compile"


async def test_a_background_compile_never_holds_the_start_and_its_graphs_come_in_between_steps(
        start_server, tiny_model, background_cache, monkeypatch):
    """Ready as soon as the model is loaded, serving eager; the child compiles the bucket into
    the cache; the engine takes it in at the next step only once the test lets it (so the eager
    stream is eager whatever the machine's speed), and the audio is the same either way. The
    graphs are compared with eager on the reader's thread; the engine's only switches them in."""
    from vox_ws.engines.voxcpm import compiled as compiled_module
    from vox_ws.engines.voxcpm import graph_check

    gate = threading.Event()
    prepared_on: list[str] = []
    compared_on: list[str] = []
    for module, name in ((compiled_module, "check_step"), (graph_check, "check_step"), (graph_check, "check_decode")):
        def recorded(*args, _check=getattr(module, name), **kwargs):
            compared_on.append(threading.current_thread().name)
            return _check(*args, **kwargs)
        monkeypatch.setattr(module, name, recorded)

    class Gated(VoxCPMEngine):
        def _compile_in_background(self, path):
            super()._compile_in_background(path)
            prepare = self.background._prepare

            def recorded(rows):
                prepared_on.append(threading.current_thread().name)
                prepare(rows)
            self.background._prepare = recorded

        def _adopt_compiled(self):
            if gate.is_set():
                super()._adopt_compiled()

    engine = Gated(model=str(tiny_model), device="cpu", slots=1, compile="on", compile_buckets=(1,),
                   compile_cache=str(background_cache), compile_wait=False)
    server = start_server(engine, slots=1)
    status, body = server.get("/readyz")
    assert status == 200 and body["status"] == "ready"
    request = {"options": {"seed": 5, "max_len": 4}}
    async with connect_client(server) as c:
        eager = await c.speak("The same words, twice.", **request)
    assert_good_stream(eager, reason="max_len")
    status, info = server.get("/v1/info")
    assert info["compile"]["buckets"] == [] and info["compile"]["background"]["adopted"] == []
    await wait_until(lambda: engine.background.status != "compiling", timeout=BACKGROUND_BOUND_S)
    assert engine.background.status == "done", engine.background.describe()
    # The bucket's graphs were loaded and run once on the reader's thread, not the one that
    # steps, and are not in use until it adopts them; the child ran on idle CPU time only.
    assert prepared_on == ["vox-ws-background-compile"]
    assert 1 in engine.compiled.compile_s and engine.compiled.ready == set()
    assert engine.compiled.verdicts == {1: None, "decode": None}
    assert sorted(compared_on) == ["vox-ws-background-compile"] * 2     # the step's bucket, the decode's
    assert engine.background.describe()["priority"] == "SCHED_IDLE"
    gate.set()
    async with connect_client(server) as c:
        compiled = await c.speak("The same words, twice.", **request)
    assert_good_stream(compiled, reason="max_len")
    status, info = server.get("/v1/info")
    background = info["compile"]["background"]
    assert info["compile"]["buckets"] == [1] and info["compile"]["compiled"] is True, info["compile"]
    assert background["compiled"] == [1] and background["adopted"] == [1] and background["decode"] is True
    assert info["compile"]["graphs"]["compiled"] == 0       # this process only loads what the child made
    np.testing.assert_allclose(compiled.pcm(), eager.pcm(), atol=1e-4)
    assert sorted(compared_on) == ["vox-ws-background-compile"] * 2     # none on the engine's thread


def test_auto_on_a_cpu_measures_each_bucket_and_uses_it_only_where_it_is_faster(tiny_model, background_cache):
    """The graphs are in the cache already (the test above): the child loads them, times a step
    of the bucket's rows both ways, and the engine adopts or declines each by that."""
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="auto", compile_buckets=(1,),
                          compile_cache=str(background_cache), compile_wait=False)
    engine.load()
    try:
        deadline = time.monotonic() + BACKGROUND_BOUND_S
        while engine.background.status == "compiling" and time.monotonic() < deadline:
            time.sleep(0.1)
        engine._adopt_compiled()
        background = engine.describe()["compile"]["background"]
        assert background["status"] == "done", background
        measured = background["measured"]["1"]
        faster = measured["compiled_ms"] < measured["eager_ms"]
        assert (background["adopted"], background["declined"]) == (([1], []) if faster else ([], [1])), background
        assert engine.runner._step_for(1) is (engine.compiled if faster else engine.runner.eager)
    finally:
        engine.close()
    assert engine.background.status == "done"


def test_a_background_compile_with_every_graph_in_the_cache_loads_no_model(tiny_model, background_cache):
    """The first child loads the model and compiles the bucket's graphs (or finds them there),
    and leaves a record of them; the second finds the record and every graph it names, and says
    each bucket is there without loading the model. The engine adopts what it says alike."""
    from vox_ws.engines.voxcpm.background import BackgroundCompile

    settings = {"model": str(tiny_model), "device": "cpu", "threads": 1, "buckets": [1],
                "cache": str(background_cache), "lora_rank": 0, "lora_alpha": 0, "max_loras": 1}
    for run in ("first", "second"):
        background = BackgroundCompile(settings)
        try:
            background._reader.join(BACKGROUND_BOUND_S)      # to the child's end
        finally:
            background.close()
        described = background.describe()
        assert described["status"] == "done" and described["compiled"] == [1], described
        assert described["cached"] is (run == "second"), described
    events = [e["event"] for e in background.arrived()]
    assert events == ["started", "bucket", "decode", "done"]


@pytest.mark.parametrize("stopped", [False, True], ids=["running", "stopped"])
def test_the_background_compile_ends_with_the_server_that_started_it(tiny_model, tmp_path, stopped):
    """A server killed outright (no close) leaves no compile process behind: the child's
    standard input closes with its parent, and it exits; one that is stopped (or stuck, reading
    nothing) is killed by the kernel with its parent all the same."""
    import signal
    import subprocess
    import sys

    import psutil

    code = ("import json, sys, time; from vox_ws.engines.voxcpm.background import BackgroundCompile; "
            f"b = BackgroundCompile({{'model': {str(tiny_model)!r}, 'device': 'cpu', 'threads': 1, 'buckets': [1], "
            f"'cache': {str(tmp_path / 'cache')!r}, 'lora_rank': 0, 'lora_alpha': 0, 'max_loras': 1}}); "
            "assert b.started_event.wait(600); print(b._process.pid, b.priority, flush=True); time.sleep(600)")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pid, priority = parent.stdout.readline().split()
        child = psutil.Process(int(pid))
        assert child.is_running() and priority == "SCHED_IDLE"
        if stopped:
            child.send_signal(signal.SIGSTOP)
        parent.send_signal(signal.SIGKILL)
        parent.wait(WAIT_TIMEOUT)
        child.wait(WAIT_TIMEOUT)             # psutil.TimeoutExpired if it outlived its parent
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_closing_the_background_compile_kills_a_child_that_will_not_stop(tiny_model, tmp_path):
    """At shutdown a compile child that does not end on SIGTERM (stopped here; stuck alike) is
    killed after a grace period: none is left behind."""
    import signal

    import psutil

    from vox_ws.engines.voxcpm.background import BackgroundCompile

    background = BackgroundCompile({"model": str(tiny_model), "device": "cpu", "threads": 1, "buckets": [1],
                                    "cache": str(tmp_path / "cache"), "lora_rank": 0, "lora_alpha": 0,
                                    "max_loras": 1})
    try:
        assert background.started_event.wait(WAIT_TIMEOUT)
        child = psutil.Process(background._process.pid)
        child.send_signal(signal.SIGSTOP)
    finally:
        background.close()
    # Stopped, SIGTERM's default action still ends it (a child stuck in C code under a Python
    # handler would not: SIGKILL after the grace then); either way none is left.
    assert background._process.returncode in (-signal.SIGTERM, -signal.SIGKILL)
    assert background.status == "stopped"
    assert not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE


def _stop(pid: int):
    """SIGSTOP a process, and wait until the kernel says it is stopped."""
    import signal

    import psutil

    child = psutil.Process(pid)
    child.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + WAIT_TIMEOUT
    while child.status() != psutil.STATUS_STOPPED:
        assert time.monotonic() < deadline, f"process {pid} not stopped in {WAIT_TIMEOUT:g}s"
        time.sleep(0.01)
    return child


def _gone(child) -> bool:
    import psutil

    return not psutil.pid_exists(child.pid) or child.status() == psutil.STATUS_ZOMBIE


@pytest.mark.hardening
def test_a_stopped_compile_child_ends_within_what_the_shutdown_has_left(tiny_model, tmp_path, monkeypatch):
    """Hardening VI, 17: a compile child stopped with SIGSTOP acts on no SIGTERM, and its own 5 s
    grace took a `--drain-timeout 1` shutdown to 6.1-7.4 s, past the documented drain + 4 s.
    `close` takes the grace from what the shutdown has left (`deadline`): with nothing left the
    child is killed at once (SIGKILL: no grace waited out); with time left it is continued
    (SIGCONT) and ends on its SIGTERM (the grace made longer than any wait here, so the SIGTERM,
    not the grace running out, ended it). It is gone when `close` returns, and a new start works."""
    import signal

    from vox_ws.engines.voxcpm import background as background_module
    from vox_ws.engines.voxcpm.background import BackgroundCompile

    monkeypatch.setattr(background_module, "STOP_GRACE_S", WAIT_TIMEOUT)
    settings = {"model": str(tiny_model), "device": "cpu", "threads": 1, "buckets": [1],
                "cache": str(tmp_path / "cache"), "lora_rank": 0, "lora_alpha": 0, "max_loras": 1}
    for left_s, ended_by in ((0.0, signal.SIGKILL), (WAIT_TIMEOUT, signal.SIGTERM)):
        background = BackgroundCompile(settings)
        try:
            assert background.started_event.wait(WAIT_TIMEOUT) and background.priority == "SCHED_IDLE"
            child = _stop(background._process.pid)
        finally:
            background.close(deadline=time.monotonic() + left_s)
        assert background._process.returncode == -ended_by, (left_s, background._process.returncode)
        assert background.status == "stopped" and _gone(child)


@pytest.mark.hardening
def test_the_servers_shutdown_gives_a_stopped_compile_child_what_its_budget_has_left(tiny_model, tmp_path,
                                                                                      start_server, monkeypatch):
    """Hardening VI, 17, through the server: `shutdown` hands what is left of its budget
    (drain + `bound_s`) down to the engine's close. With none left the stopped compile child is
    killed at once, without a grace; a new server then serves, and its own stopped child, given
    time, is continued and ends on its SIGTERM before `shutdown` returns. The documents promise
    the same bound the code keeps."""
    import asyncio
    import signal

    from conftest import connect_client
    from vox_ws.engines.voxcpm import background as background_module
    from vox_ws.server import SHUTDOWN_BOUND_S

    monkeypatch.setattr(background_module, "STOP_GRACE_S", WAIT_TIMEOUT)

    def serve(cache: str):
        # A cache each: the first child's compile, cut short, is not the second's to finish.
        engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=1, compile="on", compile_buckets=(1,),
                              compile_cache=str(tmp_path / cache), compile_wait=False)
        running = start_server(engine)
        assert engine.background.started_event.wait(WAIT_TIMEOUT)
        return running, engine, _stop(engine.background._process.pid)

    def shutdown(running, bound_s: float) -> None:
        asyncio.run_coroutine_threadsafe(running.server.shutdown(0.0, bound_s=bound_s),
                                         running.loop).result(WAIT_TIMEOUT)

    running, engine, child = serve("first")
    shutdown(running, 0.0)
    running.engine_loops[0]._thread.join(WAIT_TIMEOUT)        # the engine's close, after the budget
    assert engine.background._process.returncode == -signal.SIGKILL and _gone(child)

    running, engine, child = serve("second")

    async def speak() -> None:
        async with connect_client(running) as client:
            result = await client.speak("A new start serves.", "after", options={"max_len": 4})
        assert result.error is None and result.end["reason"] == "max_len", result.error

    asyncio.run(speak())
    shutdown(running, WAIT_TIMEOUT)
    assert engine.background._process.returncode == -signal.SIGTERM and _gone(child)
    protocol = (Path(__file__).parent.parent / "docs" / "PROTOCOL.md").read_text()
    assert f"at most `--drain-timeout` + {SHUTDOWN_BOUND_S:g} s" in protocol
