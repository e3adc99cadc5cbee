"""One engine's life, as the server runs it (a task of its event loop): started (`Launcher`),
served until its socket ends, started again after a back-off (`restarts.py`), stopped.

    start ─▶ launch ─▶ serve (the stand-in reads its messages) ─▶ its socket ends ─▶ reaped
              ▲                                                                       │
              └──── back-off ◀── it died (killed, a crash, a lost device) ◀───────────┘
                                 not again: stopping; an engine of this process's thread;
                                 one its settings cannot build; one that failed its load;
                                 too many deaths (the server is told: `fatal`)

What the engine's death costs the streams on it (`unavailable`, retryable) and what the next one
restores are the stand-in's (`proxy.EngineProxy`): this only starts, watches and stops.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from typing import Any, Callable, Protocol

from ..engine import EngineFailure
from .channel import ChannelProtocol
from .launch import Launcher, Running, stop_by
from .messages import Stop
from .restarts import RestartPolicy, Restarts

log = logging.getLogger("vox_ws.engine_process")

# How long an engine process whose socket has closed has to exit before it is killed.
REAP_S = 5.0


class Served(Protocol):
    """What the life tells the stand-in of the engine it serves."""

    refused: str | None          # the engine could not be built from its settings
    failed_loading: bool         # it failed its load (it would again)

    def on_message(self, message: Any) -> None: ...

    def connected(self, channel: ChannelProtocol | None) -> None: ...

    def ended(self) -> dict[str, Any]:
        """Everything it held fails; what it held that the next one should have."""
        ...

    def exited(self, why: str) -> None:
        """Why it ended, once its process has been reaped."""
        ...

    def restarting(self) -> None: ...

    def fatal(self, exc: BaseException, during_load: bool) -> None: ...


class EngineLife:
    """`label`: the engine's device as the log names it (the one `auto` chose, once it has)."""

    def __init__(self, launcher: Launcher, served: Served, policy: RestartPolicy | None = None,
                 label: Callable[[], str] | None = None) -> None:
        self.launcher = launcher
        self._served = served
        self._label = label or (lambda: launcher.device)
        self.restarts = Restarts(policy)
        self.pid: int | None = None
        self.last_exit: dict[str, Any] | None = None
        self.started_at = 0.0
        self.lost: dict[str, Any] | None = None       # what the engine before held, until restored
        self._running: Running | None = None
        self._channel: ChannelProtocol | None = None
        self._task: asyncio.Task | None = None
        self._created: asyncio.Future | None = None
        self._wake_up: asyncio.Event | None = None
        self.stopping = False
        self.ended = threading.Event()                # no engine is left running

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        """On the event loop that serves: its task."""
        loop = asyncio.get_running_loop()
        self._created = loop.create_future()
        self._wake_up = asyncio.Event()
        self._task = loop.create_task(self._run(), name=f"vox-ws-engine {self._label()}")

    def settled(self) -> None:
        """The engine said its first word (built, or not): `created` returns."""
        if self._created is not None and not self._created.done():
            self._created.set_result(None)

    async def created(self) -> None:
        assert self._created is not None, "start() first"
        await asyncio.shield(self._created)

    async def _run(self) -> None:
        served = self._served
        try:
            while True:
                lost = await self._serve_once()
                if self.stopping:
                    break
                if not (self.launcher.restartable and served.refused is None and not served.failed_loading):
                    if served.refused is None and not served.failed_loading:
                        served.fatal(EngineFailure(f"the engine ended ({self.last_exit['why']})"), False)
                    break
                delay = self.restarts.after_death(time.monotonic())
                if delay is None:
                    why = self.restarts.why_not()
                    log.error("engine %s: %s", self._label(), why)
                    served.fatal(EngineFailure(why), False)
                    break
                log.warning("engine %s: starting again in %.1f s (restart %d)", self._label(), delay,
                            self.restarts.count)
                served.restarting()
                assert self._wake_up is not None
                try:
                    await asyncio.wait_for(self._wake_up.wait(), delay)
                except asyncio.TimeoutError:
                    pass
                if self.stopping:
                    break
                self.lost = lost
        finally:
            self.ended.set()
            self.settled()

    async def _serve_once(self) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.started_at = time.monotonic()
        self._served.restarting()
        try:
            running = await loop.run_in_executor(None, self.launcher.launch)
        except Exception as exc:  # noqa: BLE001 - a start that failed is a death
            lost = self._served.ended()
            self._exited(f"it could not start: {type(exc).__name__}: {exc}", None)
            return lost
        self._running, self.pid = running, running.pid
        log.info("engine %s: started%s", self._label(), f" (pid {running.pid})" if running.pid else "")
        closed: asyncio.Future = loop.create_future()

        def ended(why: BaseException | None) -> None:
            if not closed.done():
                closed.set_result(why)

        _, self._channel = await loop.connect_accepted_socket(
            lambda: ChannelProtocol(self._served.on_message, ended), running.sock)
        self._served.connected(self._channel)
        why_closed = await closed
        self._served.connected(None)
        self._channel = None
        lost = self._served.ended()                     # its streams hear it at once, not after the reaping
        code = await loop.run_in_executor(None, _reaped, running)
        self._running = None
        if self.stopping:
            log.info("engine %s: stopped (exit code %s)", self._label(), code)
            self._exited("stopped", code)
        else:
            why = _exit_reason(code, why_closed)
            log.error("engine %s: died: %s", self._label(), why)
            self._exited(why, code)
        return lost

    def _exited(self, why: str, code: int | None) -> None:
        self.last_exit = {"code": code, "why": why, "at": round(time.time(), 3)}
        self._served.exited(why)

    def stop(self, deadline: float, wait: bool, on_loop: Callable[[], bool]) -> None:
        """Have the engine end by `deadline`; with `wait` (from a thread other than the event
        loop's), until it has, killed where it has not."""
        loop = self._task.get_loop() if self._task is not None else None
        if loop is None:
            return
        if on_loop():
            self._begin_stop(deadline)
        elif not loop.is_closed():
            loop.call_soon_threadsafe(self._begin_stop, deadline)
        if wait and not on_loop():
            if not self.ended.wait(max(0.0, deadline - time.monotonic()) + REAP_S):
                running = self._running
                if running is not None:
                    running.kill()

    def _begin_stop(self, deadline: float) -> None:
        if self.stopping:
            return
        self.stopping = True
        if self._channel is not None:
            self._channel.send(Stop(max(0.0, deadline - time.monotonic())))
        if self._wake_up is not None:
            self._wake_up.set()


def _reaped(running: Running) -> int | None:
    """Its exit code, once it has ended (it closed its socket: it ends, or is killed after
    `REAP_S`)."""
    code = stop_by(running, time.monotonic() + REAP_S)
    return code if code is not None else running.wait(None)


def _exit_reason(code: int | None, why_closed: BaseException | None) -> str:
    if why_closed is not None:
        return f"its channel broke ({why_closed})"
    if code is None:
        return "it did not exit when its socket closed (killed)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"
