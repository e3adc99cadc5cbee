"""An engine as `vox-ws serve` runs it, for the benchmarks of the scheduler: in an engine process
of its own (the spec `engine_specs` makes of the command line's settings, forked from the fork
server that imported the model's modules), behind its stand-in (`EngineProxy`) on an event loop
of a thread of this process. The benchmark's process is the server's side: it submits requests
through the stand-in, from that event loop, and its sinks receive the audio of the steps replayed
(`engine_process/replay.py`), as a stream's do.

    this process:  requests ──submit──▶ EngineProxy ──socket──▶ engine process: EngineLoop + engine
                   sinks ◀── StepReplay ◀── Step ◀──────────────┘   (its compile child, decoder)

What the engine measures of itself crosses as it declares it: the engine loop's stats, the
engine's `describe()` (VoxCPM2's slots, dtype, attention, compile state with the background
compile's seconds per bucket, and its process's peak memory), and each step's rows and seconds
(`Steps`, from the replay's `on_step`).

Imports no web module (the device check runs it on a machine without the web stack).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading
import time
from typing import Any

from vox_ws.commands import logs
from vox_ws.config import Limits, ServerConfig
from vox_ws.engine import GenerationRequest, Readiness
from vox_ws.engine_process.devices import engine_specs
from vox_ws.engine_process.host import DESCRIBE_EVERY_S, REPORT_EVERY_S
from vox_ws.engine_process.launch import EngineProcesses
from vox_ws.engine_process.proxy import EngineProxy
from vox_ws.engine_process.restarts import RestartPolicy
from vox_ws.engines import plugins

# How long `stop` gives the engine process (and its children: the background compile, the
# decoder) to end before they are killed.
STOP_S = 30.0


class Steps:
    """The engine's steps, as their replays report them: (rows, seconds). Each step is reported
    before the requests it ended finish (`StepReplay`)."""

    def __init__(self) -> None:
        self.taken: list[tuple[int, float]] = []

    def __call__(self, rows: int, seconds: float) -> None:
        self.taken.append((rows, seconds))


class ServedEngine:
    """`settings`: the engine's own (`--model`, `--compile`...: `EnginePlugin.create`'s keys);
    `device`, `threads` and `slots` as `vox-ws serve` takes them. Started by `start`, stopped
    (its process and this process's event loop) by `stop`; a context manager."""

    def __init__(self, plugin: str, settings: dict[str, Any], device: str, threads: int, slots: int) -> None:
        # `serve`'s limits, but a queue that holds a burst of `slots` requests sent at once (as
        # `--max-queue` would) where that is more than its default.
        limits = dataclasses.replace(Limits(), max_queue=max(Limits().max_queue, slots))
        config = ServerConfig(engine=plugin, device=device, threads=threads, slots=slots, engine_settings=settings,
                              limits=limits)
        # The engine process logs as `vox-ws serve`'s do, into this process's standard error.
        (self.spec,), _ = engine_specs(config, [device], functools.partial(logs.configure, "info", "text"))
        found = plugins().get(plugin)
        self.steps = Steps()
        # A benchmark measures one engine: one that dies is its failure, never started again.
        self.proxy = EngineProxy(EngineProcesses(self.spec), plugin, found.options if found is not None else {},
                                 restart_policy=RestartPolicy(max_deaths=1))
        self.proxy.replay.on_step = self.steps
        self.loop = _event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bench-server-loop", daemon=True)
        self._started = False

    @property
    def engine(self) -> Any:
        """The engine as this side reads it (`EngineView`): its rate, its checks, its `describe`."""
        return self.proxy.engine

    def start(self) -> None:
        """Start the engine process (it then loads: `wait_ready`)."""
        self._thread.start()
        self._started = True

        async def start() -> None:
            self.proxy.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(STOP_S)

    def wait_ready(self, timeout: float | None = None) -> None:
        """Until the engine serves; RuntimeError with why where it failed (or did not load in
        `timeout` seconds)."""
        if not self.proxy.ready_event.wait(timeout):
            raise RuntimeError(f"the engine did not load within {timeout} s")
        if self.proxy.status != Readiness.READY:
            raise RuntimeError(f"the engine failed: {self.proxy.error}")

    def submit(self, requests: list[GenerationRequest]) -> None:
        """Send `requests` to the engine from the event loop, in one turn of it, as the streams
        of a server send theirs."""

        async def send() -> None:
            for request in requests:
                self.proxy.submit(request)

        asyncio.run_coroutine_threadsafe(send(), self.loop).result(STOP_S)

    def described(self) -> dict[str, Any]:
        """The engine's `describe()` as it last declared it."""
        return self.engine.describe()

    def described_now(self) -> dict[str, Any]:
        """The engine's `describe()` as of now: its process looks every DESCRIBE_EVERY_S and
        sends it where it changed, so what has arrived that long (and a report's period or two)
        after now is as of now."""
        time.sleep(DESCRIBE_EVERY_S + 2 * REPORT_EVERY_S)
        return self.described()

    def stop(self) -> None:
        """Stop the engine process (killed after STOP_S) and the event loop's thread."""
        try:
            if self._started:
                self.proxy.stop(STOP_S)
        finally:
            if self._thread.is_alive():
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(STOP_S)
            if not self._thread.is_alive():
                self.loop.close()

    def __enter__(self) -> ServedEngine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's where it is installed, as `vox-ws serve` runs on."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()
