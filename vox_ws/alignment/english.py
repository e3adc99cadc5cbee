"""Whether a segment's text is English: the aligner's acoustic model and dictionary are US
English (`sphinx.py`), and forced to another language's words it still answers, with times that
look aligned and are not. A stream sent without `language` (VoxCPM2 reads the language from the
text) is told apart here, segment by segment, in the aligner's process; what is not English gets
estimated times, every word `estimated`.

Two tests, the cheap one first:
- the script: text whose letters are mostly outside the Latin script (Chinese, Cyrillic, Greek,
  Arabic, ...) is not English. Certain, and needs no model.
- py3langid (langid.py's model, numpy only; in the voxcpm extra beside pocketsphinx) for Latin
  text: not English where another language is at least NOT_ENGLISH_ODDS times as likely as
  English. On short texts its best guess is often wrong ("Hi." -> Serbian at 1.4 %, "Okay." ->
  Tagalog), but English's own share stays near the best one's; measured on 23 short English and
  21 short French, German, Spanish, Italian, Dutch and Portuguese texts (tests/test_alignment.py
  keeps some), English's odds against the best were at most 4.2 ("Yes."), and of the other
  languages' texts those under 10 were single words that English shares or nearly ("Hallo.",
  "Merci.", "Salut !", "Oui.", "Bom dia."): a text of a word or two that could be English is
  aligned as English, where a wrong time costs least; a sentence is told apart.

Without py3langid (an install that has the aligner by `pip install pocketsphinx` alone) the
script test is all: Latin-script text is aligned as English, as it was before.
"""

from __future__ import annotations

import unicodedata
from functools import lru_cache
from typing import Any

# How many times as likely as English another language must be for a text to be not English.
NOT_ENGLISH_ODDS = 10.0


def reads_as_english(text: str) -> bool:
    """Whether the aligner should align `text` (a segment's, as written) as English."""
    letters = [c for c in text if c.isalpha()]
    if not letters:
        return True                       # digits and symbols: spelled out in English (`spelling.py`)
    latin = sum(1 for c in letters if unicodedata.name(c, "").startswith("LATIN"))
    if latin * 2 < len(letters):
        return False
    identifier = _identifier()
    if identifier is None:
        return True
    ranked = dict(identifier.rank(text))
    best = max(ranked.values())
    return best < NOT_ENGLISH_ODDS * ranked.get("en", 0.0)


@lru_cache(maxsize=1)
def _identifier() -> Any:
    """py3langid's identifier, probabilities normalised; None where it is not installed. Loaded
    once per aligner process, at its first text without a language (0.8 s, some 100 MB)."""
    try:
        from py3langid.langid import MODEL_FILE, LanguageIdentifier
    except ImportError:
        return None
    return LanguageIdentifier.from_model_file(MODEL_FILE, norm_probs=True)
