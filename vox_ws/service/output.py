"""A stream's audio as its consumer takes it, when it must be encoded or time-stretched.

Raw PCM at speed 1 needs nothing here: the stream packs it on the scheduler thread. Otherwise
the stream's float32 audio goes through a `codecs.OutputPipeline` on the service's encoding
threads, one event at a time as the consumer takes it (so encoding follows the consumer's
pace and never runs on the event loop), and what the consumer sees is rewritten in terms of
the output: audio events carry the encoder's bytes (none when it produced none), times are
divided by the speed, and the final figures are what a decoder of the output yields.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import replace
from typing import Any

import numpy as np

from ..codecs import Encoded, OutputPipeline
from ..engine import EndReason
from .events import Audio, Ended, Event, Failed, Flushed, Phoneme, Phonemes, Segment, Word, Words


class EncodedOutput:
    def __init__(self, pipeline: OutputPipeline, executor: Executor, speed: float) -> None:
        self._pipeline = pipeline
        self._executor = executor
        self._speed = speed
        self._seq = 0
        self._first_at: float | None = None

    async def process(self, event: Event, started_at: float) -> list[Event]:
        """The events the consumer gets for one event of the stream (none, one or two)."""
        pipeline = self._pipeline
        loop = asyncio.get_running_loop()
        if isinstance(event, Audio):
            pcm = np.frombuffer(event.data, dtype="<f4")
            return self._audio(await loop.run_in_executor(self._executor, pipeline.encode, pcm))
        if isinstance(event, Ended):
            tail = []
            if event.reason != EndReason.CANCELLED:
                tail = self._audio(await loop.run_in_executor(self._executor, pipeline.finish))
            await loop.run_in_executor(self._executor, pipeline.close)
            return tail + [replace(event, stats=self._stats(event.stats, started_at))]
        if isinstance(event, Failed):
            await loop.run_in_executor(self._executor, pipeline.close)
            return [replace(event, stats=self._stats(event.stats, started_at))]
        if isinstance(event, Segment):
            return [replace(event, start_s=self._scaled(event.start_s), end_s=self._scaled(event.end_s))]
        if isinstance(event, Words):
            return [Words(tuple(Word(w.word, self._scaled(w.start_s), self._scaled(w.end_s)) for w in event.words))]
        if isinstance(event, Phonemes):
            return [Phonemes(tuple(Phoneme(p.phoneme, self._scaled(p.start_s), self._scaled(p.end_s))
                                   for p in event.phonemes))]
        if isinstance(event, Flushed):
            return [Flushed(self._scaled(event.audio_s))]
        return [event]

    def close_soon(self) -> None:
        """The consumer is gone: free the pipeline's encoder (after any call still running)."""
        try:
            self._executor.submit(self._pipeline.close)
        except RuntimeError:                  # the service is shutting down: the executor is gone
            self._pipeline.close()

    def _audio(self, encoded: Encoded) -> list[Event]:
        if not encoded:
            return []
        pipeline = self._pipeline
        first = self._seq == 0
        if first:
            self._first_at = time.monotonic()
        audio = Audio(encoded.data, self._seq, encoded.samples, encoded.samples / pipeline.rate,
                      packets=encoded.packets, durations_us=encoded.durations_us,
                      description=pipeline.description if first else None,
                      pre_skip=pipeline.pre_skip if first else 0)
        self._seq += 1
        return [audio]

    def _scaled(self, seconds: float) -> float:
        return round(seconds / self._speed, 4)

    def _stats(self, stats: dict[str, Any], started_at: float) -> dict[str, Any]:
        """The stream's figures in terms of what was handed over: a decoder of the output
        yields `audio_s` seconds (codec priming and padding included)."""
        audio_s = self._pipeline.seconds
        wall = time.monotonic() - started_at
        first = self._first_at
        heard = stats.get("heard")
        if heard is not None:
            partial = heard["partial"]
            heard = {**heard, "audio_s": self._scaled(heard["audio_s"]),
                     "segments": [self._scaled_span(seg) for seg in heard["segments"]],
                     "partial": None if partial is None else {**partial, "start_s": self._scaled(partial["start_s"]),
                                                              "sent_s": self._scaled(partial["sent_s"])}}
            stats = {**stats, "heard": heard}
        return {**stats, "chunks": self._seq, "audio_s": round(audio_s, 4),
                "usage": {**stats["usage"], "audio_s": round(audio_s, 4), "chunks": self._seq},
                "ttfa_ms": None if first is None else round((first - started_at) * 1000, 1),
                "rtf": round(wall / audio_s, 4) if audio_s > 0 else None,
                "segments": [self._scaled_span(seg) for seg in stats.get("segments", [])]}

    def _scaled_span(self, segment: dict[str, Any]) -> dict[str, Any]:
        return {**segment, "start_s": self._scaled(segment["start_s"]), "end_s": self._scaled(segment["end_s"])}
