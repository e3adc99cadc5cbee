"""The engine interface: what a speech model must do to be served, in the engine layer's words.

An engine is driven by the engine loop (`vox_ws.scheduling`) on one thread: `prefill` a newly
admitted request, `step` a batch of active requests (each step yields a piece of audio per
request and says when one is finished), `release` what a request held. It knows no socket, no
stream and no wire format: it refuses work with `Refused(kind, message)` and ends requests with
an `EndReason`; each front door maps those to its own codes and statuses.

An engine also declares the generation options it honours (`options`: ranges and defaults),
so that front doors can validate requests against the engine actually served. What it does
besides generating is in role objects, each with plain verbs: `engine.voices` (built-in and
cloned voices), `engine.text` (preparing and cutting texts, instructions, pronunciations) and
`engine.loras` (LoRA adapters).
"""

from __future__ import annotations

import enum
import itertools
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Protocol

import numpy as np


class ErrorKind(str, enum.Enum):
    """Why a request or stream was refused or failed. Front doors map these to wire codes."""

    INVALID = "invalid"              # the request is malformed or names what does not exist
    TOO_LARGE = "too_large"          # over a limit (text, audio, context)
    UNSUPPORTED = "unsupported"      # this engine or server cannot do it
    BUSY = "busy"                    # every slot taken and the queue full
    NOT_READY = "not_ready"          # still loading, or failed to load
    INTERNAL = "internal"            # the engine failed
    UNAVAILABLE = "unavailable"      # the engine can no longer serve anyone (`EngineFailure`)
    # Raised by the stream service, never by an engine:
    TIMEOUT = "timeout"              # an input stream received nothing for too long
    SLOW_CONSUMER = "slow_consumer"  # the consumer stopped taking audio
    GOING_AWAY = "going_away"        # the server is draining

    @property
    def retryable(self) -> bool:
        return self in _RETRYABLE


_RETRYABLE = frozenset({ErrorKind.BUSY, ErrorKind.NOT_READY, ErrorKind.TIMEOUT, ErrorKind.SLOW_CONSUMER,
                        ErrorKind.GOING_AWAY, ErrorKind.UNAVAILABLE})


class Refused(Exception):
    """Work the engine (or the stream service) will not do, and why; for a refusal that may
    pass later, when to try again (seconds, estimated), where that is known; for a bad field of
    the request, which (`field`, e.g. "options.cfg_value"), so a front door can name it."""

    def __init__(self, kind: ErrorKind, message: str, retry_after_s: float | None = None,
                 field: str | None = None) -> None:
        super().__init__(message)
        self.kind = kind
        self.message = message
        self.retry_after_s = retry_after_s
        self.field = field


class Readiness(str, enum.Enum):
    """Whether the model can serve: each device's engine loop has one (loading -> ready | failed;
    ready -> failed), the device set answers for all of them (`Devices.status`), and the server
    adds draining (`ServerState.status`). Its value is what `/readyz`, `/v1/info` and `hello` say."""

    LOADING = "loading"
    COMPILING = "compiling"      # loaded, its step being compiled (`Engine.loading_phase`)
    READY = "ready"
    FAILED = "failed"
    DRAINING = "draining"

    def __str__(self) -> str:          # the value in messages, on every Python
        return self.value


class EndReason(str, enum.Enum):
    DONE = "done"              # the model finished
    CANCELLED = "cancelled"    # the consumer cancelled
    MAX_LEN = "max_len"        # a length cap was reached


class RequestStatus(str, enum.Enum):
    """Where a generation request is in its device's slot queue (`scheduling/queue.py`), which
    alone moves it on, by its table of moves:

    NEW -> WAITING -> PREFILLING -> RUNNING -> FINISHED, with RUNNING -> PARKED -> RUNNING where
    the engine can pause a prefilled request (`Engine.can_park`); any of them -> FINISHED when
    it is cancelled, refused or fails."""

    NEW = "new"                  # made, not yet submitted
    WAITING = "waiting"          # in the queue for a slot
    PREFILLING = "prefilling"    # taken from the queue, its prompt going into the engine
    RUNNING = "running"          # holds a slot: stepped every turn its reader keeps up
    PARKED = "parked"            # prefilled, gave its slot back; resumes where it was
    FINISHED = "finished"        # done, cancelled or failed: its engine state released

    def __str__(self) -> str:
        return self.value


class EngineFailure(Exception):
    """The engine can no longer serve anyone (a helper process died, the device is gone).

    Raised from `step` or `prefill_many` (or returned by it for a request), it ends the engine
    loop's thread, instead of failing one batch and stepping a broken engine again: its streams
    fail `UNAVAILABLE` (the same request may succeed elsewhere), its device takes no more. The
    engine loop raises one itself for an error that means the device is lost
    (`accelerator.device_lost`)."""


# Voice-cloning modes, as engines understand them.
VOICE_MODES = ("reference", "continuation", "both")


# --------------------------------------------------------------------------- options


@dataclass(frozen=True)
class OptionSpec:
    """One generation option: its type, accepted range, default and meaning."""

    kind: type                 # bool, int or float
    low: float | None = None
    high: float | None = None
    default: Any = None
    help: str = ""

    def check(self, value: Any) -> Any:
        """The value in this option's type; raises ValueError saying what is wrong."""
        if self.kind is bool:
            if not isinstance(value, bool):
                raise ValueError(f"must be a boolean, got {type_name(value)}")
            return value
        # bool is an int subclass in Python; a client sending true for a number is a bug.
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"must be a number, got {type_name(value)}")
        if self.kind is int:
            if isinstance(value, float):
                if not value.is_integer():
                    raise ValueError(f"must be an integer, got {value}")
                value = int(value)
        else:
            value = float(value)
            if not math.isfinite(value):
                raise ValueError("must be finite")
        if (self.low is not None and value < self.low) or (self.high is not None and value > self.high):
            raise ValueError(f"must be in [{self.low}, {self.high}], got {value}")
        return value


def type_name(value: Any) -> str:
    """A value's type in the words of msgpack and JSON."""
    return {dict: "map", list: "array", str: "string", bytes: "binary", type(None): "nil"}.get(
        type(value), type(value).__name__)


# --------------------------------------------------------------------------- requests


class RequestSink(Protocol):
    """Where a request's results go. Called from the engine loop's thread; must not block."""

    def deliver(self, pcm: np.ndarray, words: list[tuple[str, int, int]] | None = None,
                phonemes: list[tuple[str, int, int]] | None = None) -> None: ...

    def finish(self, reason: EndReason) -> None: ...

    def fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None: ...

    def backlogged(self) -> bool:
        """True while the consumer has not taken enough of what was already delivered: skip stepping."""
        ...

    def audio_ahead_s(self) -> float:
        """Seconds of audio delivered beyond what a real-time listener has played since the
        first chunk (negative once the listener would be waiting); before any audio, how
        urgent the first is, in the same terms."""
        ...


@dataclass(eq=False)
class GenerationRequest:
    """One generation job: what to say, how, and where the audio goes."""

    text: str
    sink: RequestSink
    voice: str | None = None
    # What `Engine.voices.pin` returned when the stream opened: the voice itself, kept for the
    # stream's whole life even if the voice is deleted meanwhile.
    voice_pin: Any = None
    # What `Engine.loras.pin` returned when the stream opened: its LoRA adapter (None: none),
    # kept loaded until the stream ends.
    lora_pin: Any = None
    options: dict[str, Any] = field(default_factory=dict)
    id: int = field(default_factory=itertools.count(1).__next__)
    # Where it is in its slot queue (moved on by the queue alone, under the engine loop's lock).
    status: RequestStatus = RequestStatus.NEW
    # Engine-private per-request state, created by Engine.prefill.
    state: Any = None
    # Input streaming: what the previous segment left for this one to continue from (prosody),
    # and whether the engine should leave such a continuation for the next segment.
    context: Any = None
    keep_continuation: bool = False
    continuation: Any = None
    # The text went through `Engine.text.prepare` already.
    prepared: bool = False
    # Pronunciations (a `lexicon.Lexicon`) for engines that take phonemes (`takes_phonemes`),
    # which apply them as they phonemize; other engines are given the text respelled. The
    # stream service gives those the text matches, found off the event loop (`found_in`).
    pronunciations: Any = None
    # How to speak it, in words ("a calm, low voice"), for engines that follow such
    # instructions (`Engine.text.follows_instructions`); others ignore it.
    instructions: str | None = None
    # The text's language (a BCP 47 tag or Piper's en_US), where the client said it: how the
    # text is cut and normalised; None: the voice's, or found in the text.
    language: str | None = None
    steps: int = 0
    submitted_at: float = field(default_factory=time.monotonic)
    admitted_at: float | None = None      # when it first took a slot (the queue's pace is measured from it)
    # Who the request is for, broadest first (a token or address, then a connection): the
    # slot queue shares slots fairly among these. Empty: nobody in particular.
    owners: tuple[str, ...] = ()

    @property
    def parked(self) -> bool:
        return self.status is RequestStatus.PARKED


@dataclass
class StepResult:
    """What one step produced for one request. `finished` is set when the request is done."""

    audio: np.ndarray | None = None
    finished: EndReason | None = None
    # The words spoken in `audio`, where the engine knows when: (word, first sample, end sample)
    # counted from the start of `audio`, at the engine's rate.
    words: list[tuple[str, int, int]] | None = None
    # The same for each phoneme (IPA), where the engine knows (`Engine.phoneme_timings`).
    phonemes: list[tuple[str, int, int]] | None = None


# --------------------------------------------------------------------------- roles


class Role:
    """An engine's role object (`Engine.voices`, `.text`, `.loras`), made from the engine on first
    use: `factory(engine)`. An engine may also set its own in `__init__` (the instance's wins)."""

    def __init__(self, factory: Callable[[Engine], Any]) -> None:
        self.factory = factory
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Engine | None, owner: type) -> Any:
        if engine is None:
            return self
        role = engine.__dict__[self.name] = self.factory(engine)
        return role


@dataclass(frozen=True)
class VoiceFolder:
    """The folder an engine reads its built-in voices from, to which an operator may add voices
    and from which remove them while it serves (Piper's voices folder): where it is, and the
    voices named at start (`--piper-voice NAME`), which must stay: by the names they are served
    by, and by the files they are read from (`kept_files`: wherever those are, by whatever name
    the folder holds them)."""

    path: str
    named_at_start: frozenset[str] = frozenset()
    kept_files: frozenset[str] = frozenset()


class Voices:
    """An engine's voices: the built-in ones by name and, where the engine clones voices
    (`Engine.supports_voices`), those built from reference audio. The event loop calls every
    verb but `register`, which runs on a worker thread beside the steps: it must only read what
    the steps use. This one has no voice of its own and clones none."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def names(self) -> list[str]:
        """The built-in voices."""
        return []

    def has(self, voice: str) -> bool:
        return voice in self.names()

    def languages(self, voice: str | None) -> tuple[str, ...]:
        """The languages one voice speaks (None: the default voice). Cheap."""
        return self.engine.languages

    def speakers(self, voice: str) -> tuple[str, ...]:
        """The speakers of a voice that has several (each also a voice, `voice:speaker`)."""
        return ()

    def description(self, voice: str) -> str:
        """A built-in voice in a few words, for a picker that shows these rather than names
        (Home Assistant's): unique among the voices of a language. Here its name."""
        return voice

    def check(self, voice: str | None) -> None:
        """Refuse an unknown voice."""
        if voice is not None and not self.has(voice):
            # Door-neutral: each door knows what its clients may do (Wyoming's cannot register).
            hint = "; or a registered voice's id, or its name" if self.engine.supports_voices else ""
            raise Refused(ErrorKind.INVALID, f"unknown voice {voice!r} (built-in: {self.names()}{hint})",
                          field="voice")

    def pin(self, voice: str | None) -> Any:
        """Refuse an unknown voice, or return what keeps it usable by one stream until the
        stream ends (None where voices cannot go away)."""
        self.check(voice)
        return None

    def register(self, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str,
                 voice_id: str | None = None) -> dict[str, Any]:
        """Build a reusable voice prompt from reference audio; returns {voice, mode, audio_s}.
        `voice_id`: keep it under this id (the same voice on another device, or rebuilt from
        the voice store); else the engine makes one. Never evicts another voice: refuses (BUSY)
        when it holds as many as it can."""
        raise Refused(ErrorKind.UNSUPPORTED, f"engine {self.engine.name} cannot clone voices")

    def delete(self, voice_id: str) -> bool:
        return False

    def registered(self) -> list[str]:
        """The cloned voices built here, by id (`has` is true of each)."""
        return []

    def summary(self, pin: Any) -> Any:
        """What of a pin (`pin`'s answer) the engine's text rules read, as plain data (numbers,
        strings, lists, maps); None where they read nothing. The server's copy of the engine, in
        another process than the model's, hands its text rules this where the engine hands its
        own the pin (`TextRules.portable`)."""
        return None

    def not_served(self) -> dict[str, str]:
        """Voices found (on disk) that are not served, and why: a stream naming one is told so."""
        return {}

    # Built-in voices read from disk may change while the server runs (Piper's voices folder):
    # the stream service reads them again on SIGHUP, and where this is set polls `disk_stamp`
    # every so many seconds (`service.voices.rescans`). None: never polled.
    rescan_every_s: float | None = None

    def disk_stamp(self) -> Any:
        """What changes when the voices on disk do (a folder's listing); cheap, any thread but the
        event loop's. None: nothing on disk to watch."""
        return None

    def prepare_rescan(self) -> Any:
        """Read the voices on disk again and load those added or changed, on a thread of its
        own (slow: never the engine loop's or the event loop's); what `apply_rescan` serves,
        or None where nothing changed."""
        return None

    def apply_rescan(self, prepared: Any) -> dict[str, Any]:
        """Serve what `prepare_rescan` read, on the engine loop's thread between two steps;
        what changed: {"added", "removed", "left_out"} (voice names)."""
        return {}

    def discard_rescan(self, prepared: Any) -> None:
        """Free what `prepare_rescan` loaded where it will not be served (its device stopped)."""

    def folder(self) -> VoiceFolder | None:
        """The folder of built-in voices voices may be fetched into (`service.voices.fetches`);
        None: no such folder (voices are not files, or not the server's to change)."""
        return None


class TextRules:
    """How an engine takes text: whether and how a text is prepared (normalised) and cut into
    pieces that fit one generation, whether instructions change its speech, which
    pronunciations it can say. This one: one piece, as written, no instructions, respellings
    only (or IPA where the engine `takes_phonemes`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def needs_preparing(self, options: dict[str, Any], language: str | None = None) -> bool:
        """Whether a text with these options, in this language (None: not said), needs
        `prepare` before it is queued."""
        return False

    def prepare(self, text: str, options: dict[str, Any], language: str | None = None) -> str:
        """Costly work on a text (normalisation) before its request is queued: it runs on a
        preparation thread of the stream service, never on the engine loop's thread or the event
        loop, so it holds up no one else. Thread-safe. Raises Refused."""
        return text

    def split(self, text: str, options: dict[str, Any], voice_pin: Any = None,
              language: str | None = None) -> list[str]:
        """Cut a text too long for one generation into pieces that each fit, to be generated
        one after another on one stream (each continuing from the one before), at sentence
        ends in its language. The default: one piece (the engine bounds its own work)."""
        return [text]

    def added_silence_s(self, text: str, options: dict[str, Any], voice: str | None = None,
                        language: str | None = None) -> float:
        """Seconds of silence the engine adds of its own speaking `text` with these options
        (Piper's `sentence_silence` after each sentence), before any change of speed: the
        stream service counts them with a request's breaks against one bound. Cheap: the
        event loop calls it. The default: none."""
        return 0.0

    def slowing(self, options: dict[str, Any]) -> float:
        """How many times slower than the voice's own pace these options make speech (Piper's
        `length_scale`): the stream service bounds it with the output's speed. The default: 1."""
        return 1.0

    def follows_instructions(self, voice_pin: Any = None) -> bool:
        """Whether `GenerationRequest.instructions` change the speech with this voice."""
        return False

    def check_pronunciation(self, item: Any) -> None:
        """Refuse a pronunciation (a `lexicon.Pronunciation`) this engine cannot say: IPA, unless
        it takes phonemes. Cheap: the event loop calls it."""
        if item.ipa is not None and not self.engine.takes_phonemes:
            raise Refused(ErrorKind.UNSUPPORTED, f"pronunciation {item.match!r}: engine {self.engine.name} cannot "
                                                 "say IPA phonemes; give a respelling ('say')")

    def check(self, request: GenerationRequest, pin: Any) -> None:
        """Refuse a request whose text this engine cannot take (too long for its context, say),
        `pin` being its voice's pin (or its `Voices.summary`, in the server's copy). Cheap: the
        event loop calls it (`Engine.check`). The default: any text."""

    def portable(self) -> tuple[str, dict[str, Any]] | None:
        """How the server process, which has no model, makes its own copy of these rules: a
        class (`"module:Class"`, importable without torch or any model library) whose
        `from_settings(engine, settings)` takes the plain `settings` given here, its `engine`
        then being the server's copy (`engine_process/view.py`), its pins `Voices.summary`s.
        None: the server's copy follows the base rules (one piece, as written)."""
        return None


class Loras:
    """An engine's LoRA adapters: a stream pins one (its own, or the default) at its start; an
    admin loads, unloads and sets the default on every device. `pin`, `unpin`, `unloading` and
    `describe` are called by the event loop; `read` on a worker thread; `load`, `unload`,
    `set_default` and `clear_default` on the engine loop's thread, between two steps. This one has no
    LoRA support."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def _unsupported(self, field: str | None = None) -> Refused:
        return Refused(ErrorKind.UNSUPPORTED, f"engine {self.engine.name} has no LoRA support", field=field)

    def pin(self, name: str | None) -> Any:
        """The adapter a new stream speaks with (`name`, or the default where it names none),
        held until `unpin`; None: the base model. Refuses an adapter that is not loaded."""
        if name is not None:
            raise self._unsupported(field="lora")
        return None

    def unpin(self, pin: Any) -> None:
        """The stream that pinned it has ended."""

    def unloading(self, pin: Any, name: str) -> bool:
        """Whether `pin` is the adapter `name` and it is being unloaded (the service ends its
        streams once the unload's time is up)."""
        return False

    def read(self, name: str | None) -> Any:
        """Read and check an adapter from disk, for `load` on every device."""
        raise self._unsupported()

    def load(self, adapter_file: Any) -> dict[str, Any]:
        """Put what `read` read into a free slot."""
        raise self._unsupported()

    def unload(self, name: str | None) -> dict[str, Any]:
        raise self._unsupported()

    def set_default(self, name: str | None) -> dict[str, Any]:
        """Make `name` (None: the one loaded) the adapter of streams that name none."""
        raise self._unsupported()

    def clear_default(self) -> dict[str, Any]:
        raise self._unsupported()

    def describe(self) -> dict[str, Any]:
        return {"configured": False}


class SlotSizing(Protocol):
    """`--slots auto` sized again while serving (`Engine.slot_sizing`; Piper's:
    `engines/speed_slots.py`), used by the engine loop's thread alone."""

    def wait_s(self) -> float | None:
        """Seconds until it wants to measure again (0: now); None: never again."""
        ...

    def measure(self) -> Iterator[None]:
        """A measure, one short piece of engine work at each `next`, run by the loop between
        turns while no request is queued or running; closed unfinished when one comes."""
        ...

    def slots(self) -> tuple[int, str]:
        """The slots, and why, as the latest completed measure sizes them."""
        ...

    def describe(self) -> dict[str, Any]:
        """How they were measured (/v1/info's `slots_measure`)."""
        ...


# --------------------------------------------------------------------------- the interface


class Engine(ABC):
    """A speech model behind the engine loop, in roles. The verbs here run on the engine loop's
    thread, except `describe` and `check`, which the event loop may call at any time. Its
    `voices`, `text` and `loras` say which thread calls what of them."""

    name: str = "engine"
    model: str = ""
    # What the operator should know about this choice of engine ("a GPU is present but VoxCPM2
    # is not served: ..."), set where `auto` chose it; shown in the log, `hello` and /v1/info.
    notice: str = ""
    device: str = "cpu"
    sample_rate: int = 0
    # How many requests one `step` call may advance together (its rows: compute); 1 means it
    # cannot batch. It may be fewer than the engine loop's slots (memory: streams open at once):
    # each step then carries the requests whose listeners run out of audio soonest.
    max_step_batch: int = 1
    # Whether a prefilled request may wait out of the active set and resume later with its state
    # (true where that state holds no memory worth a slot): the engine loop then takes slots back
    # from a client holding more than its share while others wait.
    can_park: bool = False
    # The generation options this engine honours, with ranges and defaults.
    options: Mapping[str, OptionSpec] = {}
    # Whether `voices.register` can clone a voice from reference audio, and the sample rate it
    # wants that audio in (None: any; the stream service resamples before engine work).
    supports_voices: bool = False
    voice_sample_rate: int | None = None
    # Whether `text.split` may cut a text (it then costs a tokenisation or more, done off the
    # event loop for long texts); False: every text is one piece, queued at once.
    cuts_texts: bool = False
    # Whether steps report when each word is spoken (`StepResult.words`), from the model's own
    # durations; engines that cannot know do not guess.
    word_timings: bool = False
    # Whether steps report when each phoneme is spoken (`StepResult.phonemes`), likewise.
    phoneme_timings: bool = False
    # Whether it says words as given phonemes (IPA pronunciations, `GenerationRequest.pronunciations`).
    takes_phonemes: bool = False
    # The languages its voices speak (BCP 47 tags, or Piper's en_US), for the doors that list
    # them (`hello`, `/v1/info`, Wyoming's `describe`); empty where unknown.
    languages: tuple[str, ...] = ()
    # Set by `load` while it is in a phase worth reporting ("compiling"), for readiness.
    loading_phase: str | None = None
    # Set by `load` where `slots()` may change while serving (measured again): the engine loop
    # sizes its slots again with it under `--slots auto`. None: `slots()` is final.
    slot_sizing: SlotSizing | None = None
    # Its roles; a subclass names its own class of each (`voices = Role(MyVoices)`) or sets one.
    voices: Voices = Role(Voices)          # type: ignore[assignment]
    text: TextRules = Role(TextRules)      # type: ignore[assignment]
    loras: Loras = Role(Loras)             # type: ignore[assignment]

    @abstractmethod
    def load(self) -> None:
        """Load weights; slow; runs on the engine loop's thread before any request."""

    @property
    def honoured_options(self) -> frozenset[str]:
        """The options that change this engine's output as it is loaded now."""
        return frozenset(self.options)

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request the engine cannot serve. Called on the event loop before the
        request is queued, so it must be cheap."""
        if request.voice_pin is None:
            self.voices.check(request.voice)
        self.text.check(request, request.voice_pin)

    def slots(self) -> tuple[int, str]:
        """After `load`: how many streams this device should serve at once (its engine loop's
        slots with `--slots auto`), and how that was chosen."""
        return 8, "the default (this engine does not size itself)"

    @abstractmethod
    def prefill(self, request: GenerationRequest) -> None:
        """Prepare a newly admitted request (tokenise, prompt, caches) in `request.state`."""

    def prefill_many(self, requests: list[GenerationRequest]) -> list[BaseException | None]:
        """Prefill every request admitted in one turn; per request, None or what failed it (a
        `Refused`, or any error: it fails that request alone). Engines that can put several
        prompts through the model at once override it; this one prefills them in turn."""
        errors: list[BaseException | None] = []
        for request in requests:
            try:
                self.prefill(request)
            except Exception as exc:  # noqa: BLE001 - the engine loop fails this request alone
                errors.append(exc)
            else:
                errors.append(None)
        return errors

    @abstractmethod
    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        """Advance every request in `batch` by one generation step; one result per request."""

    def release(self, request: GenerationRequest) -> None:
        """Free what `prefill` allocated. Called once for every prefilled request."""
        request.state = None

    def close(self, deadline: float | None = None) -> None:
        """Free what `load` started (helper processes, threads). Called once, on the engine loop's
        thread, when it stops or dies; `deadline` (a `time.monotonic()` instant, the end of the
        server's shutdown) is when it must be done: a helper process that has not ended by then
        is killed (None: each its own grace, `child.STOP_GRACE_S`)."""
        return None

    def describe(self) -> dict[str, Any]:
        described = {"engine": self.name, "model": self.model, "device": self.device,
                     "sample_rate": self.sample_rate, "word_timestamps": self.word_timings}
        if self.notice:
            described["notice"] = self.notice
        return described
