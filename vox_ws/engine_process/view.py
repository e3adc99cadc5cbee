"""The server process's copy of an engine that runs in an engine process: an `Engine` whose
attributes and roles answer from what the engine declared (`declaration.py`), never by a round
trip per request, and whose verbs that change the engine (a voice registered, a rescan, a LoRA
adapter loaded) are calls to its process (`Calls`).

    the doors, the service ──▶ EngineView.voices   names, has, check, pin (a Pin sent), languages...
                                        .text     the engine's own rules where portable (VoxCPM2's
                                                  tokenizer, Piper's sentences), else the base ones
                                        .loras    pin (a Pin sent), unloading, describe
                                        .check    voices, then the text rules
                               EngineView.voices.register / delete / rescan, .loras.load ... ──▶ a Call

A pin (a voice's, an adapter's) is held in the engine process from the stream's open to its end:
the server's pin object sends `Unpin` when it is let go (garbage-collected: a stream's pins live
as long as its generation), so no path that drops a stream can leak one. The streams on each
adapter are counted here, where they are pinned and let go: an adapter being unloaded is gone
from this copy as its last stream lets it go, before that stream's end is sent (its engine frees
the slot when the `Unpin` arrives), as it was gone before engines had processes of their own.
"""

from __future__ import annotations

import importlib
import itertools
import threading
import weakref
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ..engine import (
    Engine,
    ErrorKind,
    GenerationRequest,
    Loras,
    OptionSpec,
    Refused,
    StepResult,
    TextRules,
    VoiceFolder,
    Voices,
)
from .declaration import read_option_spec

_pins = itertools.count(1)


class Calls(Protocol):
    """What the view asks of its engine process (the proxy's side of the channel)."""

    def call_engine(self, verb: str, args: dict[str, Any], payload: bytes = b"") -> Future: ...

    def pin(self, pin: int, kind: str, name: str | None) -> None: ...

    def unpin(self, pin: int) -> None: ...


class Held:
    """A stream's hold on something of the engine process's (`Pin`): its number, let go by
    `release`, or when this is garbage-collected, whichever comes first (once)."""

    pin: int
    _release: weakref.finalize

    def release(self) -> None:
        self._release()


class VoicePin(dict, Held):
    """A held voice: what the text rules read of it (its `Voices.summary`)."""

    def __init__(self, summary: Mapping[str, Any]) -> None:
        super().__init__(summary)


class LoraPin(Held):
    def __init__(self, name: str) -> None:
        self.name = name


def _held(calls: Calls, kind: str, name: str | None, held: Held, unpin: Callable[[int], None] | None = None) -> Any:
    """`held`, pinned in the engine process as `kind` `name`; `unpin` (default: the `Unpin`
    alone) lets it go, once."""
    held.pin = next(_pins)
    calls.pin(held.pin, kind, name)
    held._release = weakref.finalize(held, unpin or calls.unpin, held.pin)
    return held


def result_of(future: Future) -> Any:
    """A call's answer, waited for on a worker thread (never the event loop)."""
    return future.result()


class DeclaredVoices(Voices):
    def __init__(self, engine: EngineView, calls: Calls) -> None:
        super().__init__(engine)
        self._calls = calls
        self.data: dict[str, Any] = {"names": [], "languages": {}, "default_languages": [], "speakers": {},
                                     "descriptions": {}, "not_served": {}, "pins": {}, "registered": [],
                                     "rescan_every_s": None, "folder": None}
        self._names: frozenset[str] = frozenset()
        self._registered: set[str] = set()

    def update(self, data: dict[str, Any]) -> None:
        self.data = data
        self._names = frozenset(data["names"])
        self._registered = set(data["registered"])

    # ------------------------------------------------------------------ read from the declaration

    def names(self) -> list[str]:
        return list(self.data["names"])

    def registered(self) -> list[str]:
        return sorted(self._registered)

    def has(self, voice: str) -> bool:
        if voice in self._names or voice in self._registered:
            return True
        name, colon, speaker = voice.partition(":")
        speakers = self.data["speakers"].get(name or self._default())
        return bool(colon) and speakers is not None and speaker.isdigit() and int(speaker) < len(speakers)

    def _default(self) -> str:
        names = self.data["names"]
        return names[0].partition(":")[0] if names else ""

    def languages(self, voice: str | None) -> tuple[str, ...]:
        name = (voice or "").partition(":")[0]
        found = self.data["languages"].get(name)
        return tuple(found if found is not None else self.data["default_languages"])

    def speakers(self, voice: str) -> tuple[str, ...]:
        return tuple(self.data["speakers"].get(voice, ()))

    def description(self, voice: str) -> str:
        return self.data["descriptions"].get(voice, voice)

    def not_served(self) -> dict[str, str]:
        return dict(self.data["not_served"])

    @property
    def rescan_every_s(self) -> float | None:  # type: ignore[override]
        return self.data["rescan_every_s"]

    def folder(self) -> VoiceFolder | None:
        folder = self.data["folder"]
        return None if folder is None else VoiceFolder(folder["path"], frozenset(folder["named_at_start"]),
                                                       frozenset(folder["kept_files"]))

    def check(self, voice: str | None) -> None:
        why = self.data["not_served"].get((voice or "").partition(":")[0])
        if why is not None:
            raise Refused(ErrorKind.INVALID, f"voice {voice!r} is not served: {why}", field="voice")
        name, colon, speaker = (voice or "").partition(":")
        speakers = self.data["speakers"].get(name or self._default())
        if colon and not self.has(voice or ""):
            if speakers:
                numbered = ", ".join(f"{n} {who}" for n, who in enumerate(speakers[:8]))
                more = f", ... {len(speakers)} in all" if len(speakers) > 8 else ""
                raise Refused(ErrorKind.INVALID, f"voice {name or self._default()!r} has no speaker {speaker!r} "
                                                 f"(its speakers, by number or name: {numbered}{more})",
                              field="voice")
            if name in self._names or not name:
                raise Refused(ErrorKind.INVALID, f"voice {name or self._default()!r} has no speaker {speaker!r} "
                                                 "(one speaker)", field="voice")
        super().check(voice)

    def pin(self, voice: str | None) -> VoicePin | None:
        self.check(voice)
        summary = self.data["pins"].get(voice) if voice is not None else None
        if summary is None:
            return None
        return _held(self._calls, "voice", voice, VoicePin(summary))

    # ------------------------------------------------------------------ calls to the engine

    def register(self, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str,
                 voice_id: str | None = None) -> dict[str, Any]:
        """Waits on its worker thread for the engine process to build the voice."""
        pcm = np.ascontiguousarray(audio, dtype="<f4")
        args = {"sample_rate": sample_rate, "transcript": transcript, "mode": mode, "voice_id": voice_id}
        return result_of(self._calls.call_engine("voices.register", args, pcm.tobytes()))

    def delete(self, voice_id: str) -> bool:
        """Gone from this copy at once (`has` is false); the engine process lets it go next."""
        had = voice_id in self._registered
        self._registered.discard(voice_id)
        if had:
            self._calls.call_engine("voices.delete", {"voice_id": voice_id})
        return had

    def disk_stamp(self) -> Any:
        return result_of(self._calls.call_engine("voices.disk_stamp", {}))

    def prepare_rescan(self) -> Any:
        """The engine process reads its voices again and serves them (its own prepare and
        apply, between two of its steps): what changed, or None."""
        return result_of(self._calls.call_engine("voices.rescan", {}))

    def apply_rescan(self, prepared: Any) -> dict[str, Any]:
        return prepared

    def discard_rescan(self, prepared: Any) -> None:
        """Nothing is held here: the engine process discards what it could not serve."""


class DeclaredText(TextRules):
    """The base rules (one piece, as written), with the engine's word on instructions."""

    def __init__(self, engine: EngineView, follows_instructions: bool = False) -> None:
        super().__init__(engine)
        self._follows = follows_instructions

    def follows_instructions(self, voice_pin: Any = None) -> bool:
        return self._follows


class DeclaredLoras(Loras):
    """An engine's adapters as last described, with the streams on each as this copy holds them
    (the module's docstring); `load` and the rest are calls to its process. Thread-safe: a pin
    may be let go on any thread (garbage-collected)."""

    def __init__(self, engine: EngineView, calls: Calls) -> None:
        super().__init__(engine)
        self._calls = calls
        self.described: dict[str, Any] = {"configured": False}
        self.supported = True                 # False: the engine has no adapters at all
        self._lock = threading.Lock()
        self._streams: Counter[str] = Counter()   # adapter name -> pins held by this server's streams

    def describe(self) -> dict[str, Any]:
        """As the engine described them, each adapter's streams those pinning it now; one being
        unloaded that none pins any more is gone."""
        described = self.described
        if "adapters" not in described:
            return described
        with self._lock:
            streams = dict(self._streams)
        adapters = [{**a, "streams": streams.get(a["name"], 0)} for a in described["adapters"]
                    if a["state"] != "unloading" or streams.get(a["name"], 0) > 0]
        return {**described, "adapters": adapters}

    def _adapter(self, name: str) -> dict[str, Any] | None:
        return next((a for a in self.described.get("adapters", ()) if a["name"] == name), None)

    def pin(self, name: str | None) -> LoraPin | None:
        described = self.described
        if name is None:
            name = described.get("default")
            if name is None:
                return None
        elif not self.supported:
            raise self._unsupported(field="lora")
        elif not described.get("configured"):
            raise Refused(ErrorKind.UNSUPPORTED, "LoRA is not configured: start the server with --lora-rank N",
                          field="lora")
        adapter = self._adapter(name)
        if adapter is None:
            loaded = sorted(a["name"] for a in described.get("adapters", ()) if a["state"] == "loaded")
            raise Refused(ErrorKind.INVALID, f"unknown LoRA adapter {name!r} (loaded: {loaded})", field="lora")
        if adapter["state"] == "unloading":
            raise Refused(ErrorKind.INVALID, f"LoRA adapter {name!r} is being unloaded: {self._streams[name]} "
                                             "stream(s) still speak with it, no new one may", field="lora")
        with self._lock:
            self._streams[name] += 1
        return _held(self._calls, "lora", name, LoraPin(name), lambda number, name=name: self._let_go(number, name))

    def _let_go(self, pin: int, name: str) -> None:
        with self._lock:
            self._streams[name] -= 1
            if self._streams[name] <= 0:
                del self._streams[name]
        self._calls.unpin(pin)

    def unpin(self, pin: Any) -> None:
        if isinstance(pin, LoraPin):
            pin.release()

    def unloading(self, pin: Any, name: str) -> bool:
        if not isinstance(pin, LoraPin) or pin.name != name:
            return False
        adapter = self._adapter(name)
        return adapter is None or adapter["state"] == "unloading"

    def read(self, name: str | None) -> Any:
        """Nothing is read here: the engine process reads the file (`load`), and says what is
        wrong with it."""
        if not self.supported:
            raise self._unsupported()
        if not self.described.get("configured"):
            raise Refused(ErrorKind.UNSUPPORTED, "LoRA is not configured: start the server with --lora-rank N")
        return name

    def load(self, adapter_file: Any) -> dict[str, Any]:
        return result_of(self._calls.call_engine("loras.load", {"name": adapter_file}))

    def unload(self, name: str | None) -> dict[str, Any]:
        return result_of(self._calls.call_engine("loras.unload", {"name": name}))

    def set_default(self, name: str | None) -> dict[str, Any]:
        return result_of(self._calls.call_engine("loras.set_default", {"name": name}))

    def clear_default(self) -> dict[str, Any]:
        return result_of(self._calls.call_engine("loras.clear_default", {}))


class EngineView(Engine):
    """The engine of one engine process, as the server reads it. Before its first declaration
    it knows what its plugin says (its name, its options); the rest comes once it has loaded."""

    def __init__(self, calls: Calls, name: str, options: Mapping[str, OptionSpec] | None = None,
                 device: str = "cpu") -> None:
        self.name = name
        self.device = device
        self.options = dict(options or {})
        self._honoured = frozenset(self.options)
        self.declaration: dict[str, Any] | None = None
        self.described: dict[str, Any] | None = None
        self.voices = DeclaredVoices(self, calls)
        self.loras = DeclaredLoras(self, calls)
        self.text = DeclaredText(self)
        self._portable: Any = None

    def declare(self, data: dict[str, Any]) -> None:
        """A declaration from the engine process: everything it says is what it is now."""
        self.declaration = data
        # Its device stays the server's name for it (an engine process sees its GPU as cuda:0).
        for attribute in ("name", "model", "notice", "sample_rate", "max_step_batch", "can_park",
                          "supports_voices", "voice_sample_rate", "cuts_texts", "word_timings", "phoneme_timings"):
            setattr(self, attribute, data[attribute])
        if self.device == "auto":            # the engine's choice, as it made it
            self.device = data["device"]
        self.languages = tuple(data["languages"])
        self.options = {name: read_option_spec(spec) for name, spec in data["options"].items()}
        self._honoured = frozenset(data["honoured_options"])
        self.voices.update(data["voices"])
        self.loras.described = data["loras"]
        self.loras.supported = data["loras_supported"]
        self.declare_text(data["text"])

    def declare_text(self, text: dict[str, Any]) -> None:
        """How the engine takes text (`declaration.declare_text`): with its whole declaration,
        and before it, once the engine is built (its first `State`)."""
        self.takes_phonemes = text["takes_phonemes"]
        portable = tuple(text["portable"]) if text["portable"] is not None else None
        if portable is None:
            self.close()                             # the rules before, and what they started
            self.text = DeclaredText(self, text["follows_instructions"])
        elif portable != self._portable:
            module, _, cls = portable[0].partition(":")
            self.close()
            self.text = getattr(importlib.import_module(module), cls).from_settings(self, portable[1])
        self._portable = portable

    @property
    def honoured_options(self) -> frozenset[str]:
        return self._honoured

    def describe(self) -> dict[str, Any]:
        return dict(self.described) if self.described is not None else super().describe()

    def close(self, deadline: float | None = None) -> None:
        """What this copy started (the text rules' normaliser process, where they have one)."""
        close = getattr(self.text, "close", None)
        if close is not None:
            close(deadline)

    def load(self) -> None:
        raise RuntimeError("the engine loads in its own process")

    def prefill(self, request: GenerationRequest) -> None:
        raise RuntimeError("the engine generates in its own process")

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        raise RuntimeError("the engine generates in its own process")
