"""`accelerator.py`: which errors mean the device is lost, and each engine thread on its own
device. A device lost mid-step or mid-prefill (torch's `AcceleratorError`, injected into the
tiny VoxCPM2's runner) ends its engine: its live streams end `unavailable`, `/readyz` answers
503, `/v1/info` and the log say why, and a new stream is refused at once; running out of memory
fails only that step's stream. Two CPU devices (`--device cpu,cpu`) show that every engine
thread entered its own device before it loaded or stepped."""

from __future__ import annotations

import logging
import queue
import subprocess
import sys
import threading

import pytest
import torch

from conftest import WAIT_TIMEOUT, connect_client, loaded_loop, wait_until
from vox_ws.engine import EngineFailure, ErrorKind, GenerationRequest, Readiness, Refused
from vox_ws.engines import accelerator
from vox_ws.engines.accelerator import device_lost, enter_device, on_device
from vox_ws.engines.voxcpm.engine import VoxCPMEngine
from vox_ws.testing.tone import ToneEngine
from vox_ws.transports import protocol as p

WAIT_S = 120.0          # a bound for a hang, never reached when the loop works
# torch builds before 2.8 have no AcceleratorError: there a sticky error is a RuntimeError.
AcceleratorError = getattr(torch, "AcceleratorError", RuntimeError)
ILLEGAL_ADDRESS = ("CUDA error: an illegal memory access was encountered\nCUDA kernel errors might be "
                   "asynchronously reported at some other API call, so the stacktrace below might be incorrect.")


# ------------------------------------------------------------------ the classifier


@pytest.mark.parametrize("error", [
    AcceleratorError(ILLEGAL_ADDRESS),
    AcceleratorError("CUDA error: unknown error"),          # any accelerator API error but memory
    RuntimeError("CUDA error: device-side assert triggered"),
    RuntimeError("CUDA error: unspecified launch failure"),
    RuntimeError("CUDA error: misaligned address"),
    RuntimeError("CUDA error: uncorrectable ECC error encountered"),
    RuntimeError("CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasSgemm( handle, opa, opb, m, n, k)`"),
    RuntimeError("Triton Error [CUDA]: an illegal instruction was encountered"),
], ids=lambda error: str(error).splitlines()[0][:40])
def test_errors_that_lose_the_device(error):
    why = device_lost(error)
    assert why is not None and why.startswith(type(error).__name__ + ": ")
    assert "\n" not in why                                  # the first line: what /v1/info shows


def test_a_lost_device_under_another_error_is_found():
    try:
        try:
            raise AcceleratorError(ILLEGAL_ADDRESS)
        except RuntimeError as cause:
            raise ValueError("the step's outputs could not be read") from cause
    except ValueError as wrapped:
        why = device_lost(wrapped)
    assert why == f"{AcceleratorError.__name__}: CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize("error", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"),
    AcceleratorError("CUDA error: out of memory"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("expected scalar type Float but found BFloat16"),
    ValueError("shape mismatch"),
    Refused(ErrorKind.TOO_LARGE, "no room"),
], ids=lambda error: f"{type(error).__name__}: {str(error)[:30]}")
def test_errors_that_spare_the_device(error):
    assert device_lost(error) is None


def test_a_server_without_torch_never_imports_it():
    """A Piper install has no torch: classifying an error and entering a device import none."""
    code = ("import sys; from vox_ws.engines import accelerator as a; "
            "assert a.device_lost(RuntimeError('CUDA error: device-side assert triggered')); "
            "assert a.device_lost(ValueError('x')) is None; a.enter_device('cpu'); a.enter_device('auto'); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=WAIT_S)


def test_entering_a_device_sets_the_threads_cuda_device_and_only_for_cuda_n(monkeypatch):
    set_to, entered = [], []

    class Entered:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            entered.append(-self.index)

    monkeypatch.setattr(torch.cuda, "set_device", set_to.append)
    monkeypatch.setattr(torch.cuda, "device", Entered)
    for device in ("cpu", "cuda", "auto", "mps", "cuda:1"):
        enter_device(device)
        with on_device(device):
            pass
    assert set_to == [1] and entered == [1, -1]


# ------------------------------------------------------------------ a device lost while serving


def failing(runner, method: str, error_at: int, error: BaseException, sticky: bool = True) -> list[int]:
    """Makes `runner.<method>` raise `error` at its `error_at`-th call and, `sticky` (as CUDA's
    sticky errors do), at every call after; returns the count of its calls, as a one-item list."""
    real = getattr(runner, method)
    calls = [0]

    def call(*args, **kwargs):
        calls[0] += 1
        if calls[0] == error_at or (sticky and calls[0] > error_at):
            raise error
        return real(*args, **kwargs)

    setattr(runner, method, call)
    return calls


class Shutdowns:
    """The server's own shutdown after its engine died, asked for and recorded, not run: it would
    close every connection (1011) and exit with status 3 (tests/test_server.py), and nothing
    would be left to read what the server answers meanwhile. The module's fixture stops it."""

    def __init__(self, server) -> None:
        self.asked: list[tuple] = []
        server.server.request_shutdown = lambda *args: self.asked.append(args)


@pytest.mark.slow
async def test_a_device_lost_mid_step_ends_the_engine_and_says_why(start_server, tiny_model, caplog):
    """The engine ends on purpose (its host closes its end of the boundary; an engine process
    would exit with status 3 and be started again). This one is an engine object served on a
    thread of the test's process (`InProcess`), which cannot be started again: once it has
    ended (`last_exit`: 3), the server has no engine left, and asks to stop with exit status 3."""
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    server = start_server(engine, slots=2)
    shutdowns = Shutdowns(server)
    # Its first steps' audio is sent (the first patch decoded at once, the next by the decoder
    # process, back with the step after): the fourth step loses the device.
    calls = failing(engine.runner, "_generate", 4, AcceleratorError(ILLEGAL_ADDRESS))
    with caplog.at_level(logging.ERROR, logger="vox_ws.scheduling"):
        async with connect_client(server) as c:
            await c.send({"type": "start", "id": "live", "text": "A long text that takes many steps to say.",
                          "options": {"seed": 1, "max_len": 40}})
            live = await c.collect("live")
            assert live.chunks, "the stream was live: it had audio before the device was lost"
            assert live.error["code"] == "unavailable" and live.error["retryable"] is True, live.error
            assert "illegal memory access" in live.error["message"]
            status, ready = server.get("/readyz")
            assert status == 503 and ready["status"] == "failed", ready
            assert "AcceleratorError" in ready["error"] or "illegal memory access" in ready["error"]
            info = server.get("/v1/info")[1]
            assert info["status"] == "failed" and "the device cpu is lost" in info["error"], info
            # A new stream is refused at once, not queued behind an engine that will never step.
            await c.send({"type": "start", "id": "after", "text": "Anyone there?"})
            refused = await c.error("after")
            assert refused["code"] == "not_ready" and "the device cpu is lost" in refused["message"]
    assert calls[0] == 4                       # the broken device was not stepped again
    # The engine's host closed its end at the failure; once its thread has closed the engine and
    # ended, the server, left with no engine that serves, asks for its own shutdown.
    await wait_until(lambda: shutdowns.asked)
    assert server.server.exit_code == 3 and shutdowns.asked == [(False, p.CLOSE_INTERNAL)]
    (device,) = server.get("/v1/info")[1]["devices"]
    assert device["last_exit"]["code"] == 3 and device["last_exit"]["why"] == "exit code 3", device
    died = [r for r in caplog.records if r.name == "vox_ws.scheduling" and r.levelno == logging.ERROR]
    assert len(died) == 1 and "engine failed" in died[0].getMessage(), [r.getMessage() for r in died]
    assert "the device cpu is lost" in died[0].getMessage() and died[0].exc_info is not None


@pytest.mark.slow
async def test_running_out_of_memory_fails_only_that_steps_stream(start_server, tiny_model):
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    server = start_server(engine, slots=2)
    oom = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
    calls = failing(engine.runner, "_generate", 2, oom, sticky=False)
    async with connect_client(server) as c:
        victim = await c.speak("This one runs out of memory.", "victim", options={"seed": 1, "max_len": 8})
        assert victim.error["code"] == "internal" and "OutOfMemoryError" in victim.error["message"]
        assert server.get("/readyz")[0] == 200
        after = await c.speak("This one fits.", "after", options={"seed": 2, "max_len": 4})
    assert after.error is None and after.end["reason"] == "max_len" and after.pcm().size > 0
    assert calls[0] > 2 and server.get("/v1/info")[1]["status"] == "ready"


class Told:
    """What a request's stream would be told (the engine loop's side of a sink)."""

    def __init__(self) -> None:
        self.told: queue.Queue = queue.Queue()

    def deliver(self, pcm, words=None, phonemes=None) -> None:
        pass

    def finish(self, reason) -> None:
        self.told.put(("finish", reason, ""))

    def fail(self, kind, message: str, retry_after_s: float | None = None) -> None:
        self.told.put(("fail", kind, message))

    def backlogged(self) -> bool:
        return False

    def audio_ahead_s(self) -> float:
        return 0.0


@pytest.mark.slow
def test_a_device_lost_in_a_prefill_ends_the_engine(tiny_model):
    """VoxCPM2 hands a failed prefill back per request (one bad prompt fails alone): the loop
    finds the lost device in what it hands back."""
    engine = VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2)
    loop = loaded_loop(engine, slots=2)
    queued = threading.Event()

    def prefill_group(inputs):
        assert queued.wait(WAIT_S)       # the second request waits in the queue meanwhile
        raise AcceleratorError("CUDA error: device-side assert triggered")

    engine.runner._prefill_group = prefill_group
    try:
        requests = [GenerationRequest(text=text, options={"seed": 1, "max_len": 4}, sink=Told())
                    for text in ("First.", "Second.")]
        loop.submit(requests[0])
        loop.submit(requests[1])
        queued.set()
        for request in requests:
            kind, _, message = request.sink.told.get(timeout=WAIT_S)
            assert kind == "fail"
            assert message.startswith("engine failed: EngineFailure: the device cpu is lost: ")
        assert {r.sink.told.qsize() for r in requests} == {0}
        assert loop.status == Readiness.FAILED
        with pytest.raises(Refused) as refused:
            loop.submit(GenerationRequest(text="Third.", options={"seed": 1}, sink=Told()))
        assert refused.value.kind == ErrorKind.NOT_READY
    finally:
        loop.stop()


def test_an_engine_failure_from_a_prefill_ends_the_engine_too():
    """Before, a prefill's `EngineFailure` failed its requests `internal` and the loop stepped on."""

    class FailsToPrefill(ToneEngine):
        def prefill(self, request):
            raise EngineFailure("the helper process is gone")

    loop = loaded_loop(FailsToPrefill(), slots=1)
    try:
        request = GenerationRequest(text="Hello.", sink=Told())
        loop.submit(request)
        assert request.sink.told.get(timeout=WAIT_S)[:2] == ("fail", ErrorKind.UNAVAILABLE)
        assert loop.status == Readiness.FAILED and "helper process is gone" in loop.error
    finally:
        loop.stop()


# ------------------------------------------------------------------ each engine thread on its device


class DeviceRecorder:
    """Stands for `accelerator.enter_device`: which device each thread entered."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.entered: list[tuple[str, int]] = []

    def __call__(self, device: str) -> None:
        self.local.device = device
        self.entered.append((device, threading.get_ident()))

    def current(self) -> str | None:
        return getattr(self.local, "device", None)


async def test_each_engine_thread_enters_its_own_device_before_it_loads_and_steps(start_server, monkeypatch):
    recorder = DeviceRecorder()
    monkeypatch.setattr(accelerator, "enter_device", recorder)

    # Each engine's first step waits for the other's: the first stream cannot end before the
    # second is placed, so the second goes to the other device (the first's one slot is taken).
    both_stepping = threading.Barrier(2, timeout=WAIT_TIMEOUT)

    class Recording(ToneEngine):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, str | None, int]] = []

        def load(self) -> None:
            self.seen.append(("load", recorder.current(), threading.get_ident()))
            super().load()

        def step(self, batch):
            if not any(what == "step" for what, _, _ in self.seen):
                both_stepping.wait()
            self.seen.append(("step", recorder.current(), threading.get_ident()))
            return super().step(batch)

    engines = [Recording(), Recording()]
    server = start_server(engines, slots=1)
    async with connect_client(server) as c:
        for sid in ("a", "b"):         # one slot each: opened together, one per device
            await c.send({"type": "start", "id": sid, "text": "On its own device."})
        for sid in ("a", "b"):
            assert (await c.collect(sid)).end["reason"] == "done"
    threads = []
    for engine in engines:
        assert [what for what, _, _ in engine.seen][:2] == ["load", "step"], engine.seen
        assert {device for _, device, _ in engine.seen} == {engine.device}      # entered before any of it
        (thread,) = {thread for _, _, thread in engine.seen}
        threads.append(thread)
    assert threads[0] != threads[1]
    assert sorted(recorder.entered) == sorted((engine.device, thread) for engine, thread in zip(engines, threads))
