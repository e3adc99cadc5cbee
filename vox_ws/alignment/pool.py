"""The aligner processes: where a segment's audio and texts go once the segment is complete.

A few spawned processes (`--aligners`, 2 by default: config.py says why; never more than the
CPUs of the cgroup's quota: `cpus.cpu_limit`), started one at a time as segments need them: the first when
the first stream that asks for word times opens, another only when a segment finds every one
started busy. Each makes its decoder once (`sphinx.SphinxAligner`) and aligns one segment at a
time. Segments wait for a free process in the pool's own queue, bounded (QUEUE_PER_PROCESS a
process): past it a segment is refused (`AlignerBusy`; its words are then estimated, not
aligned), and a segment whose stream no longer waits for it (ended, cancelled, its client gone:
the stream cancels its future) leaves the queue unaligned. The queue is shared by owners (a
segment's stream's owner, as the scheduler's fair shares count them): free processes take the
owners' segments in turns, oldest first within each, and a full queue makes room for an owner
holding fewer segments than the one holding most, whose newest segment is pushed out (refused
`AlignerBusy` as if it had come last). One client's flood no longer delays every other stream's
words behind it, nor takes every place.

Threads: `align` is called on the engine's thread, `start` on the event loop, a segment's future
is cancelled on the loop, and a process's answer comes on its executor's own thread. They share
the pool's state under one lock, held to pick a process and hand it a segment, never while a
future's callbacks run. Nothing of the aligning runs on the event loop or the engine's thread:
they only hand over the audio and take a future.
"""

from __future__ import annotations

import importlib.util
import multiprocessing
import os
import threading
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

import numpy as np

from ..audio import StreamEncoder
from ..engines.cpus import cpu_limit
from ..text import base_language, text_words
from .english import reads_as_english
from .spelling import AlignmentText, written_times
from .sphinx import SAMPLE_RATE

# A timed word: (the word as written, start s, end s, estimated: placed between its neighbours).
TimedWord = tuple[str, float, float, bool]
# What `align_segment` is given: audio, the text as written and as spoken, its language.
Segment = tuple[np.ndarray, str, str, str | None]
ALIGNER_NICE = 10
# How long a stream's end waits for its last words before it goes without them (an aligner
# process hung, or starved of CPU): its audio is all sent by then.
ANSWER_WITHIN_S = 10.0
# Segments that may wait for a process, per process: at 0.06 s a sentence they wait about a
# second at most; even of 20-s segments (0.45 s each) 7 s, within the 10 s a stream's end waits
# for its words. Beyond it a flood of segments only grows the queue's memory and the wait.
QUEUE_PER_PROCESS = 16

_aligner = None


def _start_worker() -> None:
    global _aligner
    # Below the engine and the event loop, as a CPU server's engine shares the cores: words wait
    # for audio, never the other way round. Not idle-only: the stream's end waits for its words.
    os.nice(ALIGNER_NICE)
    from .sphinx import SphinxAligner
    _aligner = SphinxAligner()


def _ready() -> int:
    """Its process id: a process that ran it has started."""
    return os.getpid()


def align_segment(audio: np.ndarray, written: str, spoken: str,
                  language: str | None = None) -> list[TimedWord]:
    """In an aligner process: the written words of a segment with their times in its audio
    (a `SegmentRecording`'s). A text that is not English (its `language`, or without one, as
    `english.reads_as_english` reads it) is not aligned: its words are estimated."""
    if not (reads_as_english(written) if language is None else base_language(language) == "en"):
        return estimated_segment(audio, written)
    text = AlignmentText.of(written, spoken)
    times = _aligner.align(audio, text.words) if _aligner is not None else [None] * len(text.words)
    return written_times(text, times, len(audio) / SAMPLE_RATE)


def estimated_segment(audio: np.ndarray, written: str) -> list[TimedWord]:
    """A segment's written words each given a share of its audio by length, all estimated: for
    a segment the aligner had no room for. Cheap (no spelling, no decoder): the engine's thread
    computes it."""
    return written_times(AlignmentText(tuple(text_words(written)), (), ()), [], len(audio) / SAMPLE_RATE)


class AlignerBusy(Exception):
    """Every aligner process is busy and the queue full: the segment is not aligned."""


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


class _Process:
    """One aligner process: an executor of its own with one spawned process, so that each starts
    only when asked for, and one that dies breaks only itself. Its state is the pool's, under the
    pool's lock."""

    def __init__(self) -> None:
        self.executor = ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn"),
                                            initializer=_start_worker)
        self.busy = False                 # it holds a segment
        self.pid: int | None = None       # once started
        # Started now, not at its first segment: its decoder is made by the time one comes.
        self.executor.submit(_ready).add_done_callback(self._started)

    def _started(self, ready: Future) -> None:
        if not ready.cancelled() and ready.exception() is None:
            self.pid = ready.result()


class WordAligner:
    """Thread-safe: sinks on the engine's thread hand it segments (see the module docstring)."""

    languages = ("en",)

    def __init__(self, workers: int, answer_within_s: float = ANSWER_WITHIN_S,
                 cpus: int | None = None, queue: int | None = None) -> None:
        """At most `workers` processes, and no more than `cpus` (default: the cgroup's quota, the
        CPUs the server may run on); `queue` segments may wait (default QUEUE_PER_PROCESS each)."""
        self.workers = max(1, min(workers, cpu_limit() if cpus is None else cpus))
        self.queue_limit = QUEUE_PER_PROCESS * self.workers if queue is None else queue
        self.answer_within_s = answer_within_s
        self._processes: list[_Process] = []
        # Segments waiting, by owner; the owner first here gives the next (then goes last).
        self._waiting: OrderedDict[str, deque[tuple[Future, Segment]]] = OrderedDict()
        self._lock = threading.Lock()
        self._closed = False
        self._held = False
        # Segments aligned, refused (the queue full) and dropped (cancelled while they waited).
        self.aligned = self.refused = self.dropped = 0

    @staticmethod
    def available() -> bool:
        """Whether its aligner is installed (pocketsphinx, in the voxcpm extra)."""
        return importlib.util.find_spec("pocketsphinx") is not None

    def serves(self, language: str | None) -> bool:
        """Whether it aligns speech in `language` (None: read from the text, as VoxCPM2 does:
        each segment that is not English is given estimated times, `align_segment`)."""
        return language is None or base_language(language) in self.languages

    @property
    def processes(self) -> int:
        """Processes started and not retired."""
        return len(self._processes)

    @property
    def queued(self) -> int:
        """Segments waiting for a process."""
        return sum(len(waiting) for waiting in self._waiting.values())

    def pids(self) -> list[int]:
        """The ids of its processes that have started."""
        with self._lock:
            return [p.pid for p in self._processes if p.pid is not None]

    def align(self, audio: np.ndarray, written: str, spoken: str, language: str | None = None,
              owner: str = "") -> Future:
        """A future of `align_segment`'s words: `audio` a `SegmentRecording`'s, `written` the
        segment's text as the client sent it, `spoken` as the engine was given it, `language`
        the stream's (None: told from the text, segment by segment), `owner` its stream's (the
        queue's turns and places are shared by owners). Cancel it when its words are no longer
        wanted: a segment still waiting is then never aligned. Raises AlignerBusy where the
        queue is full; the future fails with AlignerBusy where another owner's segment later
        takes its place."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("the aligner is closed")
            pushed = self._make_room(owner)
            self._waiting.setdefault(owner, deque()).append((future, (audio, written, spoken, language)))
            handed = self._hand_over()
        future.add_done_callback(self._forget)
        if pushed is not None and pushed.set_running_or_notify_cancel():
            pushed.set_exception(AlignerBusy("pushed out of the aligner's queue by another client's segment"))
        self._watch(handed)
        return future

    def start(self, processes: int = 1) -> None:
        """Start `processes` processes now, if fewer are (each makes its decoder: some 0.5 s),
        rather than at the first segments that find none free."""
        with self._lock:
            while not self._closed and len(self._processes) < min(processes, self.workers):
                self._processes.append(_Process())

    def hold(self) -> None:
        """Hand no segment to a process until `release`: they wait in the queue (for tests that
        look at the queue)."""
        with self._lock:
            self._held = True

    def release(self) -> None:
        with self._lock:
            self._held = False
            handed = self._hand_over()
        self._watch(handed)

    def close(self, grace_s: float | None = None) -> None:
        """Stop every process; a segment waiting fails. A segment being aligned is finished
        first, for `grace_s` seconds at most (None: however long it takes): a process still
        at it then (stuck, stopped) is killed, so a shutdown keeps its bound."""
        with self._lock:
            self._closed = True
            waiting = [entry for entries in self._waiting.values() for entry in entries]
            self._waiting = OrderedDict()
            processes, self._processes = self._processes, []
        for future, _ in waiting:
            if future.set_running_or_notify_cancel():
                future.set_exception(RuntimeError("the aligner is closed"))
        # The executor knows its workers only by a private table, and (before Python 3.14's
        # `kill_workers`) has no way to end one that does not finish: taken before it forgets them.
        workers = [w for process in processes for w in (process.executor._processes or {}).values()]
        for process in processes:
            process.executor.shutdown(wait=False, cancel_futures=True)
        deadline = None if grace_s is None else time.monotonic() + grace_s
        for worker in workers:
            worker.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if worker.exitcode is None:
                worker.kill()                          # SIGKILL: a stopped process takes it too
                worker.join()
        for process in processes:
            process.executor.shutdown(wait=True)       # its own thread, now that its workers are gone

    # ------------------------------------------------------------------ under the lock

    def _make_room(self, owner: str) -> Future | None:
        """Room in the queue for one more of `owner`'s segments: where it is full, the newest of
        the owner holding most, if that owner holds more than `owner` would (its future, to be
        refused outside the lock); AlignerBusy where none holds more."""
        if self.queued < self.queue_limit:
            return None
        mine = len(self._waiting.get(owner, ()))
        most = max(self._waiting, key=lambda other: len(self._waiting[other]))
        if len(self._waiting[most]) <= mine + 1:
            self.refused += 1
            raise AlignerBusy(f"{self.queued} segments wait for the aligner's {self.workers} processes")
        pushed, _ = self._waiting[most].pop()
        if not self._waiting[most]:
            del self._waiting[most]
        self.refused += 1
        return pushed

    def _next_waiting(self) -> tuple[Future, Segment]:
        """The next segment to align: the oldest of the owner whose turn it is (then the last)."""
        owner, waiting = next(iter(self._waiting.items()))
        taken = waiting.popleft()
        del self._waiting[owner]
        if waiting:
            self._waiting[owner] = waiting
        return taken

    def _hand_over(self) -> list[tuple[_Process, Future, Future]]:
        """Each waiting segment that a free process (or one that may still start) takes:
        (process, the segment's future, the process's)."""
        handed = []
        while self._waiting and not self._held and not self._closed:
            process = self._free_process()
            if process is None:
                break
            future, segment = self._next_waiting()
            if not future.set_running_or_notify_cancel():       # cancelled: its stream is gone
                self.dropped += 1
                continue
            process, answer = self._submit(process, segment)
            handed.append((process, future, answer))
        return handed

    def _free_process(self) -> _Process | None:
        free = next((p for p in self._processes if not p.busy), None)
        if free is None and len(self._processes) < self.workers:
            free = _Process()
            self._processes.append(free)
        return free

    def _submit(self, process: _Process, segment: Segment) -> tuple[_Process, Future]:
        try:
            answer = process.executor.submit(align_segment, *segment)
        except BrokenProcessPool:         # it died since its last segment: a new one takes this one
            self._retire(process)
            process = _Process()
            self._processes.append(process)
            answer = process.executor.submit(align_segment, *segment)
        process.busy = True
        return process, answer

    def _retire(self, process: _Process) -> None:
        if process in self._processes:
            self._processes.remove(process)
            process.executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ callbacks, outside the lock

    def _watch(self, handed: list[tuple[_Process, Future, Future]]) -> None:
        for process, future, answer in handed:
            answer.add_done_callback(lambda answer, p=process, f=future: self._answered(p, f, answer))

    def _answered(self, process: _Process, future: Future, answer: Future) -> None:
        """On the process's executor thread: its segment is done; the next waiting one goes to it
        (or to another free one), and the answer to the segment's future."""
        failure = RuntimeError("the aligner is closed") if answer.cancelled() else answer.exception()
        with self._lock:
            process.busy = False
            if isinstance(failure, BrokenProcessPool):        # it died: its segment lost its words
                self._retire(process)
            elif failure is None:
                self.aligned += 1
            handed = self._hand_over()
        self._watch(handed)
        if failure is None:
            future.set_result(answer.result())
        else:
            future.set_exception(failure)

    def _forget(self, future: Future) -> None:
        """A segment's future is done: one cancelled while it waited leaves the queue now."""
        if not future.cancelled():
            return
        with self._lock:
            for owner, entries in self._waiting.items():
                for index, (waiting, _) in enumerate(entries):
                    if waiting is future:
                        del entries[index]
                        if not entries:
                            del self._waiting[owner]
                        self.dropped += 1
                        return
