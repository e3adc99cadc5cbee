"""A stream's production on the event loop: its text's way in and its audio's way out of the
engine loop, up to the pacing queue. The service's side of a stream (`start`, `check_timers`,
`fail`), and what the consumer's handle (`stream.py`) asks of it.

    text in -> StreamInput (stream_input.py) -> TextPlan (what next)
            -> _advance (the one path that starts generation)
            -> SegmentStarter (segments.py): cut, respelled, prepared off the loop where needed;
               a GenerationRequest and its SegmentSink -> engine loop
    each request's sink posts (sink, event) -> _on_request_event -> Pacing (audio, timings, segments)
    the last event (Ended, Failed) -> Pacing, closed; the stream's record (record.py) counts
    usage and writes the log line when the consumer is handed it

Its state moves one way, through `_move`, which refuses any other move: OPENING (its voice is
fetched or its text cut: nothing queued yet) -> SPEAKING (generating, or waiting for input) ->
DRAINING (its last event is queued: nothing more is produced); OPENING -> DRAINING where it
fails or is stopped first. The consumer's handle adds how the consumer ended (`StreamState`).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
from concurrent.futures import Executor
from typing import Any, Awaitable, Iterable, Protocol

from ..config import Limits
from ..engine import EndReason, ErrorKind, GenerationRequest, Refused, RequestStatus
from ..engine_process.view import Held
from .aligner_end_wait import AlignerEndWait
from .events import Ended, Failed, Flushed, Phonemes, Produced, Segment, Word, Words
from .handoff import LoopMailbox
from .markup import Part
from .metrics import Metrics
from .output import OutputStage
from .pacing import Pacing
from .record import StreamRecord
from .request import StreamRequest, StreamSetup
from .segments import SegmentStarter, TextWork
from .sink import Aligned, RequestEnded, RequestEvent, SegmentAlignment, SegmentSink
from .stream_input import StreamInput
from .text_plan import Pause, Speak, TextPlan


class StreamState(str, enum.Enum):
    """Where a stream is: the first three are its production's (`Generation.state`), the last
    three how its consumer ended (`Stream.state`)."""

    OPENING = "opening"      # its voice is fetched or its text cut: nothing queued yet
    SPEAKING = "speaking"    # generating, or waiting for more input
    DRAINING = "draining"    # its last event is queued: nothing more is produced
    ENDED = "ended"          # the consumer took `Ended`
    FAILED = "failed"        # the consumer took `Failed`
    CLOSED = "closed"        # the consumer left before the end

    def __str__(self) -> str:
        return self.value


# The moves `Generation._move` allows.
_MOVES = {StreamState.OPENING: {StreamState.SPEAKING, StreamState.DRAINING},
          StreamState.SPEAKING: {StreamState.DRAINING}}


class StreamHost(TextWork, Protocol):
    """What a stream needs from the service that opened it: its threads for text work, and:"""

    limits: Limits
    metrics: Metrics
    mailbox: LoopMailbox
    encoding: Executor          # where output pipelines (codecs, tempo) run

    def forget(self, generation: "Generation") -> None:
        """The stream has stopped producing."""


def _only(languages: tuple[str, ...]) -> str | None:
    """The language of a voice that speaks one (Piper's); None for one that speaks many (VoxCPM2
    reads the language from the text)."""
    return languages[0] if len(languages) == 1 else None


class Generation:
    """Made by the service as it opens a stream, with the stream's output stage, pacing and
    record (the `Stream` it hands the consumer reads the first two); see the module docstring."""

    def __init__(self, service: StreamHost, request: StreamRequest, setup: StreamSetup) -> None:
        engine = setup.engine_loop.engine
        wanted = request.output
        self.sample_rate = wanted.rate_for(engine.sample_rate)
        self.output = OutputStage(engine.sample_rate, wanted.format, self.sample_rate, wanted.speed,
                                  service.encoding, wanted.volume)
        self._request: GenerationRequest | None = None    # of the segment being generated

        def reader_changed(backlogged: bool) -> None:
            """The consumer fell behind (or caught up): the engine skips (or steps again) the
            segment being generated."""
            if self._request is not None:
                self.engine_loop.reader(self._request, backlogged)

        self.pacing = Pacing(service.limits.max_buffered_audio_s, wanted.speed, wanted.lookahead_s, reader_changed)
        record = StreamRecord(service.metrics, request, setup, engine.name, self.sample_rate)
        self._service = service
        self.engine_loop = setup.engine_loop          # its device's: every request of it goes there
        self._engine = setup.engine_loop.engine
        self.number = setup.number
        self._lora_pin = setup.lora_pin          # its adapter, held until it stops producing
        self._limits = service.limits
        self.record = record
        self.started_at = record.started_at
        self.word_timestamps = request.word_timestamps
        self.phoneme_timestamps = request.phoneme_timestamps
        # The text's language: the request's, else its voice's where that speaks one (Piper's);
        # None: read from the text (VoxCPM2).
        self.language = request.language or _only(self._engine.voices.languages(request.voice))
        self.plan = TextPlan(request.input_streaming, service.limits.max_text_chars, self.language)
        # Its usage's characters: a one-shot text's, and what is sent since.
        self.input = StreamInput(self.plan, request.input_streaming, self._limits.input_pause_s, self._advance,
                                 self.fail, characters=len(request.one_shot_text or ""))
        self.segments = SegmentStarter(service, self._engine, request, setup, self._limits)
        self._owner = setup.owners[0] if setup.owners else ""    # the aligner's queue shares by it
        self._voice = request.voice
        self.state = StreamState.OPENING
        # How it ended, once it has: an EndReason or, for a failure, an ErrorKind.
        self.ended_by: EndReason | ErrorKind | None = None
        self.last_event: Ended | Failed | None = None
        self._context: Any = None                # the previous segment's continuation
        self._timed_words: list[Word] = []       # every word time produced (for `heard`)
        # Where the aligner times the words: the spoken segments (their sinks) whose words are not
        # yet sent, and the end that waits for them (`Ended` comes after every word).
        self._end_wait = AlignerEndWait(setup.aligner if self.word_timestamps else None)
        self._work: asyncio.Future | None = None  # the voice, a cut or a preparation, off the loop

    @property
    def done(self) -> bool:
        """Nothing more is produced."""
        return self.state is StreamState.DRAINING

    def _move(self, to: StreamState) -> None:
        if to not in _MOVES.get(self.state, ()):
            raise RuntimeError(f"stream {self.number}: no move from {self.state} to {to}")
        self.state = to

    # ------------------------------------------------------------------ the service's side

    def start(self, text: str | list[Part] | None, fetch: Awaitable[str | None] | None = None) -> int:
        """Begin: say `text` (one-shot, or the parts of a marked-up one: texts and pauses), or,
        with None, take input (`input`); with `fetch`, the voice comes from the store first
        (a voice it lacks fails the stream). A text too long for one generation is cut by the
        engine, the pieces continuing one another; off the loop when long. Returns the queue
        position (0 also while anything is still done off the loop)."""
        parts = None if text is None else [text] if isinstance(text, str) else text
        if parts is not None:
            self.segments.spend_silence(parts)      # refused before anything is queued
        if fetch is None and (parts is None or not self.segments.cuts_off_loop(parts)):
            # Said at once: a refusal of its first segment (a full queue, say) is the caller's.
            if parts is not None:
                self.plan.say(self.segments.cut_on_loop(parts))
            self._move(StreamState.SPEAKING)
            return self._advance(refuse=True)
        self._work = asyncio.ensure_future(self._open(parts, fetch))
        return 0

    async def _open(self, parts: list[Part] | None, fetch: Awaitable[str | None] | None) -> None:
        try:
            if fetch is not None:
                fetched = await fetch
                if isinstance(fetched, str) and fetched != self._voice:
                    # The name was another owner's public voice (`VoiceService.ensure`): that one speaks.
                    self._voice = fetched
                    self.segments.use_voice(fetched)
                self.segments.voice_pin = self._engine.voices.pin(self._voice)
            if parts is not None:
                parts = await self.segments.cut(parts)
        except Refused as err:
            self._work = None
            self.fail(err)
            return
        self._work = None
        if self.done:
            return
        if parts is not None:
            self.plan.say(parts)
        self._move(StreamState.SPEAKING)
        self._advance()

    def check_timers(self, now: float) -> None:
        """The service's watchdog: a consumer that stopped reading, input that stopped coming."""
        if self.done:
            return
        if (overdue := self._end_wait.overdue(now)) is not None:
            reason, late = overdue                    # the aligner is late: its words estimated, then the end
            for words in late:
                self._timed_words.extend(words)
                self.pacing.put(Words(words))
            self._end(reason)
            return
        limits = self._limits
        if self.pacing.stalled_s(now) > limits.write_stall_timeout_s:
            self.fail(Refused(ErrorKind.SLOW_CONSUMER, f"client read no audio for {limits.write_stall_timeout_s:g}s "
                                                       "after the audio it had taken would have played"))
            return
        if (self.state is StreamState.SPEAKING and self.plan.idle
                and now - self.input.last_at > limits.stream_timeout_s):
            self.fail(Refused(ErrorKind.TIMEOUT, f"no input for {limits.stream_timeout_s:g}s and no end of input: "
                                                 "the stream is closed"))

    # ------------------------------------------------------------------ the consumer's verbs

    def cancel(self) -> None:
        """Barge-in: audio not yet taken is dropped, the stream ends with `Ended(CANCELLED)`."""
        if not self.done:
            self._end(EndReason.CANCELLED)

    def stop(self) -> None:
        """The consumer is gone: stop at once."""
        if not self.done:
            self._stop_producing()

    # ------------------------------------------------------------------ generation (loop)

    def _advance(self, refuse: bool = False) -> int:
        """The one path that starts generation: mark the flushes whose text is spoken, then, with
        no segment in flight, say what the plan has next (a pause is silence at once), or end
        once all is said. Returns the queue position of a segment it queued (else 0). A segment
        refused fails the stream, or with `refuse` raises Refused."""
        if self.state is not StreamState.SPEAKING:
            return 0
        for _ in range(self.plan.due_flushes()):
            self.pacing.put(Flushed(round(self.pacing.produced_s, 4)))
        while not self.plan.in_flight:
            step = self.plan.next()
            if step is None:
                if self.plan.done:
                    self._end(self.plan.end_reason)
                return 0
            if isinstance(step, Pause):
                self._produced(self.output.silence(step.seconds))
                continue
            try:
                return self._speak(step)
            except Refused as err:
                if refuse:
                    raise
                self.fail(err)
                return 0
        return 0

    def _speak(self, step: Speak) -> int:
        """Queue a segment, its text worked on off the loop first where it needs it."""
        if not step.prepared and self.segments.needs_preparing():
            self._work = asyncio.ensure_future(self._queue_prepared(step.text))
            return 0
        return self._queue(step.text, step.text, prepared=step.prepared)

    async def _queue_prepared(self, text: str) -> None:
        try:
            pieces = await self.segments.prepared(text, lambda: self.done)
            self._work = None
            if pieces is None:
                return
            if len(pieces) > 1:        # normalised too long for one generation: cut again
                first = self.plan.cut([piece for piece, _, _ in pieces])
                self._queue(first, first, prepared=True)
            else:
                self._queue(*pieces[0])
        except Refused as err:
            self._work = None
            self.fail(err)

    def _queue(self, text: str, engine_text: str, prepared: bool) -> int:
        aligner = self._end_wait.aligner
        alignment = None if aligner is None else SegmentAlignment(aligner, text, engine_text, self.language,
                                                                   self._owner)
        sink = SegmentSink(functools.partial(self._service.mailbox.post, self._on_request_event), self.output,
                           self.pacing, self.word_timestamps, self.phoneme_timestamps, alignment)
        request = self.segments.engine_request(engine_text, prepared, sink, self._lora_pin, self._context, self.plan)
        position = self.engine_loop.submit(request)
        self._request = request
        self.plan.started(text, self.pacing.produced_s)
        return position

    # ------------------------------------------------------------------ what a request's sink posts (loop)

    def _on_request_event(self, sink: SegmentSink, event: RequestEvent) -> None:
        if isinstance(event, Aligned):               # a spoken segment's words: wherever the next one has got to
            for words in self._end_wait.answer(sink, event.words):
                self._timed_words.extend(words)
                self.pacing.put(Words(words))
            if (released := self._end_wait.released()) is not None and not self.done:
                self._end(released)
            return
        request = self._request
        if request is None or sink is not request.sink or self.done:
            return                                 # a request this stream no longer waits for
        if isinstance(event, Produced):
            self._produced((event,))
        elif isinstance(event, Words):
            self._timed_words.extend(event.words)
            self.pacing.put(event)
        elif isinstance(event, Phonemes):
            self.pacing.put(event)
        elif not isinstance(event, RequestEnded):
            self.fail(Refused(event.kind, event.message, event.retry_after_s))
        elif event.reason == EndReason.CANCELLED:
            self._request = None
            self._end(event.reason)
        else:                                               # a segment spoken: on to the next
            self._request = None
            if sink.aligning:
                self._end_wait.expect(sink)
            segment = self.plan.spoke(self.pacing.produced_s, event.reason)
            if self.plan.continues:
                self._context = request.continuation
            self.pacing.put(Segment(len(self.plan.segments) - 1, **segment))
            self._advance()

    def _produced(self, chunks: Iterable[Produced]) -> None:
        for chunk, at in self.record.produced(chunks):
            self.pacing.put(chunk, at)

    # ------------------------------------------------------------------ endings

    def _end(self, reason: EndReason) -> None:
        if self._end_wait.holds(reason, time.monotonic()):
            return                                  # once the aligner's last words are in
        heard = None
        if reason != EndReason.CANCELLED:
            self._produced(self.output.tail())
        else:
            generated_s = self.pacing.produced_s
            self.pacing.drop_unsent()
            heard = self.plan.heard(self.pacing.produced_s, generated_s,
                                     self._timed_words if self.word_timestamps else None)
        self._stop_producing(reason)
        stats = {"segments": list(self.plan.segments), "usage": {"characters": self.input.characters},
                 **({"heard": heard} if heard is not None else {})}
        self._last(Ended(reason, stats))

    def fail(self, err: Refused) -> None:
        """End the stream with an error (its own, or from outside it: the drain time ran out)."""
        if self.done:
            return
        self._stop_producing(err.kind)
        stats = {"segments": list(self.plan.segments), "usage": {"characters": self.input.characters}}
        self._last(Failed(err.kind, err.message, stats, err.retry_after_s, err.field))

    def _last(self, event: Ended | Failed) -> None:
        """The stream's last event: the consumer stops after it."""
        self.last_event = event
        self.pacing.put(event)
        self.pacing.close()

    def _stop_producing(self, ended_by: EndReason | ErrorKind | None = None) -> None:
        self._move(StreamState.DRAINING)
        self.ended_by = ended_by
        if ended_by is not None:
            self.record.ended(ended_by)
        # No word is waited for any more: segments still in the aligner's queue leave it unaligned,
        # the one in flight's too (it may have ended on the engine's thread already).
        self._end_wait.clear()
        if self._request is not None and isinstance(self._request.sink, SegmentSink):
            self._request.sink.drop_alignment()
        self.input.stop()
        self.plan.stop()
        if self._work is not None and self._work is not asyncio.current_task():
            self._work.cancel()
        if self._request is not None and self._request.status is not RequestStatus.FINISHED:
            self.engine_loop.cancel(self._request)        # one that has ended meanwhile is let be
        if isinstance(self._context, Held):
            self._context.release()                       # the engine keeps it no longer
        self._context = None
        self.segments.release_voice()
        self.release_lora()
        self._service.forget(self)

    def end_if_unloading(self, name: str) -> None:
        """The unload of adapter `name` has had its time: a stream still speaking with it ends."""
        if self._lora_pin is not None and self._engine.loras.unloading(self._lora_pin, name):
            self.fail(Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} was unloaded: its streams had "
                                                 f"{self._limits.lora_unload_timeout_s:g} s to finish"))

    def release_lora(self) -> None:
        """Let go of the stream's adapter (the engine frees its slot once no request uses it)."""
        pin, self._lora_pin = self._lora_pin, None
        if pin is not None:
            self._engine.loras.unpin(pin)
