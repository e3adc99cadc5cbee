"""The engine thread's side of a stream: one sink per generation request.

The engine loop's thread calls a `SegmentSink` (the engine's `RequestSink`); it produces the
request's audio through the stream's output stage (resampling and packing stay off the event
loop) and posts `(sink, event)` to the loop through the service's mailbox: the sink stands for
its request (one each), and holds no reference to it (the request holds the sink; a reference
back would make a cycle for the garbage collector per segment). It reads no state of the
stream but the pacing's two figures the slot queue asks for; the stream's generation, on the
loop, drops what a sink of a request it no longer waits for posts.

    engine loop's thread                                     event loop
    deliver(pcm, words, phonemes) -> produce -> post ──▶  Generation._on_request_event(sink, event)
    finish(reason) / fail(kind, ...)          -> post ──▶

Where the stream's words come from the aligner (`SegmentAlignment`), the sink also keeps the
segment's audio, and at its end hands it to the aligner's processes; their words are posted
(`Aligned`) after the segment's end, whenever they are done:

    finish(DONE) -> post RequestEnded ───────────────────────────────────────────────────▶
                 -> aligner.align(audio)
    an aligner process's answer -> post Aligned(words, or None where it failed) ─────────▶
                                          drop_alignment() ◀── the stream no longer waits (its end,
                                          a cancel, its client gone): a segment still queued is not aligned

A segment the aligner has no room for (`AlignerBusy`: its queue is full) gets its words
estimated at once, every one `estimated`, as the aligner gives a word it could not place.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Union

import numpy as np

from ..alignment.pool import AlignerBusy, SegmentRecording, TimedWord, WordAligner, estimated_segment
from ..engine import EndReason, ErrorKind
from ..engine_process.messages import ReaderState
from .events import Phoneme, Phonemes, Produced, Word, Words
from .output import OutputStage
from .pacing import Pacing

log = logging.getLogger("vox_ws.service")


@dataclass(frozen=True, slots=True)
class RequestEnded:
    reason: EndReason


@dataclass(frozen=True, slots=True)
class RequestFailed:
    kind: ErrorKind
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True, slots=True)
class Aligned:
    """A segment's words from the aligner, in the stream's timeline; None where it failed (the
    stream goes on without them)."""

    words: tuple[Word, ...] | None


RequestEvent = Union[Produced, Words, Phonemes, RequestEnded, RequestFailed, Aligned]
"""What a request's sink posts to its stream."""

Post = Callable[["SegmentSink", RequestEvent], None]


@dataclass(frozen=True)
class SegmentAlignment:
    """A segment whose words the aligner times: its text as the client wrote it, and as the
    engine was given it (respelled, normalised), and the stream's language (None: the aligner
    tells from the text whether it is English, which alone it aligns)."""

    aligner: WordAligner
    written: str
    spoken: str
    language: str | None = None
    owner: str = ""                   # the stream's: the aligner's queue is shared by owners


class SegmentSink:
    def __init__(self, post: Post, output: OutputStage, pacing: Pacing, word_timestamps: bool,
                 phoneme_timestamps: bool, alignment: SegmentAlignment | None = None) -> None:
        self._post = post
        self._output = output
        self._pacing = pacing
        self._words = word_timestamps and alignment is None
        self._phonemes = phoneme_timestamps
        self._failed = False
        self._alignment = alignment
        self._recording = SegmentRecording(output.engine_rate) if alignment is not None else None
        self._first_sample: int | None = None    # where the segment starts in the stream's audio
        self._aligned_audio = None                # what was handed to the aligner (16 kHz), kept to estimate
        self.aligning = False                    # its words are with the aligner (set before RequestEnded)
        # Set on the loop, read on the engine's thread: the stream no longer waits for the words.
        self._dropped = False
        self._aligned_future: Future | None = None

    def deliver(self, pcm: np.ndarray, words: list[tuple[str, int, int]] | None = None,
                phonemes: list[tuple[str, int, int]] | None = None) -> None:
        if self._failed:
            return
        if not np.isfinite(pcm).all():
            # Never sent as audio (a player would play it as a burst, a codec fail on it): the
            # stream fails, and what the engine yields for it until it is cancelled is dropped.
            self._failed = True
            self.fail(ErrorKind.INTERNAL, "the model produced audio that is not finite (NaN or infinity); "
                                          "nothing of it was sent")
            return
        output = self._output
        rate, offset = output.engine_rate, output.engine_samples
        if self._recording is not None:
            if self._first_sample is None:
                self._first_sample = offset
            self._recording.add(pcm)
        for chunk in output.produce(pcm):
            self._post(self, chunk)
        # After the audio they are in: a cancel that drops that audio drops them too.
        if words and self._words:
            self._post(self, Words(tuple(Word(w, _at(offset + a, rate), _at(offset + b, rate))
                                            for w, a, b in words)))
        if phonemes and self._phonemes:
            self._post(self, Phonemes(tuple(Phoneme(p, _at(offset + a, rate), _at(offset + b, rate))
                                               for p, a, b in phonemes)))

    def finish(self, reason: EndReason) -> None:
        # The end first, the words (or their loss) after it, however soon the aligner answers.
        self.aligning = reason != EndReason.CANCELLED and self._first_sample is not None and not self._failed
        if self.aligning:
            assert self._recording is not None
            # Taken before the end is posted: the loop may estimate the words from it from then on.
            self._aligned_audio = self._recording.take()
        self._post(self, RequestEnded(reason))
        if self.aligning:
            self._align()

    def fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        self._post(self, RequestFailed(kind, message, retry_after_s))

    def backlogged(self) -> bool:
        return self._pacing.backlogged

    def reader_state(self) -> ReaderState:
        """The stream's reader as its request goes to the engine, which answers the two
        questions above itself from then on (the first told again when it changes)."""
        pacing = self._pacing
        return ReaderState(pacing.backlogged, pacing.produced_s, pacing.first_produced_at, pacing.speed)

    def audio_ahead_s(self) -> float:
        return self._pacing.audio_ahead_s()

    # ------------------------------------------------------------------ the aligner's words

    def drop_alignment(self) -> None:
        """On the loop: the stream no longer waits for this segment's words. Still queued, the
        segment leaves the aligner's queue unaligned; being aligned, its answer is let be."""
        self._dropped = True
        future = self._aligned_future
        if future is not None:
            future.cancel()

    def estimated_words(self) -> tuple[Word, ...]:
        """On the loop, once the segment has ended: its words each given a share of its audio by
        length, all `estimated` (what is sent in place of the aligner's overdue answer)."""
        assert self._alignment is not None and self._aligned_audio is not None
        return self._timed(estimated_segment(self._aligned_audio, self._alignment.written))

    def _timed(self, timed: list[TimedWord]) -> tuple[Word, ...]:
        """The segment's timed words in the stream's time."""
        assert self._first_sample is not None
        start = self._first_sample / self._output.engine_rate
        return tuple(Word(word, round(start + a, 4), round(start + b, 4), estimated)
                     for word, a, b, estimated in timed)

    def _align(self) -> None:
        alignment, audio = self._alignment, self._aligned_audio
        assert alignment is not None and audio is not None
        if self._dropped:
            return
        future: Future
        try:
            future = alignment.aligner.align(audio, alignment.written, alignment.spoken, alignment.language,
                                             alignment.owner)
        except AlignerBusy:
            future = Future()
            future.set_result(estimated_segment(audio, alignment.written))
        except Exception as exc:
            future = Future()
            future.set_exception(exc)
        # Set before `_dropped` is read again, as the loop sets that before it reads this: one of
        # the two sees the other, and the future is cancelled whichever came first.
        self._aligned_future = future
        if self._dropped:
            future.cancel()
        future.add_done_callback(self._aligned)

    def _aligned(self, future: Future) -> None:
        """On the pool's thread: the words, or their loss, to the stream."""
        if future.cancelled():                # dropped: no one waits for them
            return
        try:
            timed = future.result()
        except AlignerBusy:                   # pushed out of the queue by another owner's segment
            self._post(self, Aligned(self.estimated_words()))
            return
        except BaseException as exc:          # the aligner failed, or was closed: words lost, never audio
            log.warning("aligning a segment failed (%s: %s): its words are not sent", type(exc).__name__, exc)
            words = None
        else:
            words = self._timed(timed)
        self._post(self, Aligned(words))


def _at(sample: int, rate: int) -> float:
    return round(sample / rate, 4)
