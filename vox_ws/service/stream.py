"""One stream: text in, audio events out. This is the consumer's handle; a stream's pieces,
each with one owner and one thread, and the way a chunk takes through them, top-down:

    engine loop's thread   SegmentSink (sink.py): one per request; produces the request's audio
                       through the output stage, posts (sink, event) to the loop
    event loop         Generation (generation.py): the stream's production; its TextPlan
                       (text_plan.py, pure) says what to say next, its StreamInput
                       (stream_input.py) takes text in, its SegmentStarter (segments.py) makes
                       each segment's request; puts events in the pacing
                       Pacing (pacing.py): back-pressure, the stall clock, the lookahead
                       OutputStage.hand_over (output.py): codec, tempo, the final figures
    the consumer       Stream (here): `async for event in stream`, and a handful of verbs;
                       its StreamRecord (record.py) logs the last event it hands over

Its state (`StreamState`) moves one way:

    OPENING -> SPEAKING -> DRAINING -> ENDED | FAILED      (any of them -> CLOSED by the consumer)

the first three its production's, the last three how its consumer ended. It never calls back
into whoever consumes it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..engine import EndReason
from .events import Audio, Ended, Event, Failed, Produced
from .generation import Generation, StreamHost, StreamState
from .metrics import Metrics
from .request import StreamRequest

__all__ = ["Stream", "StreamHost", "StreamState"]


class Stream:
    """Opened by `StreamService.open_stream`, which hands it its `generation` (the service's side
    of it); see the module docstring."""

    def __init__(self, generation: Generation, request: StreamRequest, ignored: tuple[str, ...],
                 metrics: Metrics) -> None:
        """`request` as the service checked it (its voice resolved, its timestamps those the
        engine gives); `ignored`: what of it has no effect here."""
        self.generation = generation
        self.format = request.output.format
        self.sample_rate = generation.sample_rate
        self.word_timestamps = request.word_timestamps
        self.phoneme_timestamps = request.phoneme_timestamps
        self.ignored_options = list(ignored)
        self.queued = 0                          # queue position when opened (0: a slot at once)
        self._metrics = metrics
        self._output = generation.output
        self._pacing = generation.pacing
        self._handed: deque[Event] = deque()     # handed over by the output stage, not yet returned
        self._over: StreamState | None = None    # how the consumer ended: ENDED, FAILED or CLOSED

    @property
    def request_id(self) -> str:
        """The `id` of the stream's line in the server's log, for a client to quote."""
        return str(self.generation.number)

    @property
    def state(self) -> StreamState:
        return self._over or self.generation.state

    @property
    def done(self) -> bool:
        """No more events will be produced (the last ones may still be waiting to be taken)."""
        return self._over is not None or self.generation.done

    @property
    def input_closed(self) -> bool:
        """No more text will be accepted (always so for a stream opened with all its text)."""
        return self.generation.plan.input_closed

    @property
    def chunks(self) -> int:
        """Audio chunks produced so far (less those a cancel dropped)."""
        return self._pacing.produced_chunks

    @property
    def segments(self) -> list[dict[str, Any]]:
        """The segments spoken so far: {"text", "start_s", "end_s"}."""
        return self.generation.plan.segments

    def backlogged(self) -> bool:
        """More audio waits untaken than the stream may buffer: its generation is paused."""
        return self._pacing.backlogged

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Event:
        while not self._handed:
            if self._over is not None:
                raise StopAsyncIteration
            # The common case, raw PCM already waiting, takes no await (one chunk per step per stream).
            queued = self._pacing.take_now()
            if queued is None and (queued := await self._pacing.take()) is None:
                raise StopAsyncIteration
            if self._output.immediate:
                handed = self._output.hand_over_now(queued, self.generation.started_at)
            else:
                handed = await self._output.hand_over(queued, self.generation.started_at)
            # Audio encoded while the stream was cancelled or closed is never handed over.
            cancelled = self.generation.ended_by is EndReason.CANCELLED
            if not (isinstance(queued, Produced) and (cancelled or self._over is not None)):
                self._handed.extend(handed)
        event = self._handed.popleft()
        if isinstance(event, Audio):
            self._metrics.audio_bytes.labels(self.format).inc(len(event.data))
        elif isinstance(event, (Ended, Failed)):
            self._over = StreamState.ENDED if isinstance(event, Ended) else StreamState.FAILED
            self._record(event)
        return event

    def _record(self, last: Ended | Failed) -> None:
        generation = self.generation
        generation.record.handed(last, generation.input.characters, len(generation.plan.segments))

    async def aclose(self) -> None:
        """Leaving the iterator early cancels the stream."""
        self.cancel()

    def send_text(self, text: str) -> None:
        """Append text to a stream opened for text input (Refused: not one, input ended, too much)."""
        self.generation.input.send_text(text)

    def flush(self) -> None:
        """Speak what is buffered now; a `Flushed` event follows once its audio is yielded."""
        self.generation.input.flush()

    def end_input(self) -> None:
        """No more text: the rest is spoken, then the stream ends."""
        self.generation.input.end()

    def cancel(self) -> None:
        """Stop now (barge-in): the slot is freed before the next step, audio not yet taken is
        dropped, and the stream ends with `Ended(CANCELLED)`."""
        if not self.done:
            self._handed = deque(e for e in self._handed if not isinstance(e, Audio))
            self.generation.cancel()

    def close(self) -> None:
        """The consumer is gone: stop at once, yield nothing more. A stream that had ended but
        whose last event the consumer did not take is recorded with what was handed over."""
        if self._over is not None:
            return
        last = self.generation.last_event
        if last is not None:
            self._record(self._output.hand_over_now(last, self.generation.started_at)[-1])
        self._output.close_soon()
        self.generation.stop()
        self._over = StreamState.CLOSED
        self._handed.clear()
        self._pacing.discard()
