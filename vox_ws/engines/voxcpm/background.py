"""Compiling without blocking: the server is ready once the model is loaded and serves eager; a
child process (`compile_main`) compiles the step's graphs into the compile cache, and each bucket
is adopted (its graphs loaded, milliseconds) between two steps as soon as it is there.

`BackgroundCompile` starts the child and reads its events on a thread of its own, where each
bucket's graphs are loaded, run once and compared with the eager step (`prepare`; the decode's
likewise, `prepare_decode`: off the thread that steps, which would stall every stream
meanwhile); the engine loop's thread takes what has arrived (`arrived`) before each step and
only switches in there what agreed. `describe` is its progress, for `/v1/info`.

Where every graph is in the cache already, the child says so without loading the model
(`compile_main.CacheRecord`; `describe`'s `cached`); should a bucket it says is there fail to
load here, a second child compiles without trusting that record.
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

from ..accelerator import DEVICE_LOCK, enter_device
from ..child import end_process, grace_until
from .compile_workers import ENV as COMPILE_WORKERS_ENV
from .compile_workers import compile_workers

log = logging.getLogger("vox_ws.engines.voxcpm")

# How long the child has to end on SIGTERM at close before it is killed (a stuck one never does;
# a stopped one is continued to: `end_process`), unless the server's shutdown has less left.
STOP_GRACE_S = 5.0
# How long `close` waits for the reader thread once the child has gone (it may be loading a
# bucket's graphs), likewise within what the shutdown has left.
READER_GRACE_S = 10.0


class BackgroundCompile:
    """One child process compiling `settings["buckets"]` (see `compile_main`), and what it said."""

    def __init__(self, settings: dict[str, Any], prepare: Callable[[int], None] | None = None,
                 prepare_decode: Callable[[], None] | None = None) -> None:
        """`prepare(rows)`: called on this object's reader thread for each bucket the child has
        put in the cache, before the engine is told (its graphs loaded, run once and compared
        with eager there, off the thread that steps); `prepare_decode()` the same for the
        decode's graphs; a failure leaves the graphs to be loaded and compared when adopted."""
        self.buckets = tuple(settings["buckets"])
        self._prepare = prepare
        self._prepare_decode = prepare_decode
        self.device = settings["device"]
        self.status = "compiling"          # then "done", "failed" or "stopped"
        self.error = ""
        self.started = time.monotonic()
        self.started_at = time.time()      # the same, in Unix seconds, for a reader in another process
        self.seconds: float | None = None  # until done
        self.measured: dict[int, dict[str, float]] = {}
        self.compiled: list[int] = []      # buckets in the cache
        self.compile_s: dict[int, float] = {}   # the child's seconds per bucket (0: it was in the cache)
        self.adopted: list[int] = []       # buckets the step uses (the engine says)
        self.declined: list[int] = []      # compiled, but slower than eager here (the engine says)
        self.adopted_decode = False        # the decode's graphs in use (the engine says)
        self.priority = ""                 # the CPU priority the child runs at (once started)
        self.cached = False                # every graph was in the cache: the child loaded no model
        self.started_event = threading.Event()   # set once the child dies with this process
        self._events: queue.SimpleQueue = queue.SimpleQueue()
        self._closing = False              # set by `close`: an end is then a stop, not a failure
        self._starting = threading.Lock()  # `close` and a second child's start, one at a time
        self._settings = settings
        self._process = self._start(fresh=False)
        self._reader = threading.Thread(target=self._read, name="vox-ws-background-compile", daemon=True)
        self._reader.start()
        log.info("compiling the step for %s rows in the background (process %d); serving eager meanwhile",
                 list(self.buckets), self._process.pid)

    def _start(self, fresh: bool) -> subprocess.Popen:
        """The child (`fresh`: one that compiles whatever records the cache holds). It compiles
        with as many workers as this container has CPUs, where this process (serving) has one."""
        return subprocess.Popen([sys.executable, "-m", "vox_ws.engines.voxcpm.compile_main",
                                 json.dumps({**self._settings, "parent": os.getpid(), "fresh": fresh})],
                                # Its standard input closes when this process ends.
                                stdout=subprocess.PIPE, stdin=subprocess.PIPE, text=True,
                                env={**os.environ, COMPILE_WORKERS_ENV: str(compile_workers())})

    def _read(self) -> None:
        # What this thread loads and runs is on the engine's device, never beside a capture.
        enter_device(self.device)
        retry = self._read_child()
        if retry:
            with self._starting:
                if self._closing:
                    self.status = "stopped"
                    return
                log.warning("background compile: graphs the compile cache said it held did not load; "
                            "compiling them again")
                self._process = self._start(fresh=True)
            self._read_child()

    def _read_child(self) -> bool:
        """Read the child's events to its end; True where a bucket it said was in the cache failed
        to load here (its record is stale: a fresh child is wanted), and it said nothing else."""
        ended = stale = False
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
                stale = not self._bucket(event) or stale
            elif kind == "decode" and self._prepare_decode is not None:
                try:
                    with DEVICE_LOCK:
                        self._prepare_decode()
                except Exception as exc:  # noqa: BLE001 - the engine loads them when it adopts them
                    log.warning("background compile: the decode not loaded ahead (%s: %s)", type(exc).__name__, exc)
            elif kind in ("done", "failed"):
                if kind == "done" and stale:
                    break
                ended = True
                self.cached = bool(event.get("cached"))
                self.seconds = round(time.monotonic() - self.started, 1)
                self.status = kind
                self.error = event.get("error", "")
                if kind == "failed":
                    log.warning("background compile failed (%s): the step stays eager", self.error)
                else:
                    log.info("background compile done in %.1f s%s", self.seconds,
                             " (every graph in the cache: no model loaded)" if self.cached else "")
            self._events.put(event)
        self._process.wait()
        if stale:
            return True
        if not ended and self.status == "compiling":
            if self._closing:
                self.status = "stopped"
                return False
            self.status, self.error = "failed", f"the compile process exited ({self._process.returncode})"
            log.warning("background compile: %s; the step stays eager", self.error)
        return False

    def _bucket(self, event: dict[str, Any]) -> bool:
        """A bucket the child has put in the cache (or found there): loaded ahead where it will be
        used; False where one it found there failed to load."""
        rows = event["rows"]
        if not self.compiled:
            # What loading a graph first needs (inductor, seconds to import), here rather
            # than on the engine loop's thread, where it would hold a step.
            from .compiled import warm_compiler

            warm_compiler("cuda" if self.device.startswith("cuda") else "cpu")
        if rows not in self.compiled:
            self.compiled.append(rows)
        self.compile_s[rows] = float(event.get("seconds", 0.0))
        if "eager_ms" in event:
            self.measured[rows] = {"eager_ms": event["eager_ms"], "compiled_ms": event["compiled_ms"]}
        if self._prepare is not None and self.slower_than_eager(rows) is None:
            try:
                with DEVICE_LOCK:
                    self._prepare(rows)
            except Exception as exc:  # noqa: BLE001 - the engine loads it when it adopts it
                log.warning("background compile: the step for %d rows not loaded ahead (%s: %s)",
                            rows, type(exc).__name__, exc)
                if event.get("cached"):
                    return False
        log.info("background compile: the step for %d rows %s (%d/%d)", rows,
                 "in the cache already" if event.get("cached") else f"compiled in {event['seconds']:.1f} s",
                 len(self.compiled), len(self.buckets))
        return True

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
                "compile_s": {str(k): v for k, v in self.compile_s.items()},
                "started_at": round(self.started_at, 3), "cached": self.cached,
                **({"priority": self.priority} if self.priority else {}),
                **({"error": self.error} if self.error else {})}

    def close(self, deadline: float | None = None) -> None:
        """Stop the child: asked (SIGTERM, and SIGCONT should it be stopped), killed if it has not
        ended within STOP_GRACE_S or by `deadline` (`time.monotonic()`: the end of the server's
        shutdown), whichever is sooner. It is gone on return."""
        with self._starting:
            self._closing = True
            process = self._process
        if process.stdin is not None:
            process.stdin.close()
        if process.poll() is None:
            end_process(process, grace_until(deadline, STOP_GRACE_S))
            if self.status == "compiling":
                self.status = "stopped"
        self._reader.join(grace_until(deadline, READER_GRACE_S))
