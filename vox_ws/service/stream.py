"""One stream: text in, audio events out, and everything in between that is not the model.

A stream owns its state machine: its text segments and their continuation, flush marks, the
input time-out, the encoder (resampling and sample format), back-pressure by its consumer's
pace, its statistics and its log line. It is consumed as an async iterator of events
(`events.py`); it never calls back into whoever consumes it.

Threading: the scheduler thread calls the `RequestSink` methods (`deliver`, `finish`, `fail`,
`backlogged`). `deliver` encodes there (resampling and packing stay off the event loop) and
posts the bytes to the loop through the service's mailbox. Everything else runs on the loop.

    scheduler thread                      event loop
    deliver(pcm) -> encode -> post  ───▶  _on_audio -> events queue -> consumer (__anext__)
    finish(reason)           -> post  ───▶  next segment, or _end -> Ended
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import deque
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Protocol

import numpy as np

from ..audio import StreamEncoder
from ..codecs import CODECS, MAX_SPEED, MIN_SPEED, OutputPipeline, needs_pipeline
from ..config import Limits
from ..engine import EndReason, ErrorKind, GenerationRequest, Refused
from ..lexicon import Lexicon, respell
from ..metrics import Metrics
from ..scheduler import Scheduler
from ..text import StreamSegmenter
from .events import Audio, Ended, Event, Failed, Flushed, Phoneme, Phonemes, Segment, Word, Words
from .handoff import LoopMailbox
from .markup import Part, Pause
from .output import EncodedOutput
from .voice_store import owner_key

stream_log = logging.getLogger("vox_ws.stream")

# A one-shot text longer than this is cut into pieces (`Engine.split_text`) off the loop.
SPLIT_ON_LOOP_CHARS = 300
# The most audio one chunk carries, in seconds.
MAX_CHUNK_S = 1.0
# A stream with no audio yet counts as this far ahead of its listener when the scheduler picks
# whom to serve: before streams comfortably ahead (first audio matters), after those about to
# run out (a gap in audio already playing matters more).
NEW_STREAM_AHEAD_S = 1.0


class StreamHost(Protocol):
    """What a stream needs from the service that opened it."""

    limits: Limits
    metrics: Metrics
    mailbox: LoopMailbox
    encoding: Executor          # where output pipelines (codecs, tempo) run

    def forget(self, stream: "Stream") -> None:
        """The stream has stopped producing."""

    async def prepare_text(self, text: str, options: dict[str, Any]) -> str:
        """The engine's `prepare_text`, off the loop and off the scheduler thread."""

    async def split_text(self, text: str, options: dict[str, Any], voice_pin: Any) -> list[str]:
        """The engine's `split_text`, off the loop."""


_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, field: str = "text") -> None:
    """Text no engine can take is refused up front: a NUL (tokenizers and espeak stop there),
    or a lone surrogate (legal in JSON's escapes, but not Unicode text: no encoder takes it)."""
    if "\x00" in text:
        raise Refused(ErrorKind.INVALID, f"{field} must not contain NUL characters")
    if (found := _SURROGATE.search(text)) is not None:
        raise Refused(ErrorKind.INVALID, f"{field} is not valid Unicode: a lone surrogate "
                                         f"U+{ord(found.group()):04X} at character {found.start()}")


@dataclass(frozen=True)
class AudioOutput:
    """How a stream's audio is delivered: format (raw PCM or a codec, `codecs.OUTPUT_FORMATS`),
    rate (None: the engine's own, or the nearest the codec takes), speed (1: as spoken) and
    lookahead (None: as fast as the consumer takes it; else never more than that many seconds
    ahead of a real-time playback clock that starts at the first audio, for players that read
    as they play)."""

    format: str = "f32"
    sample_rate: int | None = None
    speed: float = 1.0
    lookahead_s: float | None = None

    def rate_for(self, engine_rate: int) -> int:
        """The output rate; raises Refused where the codec cannot take the rate asked for."""
        codec = CODECS.get(self.format)
        if codec is None:
            return self.sample_rate or engine_rate
        if self.sample_rate is None:
            return codec.default_rate(engine_rate)
        if not codec.takes_rate(self.sample_rate):
            raise Refused(ErrorKind.INVALID, f"format {self.format!r} takes sample rates {list(codec.rates or ())}, "
                                             f"not {self.sample_rate}")
        return self.sample_rate


# The range of AudioOutput.lookahead_s, in seconds.
MIN_LOOKAHEAD_S = 0.1
MAX_LOOKAHEAD_S = 600.0


def check_output(output: AudioOutput) -> None:
    if not MIN_SPEED <= output.speed <= MAX_SPEED:
        raise Refused(ErrorKind.INVALID, f"speed must be in [{MIN_SPEED:g}, {MAX_SPEED:g}], got {output.speed:g}")
    if output.lookahead_s is not None and not MIN_LOOKAHEAD_S <= output.lookahead_s <= MAX_LOOKAHEAD_S:
        raise Refused(ErrorKind.INVALID, f"lookahead_s must be in [{MIN_LOOKAHEAD_S:g}, {MAX_LOOKAHEAD_S:g}], "
                                         f"got {output.lookahead_s:g}")


class Stream:
    """Created by `StreamService.open_stream`; see the module docstring."""

    def __init__(self, service: StreamHost, scheduler: Scheduler, number: int, voice: str | None,
                 options: dict[str, Any],
                 output: AudioOutput, input_streaming: bool, log_fields: dict[str, Any], text_chars: int = 0,
                 voice_pin: Any = None, owners: tuple[str, ...] = (), instructions: str | None = None,
                 word_timestamps: bool = False, phoneme_timestamps: bool = False,
                 lexicon: Lexicon | None = None) -> None:
        engine = scheduler.engine
        self._service = service
        self.scheduler = scheduler                # its device's: every request of it goes there
        self._engine = engine
        self.number = number
        self.voice = voice
        self._voice_pin = voice_pin
        self._owners = owners
        self.options = options
        self.input_streaming = input_streaming
        self.format = output.format
        self.speed = output.speed
        self.lookahead_s = output.lookahead_s
        self.sample_rate = output.rate_for(engine.sample_rate)
        # Raw PCM at speed 1 is packed on the scheduler thread as it is delivered; anything else
        # is resampled there to float32 and goes through the pipeline as the consumer takes it.
        self._output: EncodedOutput | None = None
        if needs_pipeline(output.format, output.speed):
            self._output = EncodedOutput(OutputPipeline(output.format, self.sample_rate, output.speed),
                                         service.encoding, output.speed)
        self.encoder = StreamEncoder(engine.sample_rate, self.sample_rate,
                                     "f32" if self._output is not None else output.format)
        self.word_timestamps = word_timestamps
        self.phoneme_timestamps = phoneme_timestamps
        self._lexicon = lexicon if lexicon is not None and len(lexicon) else None
        self._engine_samples = 0                 # delivered so far, at the engine's rate (scheduler thread)
        self._timed_words: list[Word] = []       # every word time yielded (for `heard`)
        self._ready: deque[Event] = deque()      # encoded output not yet handed over
        self.queued = 0                          # queue position when opened (0: a slot at once)
        self.ignored_options = sorted(set(options) - engine.honoured_options)
        self._log_fields = log_fields
        self.characters = text_chars             # of text taken in (usage), one-shot or sent since
        self._limits = service.limits
        # Events for the consumer, and audio among them not yet taken (back-pressure).
        self._events: deque[Event] = deque()
        self._waiter: asyncio.Future | None = None
        self._queued_audio_s = 0.0
        self._backlog_since: float | None = None
        self._last_taken_at = time.monotonic()
        self._first_taken_at: float | None = None
        self._taken_s = 0.0                      # audio the consumer has taken, in seconds
        self._finished = False                   # Ended or Failed queued: nothing more is produced
        self._drained = False                    # ... and the consumer has taken it
        self._drained_early = False              # closed by the consumer
        self._cancelled = False
        # Statistics, counted as audio is produced (what a cancel drops is taken back out).
        self.started_at = time.monotonic()
        self.first_audio_at: float | None = None
        self._last_audio_at = 0.0
        self.chunks = 0
        self.audio_s = 0.0
        self._seq = 0
        # Text: segments waiting, the one generating, those spoken, flush marks.
        self._request: GenerationRequest | None = None
        self._preparing: asyncio.Future | None = None     # the next segment's text, being prepared
        self._segment_text = ""
        self._segmenter = StreamSegmenter()
        self._pending: deque[Part] = deque()     # texts to speak next (and, marked up, pauses)
        self._prepared_pieces: deque[str] = deque()   # normalised text cut again, next in line
        self.segments: list[dict[str, Any]] = []
        self._segment_start_s = 0.0
        self._input_closed = not input_streaming
        self._flush_marks: deque[int] = deque()
        self._last_input_at = time.monotonic()
        self._delay_timer: asyncio.TimerHandle | None = None
        self._context: Any = None                # the previous segment's continuation
        # Segments continue from one another: input streaming, or a one-shot text too long for
        # one generation (`Engine.split_text`).
        self._continues = input_streaming
        self._instructions = instructions        # for the first segment (the others continue it)
        self._capped = False                     # a segment hit its length cap
        self._feeder: asyncio.Task | None = None

    # ------------------------------------------------------------------ the consumer's side

    @property
    def done(self) -> bool:
        """No more events will come (the last one may still be waiting to be taken)."""
        return self._finished

    @property
    def input_closed(self) -> bool:
        """No more text will be accepted (always so for a stream opened with all its text)."""
        return self._input_closed

    def __aiter__(self) -> "Stream":
        return self

    async def __anext__(self) -> Event:
        event = await self._next()
        if isinstance(event, Audio):
            self._service.metrics.audio_bytes.labels(self.format).inc(len(event.data))
        return event

    async def _next(self) -> Event:
        while True:
            if self._ready:
                return self._ready.popleft()
            while not self._events:
                if self._drained or (self._finished and not self._events):
                    raise StopAsyncIteration
                await self._wait()
            if isinstance(self._events[0], Audio) and (early := self._ahead_of_playback()) > 0:
                await self._wait(early)           # or less: a cancel or close wakes it
                continue
            event = self._take()
            if self._output is None:
                return event
            ready = await self._output.process(event, self.started_at)
            # Audio encoded while the stream was cancelled or closed is never handed over.
            if not isinstance(event, Audio) or not (self._cancelled or self._drained_early):
                self._ready.extend(ready)

    async def _wait(self, timeout: float | None = None) -> None:
        """Until the producer (or a cancel, a close) wakes the consumer, or `timeout` passes."""
        loop = asyncio.get_running_loop()
        self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self._wake) if timeout is not None else None
        try:
            await self._waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    def _ahead_of_playback(self) -> float:
        """Seconds the consumer is ahead of its lookahead on a real-time playback clock (<= 0:
        the next audio may go now, as it always may without a lookahead)."""
        if self.lookahead_s is None or self._first_taken_at is None:
            return 0.0
        played = time.monotonic() - self._first_taken_at
        return self._taken_s / self.speed - played - self.lookahead_s

    def _take(self) -> Event:
        event = self._events.popleft()
        if isinstance(event, Audio):
            self._last_taken_at = time.monotonic()
            if self._first_taken_at is None:
                self._first_taken_at = self._last_taken_at
            self._taken_s += event.seconds
            was_backlogged = self.backlogged()
            self._queued_audio_s = max(0.0, self._queued_audio_s - event.seconds)
            if not self.backlogged():
                self._backlog_since = None
                if was_backlogged:
                    self.scheduler.wake()
        elif isinstance(event, (Ended, Failed)):
            self._drained = True
        return event

    def send_text(self, text: str) -> None:
        """Append text to a stream opened for text input."""
        self._check_input()
        check_text(text)
        buffered = len(self._segmenter.buffer) + sum(len(t) for t in self._pending)
        if buffered + len(text) > self._limits.max_text_chars:
            raise Refused(ErrorKind.TOO_LARGE, f"more than max_text_chars={self._limits.max_text_chars} "
                                               "characters waiting to be spoken")
        self._last_input_at = time.monotonic()
        self.characters += len(text)
        self._pending.extend(self._segmenter.push(text))
        self._arm_delay()
        self._pump()

    def flush(self) -> None:
        """Speak what is buffered now; a `Flushed` event follows once its audio is yielded."""
        self._check_input()
        self._last_input_at = time.monotonic()
        self._pending.extend(self._segmenter.flush_all())
        self._flush_marks.append(len(self.segments) + len(self._pending) + self._busy)
        self._pump()

    def end_input(self) -> None:
        """No more text: the rest is spoken, then the stream ends."""
        self._check_input()
        self._last_input_at = time.monotonic()
        self._pending.extend(self._segmenter.flush_all())
        self._input_closed = True
        self._pump()

    def cancel(self) -> None:
        """Stop now (barge-in): the slot is freed before the next step, audio not yet taken is
        dropped, and the stream ends with `Ended(CANCELLED)`."""
        if not self._finished:
            self._cancelled = True
            self._ready = deque(e for e in self._ready if not isinstance(e, Audio))
            self._end(EndReason.CANCELLED)

    def close(self) -> None:
        """The consumer is gone: stop at once, yield nothing more, log nothing."""
        if self._output is not None and not self._drained:
            self._output.close_soon()
        if not self._finished:
            self._stop_producing()
            self._events.clear()
            self._ready.clear()
            self._queued_audio_s = 0.0
            self._drained = True
            self._drained_early = True
            self._wake()

    def abort(self, kind: ErrorKind, message: str) -> None:
        """End the stream with an error from outside it (the server's drain time ran out)."""
        self._fail(kind, message)

    async def aclose(self) -> None:
        """Leaving the iterator early cancels the stream."""
        self.cancel()

    def feed(self, text: AsyncIterator[str]) -> None:
        """Read the input from an async iterator of text pieces, then end it."""
        async def run() -> None:
            try:
                async for piece in text:
                    if self._finished:
                        return
                    self.send_text(piece)
                if not self._finished:
                    self.end_input()
            except Refused as err:
                self._refused(err)
            except Exception as exc:  # noqa: BLE001 - the caller's iterator broke: end the stream, say why
                self._fail(ErrorKind.INTERNAL, f"the text input failed: {type(exc).__name__}: {exc}")
        self._feeder = asyncio.ensure_future(run())

    def _check_input(self) -> None:
        if not self.input_streaming:
            raise Refused(ErrorKind.INVALID, "this stream was not opened for text input")
        if self._input_closed:
            raise Refused(ErrorKind.INVALID, "the input of this stream has already ended")

    # ------------------------------------------------------------------ RequestSink (scheduler thread)

    def deliver(self, pcm: np.ndarray, words: list[tuple[str, int, int]] | None = None,
                phonemes: list[tuple[str, int, int]] | None = None) -> None:
        # An engine may hand over many seconds at once (Piper: a whole sentence); a chunk
        # carries at most MAX_CHUNK_S, so that a paced reader's progress is visible chunk by
        # chunk and no frame holds the socket for long.
        rate = self.encoder.in_rate
        offset = self._engine_samples
        for data in self._encoded(pcm):
            self._service.mailbox.post(self._on_audio, data)
        if words and self.word_timestamps:
            # After the audio they are in: a cancel that drops that audio drops them too.
            timed = tuple(Word(word, round((offset + a) / rate, 4), round((offset + b) / rate, 4))
                          for word, a, b in words)
            self._service.mailbox.post(self._on_words, timed)
        if phonemes and self.phoneme_timestamps:
            spoken = tuple(Phoneme(ph, round((offset + a) / rate, 4), round((offset + b) / rate, 4))
                           for ph, a, b in phonemes)
            self._service.mailbox.post(self._on_phonemes, spoken)

    def finish(self, reason: EndReason) -> None:
        self._service.mailbox.post(self._on_request_finished, self._request, reason)

    def fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        self._service.mailbox.post(self._fail, kind, message, retry_after_s)

    def backlogged(self) -> bool:
        return self._queued_audio_s >= self._limits.max_buffered_audio_s

    def audio_ahead_s(self) -> float:
        # Read on the scheduler thread while the loop writes: a float read is atomic, and a
        # stale value only reorders one step.
        first = self.first_audio_at
        if first is None:
            return NEW_STREAM_AHEAD_S
        return self.audio_s / self.speed - (time.monotonic() - first)

    # ------------------------------------------------------------------ generation (loop)

    @property
    def _busy(self) -> bool:
        """A segment is being prepared or generated."""
        return self._request is not None or self._preparing is not None

    def submit(self, text: str) -> int:
        """Queue a generation request for (the next segment of) this stream; its queue position
        (0 also while the text is first prepared by the engine: normalised, say). Engines that
        do not take phonemes are given the text with its pronunciations respelled, before
        normalisation; the segment keeps the text as sent."""
        engine_text = text
        if self._lexicon is not None and not self._engine.takes_phonemes:
            engine_text = respell(text, self._lexicon)
        if self._engine.prepares_text(self.options):
            self._preparing = asyncio.ensure_future(self._prepare_then_queue(text, engine_text))
            return 0
        return self._queue(text, engine_text, prepared=False)

    async def _prepare_then_queue(self, text: str, engine_text: str) -> None:
        try:
            prepared = await self._service.prepare_text(engine_text, self.options)
            self._preparing = None
            if self._finished:
                return
            # Normalised text can be several times longer (numbers spelled out): cut it again
            # where one generation could not carry it. Those pieces report their normalised text.
            pieces = self._engine.split_text(prepared, {**self.options, "normalize": False}, self._voice_pin)
            if len(pieces) > 1:
                self._continues = True
                self._prepared_pieces.extend(pieces[1:])
                # A flush still waits for the whole of what was sent before it.
                self._flush_marks = deque(mark + len(pieces) - 1 if mark > len(self.segments) else mark
                                          for mark in self._flush_marks)
                self._queue(pieces[0], pieces[0], prepared=True)
            else:
                self._queue(text, prepared, prepared=True)
        except Refused as err:
            self._preparing = None
            self._refused(err)

    def say(self, text: str | list[Part]) -> int:
        """Speak a one-shot text, or the parts of a marked-up one (texts and pauses): queue it
        (cut by the engine where one generation cannot carry it, the pieces one after another,
        continuing); its queue position (0 while a long text is cut, off the loop: tokenising
        thousands of characters would hold up every stream)."""
        parts = [text] if isinstance(text, str) else text
        if not self._engine.cuts_texts:
            return self._say(parts)
        if sum(len(p) for p in parts if isinstance(p, str)) > SPLIT_ON_LOOP_CHARS:
            self._preparing = asyncio.ensure_future(self._split_then_say(parts))
            return 0
        return self._say(self._split(parts))

    def _split(self, parts: list[Part]) -> list[Part]:
        return [piece for part in parts
                for piece in ([part] if isinstance(part, Pause) else
                              self._engine.split_text(part, self.options, self._voice_pin))]

    def after_voice(self, fetch: Any, text: str | list[Part] | None) -> None:
        """The voice is fetched from the store first (`fetch`, awaitable); then the stream says
        `text` (one-shot) or takes its input (streaming); a voice the store lacks fails it."""
        self._preparing = asyncio.ensure_future(self._voice_then_start(fetch, text))

    async def _voice_then_start(self, fetch: Any, text: str | list[Part] | None) -> None:
        try:
            await fetch
            self._voice_pin = self._engine.pin_voice(self.voice)
        except Refused as err:
            self._preparing = None
            self._refused(err)
            return
        self._preparing = None
        if self._finished:
            return
        try:
            if text is not None:
                self.say(text)
            else:
                self._pump()
        except Refused as err:
            self._refused(err)

    def _say(self, pieces: list[Part]) -> int:
        self._continues = len(pieces) > 1
        self._pending.extend(pieces)
        while self._pending and isinstance(self._pending[0], Pause):
            self._silence(self._pending.popleft().seconds)        # a break before any text
        return self.submit(self._pending.popleft())

    async def _split_then_say(self, parts: list[Part]) -> None:
        try:
            pieces: list[Part] = []
            for part in parts:
                pieces += [part] if isinstance(part, Pause) else \
                    await self._service.split_text(part, self.options, self._voice_pin)
            self._preparing = None
            if not self._finished:
                self._say(pieces)
        except Refused as err:
            self._preparing = None
            self._refused(err)

    def _queue(self, text: str, engine_text: str, prepared: bool) -> int:
        request = GenerationRequest(text=engine_text, sink=self, voice=self.voice, voice_pin=self._voice_pin,
                                    options=dict(self.options), owners=self._owners, prepared=prepared,
                                    context=self._context, keep_continuation=self._continues,
                                    instructions=self._instructions if not self.segments else None,
                                    pronunciations=self._lexicon if self._engine.takes_phonemes else None)
        self._engine.check(request)
        position = self.scheduler.submit(request)
        self._request = request
        self._segment_text = text
        self._segment_start_s = self.audio_s
        return position

    def _on_audio(self, data: bytes) -> None:
        if self._finished:
            return
        samples = len(data) // self.encoder.bytes_per_sample
        seconds = samples / self.sample_rate
        now = time.monotonic()
        metrics = self._service.metrics
        if self.first_audio_at is None:
            self.first_audio_at = now
            metrics.first_audio.observe(now - self.started_at)
        else:
            metrics.chunk_gap.observe(now - self._last_audio_at)
        self._last_audio_at = now
        metrics.audio_seconds.inc(seconds)
        self.chunks += 1
        self.audio_s += seconds
        self._queued_audio_s += seconds
        if self._backlog_since is None and self.backlogged():
            self._backlog_since = now
        self._emit(Audio(data, self._seq, samples, seconds))
        self._seq += 1

    def _silence(self, seconds: float) -> None:
        """Exact silence in the stream's audio (a break in marked-up text), here on the loop
        between two segments, when the scheduler thread holds none of this stream's requests."""
        for data in self._encoded(np.zeros(int(round(seconds * self.encoder.in_rate)), dtype=np.float32)):
            self._on_audio(data)

    def _encoded(self, pcm: np.ndarray) -> list[bytes]:
        """Engine audio encoded for the stream, in chunks of at most MAX_CHUNK_S; counted as
        delivered (on whichever thread holds the stream's encoder: the scheduler's, or the
        loop's between two segments)."""
        self._engine_samples += len(pcm)
        step = max(1, int(self.encoder.in_rate * MAX_CHUNK_S))
        pieces = (self.encoder.encode(pcm[start:start + step]) for start in range(0, len(pcm), step))
        return [data for data in pieces if data]

    def _on_words(self, words: tuple[Word, ...]) -> None:
        if not self._finished:
            self._timed_words.extend(words)
            self._emit(Words(words))

    def _on_phonemes(self, phonemes: tuple[Phoneme, ...]) -> None:
        if not self._finished:
            self._emit(Phonemes(phonemes))

    def _on_request_finished(self, request: GenerationRequest | None, reason: EndReason) -> None:
        if self._finished or request is not self._request:
            return
        self._request = None
        if reason == EndReason.CANCELLED:
            self._end(reason)
            return
        segment = {"text": self._segment_text, "start_s": round(self._segment_start_s, 4), "end_s": round(self.audio_s, 4)}
        self.segments.append(segment)
        self._capped |= reason == EndReason.MAX_LEN
        if self._continues:
            self._context = request.continuation
            if self.input_streaming:
                self._emit(Segment(len(self.segments) - 1, **segment))
            self._pump()
        else:
            self._end(reason)

    def _pump(self) -> None:
        """Start the next segment when none is generating; mark flushes; end when all is said."""
        if self._finished:
            return
        while self._flush_marks and self._flush_marks[0] <= len(self.segments):
            self._flush_marks.popleft()
            self._emit(Flushed(round(self.audio_s, 4)))
        if self._busy:
            return
        if self._prepared_pieces:
            piece = self._prepared_pieces.popleft()
            try:
                self._queue(piece, piece, prepared=True)
            except Refused as err:
                self._refused(err)
        elif self._pending:
            while self._pending and isinstance(self._pending[0], Pause):
                self._silence(self._pending.popleft().seconds)
            if not self._pending:
                self._pump()                          # the break was the last part
                return
            try:
                self.submit(self._pending.popleft())
            except Refused as err:
                self._refused(err)
        elif self._input_closed:
            self._end(EndReason.MAX_LEN if self._capped else EndReason.DONE)

    def _arm_delay(self) -> None:
        """Text with no boundary yet is spoken anyway once the input pauses (whole words only)."""
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        if self._segmenter.buffer.strip():
            self._delay_timer = asyncio.get_running_loop().call_later(self._limits.input_pause_s, self._delay_elapsed)

    def _delay_elapsed(self) -> None:
        self._delay_timer = None
        if not self._finished:
            self._pending.extend(self._segmenter.flush_words())
            self._pump()

    # ------------------------------------------------------------------ timers (the service's watchdog)

    def check_timers(self, now: float) -> None:
        limits = self._limits
        if self._finished:
            return
        if self._backlog_since is not None and self.backlogged():
            # A consumer that plays as it reads may read nothing while it plays what it has
            # taken (a paced player reads its socket in bursts): the stall counts from its last
            # take, or from when a real-time player would have run out, whichever is later.
            runs_out_at = self._first_taken_at + self._taken_s if self._first_taken_at is not None else 0.0
            stalled = now - max(self._backlog_since, self._last_taken_at, runs_out_at)
            if stalled > limits.write_stall_timeout_s:
                self._fail(ErrorKind.SLOW_CONSUMER, f"client read no audio for {limits.write_stall_timeout_s:g}s "
                                                    "after the audio it had taken would have played")
                return
        if (not self._input_closed and not self._busy and not self._pending
                and now - self._last_input_at > limits.stream_timeout_s):
            self._fail(ErrorKind.TIMEOUT, f"no input for {limits.stream_timeout_s:g}s and no end of input: "
                                          "the stream is closed")

    # ------------------------------------------------------------------ endings

    def _end(self, reason: EndReason) -> None:
        heard = None
        if reason != EndReason.CANCELLED:
            tail = self.encoder.flush()
            if tail:
                self._on_audio(tail)
        else:
            generated_s = self.audio_s
            self._drop_queued_audio()
            heard = self._heard(generated_s)
        self._stop_producing()
        stats = self.stats()
        if heard is not None:
            stats["heard"] = heard
        self._emit(Ended(reason, stats))
        self._count_usage()
        metrics = self._service.metrics
        metrics.streams.labels(reason.value).inc()
        if reason == EndReason.CANCELLED:
            metrics.cancellations.inc()
        self._log({"reason": reason.value, **stats})

    def _refused(self, err: Refused) -> None:
        self._fail(err.kind, err.message, err.retry_after_s)

    def _fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        if self._finished:
            return
        self._stop_producing()
        stats = self.stats()
        self._emit(Failed(kind, message, stats, retry_after_s))
        self._count_usage()
        self._service.metrics.streams.labels(kind.value).inc()
        self._log({"error": kind.value, "message": message})

    def _stop_producing(self) -> None:
        self._finished = True
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        self._pending.clear()
        self._prepared_pieces.clear()
        if self._feeder is not None and self._feeder is not asyncio.current_task():
            self._feeder.cancel()
        if self._preparing is not None and self._preparing is not asyncio.current_task():
            self._preparing.cancel()
        if self._request is not None and not self._request.cancelled:
            self.scheduler.cancel(self._request)
        self._service.forget(self)

    def _drop_queued_audio(self) -> None:
        """Barge-in: audio not yet taken is never yielded, nor counted; nor are the segment,
        word and flush events behind it, which would say that audio was sent."""
        kept: deque[Event] = deque()
        dropped = False
        for event in self._events:
            if isinstance(event, Audio):
                self.chunks -= 1
                self.audio_s -= event.seconds
                dropped = True
            elif not (dropped and isinstance(event, (Segment, Words, Phonemes, Flushed))):
                kept.append(event)
        self._events = kept
        self._queued_audio_s = 0.0

    def _emit(self, event: Event) -> None:
        self._events.append(event)
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _heard(self, generated_s: float) -> dict[str, Any]:
        """At a cancel: what the consumer took (what a listener heard, if it played it all):
        the segments wholly in it, and the one cut short with the share of its audio taken
        (None while that segment was still being generated: its length was not known) and,
        where word times are given, its words wholly taken."""
        taken = self.audio_s
        spans = [(seg["text"], seg["start_s"], seg["end_s"], True) for seg in self.segments]
        if self._request is not None:
            spans.append((self._segment_text, self._segment_start_s, generated_s, False))
        whole: list[dict[str, Any]] = []
        partial = None
        close = 1e-4                              # segment times are rounded to 0.1 ms
        for text, start, end, finished in spans:
            if finished and end <= taken + close:
                whole.append({"text": text, "start_s": start, "end_s": end})
                continue
            if start < taken - close:
                partial = {"text": text, "start_s": start, "sent_s": round(taken - start, 4),
                           "fraction": round((taken - start) / (end - start), 4) if finished else None}
                if self.word_timestamps:
                    # With true word times: the words of that segment whose audio was all sent.
                    partial["words"] = [w.word for w in self._timed_words
                                        if w.start_s >= start - close and w.end_s <= taken + close]
            break
        return {"audio_s": round(taken, 4), "text": " ".join(seg["text"] for seg in whole), "segments": whole,
                "partial": partial}

    def stats(self) -> dict[str, Any]:
        ttfa = None if self.first_audio_at is None else round((self.first_audio_at - self.started_at) * 1000, 1)
        wall = time.monotonic() - self.started_at
        return {
            "chunks": self.chunks,
            "audio_s": round(max(self.audio_s, 0.0), 4),
            "ttfa_ms": ttfa,
            "rtf": round(wall / self.audio_s, 4) if self.audio_s > 0 else None,
            "segments": list(self.segments),
            "usage": self.usage(),
        }

    def _count_usage(self) -> None:
        # Per owner (the broadest: its token or address), hashed: a token never reaches /metrics.
        owner = owner_key(self._owners[0]) if self._owners else "none"
        self._service.metrics.count_usage(owner, self.characters, max(self.audio_s, 0.0))

    def usage(self) -> dict[str, Any]:
        """What the stream used: characters of text taken in, and the audio sent (what the
        consumer took: after a cancel, not what was dropped)."""
        return {"characters": self.characters, "audio_s": round(max(self.audio_s, 0.0), 4), "chunks": self.chunks}

    def _log(self, outcome: dict[str, Any]) -> None:
        """One structured line per stream, for log pipelines."""
        outcome = {k: v for k, v in outcome.items() if k not in ("segments", "usage")}
        record = {"event": "stream", "id": self.number, **self._log_fields, "engine": self._engine.name,
                  "voice": self.voice, "format": self.format, "input": self.input_streaming,
                  "sample_rate": self.sample_rate, "segments": len(self.segments),
                  "text_chars": self.characters, **outcome}
        stream_log.info(json.dumps(record, separators=(",", ":")))
