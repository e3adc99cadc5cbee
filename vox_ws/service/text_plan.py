"""The plan of a stream's text: what is still to be said, in which pieces, and what was said.

Pure and asyncio-free (one owner: the stream, on the event loop). The stream tells it what came
in (`push`, `flush`, `end_input`, `say`) and what happened (`started`, `cut`, `spoke`), and asks it
what to do next (`due_flushes`, `next`, `done`). It knows no engine and no clock: audio times
are given to it in seconds of the stream's audio.

    pending parts (texts, pauses) -> next() -> Speak / Pause -> started -> spoke -> segments
              ^ segmenter (input streaming)     | cut(pieces): a prepared text cut again
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

from ..engine import EndReason, ErrorKind, Refused
from ..text import StreamSegmenter
from .markup import Part, Pause

__all__ = ["Pause", "Speak", "TextPlan"]

# Segment times are rounded to 0.1 ms: spans closer than this are the same instant.
CLOSE_S = 1e-4


@dataclass(frozen=True, slots=True)
class Speak:
    """The next segment to generate: its text, and whether the engine prepared it already (a
    piece of a normalised text cut again: what it reports is the normalised text)."""

    text: str
    prepared: bool = False


class TextPlan:
    def __init__(self, input_streaming: bool, max_text_chars: int, language: str | None = None) -> None:
        self.input_streaming = input_streaming
        self._max_text_chars = max_text_chars
        self._segmenter = StreamSegmenter(language=language)
        self._pending: deque[Part] = deque()         # texts to say next and, marked up, pauses
        self._prepared: deque[str] = deque()         # a normalised text cut again, next in line
        self._flush_marks: deque[int] = deque()      # segments that must be spoken for each flush
        self.segments: list[dict[str, Any]] = []     # spoken: {"text", "start_s", "end_s"}
        self.input_closed = not input_streaming
        # Segments continue from one another: input streaming, or a text cut into pieces.
        self.continues = input_streaming
        self.capped = False                          # a segment hit its length cap
        self.in_flight = False                       # a segment is being prepared or generated
        self._current: tuple[str, float] | None = None   # its reported text and start, once queued

    # ------------------------------------------------------------------ what comes in

    def push(self, text: str) -> None:
        """More streamed input; Refused (TOO_LARGE) when more than max_text_chars would wait."""
        waiting = len(self._segmenter.buffer) + sum(len(p) for p in self._pending if isinstance(p, str))
        if waiting + len(text) > self._max_text_chars:
            raise Refused(ErrorKind.TOO_LARGE, f"more than max_text_chars={self._max_text_chars} "
                                               "characters waiting to be spoken", field="text")
        self._pending.extend(self._segmenter.push(text))

    @property
    def has_partial(self) -> bool:
        """Input with no boundary yet is buffered (spoken once the input pauses)."""
        return bool(self._segmenter.buffer.strip())

    def pause_elapsed(self) -> None:
        """The input paused: its whole words so far are spoken."""
        self._pending.extend(self._segmenter.flush_words())

    def flush(self) -> None:
        """Speak all that is buffered; `due_flushes` counts this one once its audio is spoken."""
        self._pending.extend(self._segmenter.flush_all())
        self._flush_marks.append(len(self.segments) + len(self._pending) + int(self.in_flight))

    def end_input(self) -> None:
        self._pending.extend(self._segmenter.flush_all())
        self.input_closed = True

    def say(self, pieces: list[Part]) -> None:
        """A one-shot text in the pieces one generation carries (and pauses); several continue."""
        self.continues = self.continues or sum(isinstance(p, str) for p in pieces) > 1
        self._pending.extend(pieces)

    # ------------------------------------------------------------------ what next

    def due_flushes(self) -> int:
        """Flushes whose text has all been spoken since last asked."""
        due = 0
        while self._flush_marks and self._flush_marks[0] <= len(self.segments):
            self._flush_marks.popleft()
            due += 1
        return due

    def next(self) -> Speak | Pause | None:
        """The next thing to say when nothing is in flight; None: wait for input (or `done`)."""
        assert not self.in_flight, "one segment at a time"
        if self._prepared:
            self.in_flight = True
            return Speak(self._prepared.popleft(), prepared=True)
        if self._pending:
            part = self._pending.popleft()
            if isinstance(part, Pause):
                return part
            self.in_flight = True
            return Speak(part)
        return None

    @property
    def done(self) -> bool:
        """All is said and no more will come."""
        return self.input_closed and not self.in_flight and not self._pending and not self._prepared

    @property
    def idle(self) -> bool:
        """Waiting on input with nothing to say (the input time-out runs)."""
        return not self.input_closed and not self.in_flight and not self._pending

    @property
    def end_reason(self) -> EndReason:
        return EndReason.MAX_LEN if self.capped else EndReason.DONE

    # ------------------------------------------------------------------ what happened

    def cut(self, pieces: list[str]) -> str:
        """The segment in flight, prepared, is too long for one generation: it goes as `pieces`
        (the first now, the rest next in line) and a flush still waits for all of them."""
        if len(pieces) > 1:
            self.continues = True
            self._prepared.extend(pieces[1:])
            self._flush_marks = deque(mark + len(pieces) - 1 if mark > len(self.segments) else mark
                                      for mark in self._flush_marks)
        return pieces[0]

    def started(self, text: str, start_s: float) -> None:
        """The segment in flight is queued, reporting `text`, its audio from `start_s`."""
        self._current = (text, start_s)

    def spoke(self, end_s: float, reason: EndReason) -> dict[str, Any]:
        """The segment in flight is all generated: it joins `segments` (returned)."""
        text, start_s = self._current or ("", end_s)
        segment = {"text": text, "start_s": round(start_s, 4), "end_s": round(end_s, 4)}
        self.segments.append(segment)
        self.capped |= reason == EndReason.MAX_LEN
        self.in_flight = False
        self._current = None
        return segment

    def stop(self) -> None:
        """Nothing more is said: what waits is dropped."""
        self._pending.clear()
        self._prepared.clear()

    def heard(self, taken_s: float, generated_s: float, timed_words: list[Any] | None) -> dict[str, Any]:
        """At a cancel, what the consumer took (`taken_s` of audio; what a listener heard if it
        played it all): the segments wholly in it, and the one cut short with the share of its
        audio taken (None while it was still being generated: its length was not known) and,
        given word times, its words wholly taken."""
        spans = [(seg["text"], seg["start_s"], seg["end_s"], True) for seg in self.segments]
        if self._current is not None:
            spans.append((self._current[0], self._current[1], generated_s, False))
        whole: list[dict[str, Any]] = []
        partial = None
        for text, start, end, finished in spans:
            if finished and end <= taken_s + CLOSE_S:
                whole.append({"text": text, "start_s": start, "end_s": end})
                continue
            if start < taken_s - CLOSE_S:
                partial = {"text": text, "start_s": start, "sent_s": round(taken_s - start, 4),
                           "fraction": round((taken_s - start) / (end - start), 4) if finished else None}
                if timed_words is not None:
                    partial["words"] = [w.word for w in timed_words
                                        if w.start_s >= start - CLOSE_S and w.end_s <= taken_s + CLOSE_S]
            break
        return {"audio_s": round(taken_s, 4), "text": " ".join(seg["text"] for seg in whole), "segments": whole,
                "partial": partial}
