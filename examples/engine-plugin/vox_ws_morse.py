"""A Morse-code engine for vox-ws: every text sent as International Morse code, one tone per
stream, every stream stepped at once. The whole engine of docs/ENGINES.md, installed as a
package of its own (this folder's pyproject.toml declares it in the entry point group
`vox_ws.engines`).

It needs no model, so it loads at once; everything else a model's engine does, it does: it
batches (a step advances every stream), it takes generation options (`wpm`, `pitch`) and a
setting (`--morse-pitch`), it has two voices, it refuses a text it cannot send (in the server's
process too: its text rules are portable), and it says when each word is sent.
"""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import Any

import numpy as np

from vox_ws.engine import (
    EndReason,
    Engine,
    ErrorKind,
    GenerationRequest,
    OptionSpec,
    Refused,
    Role,
    StepResult,
    TextRules,
    Voices,
)
from vox_ws.engines import EnginePlugin, Setting

CODE = {
    "A": ".-", "B": "-...", "C": "-.-.", "D": "-..", "E": ".", "F": "..-.", "G": "--.", "H": "....",
    "I": "..", "J": ".---", "K": "-.-", "L": ".-..", "M": "--", "N": "-.", "O": "---", "P": ".--.",
    "Q": "--.-", "R": ".-.", "S": "...", "T": "-", "U": "..-", "V": "...-", "W": ".--", "X": "-..-",
    "Y": "-.--", "Z": "--..", "0": "-----", "1": ".----", "2": "..---", "3": "...--", "4": "....-",
    "5": ".....", "6": "-....", "7": "--...", "8": "---..", "9": "----.", ".": ".-.-.-", ",": "--..--",
    "?": "..--..", "'": ".----.", "!": "-.-.--", "/": "-..-.", "(": "-.--.", ")": "-.--.-",
    "&": ".-...", ":": "---...", ";": "-.-.-.", "=": "-...-", "+": ".-.-.", "-": "-....-",
    "_": "..--.-", '"': ".-..-.", "$": "...-..-", "@": ".--.-.",
}
RATE = 24_000
CHUNK_S = 0.25            # audio a step yields per stream
RAMP_S = 0.005            # each tone's rise and fall: a keyed tone without clicks
AMPLITUDE = 0.4


def sendable(word: str) -> str:
    """The characters of `word` Morse code has, accents dropped ("é" is sent as "E")."""
    plain = unicodedata.normalize("NFKD", word.upper())
    return "".join(c for c in plain if c in CODE)


def keying(text: str) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
    """The text as Morse timing: for each unit (a dot's length), whether the tone is on; and
    each word as written with its first and end unit. A dot is 1 unit on, a dash 3; 1 unit
    between the elements of a letter, 3 between letters, 7 between words."""
    units: list[bool] = []
    words: list[tuple[str, int, int]] = []
    for word in text.split():
        letters = sendable(word)
        if not letters:
            continue
        if units:
            units += [False] * 7
        start = len(units)
        for n, letter in enumerate(letters):
            if n:
                units += [False] * 3
            for e, element in enumerate(CODE[letter]):
                if e:
                    units.append(False)
                units += [True] * (1 if element == "." else 3)
        words.append((word, start, len(units)))
    units += [False] * 7                          # a word's gap after the last: the stream's end
    return np.array(units, dtype=bool), words


class MorseVoices(Voices):
    """Two built-in voices, the tone's shape; none cloned."""

    SHAPES = {"sine": "a pure tone, as a receiver's beat oscillator sounds", "square": "a buzzer"}

    def names(self) -> list[str]:
        return list(self.SHAPES)

    def description(self, voice: str) -> str:
        return self.SHAPES[voice]


class MorseText(TextRules):
    """One piece, as written; a text with nothing Morse code can send is refused. Portable: the
    server's process, which never builds this engine, makes its own copy (`from_settings`) and
    refuses such a text before it is queued."""

    def check(self, request: GenerationRequest, pin: Any) -> None:
        if not sendable(request.text):
            raise Refused(ErrorKind.INVALID, "nothing in this text can be sent in Morse code (letters "
                                             "A-Z, digits, and . , ? ' ! / ( ) & : ; = + - _ \" $ @)",
                          field="text")

    def portable(self) -> tuple[str, dict[str, Any]]:
        return f"{__name__}:MorseText", {}

    @classmethod
    def from_settings(cls, engine: Engine, settings: dict[str, Any]) -> MorseText:
        return cls(engine)


@dataclass
class Sending:
    """A request's state: its keying, where it is, how it sounds."""

    on: np.ndarray                # per unit: the tone is on
    rises: np.ndarray             # per unit: on, after a unit off (the tone starts here)
    falls: np.ndarray             # per unit: on, before a unit off (the tone ends here)
    words: list[tuple[str, int, int]]
    unit: int                     # samples per unit
    pitch: float
    square: bool
    sent: int = 0                 # samples so far
    next_word: int = 0

    @property
    def total(self) -> int:
        return len(self.on) * self.unit


class MorseEngine(Engine):
    name = "morse"
    model = "International Morse code"
    sample_rate = RATE
    max_step_batch = 64
    word_timings = True
    options = {
        "wpm": OptionSpec(int, 5, 60, 20, "words per minute (PARIS timing: a dot lasts 1.2 / wpm seconds)"),
        "pitch": OptionSpec(float, 200.0, 2000.0, None, "the tone's pitch in Hz (default: the server's "
                                                          "--morse-pitch)"),
    }
    voices = Role(MorseVoices)
    text = Role(MorseText)

    def __init__(self, pitch: float = 600.0, slots: int | None = None) -> None:
        self.pitch = pitch
        self._slots = slots or self.max_step_batch

    def load(self) -> None:
        """Nothing to load: a model's engine reads its weights here, on the engine loop's thread."""

    def slots(self) -> tuple[int, str]:
        return self._slots, "a step sends every stream at once"

    def prefill(self, request: GenerationRequest) -> None:
        on, words = keying(request.text)
        wpm = request.options.get("wpm") or self.options["wpm"].default
        before = np.concatenate(([False], on[:-1]))
        after = np.concatenate((on[1:], [False]))
        pitch = request.options.get("pitch") or self.pitch
        request.state = Sending(on, on & ~before, on & ~after, words, unit=round(1.2 / wpm * RATE),
                                pitch=pitch, square=request.voice == "square")

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        return [self._next_chunk(request.state) for request in batch]

    def _next_chunk(self, sending: Sending) -> StepResult:
        n = min(round(CHUNK_S * RATE), sending.total - sending.sent)
        samples = np.arange(sending.sent, sending.sent + n)
        unit, within = np.divmod(samples, sending.unit)
        ramp = RAMP_S * RATE
        rise = np.where(sending.rises[unit], np.minimum(1.0, within / ramp), 1.0)
        fall = np.where(sending.falls[unit], np.minimum(1.0, (sending.unit - within) / ramp), 1.0)
        wave = np.sin(2 * np.pi * sending.pitch / RATE * samples)
        if sending.square:
            wave = np.sign(wave) * 0.5
        audio = (AMPLITUDE * sending.on[unit] * rise * fall * wave).astype(np.float32)
        words = []
        while sending.next_word < len(sending.words):
            word, first, end = sending.words[sending.next_word]
            if first * sending.unit >= sending.sent + n:
                break
            words.append((word, first * sending.unit - sending.sent, end * sending.unit - sending.sent))
            sending.next_word += 1
        sending.sent += n
        done = EndReason.DONE if sending.sent >= sending.total else None
        return StepResult(audio=audio, finished=done, words=words)


PLUGIN = EnginePlugin(
    name="morse",
    summary="International Morse code, a tone per stream (the example engine of docs/ENGINES.md)",
    create=lambda settings: MorseEngine(pitch=settings["morse_pitch"], slots=settings.get("slots")),
    options=MorseEngine.options,
    settings=(Setting("morse-pitch", float, 600.0, "the tone's pitch in Hz, for streams that give none"),),
)
