"""Splitting text into segments that a voice can speak one after another.

Short first segments bring first audio sooner; later segments may be longer. Splits happen
only at sentence or clause punctuation, never inside a word. Sentences are found by sentencex
(Wikimedia's segmenter: the sentence marks of many scripts, and abbreviations, initials and
decimals per language, so "Dr. Smith" and "3.14" are not cut), in the text's language where it
is known and by English rules otherwise (which still see the CJK, Devanagari and Arabic marks).
Thai marks no sentence end but a space between sentences, so a Thai text is also cut there.
"""

from __future__ import annotations

import difflib
import re
from typing import Callable, Sequence

import sentencex

_CLAUSE = re.compile(r"(?<=[,;:—])\s+|(?<=[，、：；،])")
# Thai letters on both sides of a space.
_THAI_SPACE = re.compile(r"(?<=[\u0e00-\u0e7f])\s+(?=[\u0e00-\u0e7f])")
# The marks that may end a sentence in the scripts sentencex knows (a streamed text with none
# of them has no sentence end yet).
_SENTENCE_MARKS = ".!?…。！？；।॥؟۔።"
# Marks that end a sentence by themselves, with no space after them (CJK, Devanagari's danda).
_FULL_STOP = re.compile(r"[。！？；।॥][”’」』）)]*")
# The end of a buffer after its last space: a word that may still be arriving.
_PARTIAL_WORD = re.compile(r"\S*$")
_WORD = re.compile(r"\S+")


def text_words(text: str) -> list[str]:
    """The words of a text as it is written (punctuation attached): what word timings are given for."""
    return _WORD.findall(text)


def matched_owners(reference: Sequence[str], reference_owner: Sequence[int], target: Sequence[str]) -> list[int]:
    """For each item of `target` (what was said), the owner (a written word's index) of the
    `reference` item it matches (each written word said alone), by difflib: equal items pair
    up, a run of others is shared in order, an item with no counterpart goes with the one
    before it; owners never go backwards. -1 for every item where `reference` is empty."""
    if not reference:
        return [-1] * len(target)
    matched = [-1] * len(target)
    matcher = difflib.SequenceMatcher(None, reference, target, autojunk=False)
    for tag, r0, r1, t0, t1 in matcher.get_opcodes():
        if tag in ("equal", "replace") and r1 > r0:
            for k in range(t0, t1):
                matched[k] = reference_owner[r0 + (k - t0) * (r1 - r0) // (t1 - t0)]
    last = reference_owner[0]
    for k, owner in enumerate(matched):
        last = max(last, owner)
        matched[k] = last
    return matched


def base_language(language: str | None) -> str:
    """The language sentencex is given: `en` of `en-US` or Piper's `en_US`; English rules when
    none is known."""
    if not language:
        return "en"
    return re.split(r"[-_]", language, maxsplit=1)[0].lower() or "en"


def split_sentences(text: str, language: str | None = None) -> list[str]:
    lang = base_language(language)
    sentences = [s.strip() for s in sentencex.segment(lang, text) if s.strip()]
    if lang == "th":
        sentences = [part for s in sentences for part in _THAI_SPACE.split(s) if part]
    return sentences


def split_clauses(sentence: str) -> list[str]:
    return [p.strip() for p in _CLAUSE.split(sentence) if p and p.strip()]


def segment(text: str, first_max_chars: int = 60, max_chars: int = 240, min_chars: int = 12,
            language: str | None = None) -> list[str]:
    """Split text into speakable segments.

    Sentences are kept whole when they fit; a long sentence is cut at clauses; clauses shorter
    than `min_chars` are merged with their neighbour so the voice does not chop the prosody. A
    clause with no punctuation at all that is longer than the limit is cut at a space.

    The limit ramps up: the first segment at most `first_max_chars` (first audio comes fast),
    each later one at most twice the one before (but `first_max_chars` at least, `max_chars` at
    most). An engine that speaks a segment per step then makes the next segment's audio in less
    time than the previous one takes to play, as long as it runs over twice as fast as real
    time: a short first sentence followed by a long one no longer leaves the listener waiting.
    """
    segments: list[str] = []

    def limit() -> int:
        if not segments:
            return first_max_chars
        return min(max_chars, max(first_max_chars, 2 * len(segments[-1])))

    for sentence in split_sentences(text, language):
        if len(sentence) <= limit():
            segments.append(sentence)
            continue
        current = ""
        for clause in split_clauses(sentence):
            if current and len(current) + 1 + len(clause) > limit() and len(current) >= min_chars:
                segments.append(current)
                current = clause
            else:
                current = f"{current} {clause}".strip() if current else clause
            while len(current) > limit():
                head, current = _cut_at_space(current, limit())
                segments.append(head)
        if current:
            segments.append(current)
    return segments


def pack(text: str, fits: Callable[[str], bool], language: str | None = None) -> list[str]:
    """Cut `text` into as few pieces as `fits` allows, in order: whole sentences where they
    fit, else clauses, else words, else characters (a word longer than anything that fits)."""
    if fits(text):
        return [text]
    return _pack(split_sentences(text, language), fits, 0)


# How a piece too long at one level is cut at the next, and how its parts join again.
_FINER: tuple[tuple[Callable[[str], list[str]], str], ...] = ((split_clauses, " "), (str.split, " "), (list, ""))


def _pack(parts: list[str], fits: Callable[[str], bool], level: int, joiner: str = " ") -> list[str]:
    """Greedy: from each part on, the longest run of parts that fits (found by doubling, then
    halving: O(log n) calls of `fits` per piece, each on at most about a piece of text)."""
    pieces: list[str] = []
    i = 0
    while i < len(parts):
        if not fits(parts[i]):
            if level < len(_FINER):
                split, finer_joiner = _FINER[level]
                pieces += _pack(split(parts[i]), fits, level + 1, finer_joiner)
            else:
                pieces.append(parts[i])   # one character that does not fit: the engine refuses it
            i += 1
            continue
        good, step = 1, 1                 # parts[i:i+good] fits
        while i + good < len(parts) and fits(joiner.join(parts[i:i + good + step])):
            good += step
            step *= 2
        while step > 1:
            step //= 2
            if i + good + step <= len(parts) and fits(joiner.join(parts[i:i + good + step])):
                good += step
        pieces.append(joiner.join(parts[i:i + good]))
        i += good
    return pieces


def _cut_at_space(text: str, limit: int) -> tuple[str, str]:
    cut = text.rfind(" ", 0, limit)
    if cut <= 0:
        cut = limit  # no space at all (e.g. CJK without punctuation): cut at the limit
    return text[:cut].strip(), text[cut:].strip()


_STREAM_CLAUSE_END = re.compile(r"[,;:—،][\"')\]]*\s+|[，、：]")


class StreamSegmenter:
    """Cuts text that arrives in pieces (an LLM's tokens) into speakable segments.

    A segment is emitted as soon as it is complete (a sentence end), or earlier at a clause when
    the text runs long without one (the first segment sooner, for fast first audio). Nothing is
    ever cut inside a word unless the caller says the input is over (`flush_all`).
    """

    def __init__(self, first_max_chars: int = 60, max_chars: int = 240, first_clause_words: int = 4,
                 language: str | None = None) -> None:
        self.language = base_language(language)
        self.buffer = ""
        self.emitted = 0
        self.first_max_chars = first_max_chars
        self.max_chars = max_chars
        self.first_clause_words = first_clause_words

    def push(self, text: str) -> list[str]:
        self.buffer += text
        out: list[str] = []
        while True:
            first = self.emitted + len(out) == 0
            limit = self.first_max_chars if first else self.max_chars
            if first:
                # First audio matters most: the first clause of a few words may go on its own.
                clause = _STREAM_CLAUSE_END.search(self.buffer)
                sentence = self._sentence_end()
                if clause and (not sentence or clause.end() < sentence) \
                        and len(self.buffer[:clause.end()].split()) >= self.first_clause_words:
                    out += self._take(clause.end())
                    continue
            end = self._sentence_end()
            if end and (end <= limit or not self._clause_cut(limit)):
                out += self._take(end)
                continue
            if len(self.buffer) > limit:
                cut = self._clause_cut(limit) or self._space_cut(limit)
                if cut:
                    out += self._take(cut)
                    continue
            break
        return out

    def flush_words(self) -> list[str]:
        """Everything buffered up to the last whole word (a pause in the input)."""
        cut = self.buffer.rstrip().rfind(" ")
        if self.buffer[-1:].isspace():
            cut = len(self.buffer)
        return self._take(cut) if cut > 0 else []

    def flush_all(self) -> list[str]:
        """Everything buffered (the input ended, or the client asked to flush)."""
        return self._take(len(self.buffer))

    def _sentence_end(self) -> int:
        """Where the first complete sentence of the buffer ends (0: none yet). The segmenter is
        shown the buffer up to its last space with a capital letter after it, as if the next
        sentence had begun there, and says whether it would cut before: a mark at the very end
        may still go on ("3." then "14"), one before a space may be an abbreviation ("Dr. "
        then "Smith"), and a word still arriving is not yet a word. So a sentence goes to the
        voice as soon as the space after it comes (first audio does not wait for the next
        word); what hangs on the next word itself (German "am 3. Mai") is cut as a sentence end.
        Marks that end a sentence with no space after them (CJK, the danda) end it at once."""
        buffer = self.buffer
        ends = [self._thai_cut()]
        if any(mark in buffer for mark in _SENTENCE_MARKS):
            stop = _FULL_STOP.search(buffer)
            if stop:
                ends.append(stop.end())
            complete = len(buffer) - len(_PARTIAL_WORD.search(buffer).group(0))
            if complete > 0:
                first = next(iter(sentencex.segment(self.language, buffer[:complete] + "A")), "")
                if len(first) <= complete:
                    ends.append(len(first))
        return min((end for end in ends if end), default=0)

    def _thai_cut(self) -> int:
        if self.language != "th":
            return 0
        match = _THAI_SPACE.search(self.buffer)
        return match.end() if match else 0

    def _clause_cut(self, limit: int) -> int:
        cuts = [m.end() for m in _STREAM_CLAUSE_END.finditer(self.buffer[:limit + 1])]
        return cuts[-1] if cuts else 0

    def _space_cut(self, limit: int) -> int:
        cut = self.buffer.rfind(" ", 0, limit)
        return cut if cut > 0 else 0

    def _take(self, end: int) -> list[str]:
        piece, self.buffer = self.buffer[:end].strip(), self.buffer[end:].lstrip()
        if not piece:
            return []
        self.emitted += 1
        return [piece]
