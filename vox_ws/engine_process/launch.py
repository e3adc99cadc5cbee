"""Starting an engine: in a process of its own (`EngineProcesses`, what `vox-ws serve` does), or
on a thread of this process (`InProcess`: an engine object built by its caller, for tests and
embedding). Either way the server talks to it over the same socket and messages.

An engine process is forked from a fork server (`multiprocessing`'s "forkserver") that has
imported the engine's modules once (`EnginePlugin.preload`: torch and the model's package for
VoxCPM2): a restart, or the next of a test run's servers, forks it in milliseconds instead of
importing torch again. It is killed with its parent (the fork server, which ends with the
server), ends at its socket's end, and ignores SIGINT and SIGTERM: a terminal's Ctrl-C or a
supervisor's SIGTERM to the whole group would otherwise end it before the server has drained
its streams; the server stops it (`Stop`) once they are done.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any, Protocol

from ..engine import Engine
from .spec import EngineSpec, LoopSettings

# How long a process asked to stop has beyond its deadline before it is killed.
KILL_AFTER_S = 0.5


class Running(Protocol):
    """A started engine: the server's end of its socket, and its life."""

    sock: socket.socket
    pid: int | None

    def wait(self, timeout: float | None) -> int | None:
        """Its exit code once it has ended (None: still running after `timeout`)."""
        ...

    def kill(self) -> None: ...


class Launcher(Protocol):
    device: str
    restartable: bool

    def launch(self) -> Running:
        """Start the engine (blocking: call it off the event loop)."""
        ...


# --------------------------------------------------------------------------- a thread of this process


class InProcess:
    """An engine object served on a thread of this process: the same host and messages as an
    engine process, over a socket pair. It cannot be started again (the object is its caller's):
    an engine that fails stays failed, as before engine processes."""

    restartable = False

    def __init__(self, engine: Engine, loop: LoopSettings = LoopSettings()) -> None:
        self.engine = engine
        self.loop = loop
        self.device = engine.device
        self.launched = 0
        self.host: Any = None          # the engine's host once started (`host.EngineHost`): a test's handle on it

    def launch(self) -> Running:
        from .channel import BlockingChannel
        from .host import run_thread

        if self.launched:
            raise RuntimeError("an engine served in this process is started once")
        self.launched += 1
        server_end, engine_end = socket.socketpair()
        self.host, thread, ended = run_thread(self.engine, BlockingChannel(engine_end), self.loop)
        return _Thread(server_end, thread, ended)


class _Thread:
    pid = None

    def __init__(self, sock: socket.socket, thread: threading.Thread, ended: Future) -> None:
        self.sock = sock
        self._thread = thread
        self._ended = ended

    def wait(self, timeout: float | None) -> int | None:
        """As an engine process's exit code: 0 stopped, `FAILED_EXIT_CODE` its engine failed,
        1 its host raised."""
        from .host import FAILED_EXIT_CODE

        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        if not self._ended.done() or self._ended.exception() is not None:
            return 1
        return FAILED_EXIT_CODE if self._ended.result() == "failed" else 0

    def kill(self) -> None:
        """A thread cannot be killed: its socket is shut, which ends its host."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


# --------------------------------------------------------------------------- a process of its own

_forkserver_lock = threading.Lock()
_preloaded: set[str] = set()


def _context(preload: tuple[str, ...]) -> Any:
    """The fork server's context; the modules it imports are set before its first start (a fork
    server already running keeps what it imported)."""
    context = multiprocessing.get_context("forkserver")
    with _forkserver_lock:
        wanted = {"vox_ws.engine_process.main", *preload}
        if not wanted <= _preloaded:
            _preloaded.update(wanted)
            context.set_forkserver_preload(sorted(_preloaded))
    return context


class EngineProcesses:
    """Starts (and starts again) the engine process of one `EngineSpec`."""

    restartable = True

    def __init__(self, spec: EngineSpec) -> None:
        self.spec = spec
        self.device = spec.device

    def launch(self) -> Running:
        from .main import engine_main

        context = _context(self.spec.preload)
        server_end, engine_end = socket.socketpair()
        spec = self.spec
        environ = {**os.environ, **spec.env}
        process = context.Process(target=engine_main, args=(spec, environ, engine_end),
                                  name=f"vox-ws-engine {spec.device}", daemon=False)
        try:
            process.start()
        finally:
            engine_end.close()
        return _Process(server_end, process)


class _Process:
    def __init__(self, sock: socket.socket, process: Any) -> None:
        self.sock = sock
        self._process = process
        self.pid = process.pid

    def wait(self, timeout: float | None) -> int | None:
        self._process.join(timeout)
        return self._process.exitcode

    def kill(self) -> None:
        if self._process.exitcode is None:
            try:
                os.kill(self._process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def stop_by(running: Running, deadline: float) -> int | None:
    """Wait for a started engine to end by `deadline` (it was asked to), then kill it: its exit
    code (None: a thread that has not ended)."""
    code = running.wait(max(0.0, deadline - time.monotonic()))
    if code is None:
        running.kill()
        code = running.wait(KILL_AFTER_S)
    return code
