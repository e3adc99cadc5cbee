"""A stream's output stage: engine audio in, what the consumer receives out.

Two halves, one owner each:

- `produce` (the thread that holds the stream's audio: the engine loop's while a request of the
  stream is in flight, the loop's between two of them) resamples the engine's audio to the
  output rate and packs it: in the output format itself for raw PCM at speed 1, else as
  float32 for the pipeline. It returns `Produced` chunks of at most MAX_CHUNK_S.
- `hand_over` (the loop, as the consumer takes each event) turns a queued event into what the
  consumer gets: `Produced` into `Audio` (through a `codecs.OutputPipeline` on the service's
  encoding threads where a codec or a tempo is asked for, so encoding follows the consumer's
  pace and never runs on the event loop), times divided by the speed, and, on the last event,
  the stream's figures: what was handed over, counted once, here.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from ..audio import Gain, StreamEncoder
from ..codecs import CODECS, Encoded, OutputPipeline, needs_pipeline
from ..engine import EndReason, ErrorKind, Refused
from .events import Audio, Ended, Event, Failed, Flushed, Phoneme, Phonemes, Produced, Queued, Segment, Words

# The most audio one chunk carries, in seconds.
MAX_CHUNK_S = 1.0


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
    # A gain on the engine's audio (1: as spoken), brought down where it would clip (`audio.Gain`).
    volume: float = 1.0

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


def figures(chunks: int, audio_s: float, first_at: float | None, started_at: float) -> dict[str, Any]:
    """A stream's figures: its chunks and seconds of audio, first audio (ms) and real-time
    factor (wall time over audio time) so far."""
    audio_s = round(max(audio_s, 0.0), 4)
    wall = time.monotonic() - started_at
    return {"chunks": chunks, "audio_s": audio_s,
            "ttfa_ms": None if first_at is None else round((first_at - started_at) * 1000, 1),
            "rtf": round(wall / audio_s, 4) if audio_s > 0 else None}


class OutputStage:
    def __init__(self, engine_rate: int, format: str, rate: int, speed: float, executor: Executor,
                 volume: float = 1.0) -> None:
        self.format = format
        self._gain = Gain(volume)
        self.rate = rate
        self._speed = speed
        self._executor = executor
        self._pipeline = OutputPipeline(format, rate, speed) if needs_pipeline(format, speed) else None
        self._encoder = StreamEncoder(engine_rate, rate, "f32" if self._pipeline is not None else format)
        self.engine_rate = engine_rate
        self.engine_samples = 0                  # engine audio produced so far (`produce`'s thread)
        self._seq = 0                            # Audio handed over so far
        self._handed_s = 0.0
        self._first_handed_at: float | None = None

    # ------------------------------------------------------------------ producing

    def produce(self, pcm: np.ndarray) -> list[Produced]:
        """Engine audio as the stream's chunks of at most MAX_CHUNK_S (none while the resampler
        holds it back). An engine may hand over many seconds at once (Piper: a whole sentence);
        a paced reader's progress is then visible chunk by chunk, and no frame holds the socket
        for long."""
        self.engine_samples += len(pcm)
        pcm = self._gain.apply(pcm)
        step = max(1, int(self.engine_rate * MAX_CHUNK_S))
        pieces = (self._encoder.encode(pcm[start:start + step]) for start in range(0, len(pcm), step))
        return [self._produced(data) for data in pieces if data]

    def silence(self, seconds: float) -> list[Produced]:
        """Exact silence (a break in marked-up text), in the stream's chunks."""
        return self.produce(np.zeros(int(round(seconds * self.engine_rate)), dtype=np.float32))

    def tail(self) -> list[Produced]:
        """What the resampler still holds, at the end of the stream."""
        data = self._encoder.flush()
        return [self._produced(data)] if data else []

    def _produced(self, data: bytes) -> Produced:
        samples = len(data) // self._encoder.bytes_per_sample
        return Produced(data, samples, samples / self.rate)

    # ------------------------------------------------------------------ handing over

    @property
    def immediate(self) -> bool:
        """Raw PCM at speed 1: handed over as it is (`hand_over_now`), no pipeline to wait for."""
        return self._pipeline is None

    def hand_over_now(self, event: Queued, started_at: float) -> list[Event]:
        """`hand_over` where the stage is `immediate`."""
        if isinstance(event, Produced):
            return [self._counted(Audio(event.data, self._seq, event.samples, event.seconds))]
        if isinstance(event, (Ended, Failed)):
            return [replace(event, stats=self._figures(event.stats, started_at))]
        return [event]

    async def hand_over(self, event: Queued, started_at: float) -> list[Event]:
        """What the consumer gets for one queued event (none, one or two events)."""
        pipeline = self._pipeline
        if pipeline is None:
            return self.hand_over_now(event, started_at)
        if isinstance(event, Produced):
            pcm = np.frombuffer(event.data, dtype="<f4")
            return self._audio(await self._off_loop(pipeline.encode, pcm))
        if isinstance(event, Ended):
            last = Encoded()
            if event.reason != EndReason.CANCELLED:
                last = await self._off_loop(pipeline.finish)
            await self._off_loop(pipeline.close)
            return self._audio(last) + [replace(event, stats=self._figures(event.stats, started_at),
                                                rewrites=last.rewrites)]
        if isinstance(event, Failed):
            await self._off_loop(pipeline.close)
            return [replace(event, stats=self._figures(event.stats, started_at))]
        if self._speed == 1.0:
            return [event]
        if isinstance(event, Segment):
            return [replace(event, start_s=self._scaled(event.start_s), end_s=self._scaled(event.end_s))]
        if isinstance(event, Words):
            return [Words(tuple(replace(w, start_s=self._scaled(w.start_s), end_s=self._scaled(w.end_s))
                                for w in event.words))]
        if isinstance(event, Phonemes):
            return [Phonemes(tuple(Phoneme(p.phoneme, self._scaled(p.start_s), self._scaled(p.end_s))
                                   for p in event.phonemes))]
        if isinstance(event, Flushed):
            return [Flushed(self._scaled(event.audio_s))]
        return [event]

    def close_soon(self) -> None:
        """The consumer is gone: free the pipeline's encoder (after any call still running)."""
        if self._pipeline is None:
            return
        try:
            self._executor.submit(self._pipeline.close)
        except RuntimeError:                  # the service is shutting down: the executor is gone
            self._pipeline.close()

    async def _off_loop(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _audio(self, encoded: Encoded) -> list[Event]:
        if not encoded:
            return []
        pipeline = self._pipeline
        assert pipeline is not None
        first = self._seq == 0
        return [self._counted(Audio(encoded.data, self._seq, encoded.samples, encoded.samples / pipeline.rate,
                                    packets=encoded.packets, durations_us=encoded.durations_us,
                                    description=pipeline.description if first else None,
                                    pre_skip=pipeline.pre_skip if first else 0))]

    def _counted(self, audio: Audio) -> Audio:
        """Audio as it is handed over, counted for the figures of the last event."""
        if self._seq == 0:
            self._first_handed_at = time.monotonic()
        self._seq += 1
        self._handed_s += audio.seconds
        return audio

    def _scaled(self, seconds: float) -> float:
        return round(seconds / self._speed, 4)

    def _figures(self, stats: dict[str, Any], started_at: float) -> dict[str, Any]:
        """The stream's figures in terms of what was handed over (a decoder of the output
        yields `audio_s` seconds: codec priming and padding included); the stream gives its
        segments, `heard` and usage in its own audio's time."""
        audio_s = self._pipeline.seconds if self._pipeline is not None else self._handed_s
        done = figures(self._seq, audio_s, self._first_handed_at, started_at)
        out = {**stats, **done,
                    "segments": [self._scaled_span(seg) for seg in stats.get("segments", [])],
                    "usage": {**stats.get("usage", {}), "audio_s": done["audio_s"], "chunks": self._seq}}
        heard = stats.get("heard")
        if heard is not None:
            partial = heard["partial"]
            out["heard"] = {**heard, "audio_s": self._scaled(heard["audio_s"]),
                                "segments": [self._scaled_span(seg) for seg in heard["segments"]],
                                "partial": None if partial is None else
                                {**partial, "start_s": self._scaled(partial["start_s"]),
                                 "sent_s": self._scaled(partial["sent_s"])}}
        return out

    def _scaled_span(self, segment: dict[str, Any]) -> dict[str, Any]:
        return {**segment, "start_s": self._scaled(segment["start_s"]), "end_s": self._scaled(segment["end_s"])}
