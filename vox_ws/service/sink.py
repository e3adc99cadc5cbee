"""The engine thread's side of a stream: one sink per generation request.

The scheduler thread calls a `SegmentSink` (the engine's `RequestSink`); it produces the
request's audio through the stream's output stage (resampling and packing stay off the event
loop) and posts `(sink, event)` to the loop through the service's mailbox: the sink stands for
its request (one each), and holds no reference to it (the request holds the sink; a reference
back would make a cycle for the garbage collector per segment). It reads no state of the
stream but the pacing's two figures the scheduler asks for; the stream's generation, on the
loop, drops what a sink of a request it no longer waits for posts.

    scheduler thread                                     event loop
    deliver(pcm, words, phonemes) -> produce -> post ──▶  Generation._on_request_event(sink, event)
    finish(reason) / fail(kind, ...)          -> post ──▶
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Union

import numpy as np

from ..engine import EndReason, ErrorKind
from .events import Phoneme, Phonemes, Produced, Word, Words
from .output import OutputStage
from .pacing import Pacing


@dataclass(frozen=True, slots=True)
class RequestEnded:
    reason: EndReason


@dataclass(frozen=True, slots=True)
class RequestFailed:
    kind: ErrorKind
    message: str
    retry_after_s: float | None = None


RequestEvent = Union[Produced, Words, Phonemes, RequestEnded, RequestFailed]
"""What a request's sink posts to its stream."""

Post = Callable[["SegmentSink", RequestEvent], None]


class SegmentSink:
    def __init__(self, post: Post, output: OutputStage, pacing: Pacing, word_timestamps: bool,
                 phoneme_timestamps: bool) -> None:
        self._post = post
        self._output = output
        self._pacing = pacing
        self._words = word_timestamps
        self._phonemes = phoneme_timestamps
        self._failed = False

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
        self._post(self, RequestEnded(reason))

    def fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        self._post(self, RequestFailed(kind, message, retry_after_s))

    def backlogged(self) -> bool:
        return self._pacing.backlogged

    def audio_ahead_s(self) -> float:
        return self._pacing.audio_ahead_s()


def _at(sample: int, rate: int) -> float:
    return round(sample / rate, 4)
