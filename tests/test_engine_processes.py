"""The engine in a process of its own, as `vox-ws serve` runs it (`vox_ws/engine_process/`): the
server process maps no libtorch; an engine process killed mid-stream ends its streams with a
retryable `unavailable` error, readiness says 503 until it is started again, then the next stream
speaks, its registered voices restored; one that dies too often stops the server (exit 3), saying
why; and nothing of the process tree is left after SIGTERM.

Orderings by construction: the restart is held (the fork server every engine process is forked
from is stopped with SIGSTOP) while the test reads readiness 503, and let go after."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import pytest

from conftest import WAIT_TIMEOUT, assert_good_stream, connect_client, start_serve, wait_until
from helpers import LONG, tone_wav
from vox_ws.engine import EngineFailure
from vox_ws.engine_process.channel import BlockingChannel
from vox_ws.engine_process.host import FAILED_EXIT_CODE
from vox_ws.engine_process.messages import State, Step, Submit
from vox_ws.engine_process.spec import EngineSpec, LoopSettings
from vox_ws.testing.tone import ToneEngine


@dataclass
class Served:
    """A `vox-ws serve` process, as the tests' clients take a server."""

    proc: Any
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}/v1/stream"

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read())

    def engine_pid(self) -> int:
        (device,) = self.get("/v1/info")[1]["devices"]
        return device["pid"]

    def stop(self) -> int:
        """SIGTERM, then until the process has ended (a hang detector far beyond the drain)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(WAIT_TIMEOUT)


def serve(tmp_path: Path, *options: str, name: str = "serve") -> Served:
    log = tmp_path / f"{name}.log"
    proc, port = start_serve([sys.executable, "-m", "vox_ws", "serve", "--port", "0", "--voice-store", "memory",
                              "--drain-timeout", "1", *options], log)
    return Served(proc, port, log)


def _tree(pid: int) -> set[int]:
    try:
        return {pid, *(p.pid for p in psutil.Process(pid).children(recursive=True))}
    except psutil.NoSuchProcess:
        return set()


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


@pytest.fixture
def piper(tmp_path):
    served = serve(tmp_path, "--engine", "piper", "--slots", "2")
    yield served
    served.stop()


async def test_a_killed_engine_process_ends_its_streams_and_is_started_again(piper):
    """The stream on it fails `unavailable`, retryable, saying when to try again; readiness is
    503 while no engine serves (held so by a stopped fork server), 200 once the new one does;
    the next stream speaks; /v1/info says the engine's pid, its restart and why the last ended."""
    engine = piper.engine_pid()
    forkserver = psutil.Process(engine).ppid()
    async with connect_client(piper) as c:
        await c.send({"type": "start", "id": "long", "text": LONG * 4, "format": "s16"})
        await c.recv_where(lambda m: m["type"] == "chunk")          # it speaks
        os.kill(forkserver, signal.SIGSTOP)                          # no new engine until let go
        try:
            killed_at = time.monotonic()
            os.kill(engine, signal.SIGKILL)
            error = await c.error("long")
            took = time.monotonic() - killed_at
            assert error["code"] == "unavailable" and error["retryable"] is True
            assert error["retry_after_s"] > 0 and "engine serving this stream ended" in error["message"]
            status, body = piper.get("/readyz")
            assert status == 503 and body["status"] in ("failed", "loading")
            refused = await c.speak("Not now.", "meanwhile")
            assert refused.error["code"] == "not_ready" and refused.error["retryable"] is True
        finally:
            os.kill(forkserver, signal.SIGCONT)
    print(f"the stream heard its engine had died {took * 1000:.0f} ms after the kill")
    await wait_until(lambda: piper.get("/readyz")[0] == 200)
    (device,) = piper.get("/v1/info")[1]["devices"]
    assert device["restarts"] == 1 and device["pid"] not in (None, engine)
    assert device["last_exit"]["why"] == "killed by SIGKILL" and device["last_exit"]["code"] == -signal.SIGKILL
    async with connect_client(piper) as c:
        assert_good_stream(await c.speak("Speaking again.", "again"))
    log = piper.log.read_text()
    assert "engine cpu: died: killed by SIGKILL" in log and "engine cpu: starting again in" in log


async def test_sigterm_leaves_nothing_of_the_process_tree(tmp_path):
    served = serve(tmp_path, "--engine", "piper", "--slots", "2")
    async with connect_client(served) as c:
        assert_good_stream(await c.speak("One stream first.", "one"))
    tree = _tree(served.proc.pid)
    assert len(tree) >= 4                   # the server, the fork server, the engine, Piper's worker
    assert served.stop() == 0
    deadline = time.monotonic() + WAIT_TIMEOUT
    while _alive(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(tree), [psutil.Process(p).cmdline() for p in _alive(tree)]


@pytest.mark.slow
async def test_an_engine_that_dies_too_often_stops_the_server_saying_why(tmp_path):
    served = serve(tmp_path, "--engine", "piper", "--slots", "2", "--engine-restarts", "2")
    first = served.engine_pid()
    os.kill(first, signal.SIGKILL)
    await wait_until(lambda: served.get("/readyz")[0] == 200 and served.engine_pid() != first)
    os.kill(served.engine_pid(), signal.SIGKILL)
    assert served.proc.wait(WAIT_TIMEOUT) == 3
    assert "the engine process died 2 times within 600 s: not started again" in served.log.read_text()


@pytest.fixture(scope="module")
def voxcpm(tmp_path_factory, tiny_model):
    served = serve(tmp_path_factory.mktemp("voxcpm-process"), "--engine", "voxcpm", "--model", str(tiny_model),
                   "--device", "cpu", "--slots", "2", "--compile", "off")
    yield served
    served.stop()


@pytest.mark.slow
async def test_the_server_process_maps_no_libtorch_with_voxcpm(voxcpm):
    maps = Path(f"/proc/{voxcpm.proc.pid}/maps").read_text()
    assert "libtorch" not in maps and "libc10" not in maps
    engine_maps = Path(f"/proc/{voxcpm.engine_pid()}/maps").read_text()
    assert "libtorch" in engine_maps                                 # it is the engine's
    async with connect_client(voxcpm) as c:
        result = await c.speak("A text cut and checked in the server.", "s", options={"seed": 3, "max_len": 6})
    assert_good_stream(result, min_seconds=0.1, reason="max_len")
    assert "libtorch" not in Path(f"/proc/{voxcpm.proc.pid}/maps").read_text()


@pytest.mark.slow
async def test_a_voice_registered_on_an_engine_that_died_is_built_again_on_the_next(voxcpm):
    async with connect_client(voxcpm) as c:
        await c.send({"type": "voice", "id": "r", "audio": tone_wav(1.0), "transcript": "The reference says this."})
        reply = await c.recv_where(lambda m: m.get("id") == "r")
        assert reply["type"] == "voice", reply
        voice = reply["voice"]
        before = await c.speak("In the registered voice.", "before", voice=voice, options={"seed": 9, "max_len": 4})
    engine = voxcpm.engine_pid()
    os.kill(engine, signal.SIGKILL)
    await wait_until(lambda: voxcpm.get("/readyz")[0] == 200 and voxcpm.engine_pid() != engine)
    await wait_until(lambda: "1 of 1 voices" in voxcpm.log.read_text())
    async with connect_client(voxcpm) as c:
        after = await c.speak("In the registered voice.", "after", voice=voice, options={"seed": 9, "max_len": 4})
    assert_good_stream(after, min_seconds=0.1, reason="max_len")
    assert after.pcm().tobytes() == before.pcm().tobytes()          # the same voice, the same seed


class _LosesItsDevice(ToneEngine):
    """Loads, then loses its device at its first step, as a CUDA illegal address would."""

    def step(self, batch):
        raise EngineFailure("the device cpu is lost: AcceleratorError: CUDA error: an illegal memory access")


def test_an_engine_that_loses_its_device_ends_its_process_with_status_3(monkeypatch):
    """The engine process's own entry point (`engine_main`), forked with an engine that loses
    its device at its first step: it says so (`State` failed, `fatal`), fails the request
    `unavailable`, closes its end and exits with status 3, which the server's `last_exit`
    shows and after which it starts another (`life.py`)."""
    from vox_ws.engine_process import main

    monkeypatch.setattr(main, "create_engine", lambda plugin, settings: _LosesItsDevice())
    server_end, engine_end = socket.socketpair()
    process = multiprocessing.get_context("fork").Process(
        target=main.engine_main, args=(EngineSpec("lost", {}, "cpu", LoopSettings(1, 1)), dict(os.environ), engine_end))
    process.start()
    engine_end.close()
    channel = BlockingChannel(server_end)
    try:
        heard: list = []
        while not any(isinstance(m, State) and m.status == "ready" for m in heard):
            heard.append(message := channel.receive())
            assert message is not None, heard
        channel.send(Submit(1, "Say this."))
        while (message := channel.receive()) is not None:
            heard.append(message)
        process.join(WAIT_TIMEOUT)
        assert process.exitcode == FAILED_EXIT_CODE == 3
    finally:
        if process.exitcode is None:
            process.kill()
            process.join(WAIT_TIMEOUT)
        channel.close()
    (failed,) = [m for m in heard if isinstance(m, State) and m.status == "failed"]
    assert failed.fatal and "the device cpu is lost" in failed.error, failed
    told = [f for m in heard if isinstance(m, Step) for f in m.failed]
    assert [(f.request, f.kind) for f in told] == [(1, "unavailable")], told
