"""The engine loop's thread's way onto the event loop: calls queued in order, one wake-up per burst.

A batched step hands over a chunk for every stream at once. Waking the loop once per chunk
(`call_soon_threadsafe` writes to the loop's self-pipe each time) costs a system call and a
loop iteration per chunk; here the first call of a burst schedules one drain and the rest join
it, in order.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import deque
from typing import Any, Callable

log = logging.getLogger("vox_ws.service")


class LoopMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._calls: deque[tuple[Callable[..., Any], tuple]] = deque()
        self._lock = threading.Lock()
        self._scheduled = False

    def post(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on the loop soon. Thread-safe; dropped once the loop is closed."""
        with self._lock:
            self._calls.append((fn, args))
            if self._scheduled:
                return
            self._scheduled = True
        try:
            self._loop.call_soon_threadsafe(self._drain)
        except RuntimeError:
            pass  # the loop is closed: the server is exiting

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._calls:
                    self._scheduled = False
                    return
                calls = list(self._calls)
                self._calls.clear()
            for fn, args in calls:
                try:
                    fn(*args)
                except Exception:  # noqa: BLE001 - one stream's bug must not stall every other's hand-off
                    log.exception("hand-off call %r failed", fn)
