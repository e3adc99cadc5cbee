"""A stream's end that waits for the aligner's words (`Ended` comes after every word).

The aligner (`vox_ws.alignment`) times a spoken segment's words in another process, after the
segment's audio is out. A stream whose last segment is spoken while words are still with the
aligner keeps its end back until they are in, or until the aligner's answer is overdue
(`WordAligner.answer_within_s`): then the words still waited for go with estimated times, each
marked `estimated` (a share of its segment's audio by its length, as a segment the aligner had no
room for gets), and the end after them: captions keep every word under load. A cancel never
waits.
"""

from __future__ import annotations

from typing import Hashable

from ..alignment.pool import WordAligner
from ..engine import EndReason
from .events import Word
from .word_timings import AlignedInOrder


class AlignerEndWait:
    """One stream's segments with the aligner (in the order spoken) and the end held for them.
    Pure: the caller passes the clock's reading."""

    def __init__(self, aligner: WordAligner | None) -> None:
        self.aligner = aligner                  # None: its words are the engine's, or nobody's
        self._segments = AlignedInOrder()
        self._held: EndReason | None = None     # the end waiting for the words
        self._held_since = 0.0

    def expect(self, segment: Hashable) -> None:
        """A spoken segment whose words are now with the aligner."""
        self._segments.expect(segment)

    def answer(self, segment: Hashable, words: tuple[Word, ...] | None) -> list[tuple[Word, ...]]:
        """The aligner's words for `segment`; returns the words now due, in the order spoken."""
        return self._segments.answer(segment, words)

    def holds(self, reason: EndReason, now: float) -> bool:
        """Whether the end for `reason` waits (words are still with the aligner); it is kept."""
        if reason == EndReason.CANCELLED or not self._segments.waiting:
            return False
        self._held, self._held_since = reason, now
        return True

    def released(self) -> EndReason | None:
        """The end held, once the last words it waited for are in; else None."""
        return self._held if self._held is not None and not self._segments.waiting else None

    def overdue(self, now: float) -> tuple[EndReason, list[tuple[Word, ...]]] | None:
        """The end held and the words to send before it, once the aligner's answer is overdue:
        the segments still waited for leave the aligner, their words estimated; else None."""
        if self._held is None or now - self._held_since <= self.aligner.answer_within_s:
            return None
        held, self._held = self._held, None            # given to the caller, which ends the stream
        return held, self._segments.estimate_waiting()

    def clear(self) -> None:
        """No word is waited for any more (the stream stopped producing)."""
        self._segments.clear()
