"""Captions (SRT, WebVTT) from what a stream said and when: its word timings where it has them
(the engine's own, Piper's, or the aligner's, VoxCPM2's), else its segments' (each segment's
time shared among its lines by their length). Cues are of readable length: one line of at most
MAX_CUE_CHARS characters, at most MAX_CUE_S long (a word longer than either is cut across cues,
its time shared by its letters),
and a sentence end closes one. WebVTT files are written by webvtt-py, their text escaped
(`&amp;`, `&lt;`, `&gt;`: a player takes `<...>` for a tag and drops it); SRT, whose readers
take text as it is, is written here (webvtt-py's SRT writer drops what looks like a tag).
"""

from __future__ import annotations

import html
import math
import re
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# One subtitle line (broadcasters' guides ask for 37 to 42 characters), on screen at most this long.
MAX_CUE_CHARS = 42
MAX_CUE_S = 6.0
CAPTION_FORMATS = (".srt", ".vtt")
_SENTENCE_END = tuple(".!?…。！？；।؟")
_ARROW = re.compile(r"-{2,}>")


@dataclass(frozen=True)
class Cue:
    start_s: float
    end_s: float
    text: str

    def __post_init__(self) -> None:
        # One line, and never a cue's timing arrow: "-->" in a cue's text ends the file for a
        # WebVTT reader, and a blank line ends the cue.
        object.__setattr__(self, "text", _ARROW.sub("\u2192", " ".join(self.text.split())))


def cues_from_words(words: Iterable[tuple[str, float, float]]) -> list[Cue]:
    """Words (word, start_s, end_s), in order, as cues."""
    cues: list[Cue] = []
    line: list[tuple[str, float, float]] = []

    def close() -> None:
        if line:
            cues.append(Cue(line[0][1], line[-1][2], " ".join(word for word, _, _ in line)))
            line.clear()

    for word, start, end in _cut_long_words(words):
        if line and (len(" ".join(w for w, _, _ in line)) + 1 + len(word) > MAX_CUE_CHARS
                     or end - line[0][1] > MAX_CUE_S):
            close()
        line.append((word, start, end))
        if word.rstrip("\"')]»”’").endswith(_SENTENCE_END):
            close()
    close()
    return cues


def _cut_long_words(words: Iterable[tuple[str, float, float]]) -> Iterable[tuple[str, float, float]]:
    """Each word, and a word over a cue's bounds (MAX_CUE_CHARS, MAX_CUE_S) in pieces that fit,
    its time shared by their letters."""
    for word, start, end in words:
        pieces = max(math.ceil(len(word) / MAX_CUE_CHARS), math.ceil((end - start) / MAX_CUE_S), 1)
        if pieces == 1:
            yield word, start, end
            continue
        size = math.ceil(len(word) / pieces)
        parts = [word[at:at + size] for at in range(0, len(word), size)]
        at = start
        for part in parts:
            until = at + (end - start) * len(part) / len(word)
            yield part, round(at, 3), round(until, 3)
            at = until


def cues_from_segments(segments: Iterable[tuple[str, float, float]]) -> list[Cue]:
    """Segments (text, start_s, end_s) as cues: a segment longer than a line is cut into lines
    (at spaces; text without spaces, CJK, at the width), its time shared by their lengths."""
    cues: list[Cue] = []
    for text, start, end in segments:
        lines = textwrap.wrap(" ".join(text.split()), MAX_CUE_CHARS) or [text]
        total = sum(len(line) for line in lines)
        at = start
        for line in lines:
            until = at + (end - start) * len(line) / total if total else end
            cues.append(Cue(round(at, 3), round(until, 3), line))
            at = until
    return cues


def write_captions(cues: list[Cue], path: str | Path) -> None:
    """SRT or WebVTT by the file's suffix (CAPTION_FORMATS)."""
    from webvtt import Caption, WebVTT

    path = Path(path)
    if path.suffix.lower() not in CAPTION_FORMATS:
        raise ValueError(f"{path}: captions are .srt or .vtt files")
    if path.suffix.lower() == ".srt":
        path.write_text("".join(f"{number}\n{_clock(cue.start_s, ',')} --> {_clock(_end(cue), ',')}\n{cue.text}\n\n"
                                for number, cue in enumerate(cues, start=1)), encoding="utf-8")
        return
    captions = WebVTT(captions=[Caption(start=_clock(cue.start_s), end=_clock(_end(cue)),
                                        text=html.escape(cue.text, quote=False)) for cue in cues])
    captions.save(str(path))


def _end(cue: Cue) -> float:
    return max(cue.end_s, cue.start_s + 0.001)


def _clock(seconds: float, point: str = ".") -> str:
    millis = round(seconds * 1000)
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    return f"{hours:02d}:{minutes:02d}:{millis // 1000:02d}{point}{millis % 1000:03d}"
