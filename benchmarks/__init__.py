"""Developer benchmarks, run from a source checkout: `python -m benchmarks.NAME --help`.

They are not part of the installed package (`vox-ws bench`, the load generator for a running
server, is). A benchmark that starts a server of its own runs it as `python -m benchmarks.NAME
--serve ...` in a child process, which finds this package through `ROOT`.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def module_command(module: str, *args: str) -> list[str]:
    """The command line of `python -m benchmarks.MODULE ARGS`; run it with cwd=ROOT."""
    return [sys.executable, "-m", f"benchmarks.{module}", *args]


def free_port() -> int:
    """A TCP port on loopback that nothing listens on now, for a server a benchmark starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_server(server: subprocess.Popen, grace_s: float = 30.0) -> None:
    """A server the benchmark started, stopped: asked first (SIGTERM: it drains and closes its
    helper processes), killed if it has not ended within `grace_s`."""
    server.terminate()
    try:
        server.wait(grace_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()
