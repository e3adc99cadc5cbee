"""Engine work in a process of its own: start it with a socket to talk over, and stop it.

Used where a second process pays: native code that can crash (Piper's espeak-ng), or work that
must not share the engine thread's GIL (the VoxCPM2 VAE decode on a CPU). The child runs
`python -m MODULE FD`; messages both ways are pickled tuples over a `multiprocessing` connection.
"""

from __future__ import annotations

import logging
import os
import pickle
import select
import signal
import socket
import subprocess
import sys
import time
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


def killed_with_parent() -> None:
    """On Linux, the kernel kills this process (SIGKILL: also when it is stopped, or stuck where
    no thread reads what its parent sends) as soon as the process that started it is gone."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        return


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
        except (EOFError, ConnectionError):          # gone: closed, or reset while it stopped
            return
        if message[0] == "stop":
            return
        yield message


# How long a helper process has to end when it is stopped (asked, or sent SIGTERM) before it is
# killed, unless the server's shutdown has less left (`grace_until`).
STOP_GRACE_S = 5.0


def grace_until(deadline: float | None, most: float = STOP_GRACE_S) -> float:
    """Seconds a helper process may take to end: `most`, or what is left until `deadline` (a
    `time.monotonic()` instant: the end of the server's shutdown) where that is sooner; never
    below 0."""
    if deadline is None:
        return most
    return max(0.0, min(most, deadline - time.monotonic()))


def end_process(proc: subprocess.Popen, grace_s: float, ask: Callable[[], None] | None = None) -> None:
    """End a helper process within `grace_s` seconds: asked (`ask`, else SIGTERM) and continued
    (SIGCONT: a stopped process acts on nothing, a SIGTERM included, until it is continued), then
    killed once the grace runs out, at once where there is none. It is gone (reaped) on return."""
    if proc.poll() is not None:
        return
    if grace_s > 0:
        if ask is not None:
            ask()
        else:
            proc.terminate()
        proc.send_signal(signal.SIGCONT)
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            log.warning("process %d did not end within %.1f s: killed", proc.pid, grace_s)
    proc.kill()
    proc.wait()


def stop_child(proc: subprocess.Popen, conn: Connection, grace_s: float = STOP_GRACE_S) -> None:
    """Ask the child to stop, kill it if it has not within `grace_s`, and close the connection."""

    def ask() -> None:
        # Only where the message fits: a child that reads nothing (stopped, stuck) with its
        # socket's buffer full would hold this thread on the send, past any grace.
        if select.select([], [conn.fileno()], [], 0)[1]:
            try:
                send(conn, ("stop",))
            except OSError:
                pass

    end_process(proc, grace_s, ask)
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

    def close(self, deadline: float | None = None) -> None:
        """Stop the process: within STOP_GRACE_S, or by `deadline` (`time.monotonic()`) if sooner."""
        if self._proc is not None:
            stop_child(self._proc, self._conn, grace_until(deadline))
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
    try:
        send(conn, ("ready", ready))
        for kind, payload in messages(conn):
            try:
                reply = handle(kind, payload)
            except Exception as exc:  # noqa: BLE001 - the parent fails that request and goes on
                reply = ("error", f"{type(exc).__name__}: {exc}")
            send(conn, reply)
    except ConnectionError:
        # The parent went away (a start that failed stops its workers while they load): nobody
        # is left to tell, and a traceback after the parent's one line only hid it.
        return
