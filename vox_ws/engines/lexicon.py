"""Pronunciations: words and phrases said another way, from a server lexicon and per request.

An entry maps a word or a phrase (whole words; case-insensitive unless it says otherwise;
punctuation around a word does not count) to a respelling, which any engine can say, or to
IPA phonemes, which only an engine that takes phonemes can (Piper, `Engine.takes_phonemes`).

    JSON   [{"match": "SQL", "say": "sequel"}, {"match": "Nguyen", "ipa": "ŋwˈiən"},
            {"match": "US", "say": "U S", "case_sensitive": true}]   (or {"entries": [...]},
           or {"SQL": "sequel", ...} for respellings only)
    TSV    match <TAB> respelling, or match <TAB> /ipa/, a line each; `#` starts a comment

Entries are matched left to right, the longest phrase first; a request's own entries come
before the server's. The text a client sent is what it is told back (segments, words, heard):
engines that take phonemes apply entries as they phonemize (each word keeps its place), the
others are given the respelled text.
"""

from __future__ import annotations

import json
import re
import unicodedata
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from ..engine import ErrorKind, Refused

MAX_ENTRY_CHARS = 100          # of a match, a respelling or IPA
MAX_REQUEST_ENTRIES = 64       # a request's own
MAX_LEXICON_ENTRIES = 20_000   # the server's
MAX_LEXICON_BYTES = 4 << 20
MAX_PHRASE_WORDS = 8

_WORD = re.compile(r"\S+")
# Punctuation that may stand around a word (Latin, general and CJK punctuation, full-width forms).
_EDGE_PUNCTUATION = "".join(chr(c) for c in (*range(0x3040), *range(0xFF00, 0xFF66))
                            if unicodedata.category(chr(c)).startswith("P"))


@dataclass(frozen=True)
class Pronunciation:
    match: str
    say: str | None = None
    ipa: str | None = None
    case_sensitive: bool = False

    @property
    def words(self) -> tuple[str, ...]:
        return tuple(_key(w, self.case_sensitive) for w in self.match.split())


def _bare(word: str) -> str:
    return word.strip(_EDGE_PUNCTUATION)


def _key(word: str, case_sensitive: bool) -> str:
    bare = _bare(word)
    return bare if case_sensitive else bare.casefold()


def entry(value: Any, where: str) -> Pronunciation:
    """One entry from its JSON shape; Refused (INVALID) naming `where` when it is not one."""
    if not isinstance(value, dict):
        raise Refused(ErrorKind.INVALID, f"{where}: an entry is an object with 'match' and 'say' or 'ipa'")
    unknown = set(value) - {"match", "say", "ipa", "case_sensitive"}
    if unknown:
        raise Refused(ErrorKind.INVALID, f"{where}: unknown field {sorted(unknown)[0]!r}")
    match, say, ipa = value.get("match"), value.get("say"), value.get("ipa")
    case_sensitive = value.get("case_sensitive", False)
    if not isinstance(match, str) or not match.split():
        raise Refused(ErrorKind.INVALID, f"{where}: 'match' must be a word or phrase")
    if (say is None) == (ipa is None):
        raise Refused(ErrorKind.INVALID, f"{where} ({match!r}): give one of 'say' and 'ipa'")
    for name, text in (("match", match), ("say", say), ("ipa", ipa)):
        if text is None:
            continue
        if not isinstance(text, str) or not text.strip():
            raise Refused(ErrorKind.INVALID, f"{where} ({match!r}): {name!r} must be a non-empty string")
        if len(text) > MAX_ENTRY_CHARS:
            raise Refused(ErrorKind.TOO_LARGE, f"{where} ({match!r}): {name!r} is over {MAX_ENTRY_CHARS} characters")
        if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in text):
            raise Refused(ErrorKind.INVALID, f"{where} ({match!r}): {name!r} has a control character")
    if len(match.split()) > MAX_PHRASE_WORDS:
        raise Refused(ErrorKind.TOO_LARGE, f"{where} ({match!r}): a phrase of more than {MAX_PHRASE_WORDS} words")
    if not all(_bare(w) for w in match.split()):
        raise Refused(ErrorKind.INVALID, f"{where} ({match!r}): 'match' must be words, not punctuation")
    if not isinstance(case_sensitive, bool):
        raise Refused(ErrorKind.INVALID, f"{where} ({match!r}): 'case_sensitive' must be true or false")
    return Pronunciation(match.strip(), say.strip() if say else None, ipa.strip() if ipa else None, case_sensitive)


def request_entries(value: Any) -> tuple[Pronunciation, ...]:
    """A request's `pronunciations`: a list of entries, at most MAX_REQUEST_ENTRIES."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise Refused(ErrorKind.INVALID, "field 'pronunciations' must be a list of entries")
    if len(value) > MAX_REQUEST_ENTRIES:
        raise Refused(ErrorKind.TOO_LARGE, f"field 'pronunciations' has {len(value)} entries, over "
                                           f"{MAX_REQUEST_ENTRIES}")
    return tuple(entry(item, f"pronunciations[{n}]") for n, item in enumerate(value))


class Lexicon:
    """Entries in a trie of words (one for case-insensitive entries, by folded words; one for the
    others, by words as written): the longest match at a word is found by walking at most
    MAX_PHRASE_WORDS levels, so matching is linear in the text whatever the entries. With `under`
    (the server's lexicon beneath a request's entries), a word is matched here first, then
    there; neither is copied."""

    def __init__(self, entries: Iterable[Pronunciation] = (), under: Lexicon | None = None) -> None:
        self.entries = tuple(entries)
        self._under = under
        self._folded: dict[str | None, Any] = {}
        self._exact: dict[str | None, Any] = {}
        for item in self.entries:
            node = self._exact if item.case_sensitive else self._folded
            for word in item.words:
                node = node.setdefault(word, {})
            node.setdefault(None, item)                        # the first entry of a phrase wins

    def __len__(self) -> int:
        return len(self.entries) + (len(self._under) if self._under is not None else 0)

    def _longest(self, folded: Sequence[str], exact: Sequence[str], i: int) -> Pronunciation | None:
        """The longest entry matching the words from `i` (as long: a case-sensitive one)."""
        hit, length = None, 0
        for node, keys in ((self._exact, exact), (self._folded, folded)):
            for j in range(i, min(len(keys), i + MAX_PHRASE_WORDS)):
                node = node.get(keys[j])
                if node is None:
                    break
                item = node.get(None)
                if item is not None and j + 1 - i > length:
                    hit, length = item, j + 1 - i
        return hit

    def find(self, words: Sequence[str]) -> list[tuple[int, int, Pronunciation]]:
        """(first word, end word, entry) of every match in `words` (a text's whitespace-split
        words), left to right, never overlapping."""
        found = []
        folded = [_key(w, False) for w in words]
        exact = [_bare(w) for w in words]
        layers = [self] if self._under is None else [self, self._under]
        i = 0
        while i < len(words):
            hit = None
            for layer in layers:
                hit = layer._longest(folded, exact, i)
                if hit is not None:
                    break                                      # a request's entry before the server's
            if hit is None:
                i += 1
                continue
            found.append((i, i + len(hit.words), hit))
            i += len(hit.words)
        return found


def found_in(words: Sequence[str], lexicon: Lexicon) -> tuple[Pronunciation, ...]:
    """The entries of `lexicon` that a text's words match, each once, in the order found: all of
    it that an engine phonemizing the text, or any piece of it, needs (it crosses to the engine
    process with the request, the server's 20,000 entries never do)."""
    return tuple(dict.fromkeys(item for _, _, item in lexicon.find(words)))


def combined(first: Sequence[Pronunciation], then: Lexicon) -> Lexicon:
    """A request's entries before the server's."""
    return Lexicon(first, under=then) if first else then


def respell(text: str, lexicon: Lexicon, ipa: bool = False) -> str:
    """The text with every matched word or phrase replaced by its respelling (punctuation around
    it kept); IPA entries are left for engines that take phonemes (`ipa`: put in too, for what
    the text becomes on such an engine)."""
    if not len(lexicon):
        return text
    spans = [m.span() for m in _WORD.finditer(text)]
    words = [text[a:b] for a, b in spans]
    out, at = [], 0
    for first, end, item in lexicon.find(words):
        said = item.say if item.say is not None else (item.ipa if ipa else None)
        if said is None:
            continue
        start = spans[first][0] + (len(words[first]) - len(words[first].lstrip(_EDGE_PUNCTUATION)))
        stop = spans[end - 1][1] - (len(words[end - 1]) - len(words[end - 1].rstrip(_EDGE_PUNCTUATION)))
        out += [text[at:start], said]
        at = stop
    return "".join(out) + text[at:]


def parse_lexicon(data: bytes, name: str) -> tuple[Lexicon, list[str]]:
    """A lexicon file (JSON, or TSV when it does not start with `[` or `{`): the lexicon, and
    what is wrong with it, a line each (empty when all is well)."""
    if len(data) > MAX_LEXICON_BYTES:
        return Lexicon(), [f"{name}: over {MAX_LEXICON_BYTES} bytes"]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Lexicon(), [f"{name}: not UTF-8 ({exc})"]
    entries: list[Pronunciation] = []
    problems: list[str] = []
    if text.lstrip().startswith(("[", "{")):
        try:
            value = json.loads(text)
        except (ValueError, RecursionError) as exc:
            return Lexicon(), [f"{name}: not JSON: {exc}"]
        if isinstance(value, dict) and "entries" in value:
            value = value["entries"]
        if isinstance(value, dict):
            value = [{"match": k, "say": v} for k, v in value.items()]
        if not isinstance(value, list):
            return Lexicon(), [f"{name}: a list of entries, or an object of respellings"]
        for n, item in enumerate(value):
            try:
                entries.append(entry(item, f"{name} entry {n}"))
            except Refused as err:
                problems.append(err.message)
    else:
        for n, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].rstrip()
            if not line.strip():
                continue
            match, tab, said = line.partition("\t")
            said = said.strip()
            fields: dict[str, Any] = {"match": match}
            if said.startswith("/") and said.endswith("/") and len(said) > 2:
                fields["ipa"] = said[1:-1]
            else:
                fields["say"] = said
            try:
                if not tab:
                    raise Refused(ErrorKind.INVALID, f"{name} line {n}: 'match<TAB>respelling' or 'match<TAB>/ipa/'")
                entries.append(entry(fields, f"{name} line {n}"))
            except Refused as err:
                problems.append(err.message)
    if len(entries) > MAX_LEXICON_ENTRIES:
        problems.append(f"{name}: {len(entries)} entries, over {MAX_LEXICON_ENTRIES}")
    return Lexicon(entries), problems
