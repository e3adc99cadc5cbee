"""Rules a request must pass at every front door, checked once here; each door only words the
refusal for its wire (`Refused.field` names what was wrong)."""

from __future__ import annotations

import math
import re
from typing import Any, Mapping

from ..codecs import MAX_SPEED, MIN_SPEED
from ..engine import ErrorKind, OptionSpec, Refused, type_name

# The output sample rates a client may ask for (a codec may take fewer).
MIN_SAMPLE_RATE = 8000
MAX_SAMPLE_RATE = 48000
# The range of a stream's lookahead (`AudioOutput.lookahead_s`), in seconds.
MIN_LOOKAHEAD_S = 0.1
MAX_LOOKAHEAD_S = 600.0
# The range of a stream's gain (`AudioOutput.volume`).
MAX_VOLUME = 4.0
# A language tag: BCP 47's shape (en, en-US, zh-Hant-TW), or Piper's en_US.
_LANGUAGE = re.compile(r"[A-Za-z]{2,3}(?:[-_][A-Za-z0-9]{1,8}){0,3}")
# Instructions describe a voice in a sentence or two; they are spoken to the model as text.
MAX_INSTRUCTIONS_CHARS = 500

_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: str, field: str = "text") -> None:
    """Text no engine can take is refused up front: a NUL (tokenizers and espeak stop there),
    or a lone surrogate (legal in JSON's escapes, but not Unicode text: no encoder takes it)."""
    if "\x00" in text:
        raise Refused(ErrorKind.INVALID, f"{field} must not contain NUL characters")
    if (found := _SURROGATE.search(text)) is not None:
        raise Refused(ErrorKind.INVALID, f"{field} is not valid Unicode: a lone surrogate "
                                         f"U+{ord(found.group()):04X} at character {found.start()}")


def check_language(language: Any) -> str:
    """A language tag as a client gives it (`language`, `lang_code`), checked for shape; what it
    names need not be known (text handling falls back to English rules)."""
    if not isinstance(language, str) or not _LANGUAGE.fullmatch(language):
        raise Refused(ErrorKind.INVALID, f"field 'language' must be a language tag such as 'en', 'en-US' or 'zh', "
                                         f"got {language!r}", field="language")
    return language


def check_output(speed: float, lookahead_s: float | None, volume: float = 1.0) -> None:
    """A stream's speed, lookahead and volume (`AudioOutput`) in their ranges."""
    if isinstance(volume, bool) or not isinstance(volume, (int, float)) or not 0.0 <= volume <= MAX_VOLUME:
        raise Refused(ErrorKind.INVALID, f"field 'volume' must be a number in [0, {MAX_VOLUME:g}], got {volume!r}",
                      field="volume")
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise Refused(ErrorKind.INVALID, f"field 'speed' must be a number in [{MIN_SPEED:g}, {MAX_SPEED:g}], "
                                         f"got {speed!r}", field="speed")
    if lookahead_s is not None and not MIN_LOOKAHEAD_S <= lookahead_s <= MAX_LOOKAHEAD_S:
        raise Refused(ErrorKind.INVALID, f"field 'lookahead_s' must be in [{MIN_LOOKAHEAD_S:g}, "
                                         f"{MAX_LOOKAHEAD_S:g}], got {lookahead_s:g}", field="lookahead_s")


def check_slowing(speed: float, slowing: float) -> None:
    """The output's `speed` and the engine's own slowing (`TextRules.slowing`: Piper's
    `length_scale`) compound: 0.25 and 4 made speech 16 times slower, 330 characters 497 s of
    audio. Together they may slow it as much as either alone at its bound, else INVALID."""
    most = 1 / MIN_SPEED
    if slowing / speed > most + 1e-9:
        raise Refused(ErrorKind.INVALID, f"speed {speed:g} with options that slow the voice {slowing:g} "
                                         f"times would make speech {slowing / speed:g} times slower: "
                                         f"together at most {most:g}", field="speed")


def check_length(text: str, max_chars: int, field: str = "text") -> None:
    """A text of at most `max_chars` characters (`Limits.max_text_chars`), else TOO_LARGE."""
    if len(text) > max_chars:
        raise Refused(ErrorKind.TOO_LARGE, f"field '{field}' has {len(text)} characters, over "
                                           f"max_text_chars={max_chars}", field=field)


def check_speed(value: Any, field: str = "speed") -> float:
    """A speed as a door received it: a finite number in [MIN_SPEED, MAX_SPEED], else INVALID."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not MIN_SPEED <= value <= MAX_SPEED:
        raise Refused(ErrorKind.INVALID, f"field '{field}' must be a number in [{MIN_SPEED:g}, {MAX_SPEED:g}], "
                                         f"got {value!r}", field=field)
    return float(value)


def check_instructions(text: str, field: str = "instructions") -> None:
    """Instructions of at most MAX_INSTRUCTIONS_CHARS, else TOO_LARGE."""
    if len(text) > MAX_INSTRUCTIONS_CHARS:
        raise Refused(ErrorKind.TOO_LARGE, f"field '{field}' has {len(text)} characters, over "
                                           f"{MAX_INSTRUCTIONS_CHARS}", field=field)


def check_options(raw: Any, specs: Mapping[str, OptionSpec]) -> dict[str, Any]:
    """A request's generation options against those the served engine declares: each value in
    its option's type; unknown names and bad values refused (INVALID, field `options.NAME`)."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise Refused(ErrorKind.INVALID, f"field 'options' must be a map, got {type_name(raw)}", field="options")
    out: dict[str, Any] = {}
    for name, value in raw.items():
        spec = specs.get(name)
        if spec is None:
            raise Refused(ErrorKind.INVALID, f"unknown option 'options.{name}' (known: {sorted(specs)})",
                          field=f"options.{name}")
        try:
            out[name] = spec.check(value)
        except ValueError as exc:
            raise Refused(ErrorKind.INVALID, f"option 'options.{name}' {exc}", field=f"options.{name}") from None
    if "min_len" in out and "max_len" in out and out["min_len"] > out["max_len"]:
        raise Refused(ErrorKind.INVALID, "option 'options.min_len' must not exceed 'options.max_len'",
                      field="options.min_len")
    return out
