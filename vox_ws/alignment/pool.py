"""The aligner processes: where a segment's audio and texts go once the segment is complete.

A pool of spawned processes, one per core, started at the first segment that asks: each makes
its decoder once (`sphinx.SphinxAligner`) and aligns one segment at a time. Nothing of it runs
on the event loop or the engine's thread: they only hand over the audio and take a future.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import threading
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..audio import StreamEncoder
from ..text import base_language
from .spelling import AlignmentText, written_times
from .sphinx import SAMPLE_RATE

# A timed word: (the word as written, start s, end s, estimated: placed between its neighbours).
TimedWord = tuple[str, float, float, bool]
ALIGNER_NICE = 10
# How long a stream's end waits for its last words before it goes without them (an aligner
# process hung, or starved of CPU): its audio is all sent by then.
ANSWER_WITHIN_S = 10.0

_aligner = None


def _start_worker() -> None:
    global _aligner
    # Below the engine and the event loop, as a CPU server's engine shares the cores: words wait
    # for audio, never the other way round. Not idle-only: the stream's end waits for its words.
    os.nice(ALIGNER_NICE)
    from .sphinx import SphinxAligner
    _aligner = SphinxAligner()


def _ready() -> None:
    """Nothing: a process that ran it has started."""


def align_segment(audio: np.ndarray, written: str, spoken: str) -> list[TimedWord]:
    """In an aligner process: the written words of a segment with their times in its audio
    (a `SegmentRecording`'s)."""
    text = AlignmentText.of(written, spoken)
    times = _aligner.align(audio, text.words) if _aligner is not None else [None] * len(text.words)
    return written_times(text, times, len(audio) / SAMPLE_RATE)


class SegmentRecording:
    """A segment's audio as the aligner takes it (16-bit at SAMPLE_RATE: a sixth of 48 kHz
    float's memory), gathered as the engine yields it."""

    def __init__(self, rate: int) -> None:
        self._encoder = StreamEncoder(rate, SAMPLE_RATE, "s16")
        self._parts: list[bytes] = []

    def add(self, pcm: np.ndarray) -> None:
        self._parts.append(self._encoder.encode(pcm))

    def take(self) -> np.ndarray:
        """All of it, the resampler's tail included."""
        self._parts.append(self._encoder.flush())
        audio, self._parts = np.frombuffer(b"".join(self._parts), dtype="<i2"), []
        return audio


class WordAligner:
    """Thread-safe: sinks on the engine's thread hand it segments."""

    languages = ("en",)

    def __init__(self, workers: int | None = None, answer_within_s: float = ANSWER_WITHIN_S) -> None:
        self.workers = workers or len(os.sched_getaffinity(0))
        self.answer_within_s = answer_within_s
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._closed = False

    @staticmethod
    def available() -> bool:
        """Whether its aligner is installed (pocketsphinx, in the voxcpm extra)."""
        return importlib.util.find_spec("pocketsphinx") is not None

    def serves(self, language: str | None) -> bool:
        """Whether it aligns speech in `language` (None: read from the text, as VoxCPM2 does;
        a text in another script is given estimated times)."""
        return language is None or base_language(language) in self.languages

    def align(self, audio: np.ndarray, written: str, spoken: str) -> Future:
        """A future of `align_segment`'s words: `audio` a `SegmentRecording`'s, `written` the
        segment's text as the client sent it, `spoken` as the engine was given it."""
        with self._lock:
            if self._closed:
                raise RuntimeError("the aligner is closed")
            try:
                return self._started().submit(align_segment, audio, written, spoken)
            except BrokenProcessPool:       # a process died (its segment lost its words): anew
                broken, self._pool = self._pool, None
                broken.shutdown(wait=False)
                return self._started().submit(align_segment, audio, written, spoken)

    def start(self) -> None:
        """Start every process now (each makes its decoder: some 0.5 s), not at the first words."""
        with self._lock:
            if self._pool is None and not self._closed:
                for _ in range(self.workers):
                    self._started().submit(_ready)

    def _started(self) -> ProcessPoolExecutor:
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=_start_worker)
        return self._pool

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
