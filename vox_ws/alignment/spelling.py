"""From the text a client wrote to the words an aligner hears, and back.

An engine may be given another text than the client sent (pronunciations respelled, numbers
normalised); a dictionary aligner wants plain words ("3" is heard as "three"). Each written word
is spelled as the words it is spoken as, and every spoken word keeps the index of the written
word it belongs to, so that the times come back for the words the client wrote, as Piper's do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from ..text import matched_owners, text_words

# Symbols that are words when spoken alone or inside a token ("R&D", "50%").
_SYMBOLS = {"&": "and", "%": "percent", "+": "plus", "@": "at", "=": "equals", "$": "dollars", "£": "pounds",
            "€": "euros", "#": "number"}
_CURRENCIES = frozenset("$£€")
_CENTS = {"$": "cents", "€": "cents", "£": "pence"}
# Abbreviations as they are read (the dictionary has some of them as other words: "dr" as "drive").
_ABBREVIATIONS = {"dr": "doctor", "mr": "mister", "mrs": "missus", "ms": "miss", "jr": "junior", "sr": "senior",
                  "st": "saint", "vs": "versus", "etc": "etcetera", "approx": "approximately"}
_ABBREVIATED = re.compile(r"[a-z]+\.[,;:!?\"')]*")
_PIECE = re.compile(r"\d+(?:[.,]\d+)*|[a-z]+(?:'[a-z]+)*|[&%+@=$£€#]")


@lru_cache(maxsize=1)
def _inflect():
    import inflect  # in the voxcpm extra, beside the aligner
    return inflect.engine()


# Longer runs of digits are read digit by digit (and inflect's time on them stays bounded).
MAX_NUMBER_DIGITS = 15


def _number_words(number: str) -> list[str]:
    digits = number.replace(",", "")
    try:
        if len(digits) > MAX_NUMBER_DIGITS:
            raise ValueError(digits)
        if digits.isdigit() and len(digits) == 4 and "," not in number and 1100 <= int(digits) <= 1999:
            # a year: "nineteen ninety-nine", "nineteen hundred"
            spoken = _inflect().number_to_words(digits[:2]) + " " + (
                "hundred" if digits[2:] == "00" else _inflect().number_to_words(digits[2:], group=2))
        else:
            spoken = _inflect().number_to_words(digits, andword="")
    except Exception:        # too long, or a form inflect refuses ("1.2.3"): digit by digit
        spoken = " ".join(_inflect().number_to_words(d) for d in digits if d.isdigit())
    return [w for w in re.split(r"[\s,-]+", str(spoken)) if w]


def spoken_words(token: str) -> list[str]:
    """The dictionary words a written token is heard as, lower case: "3-day" -> three, day;
    "R&D" -> r, and, d; "$3.50" -> three, dollars, fifty, cents; "Dr." -> doctor; "?" -> none."""
    lowered = token.lower().replace("’", "'")
    pieces = _PIECE.findall(lowered)
    if len(pieces) == 1 and pieces[0] in _ABBREVIATIONS and _ABBREVIATED.fullmatch(lowered):
        return [_ABBREVIATIONS[pieces[0]]]
    words: list[str] = []
    at = 0
    while at < len(pieces):
        piece = pieces[at]
        number = pieces[at + 1] if at + 1 < len(pieces) and pieces[at + 1][0].isdigit() else None
        if piece in _CURRENCIES and number is not None:        # "$3.50": three dollars fifty cents
            whole, _, cents = number.replace(",", "").partition(".")
            words += _number_words(whole) + [_SYMBOLS[piece]]
            if cents.strip("0"):
                words += _number_words(cents[:2].ljust(2, "0")) + [_CENTS[piece]]
            at += 2
            continue
        if piece[0].isdigit():
            words += _number_words(piece)
        elif piece in _SYMBOLS:
            words.append(_SYMBOLS[piece])
        else:
            words.append(piece)
        at += 1
    return words


def _spelled(tokens: list[str]) -> tuple[list[str], list[int]]:
    words: list[str] = []
    owner: list[int] = []
    for index, token in enumerate(tokens):
        for word in spoken_words(token):
            words.append(word)
            owner.append(index)
    return words, owner


@dataclass(frozen=True)
class AlignmentText:
    """What one segment's aligner is given: the dictionary words the engine spoke, in order,
    each with the index of the written word (the client's) it says."""

    written: tuple[str, ...]
    words: tuple[str, ...]
    owner: tuple[int, ...]

    @classmethod
    def of(cls, written_text: str, spoken_text: str) -> "AlignmentText":
        """Both texts spelled as dictionary words and matched word by word: equal words pair up,
        a run of others is shared in order ("Dr." said "doctor"), a spoken word with no written
        counterpart goes with the word before it."""
        written = text_words(written_text)
        words, spoken_owner = _spelled(text_words(spoken_text))
        if written_text == spoken_text:
            return cls(tuple(written), tuple(words), tuple(spoken_owner))
        reference, reference_owner = _spelled(written)
        # Written words that are all said as nothing ("—"): the first takes what was said.
        owner = matched_owners(reference, reference_owner, words) if reference else [0] * len(words)
        return cls(tuple(written), tuple(words), tuple(owner))


def written_times(text: AlignmentText, times: list[tuple[float, float] | None],
                  duration_s: float) -> list[tuple[str, float, float, bool]]:
    """Each written word with its (start, end) from its spoken words' `times` (None: not placed),
    and whether it is estimated: a word with none placed gets a share of the time between its
    placed neighbours (by length), never dropped."""
    placed: list[tuple[float, float] | None] = [None] * len(text.written)
    for owner, time in zip(text.owner, times):
        if time is None or owner < 0:
            continue
        current = placed[owner]
        placed[owner] = time if current is None else (min(current[0], time[0]), max(current[1], time[1]))
    result: list[tuple[str, float, float, bool]] = []
    index = 0
    while index < len(text.written):
        if placed[index] is not None:
            start, end = placed[index]
            result.append((text.written[index], start, end, False))
            index += 1
            continue
        run_end = index
        while run_end < len(text.written) and placed[run_end] is None:
            run_end += 1
        after = placed[run_end][0] if run_end < len(text.written) else duration_s
        before = result[-1][2] if result else 0.0
        after = max(after, before)
        lengths = [max(1, len(w)) for w in text.written[index:run_end]]
        total, at = sum(lengths), before
        for word, length in zip(text.written[index:run_end], lengths):
            end = at + (after - before) * length / total
            result.append((word, round(at, 4), round(end, 4), True))
            at = end
        index = run_end
    return result
