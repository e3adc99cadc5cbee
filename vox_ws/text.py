"""Splitting text into segments that a voice can speak one after another.

Short first segments bring first audio sooner; later segments may be longer. Splits happen
only at sentence or clause punctuation (English and Chinese), never inside a word.
"""

from __future__ import annotations

import re

# A boundary is punctuation followed by whitespace or end of text (ASCII), or any CJK
# punctuation (which needs no following space).
_SENTENCE = re.compile(r"(?<=[.!?…])[\"')\]]*\s+|(?<=[。！？；])")
_CLAUSE = re.compile(r"(?<=[,;:—])\s+|(?<=[，、：；])")


def split_sentences(text: str) -> list[str]:
    return [p.strip() for p in _SENTENCE.split(text) if p and p.strip()]


def split_clauses(sentence: str) -> list[str]:
    return [p.strip() for p in _CLAUSE.split(sentence) if p and p.strip()]


def segment(text: str, first_max_chars: int = 60, max_chars: int = 240, min_chars: int = 12) -> list[str]:
    """Split text into speakable segments.

    Sentences are kept whole when they fit; a long sentence is cut at clauses (the first
    segment of the text at `first_max_chars`, so first audio comes fast); clauses shorter than
    `min_chars` are merged with their neighbour so the voice does not chop the prosody. A
    clause with no punctuation at all that is longer than the limit is cut at a space.
    """
    segments: list[str] = []
    for sentence in split_sentences(text):
        limit = first_max_chars if not segments else max_chars
        if len(sentence) <= limit:
            segments.append(sentence)
            continue
        current = ""
        for clause in split_clauses(sentence):
            limit = first_max_chars if not segments else max_chars
            if current and len(current) + 1 + len(clause) > limit and len(current) >= min_chars:
                segments.append(current)
                current = clause
            else:
                current = f"{current} {clause}".strip() if current else clause
            while len(current) > max_chars:
                head, current = _cut_at_space(current, max_chars)
                segments.append(head)
        if current:
            segments.append(current)
    return segments


def _cut_at_space(text: str, limit: int) -> tuple[str, str]:
    cut = text.rfind(" ", 0, limit)
    if cut <= 0:
        cut = limit  # no space at all (e.g. CJK without punctuation): cut at the limit
    return text[:cut].strip(), text[cut:].strip()
