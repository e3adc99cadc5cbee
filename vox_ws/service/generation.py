"""A stream's production on the event loop: its text's way in and its audio's way out of the
scheduler, up to the pacing queue. The service's side of a stream (`start`, `feed`,
`check_timers`, `abort`), and what the consumer's handle (`stream.py`) asks of it.

    text in -> TextPlan (what next) -> _advance (the one path that starts generation)
            -> prepared / cut off the loop where needed -> _queue: a GenerationRequest and its
               SegmentSink -> scheduler
    each request's sink posts (sink, event) -> _on_request_event -> Pacing (audio, timings, segments)
    the last event (Ended, Failed) -> Pacing, closed; usage, metrics and one log line

Its state: OPENING (its voice is fetched or its text cut: nothing queued yet) -> SPEAKING
(generating, or waiting for input) -> DRAINING (its last event is queued: nothing more is
produced). The consumer's handle adds how the consumer ended (`StreamState`).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import json
import logging
import time
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Awaitable, Iterable, Protocol

from ..config import Limits
from ..engine import EndReason, ErrorKind, GenerationRequest, Refused
from ..lexicon import respell
from ..metrics import Metrics
from .events import Ended, Failed, Flushed, Phonemes, Produced, Segment, Word, Words
from .handoff import LoopMailbox
from .markup import Part
from .output import OutputStage, figures
from .pacing import Pacing
from .request import StreamRequest, StreamSetup
from .sink import RequestEnded, RequestEvent, SegmentSink
from .text_plan import Pause, Speak, TextPlan
from .validation import check_text

stream_log = logging.getLogger("vox_ws.stream")

# A one-shot text longer than this is cut into pieces (`Engine.text.split`) off the loop.
SPLIT_ON_LOOP_CHARS = 300


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


class StreamHost(Protocol):
    """What a stream needs from the service that opened it."""

    limits: Limits
    metrics: Metrics
    mailbox: LoopMailbox
    encoding: Executor          # where output pipelines (codecs, tempo) run

    def forget(self, generation: "Generation") -> None:
        """The stream has stopped producing."""

    async def prepare_text(self, text: str, options: dict[str, Any], language: str | None = None) -> str:
        """The engine's `text.prepare`, off the loop and off the scheduler thread."""

    async def split_text(self, text: str, options: dict[str, Any], voice_pin: Any,
                         language: str | None = None) -> list[str]:
        """The engine's `text.split`, off the loop."""


def _only(languages: tuple[str, ...]) -> str | None:
    """The language of a voice that speaks one (Piper's); None for one that speaks many (VoxCPM2
    reads the language from the text)."""
    return languages[0] if len(languages) == 1 else None


class Generation:
    """Made by a `Stream` (which the service opens); see the module docstring."""

    def __init__(self, service: StreamHost, request: StreamRequest, setup: StreamSetup, output: OutputStage,
                 pacing: Pacing) -> None:
        self._service = service
        self.scheduler = setup.scheduler          # its device's: every request of it goes there
        self._engine = setup.scheduler.engine
        self.number = setup.number
        self.voice = request.voice
        self._voice_pin = setup.voice_pin
        self._lora_pin = setup.lora_pin          # its adapter, held until it stops producing
        self._owners = setup.owners
        self.options = dict(request.options)
        self.input_streaming = request.input_streaming
        self.word_timestamps = request.word_timestamps
        self.phoneme_timestamps = request.phoneme_timestamps
        self._lexicon = setup.lexicon if setup.lexicon is not None and len(setup.lexicon) else None
        self._instructions = request.instructions  # for the first segment (the others continue it)
        self.language = request.language
        # Of text taken in (usage): a one-shot text's, or what was sent since.
        self.characters = len(request.one_shot_text or "")
        self._log_fields = dict(setup.log_fields)
        self._limits = service.limits
        self._written_chars = 0               # of the segments so far, as sent
        self._pronounced_chars = 0            # ... and with their pronunciations put in
        self._output = output
        self._pacing = pacing
        self.plan = TextPlan(self.input_streaming, service.limits.max_text_chars,
                             self.language or _only(self._engine.voices.languages(self.voice)))
        self.state = StreamState.OPENING
        self.cancelled = False
        self.started_at = time.monotonic()
        self._last_audio_at = 0.0
        self._request: GenerationRequest | None = None    # of the segment being generated
        self._context: Any = None                # the previous segment's continuation
        self._timed_words: list[Word] = []       # every word time produced (for `heard`)
        self._work: asyncio.Future | None = None  # the voice, a cut or a preparation, off the loop
        self._feeder: asyncio.Task | None = None
        self._delay_timer: asyncio.TimerHandle | None = None
        self._last_input_at = time.monotonic()

    @property
    def done(self) -> bool:
        """Nothing more is produced."""
        return self.state is StreamState.DRAINING

    # ------------------------------------------------------------------ the service's side

    def start(self, text: str | list[Part] | None, fetch: Awaitable[None] | None = None) -> int:
        """Begin: say `text` (one-shot, or the parts of a marked-up one: texts and pauses), or,
        with None, take input (`send_text`); with `fetch`, the voice comes from the store first
        (a voice it lacks fails the stream). A text too long for one generation is cut by the
        engine, the pieces continuing one another; off the loop when long (tokenising thousands
        of characters would hold up every stream). Returns the queue position (0 also while
        anything is still done off the loop)."""
        parts = None if text is None else [text] if isinstance(text, str) else text
        if fetch is None and (parts is None or not self._cuts_off_loop(parts)):
            # Said at once: a refusal of its first segment (a full queue, say) is the caller's.
            if parts is not None:
                self.plan.say(self._cut_on_loop(parts))
            self.state = StreamState.SPEAKING
            return self._advance(refuse=True)
        self._work = asyncio.ensure_future(self._open(parts, fetch))
        return 0

    async def _open(self, parts: list[Part] | None, fetch: Awaitable[None] | None) -> None:
        try:
            if fetch is not None:
                await fetch
                self._voice_pin = self._engine.voices.pin(self.voice)
            if parts is not None:
                parts = await self._cut(parts)
        except Refused as err:
            self._work = None
            self._refused(err)
            return
        self._work = None
        if self.done:
            return
        if parts is not None:
            self.plan.say(parts)
        self.state = StreamState.SPEAKING
        self._advance()

    def feed(self, text: AsyncIterator[str]) -> None:
        """Read the input from an async iterator of text pieces, then end it."""
        async def run() -> None:
            try:
                async for piece in text:
                    if self.done:
                        return
                    self.send_text(piece)
                if not self.done:
                    self.end_input()
            except Refused as err:
                self._refused(err)
            except Exception as exc:  # noqa: BLE001 - the caller's iterator broke: end the stream, say why
                self._fail(ErrorKind.INTERNAL, f"the text input failed: {type(exc).__name__}: {exc}")
        self._feeder = asyncio.ensure_future(run())

    def check_timers(self, now: float) -> None:
        """The service's watchdog: a consumer that stopped reading, input that stopped coming."""
        if self.done:
            return
        limits = self._limits
        if self._pacing.stalled_s(now) > limits.write_stall_timeout_s:
            self._fail(ErrorKind.SLOW_CONSUMER, f"client read no audio for {limits.write_stall_timeout_s:g}s "
                                                "after the audio it had taken would have played")
            return
        if (self.state is StreamState.SPEAKING and self.plan.idle
                and now - self._last_input_at > limits.stream_timeout_s):
            self._fail(ErrorKind.TIMEOUT, f"no input for {limits.stream_timeout_s:g}s and no end of input: "
                                          "the stream is closed")

    def abort(self, kind: ErrorKind, message: str) -> None:
        """End the stream with an error from outside it (the server's drain time ran out)."""
        self._fail(kind, message)

    # ------------------------------------------------------------------ the consumer's verbs

    def send_text(self, text: str) -> None:
        """Append text to a stream opened for text input."""
        self._check_input()
        check_text(text)
        self.plan.push(text)
        self._last_input_at = time.monotonic()
        self.characters += len(text)
        self._arm_delay()
        self._advance()

    def flush(self) -> None:
        """Speak what is buffered now; a `Flushed` event follows once its audio is yielded."""
        self._check_input()
        self._last_input_at = time.monotonic()
        self.plan.flush()
        self._advance()

    def end_input(self) -> None:
        """No more text: the rest is spoken, then the stream ends."""
        self._check_input()
        self._last_input_at = time.monotonic()
        self.plan.end_input()
        self._advance()

    def cancel(self) -> None:
        """Barge-in: audio not yet taken is dropped, the stream ends with `Ended(CANCELLED)`."""
        if not self.done:
            self._end(EndReason.CANCELLED)

    def stop(self) -> None:
        """The consumer is gone: stop at once, log nothing."""
        if not self.done:
            self._stop_producing()

    def _check_input(self) -> None:
        if not self.input_streaming:
            raise Refused(ErrorKind.INVALID, "this stream was not opened for text input")
        if self.plan.input_closed:
            raise Refused(ErrorKind.INVALID, "the input of this stream has already ended")

    # ------------------------------------------------------------------ generation (loop)

    def _advance(self, refuse: bool = False) -> int:
        """The one path that starts generation: mark the flushes whose text is spoken, then, with
        no segment in flight, say what the plan has next (a pause is silence at once), or end
        once all is said. Returns the queue position of a segment it queued (else 0). A segment
        refused fails the stream, or with `refuse` raises Refused."""
        if self.state is not StreamState.SPEAKING:
            return 0
        for _ in range(self.plan.due_flushes()):
            self._pacing.put(Flushed(round(self._pacing.produced_s, 4)))
        while not self.plan.in_flight:
            step = self.plan.next()
            if step is None:
                if self.plan.done:
                    self._end(self.plan.end_reason)
                return 0
            if isinstance(step, Pause):
                self._produced(self._output.silence(step.seconds))
                continue
            try:
                return self._speak(step)
            except Refused as err:
                if refuse:
                    raise
                self._refused(err)
                return 0
        return 0

    def _speak(self, step: Speak) -> int:
        """Queue a segment. Engines that do not take phonemes are given the text with its
        pronunciations respelled, before normalisation; the segment keeps the text as sent. A
        text with pronunciations to find, or one the engine prepares (normalises), is worked on
        off the loop first (a lexicon of 20,000 phrases over a 5,000-character text is some
        35 ms of matching)."""
        if step.prepared:
            return self._queue(step.text, step.text, prepared=True)
        if self._lexicon is not None or self._engine.text.needs_preparing(self.options, self.language):
            self._work = asyncio.ensure_future(self._prepare_then_queue(step.text))
            return 0
        return self._queue(step.text, step.text, prepared=False)

    async def _respelled(self, text: str) -> str:
        """The text the engine is given, its pronunciations put in (off the loop). IPA entries
        are only taken by engines that take phonemes, which are given the text as sent: one
        respelling serves the bound (IPA counted where it applies) and, for the other engines,
        is the text they are given."""
        if self._lexicon is None:
            return text
        takes_phonemes = self._engine.takes_phonemes
        said = await self._service.off_loop(respell, text, self._lexicon, takes_phonemes)
        self._check_pronounced(len(text), len(said))
        return text if takes_phonemes else said

    def _check_pronounced(self, written: int, said: int) -> None:
        """What `max_text_chars` bounds is the text as it will be said, pronunciations put in
        (an entry may say a one-letter word as 100 characters): a one-shot text in all; a
        streamed one, whose length has no bound, may grow by at most that much over its life."""
        self._written_chars += written
        self._pronounced_chars += said
        limit = self._limits.max_text_chars
        if not self.input_streaming and self._pronounced_chars > limit:
            raise Refused(ErrorKind.TOO_LARGE, f"with its pronunciations the text is {self._pronounced_chars} "
                                               f"characters, over max_text_chars={limit}", field="pronunciations")
        if self._pronounced_chars - self._written_chars > limit:
            raise Refused(ErrorKind.TOO_LARGE, "its pronunciations have made the streamed text "
                                               f"{self._pronounced_chars - self._written_chars} characters longer, "
                                               f"over max_text_chars={limit}", field="pronunciations")

    async def _prepare_then_queue(self, text: str) -> None:
        try:
            engine_text = await self._respelled(text)
            if self.done:
                self._work = None
                return
            if not self._engine.text.needs_preparing(self.options, self.language):
                self._work = None
                self._queue(text, engine_text, prepared=False)
                return
            prepared = await self._service.prepare_text(engine_text, self.options, self.language)
            self._work = None
            if self.done:
                return
            # Normalised text can be several times longer (numbers spelled out): cut it again
            # where one generation could not carry it. Those pieces report their normalised text.
            pieces = self._engine.text.split(prepared, {**self.options, "normalize": False}, self._voice_pin,
                                             self.language)
            if len(pieces) > 1:
                first = self.plan.cut(pieces)
                self._queue(first, first, prepared=True)
            else:
                self._queue(text, prepared, prepared=True)
        except Refused as err:
            self._work = None
            self._refused(err)

    def _queue(self, text: str, engine_text: str, prepared: bool) -> int:
        sink = SegmentSink(functools.partial(self._service.mailbox.post, self._on_request_event), self._output,
                           self._pacing, self.word_timestamps, self.phoneme_timestamps)
        request = GenerationRequest(text=engine_text, sink=sink, voice=self.voice, voice_pin=self._voice_pin,
                                    lora_pin=self._lora_pin, options=dict(self.options), owners=self._owners,
                                    prepared=prepared,
                                    context=self._context, keep_continuation=self.plan.continues,
                                    instructions=self._instructions if not self.plan.segments else None,
                                    language=self.language,
                                    pronunciations=self._lexicon if self._engine.takes_phonemes else None)
        self._engine.check(request)
        position = self.scheduler.submit(request)
        self._request = request
        self.plan.started(text, self._pacing.produced_s)
        return position

    def _cuts_off_loop(self, parts: list[Part]) -> bool:
        return self._engine.cuts_texts and sum(len(p) for p in parts if isinstance(p, str)) > SPLIT_ON_LOOP_CHARS

    def _cut_on_loop(self, parts: list[Part]) -> list[Part]:
        if not self._engine.cuts_texts:
            return parts
        return [piece for part in parts
                for piece in ([part] if isinstance(part, Pause) else
                              self._engine.text.split(part, self.options, self._voice_pin, self.language))]

    async def _cut(self, parts: list[Part]) -> list[Part]:
        if not self._cuts_off_loop(parts):
            return self._cut_on_loop(parts)
        pieces: list[Part] = []
        for part in parts:
            pieces += [part] if isinstance(part, Pause) else \
                await self._service.split_text(part, self.options, self._voice_pin, self.language)
        return pieces

    def _arm_delay(self) -> None:
        """Text with no boundary yet is spoken anyway once the input pauses (whole words only)."""
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        if self.plan.has_partial:
            self._delay_timer = asyncio.get_running_loop().call_later(self._limits.input_pause_s, self._delay_elapsed)

    def _delay_elapsed(self) -> None:
        self._delay_timer = None
        if not self.done:
            self.plan.pause_elapsed()
            self._advance()

    # ------------------------------------------------------------------ what a request's sink posts (loop)

    def _on_request_event(self, sink: SegmentSink, event: RequestEvent) -> None:
        request = self._request
        if request is None or sink is not request.sink or self.done:
            return                                 # a request this stream no longer waits for
        if isinstance(event, Produced):
            self._produced((event,))
        elif isinstance(event, Words):
            self._timed_words.extend(event.words)
            self._pacing.put(event)
        elif isinstance(event, Phonemes):
            self._pacing.put(event)
        elif isinstance(event, RequestEnded):
            self._segment_done(request, event.reason)
        else:
            self._fail(event.kind, event.message, event.retry_after_s)

    def _segment_done(self, request: GenerationRequest, reason: EndReason) -> None:
        self._request = None
        if reason == EndReason.CANCELLED:
            self._end(reason)
            return
        segment = self.plan.spoke(self._pacing.produced_s, reason)
        if self.plan.continues:
            self._context = request.continuation
        self._pacing.put(Segment(len(self.plan.segments) - 1, **segment))
        self._advance()

    def _produced(self, chunks: Iterable[Produced]) -> None:
        metrics = self._service.metrics
        for chunk in chunks:
            now = time.monotonic()
            if self._pacing.first_produced_at is None:       # the pacing keeps that time
                metrics.first_audio.observe(now - self.started_at)
            else:
                metrics.chunk_gap.observe(now - self._last_audio_at)
            self._last_audio_at = now
            metrics.audio_seconds.inc(chunk.seconds)
            self._pacing.put(chunk, now)

    # ------------------------------------------------------------------ endings

    def _end(self, reason: EndReason) -> None:
        heard = None
        if reason != EndReason.CANCELLED:
            self._produced(self._output.tail())
        else:
            self.cancelled = True
            generated_s = self._pacing.produced_s
            self._pacing.drop_unsent()
            heard = self.plan.heard(self._pacing.produced_s, generated_s,
                                     self._timed_words if self.word_timestamps else None)
        self._stop_producing()
        stats = self._stats()
        if heard is not None:
            stats["heard"] = heard
        self._last(Ended(reason, stats))
        metrics = self._service.metrics
        metrics.streams.labels(reason.value).inc()
        if reason == EndReason.CANCELLED:
            metrics.cancellations.inc()
        self._log({"reason": reason.value, **self._produced_figures(), **({"heard": heard} if heard else {})})

    def _refused(self, err: Refused) -> None:
        self._fail(err.kind, err.message, err.retry_after_s)

    def _fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        if self.done:
            return
        self._stop_producing()
        self._last(Failed(kind, message, self._stats(), retry_after_s))
        self._service.metrics.streams.labels(kind.value).inc()
        self._log({"error": kind.value, "message": message})

    def _stop_producing(self) -> None:
        self.state = StreamState.DRAINING
        if self._delay_timer is not None:
            self._delay_timer.cancel()
        self.plan.stop()
        for task in (self._feeder, self._work):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        if self._request is not None and not self._request.cancelled:
            self.scheduler.cancel(self._request)
        self.release_lora()
        self._service.forget(self)

    def end_if_unloading(self, name: str) -> None:
        """The unload of adapter `name` has had its time: a stream still speaking with it ends."""
        if self._lora_pin is not None and self._engine.loras.unloading(self._lora_pin, name):
            self._fail(ErrorKind.INVALID, f"LoRA adapter {name!r} was unloaded: its streams had "
                                          f"{self._limits.lora_unload_timeout_s:g} s to finish")

    def release_lora(self) -> None:
        """Let go of the stream's adapter (the engine frees its slot once no request uses it)."""
        pin, self._lora_pin = self._lora_pin, None
        if pin is not None:
            self._engine.loras.unpin(pin)

    def _last(self, event: Ended | Failed) -> None:
        """The stream's last event: usage is counted, the consumer stops after it."""
        # Per owner (the broadest: its token or address), labelled by a keyed hash (`owner_label`).
        owner = self._owners[0] if self._owners else "none"
        self._service.metrics.count_usage(owner, self.characters, max(self._pacing.produced_s, 0.0))
        self._pacing.put(event)
        self._pacing.close()

    def _stats(self) -> dict[str, Any]:
        """What the stream knows of its figures in its own audio's time; the output stage adds
        what was handed over (chunks, audio_s, ttfa_ms, rtf) when it hands the last event."""
        return {"segments": list(self.plan.segments), "usage": {"characters": self.characters}}

    def _produced_figures(self) -> dict[str, Any]:
        pacing = self._pacing
        return figures(pacing.produced_chunks, pacing.produced_s, pacing.first_produced_at, self.started_at)

    def _log(self, outcome: dict[str, Any]) -> None:
        """One structured line per stream, for log pipelines."""
        record = {"event": "stream", "id": self.number, **self._log_fields, "engine": self._engine.name,
                  "voice": self.voice, "format": self._output.format, "input": self.input_streaming,
                  "sample_rate": self._output.rate, "segments": len(self.plan.segments),
                  "language": self.language, "text_chars": self.characters, **outcome}
        stream_log.info(json.dumps(record, separators=(",", ":")), extra={"fields": record})
