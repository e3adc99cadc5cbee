"""A tone engine for benchmarks and tests: no model, a sine per stream, paced like a real one.

It is never offered by `auto` and is not in the default engine registry: the transport
benchmark and the tests register it themselves. Its steps sleep to a fixed interval so that the
audio arrives at a known pace and the transport, not the engine, is what gets measured.

With `stamp=True` the first samples of every chunk carry the wall-clock time (ns) at which the
engine handed the chunk over, so a client on the same machine can measure hand-off -> receipt.
Stamps survive only the `f32` format at the engine's own rate (no resampling, no clipping).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..engine import EndReason, Engine, GenerationRequest, Role, StepResult, Voices
from ..engines import EnginePlugin

STAMP_MARKER = 2.0          # out of the audio range: a stamped chunk starts with it
STAMP_SAMPLES = 5


def read_stamp(samples: np.ndarray) -> int | None:
    """The hand-off time (time.time_ns()) stamped into a chunk, if any."""
    if samples.shape[0] < STAMP_SAMPLES or samples[0] != STAMP_MARKER:
        return None
    value = 0
    for piece in samples[1:STAMP_SAMPLES]:
        value = (value << 16) | int(round(float(piece) * 65536.0))
    return value


def _write_stamp(chunk: np.ndarray, ns: int) -> None:
    chunk[0] = STAMP_MARKER
    for i in range(4):
        chunk[STAMP_SAMPLES - 1 - i] = ((ns >> (16 * i)) & 0xFFFF) / 65536.0


@dataclass
class _Tone:
    remaining: int
    frequency: float
    phase: int = 0


def tone_samples(text: str, sample_rate: int, seconds_per_char: float) -> int:
    return max(1, int(round(len(text.strip()) * seconds_per_char * sample_rate)))


class _ToneVoices(Voices):
    def names(self) -> list[str]:
        return ["tone"]


class ToneEngine(Engine):
    """Speaks every text as a sine, `seconds_per_char` seconds of audio per character."""

    name = "tone"
    model = "tone"
    device = "cpu"
    voices = Role(_ToneVoices)

    def __init__(self, sample_rate: int = 24000, slots: int = 256, chunk_s: float = 0.08,
                 step_interval_s: float = 0.0, seconds_per_char: float = 0.05, stamp: bool = False) -> None:
        self.sample_rate = sample_rate
        self.max_step_batch = slots
        self._chunk = max(1, int(round(chunk_s * sample_rate)))
        self._interval = step_interval_s
        self._per_char = seconds_per_char
        self._stamp = stamp
        self._next_step = 0.0

    def load(self) -> None:
        self._next_step = time.monotonic()

    def slots(self) -> tuple[int, str]:
        return self.max_step_batch, "the tone engine steps every stream at once"

    def prefill(self, request: GenerationRequest) -> None:
        frequency = 220.0 + 20.0 * (request.id % 12)
        request.state = _Tone(tone_samples(request.text, self.sample_rate, self._per_char), frequency)

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        if self._interval:
            # Pace like a model: one step per interval, whatever the batch.
            self._next_step = max(self._next_step + self._interval, time.monotonic())
            delay = self._next_step - time.monotonic()
            if delay > 0:
                time.sleep(delay)
        results = []
        for request in batch:
            tone: _Tone = request.state
            n = min(self._chunk, tone.remaining)
            t = (tone.phase + np.arange(n)) / self.sample_rate
            chunk = (0.3 * np.sin(2 * np.pi * tone.frequency * t)).astype(np.float32)
            tone.phase += n
            tone.remaining -= n
            results.append(StepResult(audio=chunk, finished=EndReason.DONE if tone.remaining <= 0 else None))
        if self._stamp:
            # The step's hand-off: every chunk of it leaves the engine now.
            handed_off = time.time_ns()
            for result in results:
                _write_stamp(result.audio, handed_off)
        return results


PLUGIN = EnginePlugin(
    name="tone",
    summary="a paced sine per stream, for benchmarks and tests (never chosen by auto)",
    create=lambda settings: ToneEngine(slots=settings.get("slots") or 256),
)
