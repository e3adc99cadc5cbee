"""Voice registrations waiting for the voice worker: bounded, and served owner by owner.

A registration holds its reference audio (up to `max_frame_bytes`) from the moment it is
admitted, so how many may wait is bounded per owner and in all: one more is refused `busy`
(retryable) before its audio is read. Waiting ones are served one at a time, the owner served
longest ago (or never) first, so an owner's burst of uploads waits behind itself, never in
front of another owner's one registration.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, deque
from types import TracebackType

from ...engine import ErrorKind, Refused
from ...scheduling.queue import QueuePace


class RegistrationQueue:
    def __init__(self, per_owner: int, total: int) -> None:
        self.per_owner = per_owner
        self.total = total
        self._pending: Counter[str] = Counter()       # owner -> admitted, not yet released
        self._waiting: dict[str, deque[asyncio.Future]] = {}    # owner -> turns, oldest first
        self._served: dict[str, int] = {}             # owner -> when it last had a turn (a count)
        self._clock = itertools.count()
        self._busy = False
        self.pace = QueuePace()                       # how long a turn at the worker takes
        self._turn_started = 0.0

    @property
    def pending(self) -> int:
        return sum(self._pending.values())

    def admit(self, owner: str) -> Registration:
        """A place in the queue for `owner`; raises Refused(BUSY) over the bounds, with a retry
        hint: the pending registrations' turns at the worker, at the pace measured."""
        if self._pending[owner] >= self.per_owner:
            raise Refused(ErrorKind.BUSY, f"{self.per_owner} voice registrations of yours are already waiting "
                                          "or running: try again when one is done", self.retry_after_s())
        if self.pending >= self.total:
            raise Refused(ErrorKind.BUSY, f"{self.total} voice registrations are waiting: try again shortly",
                          self.retry_after_s())
        self._pending[owner] += 1
        return Registration(self, owner)

    def retry_after_s(self) -> float:
        """When a refused registration should try again: the pending ones' turns at the worker
        (the one running, then the others), at the pace measured."""
        holding = [time.monotonic() - self._turn_started] if self._busy else []
        return self.pace.wait_s(holding, 1, after=self.pending - 1)

    async def _take_turn(self, owner: str) -> None:
        if not self._busy and not self._waiting:
            self._busy = True
            self._served[owner] = next(self._clock)
            return
        turn = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(owner, deque()).append(turn)
        try:
            await turn
        except asyncio.CancelledError:
            if turn.done() and not turn.cancelled():
                self._pass_turn()                     # it was ours: the next one's now
            else:
                self._forget(owner, turn)
            raise

    def _pass_turn(self) -> None:
        while self._waiting:
            owner = min(self._waiting, key=lambda o: self._served.get(o, -1))
            turn = self._waiting[owner].popleft()
            if not self._waiting[owner]:
                del self._waiting[owner]
            if not turn.done():
                self._served[owner] = next(self._clock)
                turn.set_result(None)
                return
        self._busy = False

    def _forget(self, owner: str, turn: asyncio.Future) -> None:
        waiting = self._waiting.get(owner)
        if waiting is not None and turn in waiting:
            waiting.remove(turn)
            if not waiting:
                del self._waiting[owner]

    def _release(self, owner: str) -> None:
        self._pending[owner] -= 1
        if self._pending[owner] <= 0:
            del self._pending[owner]
            if owner not in self._waiting:
                self._served.pop(owner, None)         # bounded by the owners with one pending


class Registration:
    """One admitted registration: `async with` it for its turn at the worker; `release()` it
    (always; idempotent) once done or abandoned."""

    def __init__(self, queue: RegistrationQueue, owner: str) -> None:
        self._queue = queue
        self.owner = owner
        self._released = False

    async def __aenter__(self) -> Registration:
        await self._queue._take_turn(self.owner)
        self._queue._turn_started = time.monotonic()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self._queue.pace.observe(time.monotonic() - self._queue._turn_started)
        self._queue._pass_turn()

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._queue._release(self.owner)
