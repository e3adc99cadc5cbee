"""A stream's events on their way to its consumer, and the back-pressure that the consumer's
pace makes: how much audio waits untaken (the slot queue skips a backlogged stream's steps),
since when the consumer took nothing (the stall time-out), how far ahead of a real-time
listener the audio is (the slot queue serves the streams about to run out first), and, with a
lookahead, the playback clock that holds the next audio back.

On the event loop, one owner (the stream); `backlogged` and `audio_ahead_s` are also read by the
engine loop's thread (float and bool reads: a stale value only reorders one step).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from ..scheduling.queue import NEW_STREAM_AHEAD_S
from .events import Flushed, Phonemes, Produced, Queued, Segment, Words


class Pacing:
    def __init__(self, max_buffered_s: float, speed: float, lookahead_s: float | None,
                 on_backlog: Callable[[bool], None]) -> None:
        self._max_buffered_s = max_buffered_s
        self.speed = speed
        self._lookahead_s = lookahead_s
        self._on_backlog = on_backlog          # the backlog began (True) or cleared: the producer pauses or goes on
        self._events: deque[Queued] = deque()
        self._waiter: asyncio.Future | None = None
        self._closed = False                   # no more events will be put
        self.produced_s = 0.0                  # audio put (less what a cancel dropped)
        self.produced_chunks = 0
        self.first_produced_at: float | None = None
        self.queued_s = 0.0                    # audio put, not yet taken
        self.backlogged = False
        self._backlog_since: float | None = None
        self.taken_s = 0.0                     # audio the consumer has taken
        self._first_taken_at: float | None = None
        self._last_taken_at = time.monotonic()

    # ------------------------------------------------------------------ the producer's side

    def put(self, event: Queued, now: float | None = None) -> None:
        """One more event for the consumer (`now`: the time, where the caller has it)."""
        if isinstance(event, Produced):
            now = time.monotonic() if now is None else now
            if self.first_produced_at is None:
                self.first_produced_at = now
            self.produced_s += event.seconds
            self.produced_chunks += 1
            self.queued_s += event.seconds
            self._update_backlog(now)
        self._events.append(event)
        self.wake()

    def close(self) -> None:
        """The last event is in: the consumer stops once it has taken everything."""
        self._closed = True
        self.wake()

    def drop_unsent(self) -> None:
        """Barge-in: audio not yet taken is never taken, nor counted as produced; nor are the
        segment, word and flush events behind it, which would say that audio was sent."""
        kept: deque[Queued] = deque()
        dropped = False
        for event in self._events:
            if isinstance(event, Produced):
                self.produced_s -= event.seconds
                self.produced_chunks -= 1
                dropped = True
            elif not (dropped and isinstance(event, (Segment, Words, Phonemes, Flushed))):
                kept.append(event)
        self._events = kept
        self.queued_s = 0.0
        self._update_backlog(time.monotonic())

    def discard(self) -> None:
        """The consumer is gone: nothing more is taken."""
        self._events.clear()
        self.queued_s = 0.0
        self.backlogged = False
        self.close()

    def audio_ahead_s(self) -> float:
        """Seconds of audio produced beyond what a real-time listener has played since the
        first chunk (negative: it would be waiting); before any, NEW_STREAM_AHEAD_S."""
        first = self.first_produced_at
        if first is None:
            return NEW_STREAM_AHEAD_S
        return self.produced_s / self.speed - (time.monotonic() - first)

    # ------------------------------------------------------------------ the consumer's side

    async def take(self) -> Queued | None:
        """The next event, once the lookahead lets it go; None once all are taken."""
        while True:
            while not self._events:
                if self._closed:
                    return None
                await self._wait()
            if isinstance(self._events[0], Produced) and (early := self._ahead_of_playback()) > 0:
                await self._wait(early)           # or less: a cancel or close wakes it
                continue
            return self._take()

    def take_now(self) -> Queued | None:
        """The next event if it may be taken now, without waiting (None: `take` must wait)."""
        if not self._events or (isinstance(self._events[0], Produced) and self._ahead_of_playback() > 0):
            return None
        return self._take()

    def _take(self) -> Queued:
        event = self._events.popleft()
        if isinstance(event, Produced):
            now = time.monotonic()
            self._last_taken_at = now
            if self._first_taken_at is None:
                self._first_taken_at = now
            self.taken_s += event.seconds
            self.queued_s = max(0.0, self.queued_s - event.seconds)
            self._update_backlog(now)
        return event

    def stalled_s(self, now: float) -> float:
        """How long a backlogged consumer has taken nothing it could not still be playing (0
        when not backlogged). A consumer that plays as it reads may read nothing while it plays
        what it took (a paced player reads its socket in bursts): the stall counts from its last
        take, or from when a real-time player would have run out, whichever is later."""
        if self._backlog_since is None or not self.backlogged:
            return 0.0
        runs_out_at = self._first_taken_at + self.taken_s if self._first_taken_at is not None else 0.0
        return now - max(self._backlog_since, self._last_taken_at, runs_out_at)

    def wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    # ------------------------------------------------------------------ inside

    def _update_backlog(self, now: float) -> None:
        was = self.backlogged
        self.backlogged = self.queued_s >= self._max_buffered_s
        if self.backlogged and self._backlog_since is None:
            self._backlog_since = now
        elif not self.backlogged:
            self._backlog_since = None
        if self.backlogged != was:
            self._on_backlog(self.backlogged)

    def _ahead_of_playback(self) -> float:
        """Seconds the consumer is ahead of its lookahead on a real-time playback clock (<= 0:
        the next audio may go now, as it always may without a lookahead)."""
        if self._lookahead_s is None or self._first_taken_at is None:
            return 0.0
        played = time.monotonic() - self._first_taken_at
        return self.taken_s / self.speed - played - self._lookahead_s

    async def _wait(self, timeout: float | None = None) -> None:
        """Until the producer (or a cancel, a close) wakes the consumer, or `timeout` passes."""
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self.wake) if timeout is not None else None
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()
