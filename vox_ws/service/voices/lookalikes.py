"""Names that look alike: one normal form to compare them by, and names mixing scripts refused.

A voice's name is shown to people (Open WebUI's list, Home Assistant's picker), who cannot tell
`Alloy`, fullwidth `ａｌｌｏｙ` and `alloy` apart, nor Cyrillic `а` from Latin `a`. So the server's
voices, its aliases and the public voices are one name each by their normal form (`name_key`:
NFKC, case folded, NFKC again: Unicode's NFKC_Casefold, less its removal of default-ignorable
characters, which a voice's name cannot hold), and a name that mixes scripts is refused
(`mixes_scripts`), as Unicode's UTS #39 detects mixed scripts (section 5.1) at its "highly
restrictive" level (5.2): the letters of a name are of one script, or of Latin with Han and
Japanese kana, Latin with Han and Bopomofo, or Latin with Han and Hangul (characters common to
every script, digits and punctuation, and combining marks belong to any). `аlloy` (Cyrillic
`а`, Latin `lloy`) is refused; `日本語のボイス` and `Ελένη` are names. Each character's script is
the `confusable_homoglyphs` package's table of Unicode's Scripts.txt.

What this does not catch: a name wholly in a script whose letters look like another's (an
all-Greek `ΚΟΑ` beside a Latin `KOA`); comparing those takes UTS #39's confusable skeletons.
"""

from __future__ import annotations

import unicodedata

# Scripts that belong to every script (UTS #24's Common and Inherited), and what the table
# answers for an unassigned character (which a name's pattern already refuses).
_ANY_SCRIPT = frozenset({"COMMON", "INHERITED", "Unknown"})
# UTS #39 5.2, "highly restrictive": the scripts a name may mix.
_MIXES_ALLOWED = (frozenset({"LATIN", "HAN", "HIRAGANA", "KATAKANA"}),
                  frozenset({"LATIN", "HAN", "BOPOMOFO"}), frozenset({"LATIN", "HAN", "HANGUL"}))


def name_key(name: str) -> str:
    """What two names that read the same have in common: `Alloy`, `ａｌｌｏｙ` and `alloy` are
    `alloy`."""
    return unicodedata.normalize("NFKC", unicodedata.normalize("NFKC", name).casefold())


def scripts_of(name: str) -> frozenset[str]:
    """The scripts of a name's characters (Scripts.txt's names, upper case), less those that
    belong to every script."""
    from confusable_homoglyphs import categories  # its tables load at first use

    return frozenset(categories.alias(character) for character in name) - _ANY_SCRIPT


def mixes_scripts(name: str) -> bool:
    """Whether a name mixes scripts beyond what UTS #39's highly restrictive level allows."""
    scripts = scripts_of(unicodedata.normalize("NFKC", name))
    return len(scripts) > 1 and not any(scripts <= allowed for allowed in _MIXES_ALLOWED)
