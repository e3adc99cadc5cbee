"""An engine process's entry point (forked by `launch.EngineProcesses`): its own process set up,
its engine built from the spec (`auto` chooses here, where torch may be imported), and served
until the server stops it or goes."""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
from typing import Any

from ..engine import Readiness
from ..engines import create_engine
from ..engines.child import killed_with_parent
from .channel import BlockingChannel
from .host import FAILED_EXIT_CODE, EngineHost
from .messages import State
from .spec import EngineSpec

log = logging.getLogger("vox_ws.engine_process")


def engine_main(spec: EngineSpec, environ: dict[str, Any], sock: socket.socket) -> None:
    killed_with_parent()
    # The server drains its streams on SIGINT and SIGTERM, then stops this process (`Stop`).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.environ.clear()
    os.environ.update(environ)
    if spec.cpus:
        try:
            os.sched_setaffinity(0, spec.cpus)
        except (AttributeError, OSError) as exc:
            log.warning("engine process: not pinned to CPUs %s: %s", list(spec.cpus), exc)
    if spec.log_setup is not None:
        spec.log_setup()
    channel = BlockingChannel(sock)
    try:
        engine = create_engine(spec.plugin, spec.settings)
    except Exception as exc:  # noqa: BLE001 - said to the server, which says it in one line
        channel.send(State(Readiness.FAILED.value, f"{exc}", refused=True))
        channel.flush(5.0)
        channel.close()
        return
    host = EngineHost(engine, channel, spec.loop)
    ended = host.serve()
    log.debug("engine process %d: %s", os.getpid(), ended)
    channel.close()
    if ended == "failed":
        sys.exit(FAILED_EXIT_CODE)
