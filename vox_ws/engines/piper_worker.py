"""Piper's synthesis in a process of its own, so that a crash of its native code is contained.

Piper phonemizes with the espeak-ng bundled in piper-tts, which segfaults on some inputs (runs of
single letters with periods, "a.a.a...", over ~95 of them): in the server's own process that
killed every stream. Here only this worker dies; the engine fails the request that was being
spoken (`WorkerCrashed`, a plain exception: the engine loop answers that stream with `internal`)
and starts a new worker for the next one.

    engine thread                          worker (python -m vox_ws.engines.piper_worker FD)
    start()            ── init(threads, ──────▶   load each voice, speak "Ready." once in it
                          voices)
                       ◀── ready(rate, ───────    a voice whose model fails is left out (one
                          left out)               the operator named fails the start, naming it)
    phonemize(text)    ── phonemize(text) ────▶   espeak-ng: text to phonemes, cut in pieces,
                       ◀── words, pieces ─────    each phoneme marked with its text word
    speak(phonemes)    ── speak(phonemes) ────▶   run the VITS model on one piece
                       ◀── audio(f32), samples    and each phoneme's length in samples
    measure_piece(ph)  ── measure(phonemes) ──▶   speak a piece of SPEED_SAMPLE, timed: its
                       ◀── speech, wall, CPU s    seconds of speech, of wall time, of CPU time

Work is cut by the audio it makes, not by characters: a piece has at most `MAX_PHONEMES`
phonemes (about 3 s of speech, under half a second of work here), so no text, however dense
(a run of digits, CJK read letter by letter), holds the engine for longer than one piece.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable

import numpy as np

from ..files import read_regular_file
from ..text import text_words
from .child import Worker, WorkerCrashed, serve_worker
from .piper_voices import MAX_MODEL_BYTES, PiperVoiceFile, model_problem
from .piper_words import NO_WORD, phoneme_samples, word_owners
from .speed_slots import Timed

__all__ = ["MAX_PHONEMES", "SPEED_SAMPLE", "Piece", "PiperWorker", "Timed", "WorkerCrashed"]

# A piece of phonemes spoken by one `speak`, and for each phoneme the index of the text word it
# belongs to (piper_words.NO_WORD for spaces, stress and punctuation).
Piece = tuple[list[str], list[int]]
# Words said another way (a pronunciation): (first word, end word, "ipa" or "say", what).
Said = tuple[int, int, str, str]

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

    def __init__(self, threads: int, voices: list[PiperVoiceFile], measure: bool = True) -> None:
        """`measure`: time the first voice at the first start (the engine's slots are sized by
        it); a worker started by a rescan of the voices (`PiperEngine`) does not."""
        super().__init__(WORKER_MODULE, "Piper worker", threads)
        # What the worker loads each voice from: its name, model path and parsed config (read
        # once, by piper_voices), and whether a model that cannot be loaded fails the start.
        self.voices = [(v.name, v.model_path, v.config, v.required) for v in voices]
        self.sample_rate = 0
        self.word_timings = False          # the model's durations are available (the onnx package)
        self.measured: Timed | None = None  # the first start's measure (`measure`), timed as `measure_piece`
        self.left_out: dict[int, str] = {}  # the first start's: voice number -> why its model failed
        self._measure = measure
        self._started = False

    def start(self) -> None:  # type: ignore[override]
        # The speed is measured by the first worker only: a restart after a crash is not slowed
        # by it, and the slot count it set stays as it is.
        first, self._started = not self._started, True
        rate, self.word_timings, measured, left_out = super().start(
            ("init", self.threads, first and self._measure, self.voices), LOAD_TIMEOUT_S)
        self.sample_rate = int(rate)
        if first:
            self.measured = measured
            self.left_out = left_out
            # The engine serves the others, numbered as the worker numbers them: a restart loads
            # those alone, each required (a voice lost then must not renumber the others).
            self.voices = [(name, model, config, True) for number, (name, model, config, _)
                           in enumerate(self.voices) if number not in left_out]

    def restart(self) -> None:
        self.start()

    @property
    def speed(self) -> float:
        """Seconds of speech per second of work, as measured at the first start (0: not measured)."""
        return self.measured[0] / self.measured[1] if self.measured else 0.0

    def phonemize(self, text: str, said: list[Said] | None = None, voice: int = 0) -> tuple[list[str], list[Piece]]:
        """Text to its words and to pieces of at most MAX_PHONEMES phonemes, each spoken by one
        `speak`, each phoneme marked with its word; the words of `said` said as it says; in
        the language of voice number `voice`."""
        return self.ask(("phonemize", (voice, text, said or [])), SPEAK_TIMEOUT_S, "phonemizing")

    def speak(self, phonemes: list[str], voice: int = 0, scales: tuple = (None, None, None, None)
              ) -> tuple[np.ndarray, tuple[int, list[int]] | None]:
        """The audio of a piece in voice number `voice` (with `scales`: length, noise, noise_w,
        and the speaker's id; None: the voice's own), and where its phonemes lie in it:
        (samples before the first, samples of each), or None without the model's durations."""
        audio, alignment = self.ask(("speak", (voice, phonemes, scales)), SPEAK_TIMEOUT_S, "speaking")
        return np.frombuffer(audio, dtype=np.float32), alignment

    def measure_piece(self, phonemes: list[str]) -> Timed:
        """A piece spoken in the first voice and timed in the worker, its audio dropped: the
        engine's speed measured again while it serves (`speed_slots`), a piece between two turns."""
        return self.ask(("measure", (0, phonemes)), SPEAK_TIMEOUT_S, "measuring")


# ---------------------------------------------------------------------------- the worker


def _load(threads: int, model_path: str, config: dict, sessions: dict[tuple, tuple[Any, bool]] | None = None):
    """A voice: its model's ONNX session (shared with the voices already in `sessions` whose
    model is the same file) and its own config."""
    from piper import PiperVoice
    from piper.config import PiperConfig

    config = PiperConfig.from_dict(config)
    sessions = {} if sessions is None else sessions
    key = _model_file(model_path)
    if key not in sessions:
        sessions[key] = _session(threads, model_path)
    session, aligned = sessions[key]
    return PiperVoice(session=session, config=config), int(config.sample_rate), aligned


def _model_file(path: str) -> tuple:
    """Which file a model is, however it is named (a link, a second name): voices that differ in
    their config alone (a speed, a language code, a speaker) share one model, and one session of
    it: a session of the bundled 63 MB voice holds about 170 MB."""
    info = os.stat(path)
    return info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns


def _session(threads: int, model_path: str) -> tuple[Any, bool]:
    import onnxruntime

    options = onnxruntime.SessionOptions()
    # One intra-op thread was as fast as two for this voice and leaves a core for the server.
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    model, aligned = _model_with_durations(model_path)
    return onnxruntime.InferenceSession(model, sess_options=options, providers=["CPUExecutionProvider"]), aligned


def _read_model(path: str) -> bytes:
    """A model's bytes: a regular file (a FIFO is refused, not waited on), within MAX_MODEL_BYTES,
    not plainly something else (`model_problem`)."""
    data = read_regular_file(path, MAX_MODEL_BYTES)
    problem = model_problem(len(data), data[:64])
    if problem is not None:
        raise ValueError(problem)
    return data


def _model_with_durations(path: str) -> tuple[bytes, bool]:
    """The voice's ONNX model with its phoneme durations as a second output (patched in memory
    by piper-tts's own tool), or the model as it is where the onnx package is missing."""
    try:
        import onnx
        from piper.patch_voice_with_alignment import add_alignment_output
    except ImportError:
        return _read_model(path), False
    data = _read_model(path)
    model = onnx.load_model_from_string(data)
    del data                     # the file's bytes are not held while the model is written out again
    try:
        add_alignment_output(model)
    except ValueError:           # already patched
        pass
    return model.SerializeToString(), True


def phonemize(voice, text: str, said: list[Said] = ()) -> tuple[list[str], list[Piece]]:
    """Text to its words, and to pieces of whole words, at most MAX_PHONEMES phonemes each (a
    word longer than that alone excepted), each phoneme marked with its word. A sentence too
    long for one piece is cut into pieces of about equal length, at a clause (a comma's
    phoneme) where one is near, else between words; short sentences in a row share a piece
    ("a. b. c." is one utterance, not three steps). The words of a pronunciation (`said`) are
    said as it says, with the phonemes given (IPA) or those of the respelling; a phrase is
    then one word."""
    words = text_words(text)
    sentences = [s for s in voice.phonemize(text) if s]
    owners = word_owners(words, sentences, voice.phonemize)
    for first, end, kind, what in said:
        phonemes = list(what) if kind == "ipa" else [ph for s in voice.phonemize(what) for ph in s]
        for sentence, owner in zip(sentences, owners):
            held = [i for i, o in enumerate(owner) if first <= o < end]
            if held:
                sentence[held[0]:held[-1] + 1] = phonemes
                owner[held[0]:held[-1] + 1] = [first] * len(phonemes)
        words[first:end] = [" ".join(words[first:end]), *[""] * (end - first - 1)]   # one word; its index kept
    pieces: list[Piece] = []
    for sentence, owner in zip(sentences, owners):
        count = -(-len(sentence) // MAX_PHONEMES)
        if count == 1:
            pieces.append((sentence, owner))
            continue
        target = len(sentence) / count
        start = 0
        while len(sentence) - start > MAX_PHONEMES:
            cut = _cut(sentence, start, int(start + target))
            pieces.append((sentence[start:cut], owner[start:cut]))
            start = cut
        pieces.append((sentence[start:], owner[start:]))
    merged: list[Piece] = []
    for phonemes, owner in (p for p in pieces if any(ph.strip() for ph in p[0])):
        if merged and _cost(merged[-1][0]) + 1 + _cost(phonemes) <= MAX_PHONEMES:
            merged[-1] = (merged[-1][0] + [" "] + phonemes, merged[-1][1] + [NO_WORD] + owner)
        else:
            merged.append((phonemes, owner))
    return words, merged


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


def speak(voice, phonemes: list[str], aligned: bool, scales: tuple = (None, None, None, None)
          ) -> tuple[np.ndarray, tuple[int, list[int]] | None]:
    """One piece to float32 audio, and where each phoneme lies in it (see PiperWorker.speak).
    Unlike PiperVoice.synthesize, no per-sentence peak normalisation: it would make loudness
    jump between pieces."""
    from piper.config import SynthesisConfig

    length, noise, noise_w, speaker = scales
    config = SynthesisConfig(speaker_id=speaker, length_scale=length, noise_scale=noise, noise_w_scale=noise_w,
                             normalize_audio=False)
    ids = voice.phonemes_to_ids(phonemes)
    alignment = None
    if aligned:
        audio, id_samples = voice.phoneme_ids_to_audio(ids, config, include_alignments=True)
        if id_samples is not None and len(id_samples) == len(ids):
            alignment = phoneme_samples(phonemes, id_samples, voice.config.phoneme_id_map)
    else:
        audio = voice.phoneme_ids_to_audio(ids, config)
    return np.clip(np.asarray(audio, dtype=np.float32), -1.0, 1.0), alignment


# Spoken once at start to measure how much faster than real time this machine speaks.
SPEED_SAMPLE = "The quick brown fox jumps over the lazy dog, and then it runs back home again."


def _start(init: tuple) -> tuple[tuple[int, bool, Timed | None, dict[int, str]], Callable[[str, Any], tuple]]:
    """Load every voice: one whose model cannot be loaded (and spoken: a model that parses but
    takes no phonemes) is left out, and said why in `left_out`, unless it is required; then the
    start fails naming its file. Each is loaded now, not at first use: a load takes a second
    or more, and a stream's first audio (and every other stream's) would wait on it."""
    _, threads, measure, files = init
    loaded, left_out, sessions = {}, {}, {}

    def failed(number: int, exc: Exception) -> None:
        name, model, _, required = files[number]
        why = f"its model {model!r} cannot be loaded ({type(exc).__name__}: {exc})"
        if required:
            raise RuntimeError(f"voice {name!r}: {why}") from None
        left_out[number] = why

    # Every voice loaded, then each warmed: loading one beside another's warmed buffers put
    # 16 MB more on the worker's peak (476 MB against 460 with two voices).
    for number, (_, model, config, _) in enumerate(files):
        try:
            loaded[number] = _load(threads, model, config, sessions)
        except Exception as exc:  # noqa: BLE001 - a foreign or broken file fails in any of its ways
            failed(number, exc)
    for number, (voice, _, aligned) in list(loaded.items()):
        try:
            for phonemes, _ in phonemize(voice, "Ready.")[1]:     # warm the phonemizer and the ONNX graph
                speak(voice, phonemes, aligned)
        except Exception as exc:  # noqa: BLE001 - a model that loads but takes no phonemes
            del loaded[number]
            failed(number, exc)
    served = list(loaded.values())               # numbered as the engine numbers the voices it serves
    if not served:
        raise RuntimeError("no voice could be loaded: " + "; ".join(left_out.values()))
    voice, rate, aligned = served[0]
    measured = _measure(voice, rate, aligned) if measure else None

    def handle(kind: str, payload: Any) -> tuple:
        number, *rest = payload
        voice, rate, aligned = served[number]
        if kind == "phonemize":
            return ("pieces", phonemize(voice, *rest))
        if kind == "measure":
            return ("measured", _timed_speak(voice, rate, aligned, rest[0]))
        audio, alignment = speak(voice, rest[0], aligned, *rest[1:])
        return ("audio", (audio.tobytes(), alignment))
    return (rate, aligned, measured, left_out), handle


def _measure(voice: Any, rate: int, aligned: bool) -> Timed:
    """SPEED_SAMPLE spoken twice, timed: how much faster than real time this machine speaks
    (speech / wall), and how much of the CPU it asked for the worker had meanwhile (CPU / wall)."""
    pieces = [phonemes for phonemes, _ in phonemize(voice, SPEED_SAMPLE)[1]]
    times = [_timed_speak(voice, rate, aligned, piece) for piece in pieces for _ in range(2)]
    speech, wall, cpu = (sum(column) for column in zip(*times))
    return speech, wall, cpu


def _timed_speak(voice: Any, rate: int, aligned: bool, phonemes: list[str]) -> Timed:
    """A piece spoken: its seconds of speech, and the wall and CPU seconds it took (the
    process's CPU time counts every thread of ONNX Runtime's)."""
    cpu, wall = time.process_time(), time.perf_counter()
    samples = len(speak(voice, phonemes, aligned)[0])
    return samples / rate, time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    serve_worker(_start)


if __name__ == "__main__":
    main()
