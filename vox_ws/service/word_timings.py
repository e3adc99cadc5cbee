"""Where a stream's word times come from: the engine's own where it knows them (Piper's
durations), else the aligner's (`vox_ws.alignment`) for the languages it serves; `--word-timings
aligned` takes every engine's from the aligner (to measure it against an engine's own), and
`engine` never runs the aligner."""

from __future__ import annotations

from typing import Any, Hashable

from ..alignment.pool import WordAligner
from ..config import ServerConfig
from ..engine import Engine
from .events import Word

MODES = ("auto", "aligned", "engine")


class WordTimings:
    def __init__(self, aligner: WordAligner | None = None, always_aligned: bool = False) -> None:
        self.aligner = aligner
        self.always_aligned = always_aligned

    @classmethod
    def for_mode(cls, mode: str, aligners: int = ServerConfig.aligners) -> "WordTimings":
        """The server's choice (`--word-timings`), with at most `aligners` aligner processes
        (`--aligners`). Raises ValueError where it cannot be had."""
        if mode not in MODES:
            raise ValueError(f"--word-timings takes {', '.join(MODES)}, not {mode!r}")
        if mode == "engine" or (mode == "auto" and not WordAligner.available()):
            return cls()
        if not WordAligner.available():
            raise ValueError("--word-timings aligned needs the aligner: pip install pocketsphinx "
                             "(it comes with the voxcpm extra)")
        return cls(WordAligner(aligners), always_aligned=mode == "aligned")

    def _engine_words(self, engine: Engine) -> bool:
        return engine.word_timings and not self.always_aligned

    def aligner_for(self, engine: Engine, language: str | None) -> WordAligner | None:
        """The aligner that times a stream's words, or None (the engine does, or nobody)."""
        if self.aligner is None or self._engine_words(engine) or not self.aligner.serves(language):
            return None
        return self.aligner

    def given(self, engine: Engine, language: str | None) -> bool:
        """Whether a stream in `language` (None: read from its text) gets word times."""
        return self._engine_words(engine) or self.aligner_for(engine, language) is not None

    def offered(self, engine: Engine) -> bool:
        """Whether any stream does (`hello.features`' `word_timestamps`)."""
        return self._engine_words(engine) or self.aligner is not None

    def describe(self, engine: Engine) -> dict[str, Any] | None:
        """`/v1/info`'s `word_timings`: their source and, for the aligner, its languages."""
        if self._engine_words(engine):
            return {"source": "engine"}
        if self.aligner is not None:
            return {"source": "aligner", "languages": list(self.aligner.languages)}
        return None

    def close(self, grace_s: float | None = None) -> None:
        """Stop the aligner's processes, a segment being aligned given `grace_s` (None: no bound)."""
        if self.aligner is not None:
            self.aligner.close(grace_s)


class AlignedInOrder:
    """One stream's segments whose words are with the aligner, in the order spoken: its
    processes may answer out of it, the words go out in it. A segment is its sink (any hashable
    with `drop_alignment` and `estimated_words`)."""

    def __init__(self) -> None:
        self._answers: dict[Hashable, tuple[tuple[Word, ...] | None] | None] = {}

    @property
    def waiting(self) -> bool:
        return bool(self._answers)

    def expect(self, segment: Hashable) -> None:
        self._answers[segment] = None

    def answer(self, segment: Hashable, words: tuple[Word, ...] | None) -> list[tuple[Word, ...]]:
        """The words now due, in order (a failed segment's: none); [] for a segment not expected."""
        if segment not in self._answers:
            return []
        self._answers[segment] = (words,)
        due = []
        while self._answers and (first := next(iter(self._answers.values()))) is not None:
            del self._answers[next(iter(self._answers))]
            if first[0]:
                due.append(first[0])
        return due

    def estimate_waiting(self) -> list[tuple[Word, ...]]:
        """Give up on the aligner: every segment still waited for gets its words estimated (its
        `estimated_words`) and leaves the aligner's queue; the words now due, in order."""
        due = []
        for segment, answered in self._answers.items():
            if answered is None:
                segment.drop_alignment()
            words = segment.estimated_words() if answered is None else answered[0]
            if words:
                due.append(words)
        self._answers.clear()
        return due

    def clear(self) -> None:
        """Forget every segment waited for: its words are no longer wanted, and one still in the
        aligner's queue leaves it unaligned (`SegmentSink.drop_alignment`)."""
        segments = list(self._answers)
        self._answers.clear()
        for segment in segments:
            segment.drop_alignment()
