"""US English forced alignment by PocketSphinx, in an aligner process (`pool.py`).

PocketSphinx 5 carries its acoustic model and its dictionary (CMUdict) inside the wheel: nothing
is fetched. Given a segment's audio and the words spoken in it, the decoder is constrained to
exactly those words (`set_align_text`) and its Viterbi path gives each word's frames (10 ms).
Its C search holds the GIL, so it runs in processes of its own, never on a thread of the server.

Making a decoder costs some 0.3 s, aligning a second of speech about 20 ms: each process makes
one and keeps it. A segment with more words than its audio could hold (MAX_WORDS_PER_S) is not
searched: its words are estimated, and no text holds a process for long. Words out of the
dictionary are added with a pronunciation spelled by rule (`letters_to_phones`): close enough
to place the word between its neighbours. Added words are
kept (a name recurs) up to MAX_ADDED_WORDS, and then the decoder is made anew, so that a stream
of invented words cannot grow it without bound.
"""

from __future__ import annotations

import logging
import re

import numpy as np

SAMPLE_RATE = 16000
FRAME_S = 0.01
# PocketSphinx places a word's start and end a little early against the model's own durations
# (Piper's): measured over 50 sentences by `python -m benchmarks.alignment`, docs/PERFORMANCE.md.
START_SHIFT_S = 0.055
END_SHIFT_S = 0.005
MAX_ADDED_WORDS = 5000
# Words a second of audio may hold and still be searched (speech says some 3 a second).
MAX_WORDS_PER_S = 10

log = logging.getLogger("vox_ws.alignment")

# Letters to CMUdict phones, longest first; a rough spelling rule set for words the dictionary
# lacks (names, coinages): it only has to be nearer to the word's sound than its neighbours'.
_RULES = [("tch", "CH"), ("sch", "S K"), ("tion", "SH AH N"), ("sion", "ZH AH N"), ("ough", "OW"),
          ("igh", "AY"), ("ch", "CH"), ("sh", "SH"), ("th", "TH"), ("ph", "F"), ("wh", "W"), ("ck", "K"),
          ("ng", "NG"), ("qu", "K W"), ("gh", "G"), ("kn", "N"), ("wr", "R"), ("ee", "IY"), ("ea", "IY"),
          ("oo", "UW"), ("ou", "AW"), ("ow", "OW"), ("oi", "OY"), ("oy", "OY"), ("ai", "EY"), ("ay", "EY"),
          ("au", "AO"), ("aw", "AO"), ("ie", "IY"), ("ei", "EY"), ("ey", "IY"), ("er", "ER"), ("ar", "AA R"),
          ("or", "AO R"), ("ur", "ER"), ("ir", "ER"),
          ("a", "AE"), ("b", "B"), ("c", "K"), ("d", "D"), ("e", "EH"), ("f", "F"), ("g", "G"), ("h", "HH"),
          ("i", "IH"), ("j", "JH"), ("k", "K"), ("l", "L"), ("m", "M"), ("n", "N"), ("o", "AA"), ("p", "P"),
          ("q", "K"), ("r", "R"), ("s", "S"), ("t", "T"), ("u", "AH"), ("v", "V"), ("w", "W"), ("x", "K S"),
          ("y", "IY"), ("z", "Z")]
_VOWELS = set("aeiouy")


def letters_to_phones(word: str) -> str:
    """A pronunciation for a word of letters a-z (and apostrophes) by spelling rules."""
    letters = re.sub(r"[^a-z]", "", word.lower())
    if len(letters) > 3 and letters.endswith("e") and letters[-2] not in _VOWELS:
        letters = letters[:-1]                      # a silent final e
    letters = re.sub(r"([^aeiou])\1", r"\1", letters)   # doubled consonants say one
    phones: list[str] = []
    at = 0
    while at < len(letters):
        for graphemes, said in _RULES:
            if letters.startswith(graphemes, at):
                if graphemes == "y" and at == 0:
                    said = "Y"
                phones += said.split()
                at += len(graphemes)
                break
    return " ".join(phones) or "AH"


def _is_filler(word: str) -> bool:
    return word.startswith(("<", "[", "+")) or word == "NULL"


class SphinxAligner:
    """One decoder, used by one thread at a time (an aligner process's own)."""

    def __init__(self) -> None:
        self._decoder = self._new_decoder()
        self._added = 0

    @staticmethod
    def _new_decoder():
        from pocketsphinx import Decoder
        # Beams far wider than recognition's: with the words fixed the search is narrow anyway,
        # and the default ones lost the only path on one clip in four (some 10% slower).
        return Decoder(samprate=SAMPLE_RATE, bestpath=False, loglevel="FATAL", beam=1e-100, wbeam=1e-80,
                       pbeam=1e-100)

    def _know(self, words: tuple[str, ...]) -> None:
        missing = sorted({w for w in words if self._decoder.lookup_word(w) is None})
        if not missing:
            return
        if self._added + len(missing) > MAX_ADDED_WORDS:
            self._decoder, self._added = self._new_decoder(), 0
        for word in missing:
            self._decoder.add_word(word, letters_to_phones(word), update=word == missing[-1])
        self._added += len(missing)

    def align(self, audio: np.ndarray, words: tuple[str, ...]) -> list[tuple[float, float] | None]:
        """Each word's (start, end) in seconds from the start of `audio` (16-bit, SAMPLE_RATE);
        all None where it could not be aligned to the words (too short for them, say)."""
        if not words:
            return []
        if len(words) > MAX_WORDS_PER_S * len(audio) / SAMPLE_RATE + 4:
            return [None] * len(words)
        raw = np.asarray(audio, dtype="<i2").tobytes()
        self._know(words)
        decoder = self._decoder
        try:
            decoder.set_align_text(" ".join(words))
            decoder.start_utt()
            decoder.process_raw(raw, full_utt=True)
            decoder.end_utt()
            segments = [s for s in decoder.seg() or () if not _is_filler(s.word)]
        except RuntimeError as err:            # no path through the words: nothing placed
            log.debug("alignment failed: %s", err)
            return [None] * len(words)
        if len(segments) != len(words):
            return [None] * len(words)
        duration = len(audio) / SAMPLE_RATE
        times: list[tuple[float, float] | None] = []
        last = 0.0
        for segment in segments:
            start = min(max(segment.start_frame * FRAME_S + START_SHIFT_S, last), duration)
            end = min(max((segment.end_frame + 1) * FRAME_S + END_SHIFT_S, start), duration)
            times.append((round(start, 4), round(end, 4)))
            last = end
        return times
