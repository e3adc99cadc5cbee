"""Engine work in a process of its own: start it with a socket to talk over, and stop it.

Used where a second process pays: native code that can crash (Piper's espeak-ng), or work that
must not share the engine thread's GIL (the VoxCPM2 VAE decode on a CPU). The child runs
`python -m MODULE FD`; messages both ways are pickled tuples over a `multiprocessing` connection.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Callable, Iterator

log = logging.getLogger("vox_ws.engines")


def start_child(module: str, threads: int) -> tuple[subprocess.Popen, Connection]:
    parent, child = socket.socketpair()
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.Popen([sys.executable, "-m", module, str(child.fileno())], pass_fds=(child.fileno(),),
                            env=env, stdin=subprocess.DEVNULL)
    child.close()
    return proc, Connection(parent.detach())


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> Any:
    """The next message; EOFError once the other side has gone."""
    return pickle.loads(conn.recv_bytes())


def messages(conn: Connection) -> Iterator[tuple]:
    """In the child: the parent's messages, until it says stop or goes away."""
    while True:
        try:
            message = receive(conn)
        except EOFError:
            return
        if message[0] == "stop":
            return
        yield message


def stop_child(proc: subprocess.Popen, conn: Connection, timeout: float = 5.0) -> None:
    """Ask the child to stop, kill it if it does not, and close the connection."""
    try:
        send(conn, ("stop",))
    except OSError:
        pass
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    conn.close()


def describe_exit(proc: subprocess.Popen) -> str:
    code = proc.poll()
    if code is None:
        return "still running"
    if code < 0:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    return f"exit code {code}"


def child_connection() -> Connection:
    """In the child: outlive the signal that reaches the whole process group (the server drains
    first, then closes the socket) and connect to the parent."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.setdefault("TQDM_DISABLE", "1")
    return Connection(int(sys.argv[1]))


class WorkerCrashed(Exception):
    """A worker died (or hung) while working; it is replaced before its next job."""


class WorkerHung(WorkerCrashed):
    """A worker took longer than its time-out and was killed."""


class Worker:
    """A parent's handle on a worker process that answers one request at a time and is started
    again after a crash. Not thread-safe: one thread uses it (or its owner locks it)."""

    def __init__(self, module: str, name: str, threads: int = 1) -> None:
        self.module = module
        self.name = name
        self.threads = threads
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.restarts = 0

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, init: tuple, timeout: float) -> Any:
        """Start the process, send it `init`, and return the payload of its ("ready", payload)."""
        self._proc, self._conn = start_child(self.module, self.threads)
        send(self._conn, init)
        kind, payload = self._receive(timeout, "starting")
        if kind != "ready":
            raise RuntimeError(f"the {self.name} could not start: {payload}")
        return payload

    def ask(self, message: tuple, timeout: float, doing: str) -> Any:
        """Send one request and return the payload of the answer; starts a new process first
        if the last one died. Raises WorkerCrashed, or RuntimeError for the worker's own error."""
        if not self.alive:
            self.restarts += 1
            log.warning("starting a new %s (restart %d)", self.name, self.restarts)
            self.close()
            self.restart()
        try:
            send(self._conn, message)
        except OSError:
            raise self._crashed(f"before {doing}") from None
        kind, payload = self._receive(timeout, doing)
        if kind == "error":
            raise RuntimeError(payload)
        return payload

    def restart(self) -> None:
        """Start again after a crash (subclasses: with their own `init`)."""
        raise NotImplementedError

    def close(self) -> None:
        if self._proc is not None:
            stop_child(self._proc, self._conn)
            self._proc = self._conn = None

    def _receive(self, timeout: float, doing: str) -> tuple[str, Any]:
        try:
            if not self._conn.poll(timeout):
                self._proc.kill()
                self._proc.wait()
                raise WorkerHung(str(self._crashed(f"hung {doing} for {timeout:g} s")))
            return receive(self._conn)
        except (EOFError, OSError):
            self._proc.wait()
            raise self._crashed(doing) from None

    def _crashed(self, doing: str) -> WorkerCrashed:
        what = describe_exit(self._proc)
        log.error("the %s (pid %d) died %s: %s", self.name, self._proc.pid, doing, what)
        return WorkerCrashed(f"the {self.name} died {doing} ({what}); other streams go on")


def serve_worker(start: Callable[[tuple], tuple[Any, Callable[[str, Any], tuple]]]) -> None:
    """In a `Worker`'s process: `start(init)` loads what the worker needs and returns (what
    to answer "ready" with, a handler); then every request (kind, payload) is answered with
    `handler(kind, payload)`, or ("error", why) when it raises, until the parent says stop."""
    conn = child_connection()
    init = receive(conn)
    try:
        ready, handle = start(init)
    except Exception as exc:  # noqa: BLE001 - the parent reports it
        send(conn, ("failed", f"{type(exc).__name__}: {exc}"))
        return
    send(conn, ("ready", ready))
    for kind, payload in messages(conn):
        try:
            reply = handle(kind, payload)
        except Exception as exc:  # noqa: BLE001 - the parent fails that request and goes on
            reply = ("error", f"{type(exc).__name__}: {exc}")
        send(conn, reply)
