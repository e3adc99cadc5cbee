"""Voice names that clients send by habit, mapped onto voices this server has.

OpenAI-style tools send OpenAI's voice names (`alloy` ... `cedar`) whatever the server; a user
may want names of their own. An alias maps a name onto a built-in voice, or onto a voice the
engine designs from words (`instructions`, with a pinned `seed` so that the voice stays the same
from one request to the next). A request naming an alias gets the alias's voice, its
instructions unless the request has its own, and its options under the request's own.

`--voice-aliases FILE` (JSON or TOML) adds its names to the defaults, its own winning where a
name is both; `false` takes a default name away:

    # TOML                                    // JSON
    alloy = "joe"                             {"alloy": "joe",
    echo = false                               "echo": false,
    slow-joe = { voice = "joe", speed = 0.8 }  "slow-joe": {"voice": "joe", "speed": 0.8},
    [nova]                                     "nova": {"engine": "voxcpm",
    engine = "voxcpm"                                   "instructions": "A young woman, bright.",
    instructions = "A young woman, bright."             "options": {"seed": 7}}}
    options = { seed = 7 }

`engine = "voxcpm"`: that engine's alone (a voice designed from words is VoxCPM2's); another
engine leaves it out quietly and keeps its default `nova`.

The defaults give OpenAI's names distinct voices where the engine has them: its built-in voices
of the default voice's language (Piper with several voices), else designed voices (VoxCPM2),
else its default voice. Each name keeps its built-in voice when voices come and go
(`default_voice_for`): a voice added takes only the names it ranks first for, a voice taken away
gives up only its own. (They were dealt in turn over every voice, and one more voice in a folder
changed what almost every name sounded like.) They are OpenAI's clients' names: Wyoming's
`describe` lists an alias only where the aliases file names it.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ...codecs import MAX_SPEED, MIN_SPEED
from ...engine import Engine
from ...files import FileTooLarge, read_regular_file
from .lookalikes import name_key

try:
    import tomllib
except ImportError:                       # Python 3.10
    import tomli as tomllib

OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse",
                 "marin", "cedar")
# What each of OpenAI's voices sounds like, in words an engine that designs voices follows.
DESIGNED = {
    "alloy": "A calm, neutral adult voice, clear and even.",
    "ash": "A warm, deep male voice, relaxed and friendly.",
    "ballad": "A gentle, expressive male voice with a soft storytelling tone.",
    "coral": "A bright, cheerful female voice, warm and lively.",
    "echo": "A steady, clear male voice, measured and confident.",
    "fable": "A lively, expressive narrator with a British accent.",
    "nova": "A young, energetic female voice, bright and upbeat.",
    "onyx": "A deep, authoritative male voice, slow and resonant.",
    "sage": "A calm, thoughtful female voice, soft and unhurried.",
    "shimmer": "A soft, airy female voice, light and soothing.",
    "verse": "A versatile, animated male voice, warm and expressive.",
    "marin": "A natural, conversational female voice, clear and friendly.",
    "cedar": "A natural, conversational male voice, grounded and warm.",
}
MAX_ALIASES = 256
MAX_FILE_BYTES = 1 << 20
_ALIAS_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class Alias:
    name: str
    voice: str | None = None                 # a built-in voice; None: the engine's default
    instructions: str | None = None          # a voice designed from words, where the engine can
    options: Mapping[str, Any] = field(default_factory=dict)
    speed: float = 1.0                       # times the request's own speed
    # Served by this engine only: one file for several engines (a voice designed from words is
    # VoxCPM2's); another engine leaves it out without an error, its default name kept.
    engine: str | None = None

    def describe(self) -> dict[str, Any]:
        described: dict[str, Any] = {"voice": self.voice}
        if self.speed != 1.0:
            described["speed"] = self.speed
        if self.instructions:
            described["instructions"] = self.instructions
        if self.options:
            described["options"] = dict(self.options)
        return described


def default_aliases(engine: Engine) -> dict[str, Alias]:
    builtin = engine.voices.names()
    if builtin:
        # The voices of the default voice's language (any region): what OpenAI's clients send
        # is in the server's language, and a German voice reads English badly.
        home = _language_family(engine.voices.languages(None))
        speaking = [voice for voice in builtin if _language_family(engine.voices.languages(voice)) == home]
        return {name: Alias(name, default_voice_for(name, speaking or builtin)) for name in OPENAI_VOICES}
    if engine.text.follows_instructions(None):
        seeded = "seed" in engine.options
        return {name: Alias(name, None, DESIGNED[name], {"seed": zlib.crc32(name.encode())} if seeded else {})
                for name in OPENAI_VOICES}
    return {name: Alias(name) for name in OPENAI_VOICES}


def default_voice_for(name: str, voices: list[str]) -> str:
    """The built-in voice a default name stands for: the one that ranks first for it, each
    (name, voice) pair ranked by its own hash (rendezvous hashing), whatever the other voices."""
    return max(voices, key=lambda voice: hashlib.blake2b(f"{name}\n{voice}".encode(), digest_size=8).digest())


def _language_family(languages: tuple[str, ...]) -> str:
    """`en` of `en_US` (Piper), `en-GB` or `en` (VoxCPM2): the first language's."""
    return languages[0].replace("-", "_").partition("_")[0].lower() if languages else ""


def load_aliases(path: str) -> dict[str, Alias | None]:
    """Aliases from a JSON or TOML file (by its suffix; else JSON), None for a name taken away
    (`false`); raises ValueError saying what is wrong. Which voices they name is checked against
    the engine once it has loaded (`check_aliases`)."""
    file = Path(path).expanduser()
    try:
        data = read_regular_file(file, MAX_FILE_BYTES)     # a FIFO is refused, not waited on
        if len(data) > MAX_FILE_BYTES:                      # it grew after its size was read
            raise FileTooLarge(0, f"over {MAX_FILE_BYTES} bytes")
    except OSError as exc:
        raise ValueError(f"{path}: {exc.strerror or exc}") from None
    try:
        table = tomllib.loads(data.decode()) if file.suffix.lower() == ".toml" else json.loads(data)
    except RecursionError:
        # json and tomllib refuse nesting past the recursion limit with this, which stopped the
        # start with a traceback; no alias nests past 3.
        raise ValueError(f"{path}: nested too deeply") from None
    except ValueError as exc:                               # UnicodeDecodeError is one
        raise ValueError(f"{path}: {exc}") from None
    if not isinstance(table, dict):
        raise ValueError(f"{path}: must map names to voices")
    if len(table) > MAX_ALIASES:
        raise ValueError(f"{path}: {len(table)} aliases, at most {MAX_ALIASES}")
    return {name: _alias(path, name, value) for name, value in table.items()}


def _alias(path: str, name: Any, value: Any) -> Alias | None:
    if not isinstance(name, str) or not _ALIAS_NAME.fullmatch(name):
        raise ValueError(f"{path}: alias {name!r}: names are 1-64 letters, digits, '_', '.' or '-'")
    if value is False:
        return None                                      # a default name taken away
    if isinstance(value, str) or value is None:
        return Alias(name, value or None)
    if not isinstance(value, dict):
        raise ValueError(f"{path}: alias {name!r}: a voice name, false, or a table of voice, instructions, options")
    unknown = sorted(set(value) - {"voice", "instructions", "options", "speed", "engine"})
    if unknown:
        raise ValueError(f"{path}: alias {name!r}: unknown field {unknown[0]!r}")
    voice, instructions, options = value.get("voice"), value.get("instructions"), value.get("options", {})
    if voice is not None and not isinstance(voice, str):
        raise ValueError(f"{path}: alias {name!r}: 'voice' must be a string")
    if instructions is not None and not isinstance(instructions, str):
        raise ValueError(f"{path}: alias {name!r}: 'instructions' must be a string")
    if not isinstance(options, dict):
        raise ValueError(f"{path}: alias {name!r}: 'options' must be a table")
    speed = value.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise ValueError(f"{path}: alias {name!r}: 'speed' must be a number in [{MIN_SPEED:g}, {MAX_SPEED:g}]")
    engine = value.get("engine")
    if engine is not None and not (isinstance(engine, str) and _ALIAS_NAME.fullmatch(engine)):
        raise ValueError(f"{path}: alias {name!r}: 'engine' must name an engine (piper, voxcpm)")
    return Alias(name, voice or None, instructions or None, dict(options), float(speed), engine)


def for_engine(configured: Mapping[str, Alias | None],
               engine: Engine) -> tuple[dict[str, Alias | None], list[str]]:
    """The file's aliases this engine serves (those without `engine`, and its own), and the
    names of those for another engine, which it leaves out as if the file did not name them."""
    kept = {name: alias for name, alias in configured.items()
            if alias is None or alias.engine in (None, engine.name)}
    return kept, sorted(set(configured) - set(kept))


def with_defaults(configured: Mapping[str, Alias | None], engine: Engine) -> dict[str, Alias]:
    """The defaults, with a file's aliases over them and the names it takes away (None) gone."""
    merged: dict[str, Alias | None] = {**default_aliases(engine), **configured}
    return {name: alias for name, alias in merged.items() if alias is not None}


def check_aliases(aliases: Mapping[str, Alias], engine: Engine) -> list[tuple[str, str]]:
    """What is wrong with aliases for this engine: (alias, why), one each (empty: all good)."""
    problems = []
    voices = {name_key(voice): voice for voice in engine.voices.names()}
    seen: dict[str, str] = {}                   # the aliases' names by their normal forms
    for alias in aliases.values():
        if alias.voice is not None and not engine.voices.has(alias.voice):
            problems.append((alias.name, f"no built-in voice {alias.voice!r} (built-in: {engine.voices.names()})"))
        key = name_key(alias.name)
        if engine.voices.has(alias.name) or key in voices:
            problems.append((alias.name, f"the engine has a voice of that name, or one that reads the same "
                                         f"({voices.get(key, alias.name)!r})"))
        elif key in seen:
            problems.append((alias.name, f"it reads the same as the alias {seen[key]!r}"))
        seen.setdefault(key, alias.name)
        for option, value in alias.options.items():
            spec = engine.options.get(option)
            if spec is None:
                problems.append((alias.name, f"engine {engine.name} has no option {option!r}"))
                continue
            try:
                spec.check(value)
            except ValueError as exc:
                problems.append((alias.name, f"option {option!r} {exc}"))
    return problems
