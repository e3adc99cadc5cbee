"""What an engine declares of itself to the server process, which has no model: everything the
front doors and the stream service ask of an engine without generating (its name, rate, options,
voices, languages, speakers, which voices are cloned here, its text rules' portable copy, its
LoRA adapters), as plain data (msgpack's types). Made in the engine process, once the engine has
loaded and again whenever it changes (`Declared`); its text part (`declare_text`) also once the
engine is built, before its load (the first `State`); read by `view.EngineView`.

Every field comes from the engine contract's own verbs (`vox_ws/engine.py`): an engine of
another package declares itself with no code of its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..engine import Engine, Loras, OptionSpec

# Registered voices listed with their pin summaries at most (VoxCPM2 keeps 1024 built).
MAX_DECLARED_VOICES = 4096


def declare(engine: Engine) -> dict[str, Any]:
    """The engine, as the server's copy of it reads it."""
    voices = engine.voices
    names = list(voices.names())
    return {
        "name": engine.name,
        "model": engine.model,
        "notice": engine.notice,
        "device": engine.device,
        "sample_rate": engine.sample_rate,
        "max_step_batch": engine.max_step_batch,
        "can_park": engine.can_park,
        "supports_voices": engine.supports_voices,
        "voice_sample_rate": engine.voice_sample_rate,
        "cuts_texts": engine.cuts_texts,
        "word_timings": engine.word_timings,
        "phoneme_timings": engine.phoneme_timings,
        "languages": list(engine.languages),
        "options": {name: option_spec(spec) for name, spec in engine.options.items()},
        "honoured_options": sorted(engine.honoured_options),
        "slot_sizing": engine.slot_sizing is not None,
        "voices": declare_voices(engine, names),
        "text": declare_text(engine),
        "loras": engine.loras.describe(),
        # An engine whose adapters role is the contract's own has none at all (Piper).
        "loras_supported": type(engine.loras).pin is not Loras.pin,
    }


def declare_text(engine: Engine) -> dict[str, Any]:
    """How the engine takes text: whether it says IPA phonemes, its text rules' portable copy,
    whether it follows instructions. Declared once the engine is built, before its load, too
    (`State`): the server checks its lexicon's pronunciations against it at its start, as it
    did against the engine object itself before engines had processes of their own."""
    portable = engine.text.portable()
    return {"takes_phonemes": engine.takes_phonemes,
            "portable": list(portable) if portable is not None else None,
            "follows_instructions": engine.text.follows_instructions(None)}


def declare_voices(engine: Engine, names: list[str]) -> dict[str, Any]:
    voices = engine.voices
    bare = list(dict.fromkeys(name.partition(":")[0] for name in names))
    registered = voices.registered()[-MAX_DECLARED_VOICES:]
    folder = voices.folder()
    return {
        "names": names,
        "languages": {name: list(voices.languages(name)) for name in bare},
        "default_languages": list(voices.languages(None)),
        "speakers": {name: list(speakers) for name in bare if (speakers := voices.speakers(name))},
        "descriptions": {name: voices.description(name) for name in bare},
        "not_served": dict(voices.not_served()),
        # What the text rules read of each voice's pin (`Voices.summary`), where anything:
        # the server's copy then pins these voices in the engine (`Pin`) for its streams.
        "pins": {voice: summary for voice in [*bare, *registered]
                 if (summary := _summary(engine, voice)) is not None},
        "registered": registered,
        "rescan_every_s": voices.rescan_every_s,
        "folder": None if folder is None else {"path": folder.path, "named_at_start": sorted(folder.named_at_start),
                                                "kept_files": sorted(folder.kept_files)},
    }


def _summary(engine: Engine, voice: str) -> Any:
    try:
        return engine.voices.summary(engine.voices.pin(voice))
    except Exception:  # noqa: BLE001 - a voice that cannot be pinned now has nothing to declare
        return None


def option_spec(spec: OptionSpec) -> dict[str, Any]:
    return {**dataclasses.asdict(spec), "kind": spec.kind.__name__}


_KINDS = {"bool": bool, "int": int, "float": float}


def read_option_spec(data: dict[str, Any]) -> OptionSpec:
    return OptionSpec(**{**data, "kind": _KINDS[data["kind"]]})
