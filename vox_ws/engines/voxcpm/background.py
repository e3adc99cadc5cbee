"""Compiling without blocking: the server is ready once the model is loaded and serves eager; a
child process (`compile_main`) compiles the step's graphs into the compile cache, and each bucket
is adopted (its graphs loaded, milliseconds) between two steps as soon as it is there.

`BackgroundCompile` starts the child and reads its events on a thread of its own, where each
bucket's graphs are loaded and run once (`prepare`: off the thread that steps, which would stall
every stream meanwhile); the engine loop's thread takes what has arrived (`arrived`) before
each step and only switches it on there (with LoRA slots it loads them there too). `describe` is
its progress, for `/v1/info`.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger("vox_ws.engines.voxcpm")

# How long the child has to end on SIGTERM at close before it is killed (a stopped or stuck one
# never does).
STOP_GRACE_S = 5.0


class BackgroundCompile:
    """One child process compiling `settings["buckets"]` (see `compile_main`), and what it said."""

    def __init__(self, settings: dict[str, Any], prepare: Callable[[int], None] | None = None) -> None:
        """`prepare(rows)`: called on this object's reader thread for each bucket the child has
        put in the cache, before the engine is told (its graphs loaded and run once there, off
        the thread that steps); a failure leaves the bucket to be loaded when adopted."""
        self.buckets = tuple(settings["buckets"])
        self._prepare = prepare
        self.device = settings["device"]
        self.status = "compiling"          # then "done", "failed" or "stopped"
        self.error = ""
        self.started = time.monotonic()
        self.seconds: float | None = None  # until done
        self.measured: dict[int, dict[str, float]] = {}
        self.compiled: list[int] = []      # buckets in the cache
        self.adopted: list[int] = []       # buckets the step uses (the engine says)
        self.declined: list[int] = []      # compiled, but slower than eager here (the engine says)
        self.adopted_decode = False        # the decode's graphs in use (the engine says)
        self.priority = ""                 # the CPU priority the child runs at (once started)
        self.started_event = threading.Event()   # set once the child dies with this process
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False              # set by `close`: an end is then a stop, not a failure
        self._process = subprocess.Popen([sys.executable, "-m", "vox_ws.engines.voxcpm.compile_main",
                                          json.dumps({**settings, "parent": os.getpid()})],
                                         stdout=subprocess.PIPE, stdin=subprocess.PIPE,
                                         text=True)   # its standard input closes when this process ends
        self._reader = threading.Thread(target=self._read, name="vox-ws-background-compile", daemon=True)
        self._reader.start()
        log.info("compiling the step for %s rows in the background (process %d); serving eager meanwhile",
                 list(self.buckets), self._process.pid)

    def _read(self) -> None:
        ended = False
        for line in self._process.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            kind = event.get("event")
            if kind == "started":
                self.priority = event.get("priority", "")
                self.started_event.set()
            elif kind == "bucket":
                if not self.compiled:
                    # What loading a graph first needs (inductor, seconds to import), here rather
                    # than on the engine loop's thread, where it would hold a step.
                    from .compiled import warm_compiler

                    warm_compiler("cuda" if self.device.startswith("cuda") else "cpu")
                self.compiled.append(event["rows"])
                if "eager_ms" in event:
                    self.measured[event["rows"]] = {"eager_ms": event["eager_ms"], "compiled_ms": event["compiled_ms"]}
                if self._prepare is not None and self.slower_than_eager(event["rows"]) is None:
                    try:
                        self._prepare(event["rows"])
                    except Exception as exc:  # noqa: BLE001 - the engine loads it when it adopts it
                        log.warning("background compile: the step for %d rows not loaded ahead (%s: %s)",
                                    event["rows"], type(exc).__name__, exc)
                log.info("background compile: the step for %d rows compiled in %.1f s (%d/%d)", event["rows"],
                         event["seconds"], len(self.compiled), len(self.buckets))
            elif kind in ("done", "failed"):
                ended = True
                self.seconds = round(time.monotonic() - self.started, 1)
                self.status = kind
                self.error = event.get("error", "")
                if kind == "failed":
                    log.warning("background compile failed (%s): the step stays eager", self.error)
                else:
                    log.info("background compile done in %.1f s", self.seconds)
            self._events.put(event)
        self._process.wait()
        if not ended and self.status == "compiling":
            if self._closing:
                self.status = "stopped"
                return
            self.status, self.error = "failed", f"the compile process exited ({self._process.returncode})"
            log.warning("background compile: %s; the step stays eager", self.error)

    def slower_than_eager(self, rows: int) -> dict[str, float] | None:
        """The child's timings of a step of `rows` rows where compiled was not the faster (the
        bucket is left eager), else None (faster, or not measured: taken)."""
        measured = self.measured.get(rows)
        return measured if measured and measured["compiled_ms"] >= measured["eager_ms"] else None

    def arrived(self) -> list[dict[str, Any]]:
        """The events said since the last call (never blocks)."""
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def describe(self) -> dict[str, Any]:
        return {"status": self.status, "buckets": list(self.buckets), "compiled": list(self.compiled),
                "adopted": list(self.adopted), "declined": list(self.declined), "decode": self.adopted_decode,
                "measured": {str(k): v for k, v in self.measured.items()}, "seconds": self.seconds,
                **({"priority": self.priority} if self.priority else {}),
                **({"error": self.error} if self.error else {})}

    def close(self) -> None:
        self._closing = True
        if self._process.stdin is not None:
            self._process.stdin.close()
        if self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            if self.status == "compiling":
                self.status = "stopped"
        self._reader.join(10)
