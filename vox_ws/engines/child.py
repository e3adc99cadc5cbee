"""Engine work in a process of its own: start it with a socket to talk over, and stop it.

Used where a second process pays: native code that can crash (Piper's espeak-ng), or work that
must not share the engine thread's GIL (the VoxCPM2 VAE decode on a CPU). The child runs
`python -m MODULE FD`; messages both ways are pickled tuples over a `multiprocessing` connection.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
from multiprocessing.connection import Connection
from typing import Any, Iterator


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
