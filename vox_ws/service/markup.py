"""SSML, a small subset: pauses, substitutions, spelling out, paragraphs and sentences.

A text is read as SSML only when asked (`markup: "ssml"`) or when it starts with `<speak`;
plain text is never parsed. Supported:

    <speak>                     the root (added when `markup: "ssml"` and the text lacks it)
    <break time="500ms"/>       exact silence there: `ms` or `s`; or strength="none" .. "x-strong"
    <sub alias="W3C">...</sub>  says the alias instead of the enclosed text
    <say-as interpret-as="characters">ABC</say-as>   spells it out ("spell-out" too)
    <p>, <s>                    a paragraph, a sentence: each spoken as a segment of its own

Anything else (another tag or attribute, a document type, entities) is refused, naming it;
nothing is ever read aloud that was meant as markup. The result is the parts to speak in
order: texts, and pauses between them.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

from ..engine import ErrorKind, Refused

MAX_BREAK_S = 10.0          # one break at most (the vendors' common bound); all of a request's
                            # silence together: `silence.MAX_SILENCE_S`, counted by the stream
MAX_DEPTH = 16              # nesting of elements
STRENGTH_S = {"none": 0.0, "x-weak": 0.25, "weak": 0.5, "medium": 0.75, "strong": 1.0, "x-strong": 1.25}
SPELLED = ("characters", "spell-out")
TAGS = ("speak", "break", "sub", "say-as", "p", "s")

_TIME = re.compile(r"\s*(\d+(?:\.\d+)?)\s*(ms|s)\s*")
_XML_LANG = "{http://www.w3.org/XML/1998/namespace}lang"
_ALLOWED_ATTRIBUTES = {"speak": {"version", _XML_LANG}, "break": {"time", "strength"}, "sub": {"alias"},
                       "say-as": {"interpret-as"}, "p": {_XML_LANG}, "s": {_XML_LANG}}


@dataclass(frozen=True)
class Pause:
    """Silence of this many seconds, between the texts around it."""

    seconds: float


Part = str | Pause


def wants_markup(text: str, markup: str | None) -> bool:
    """Whether a text is to be read as SSML: `markup` says so, or (unsaid) the text starts with
    `<speak`. Raises Refused for a `markup` other than "ssml" or "none"."""
    if markup not in (None, "ssml", "none"):
        raise Refused(ErrorKind.INVALID, f"field 'markup' must be 'ssml' or 'none', got {markup!r}")
    if markup is None:
        return text.lstrip().startswith("<speak")
    return markup == "ssml"


def parse_ssml(text: str) -> list[Part]:
    """The parts an SSML text speaks: texts, and pauses between them (never two in a row,
    never an empty text). Raises Refused (INVALID, or TOO_LARGE for a break too long; the
    request's silence in all is the stream's `SilenceBudget`)."""
    if "<!" in text:
        raise Refused(ErrorKind.INVALID, "SSML: document types, entities and CDATA are not accepted")
    source = text.strip()
    if not source.startswith("<speak"):
        source = f"<speak>{source}</speak>"
    try:
        root = ET.fromstring(source)
    except ET.ParseError as exc:
        raise Refused(ErrorKind.INVALID, f"SSML is not well-formed: {exc}") from None
    if _tag(root) != "speak":
        raise Refused(ErrorKind.INVALID, f"SSML: the root must be <speak>, not <{_tag(root)}>")
    reader = _Reader()
    reader.element(root, 0)
    return reader.finish()


def _tag(element: ET.Element) -> str:
    return element.tag.rsplit("}", 1)[-1] if isinstance(element.tag, str) else str(element.tag)


class _Reader:
    def __init__(self) -> None:
        self.parts: list[Part] = []
        self.text: list[str] = []

    def element(self, element: ET.Element, depth: int) -> None:
        tag = _tag(element)
        if depth > MAX_DEPTH:
            raise Refused(ErrorKind.INVALID, f"SSML: elements nested over {MAX_DEPTH} deep")
        if tag not in TAGS:
            raise Refused(ErrorKind.INVALID, f"SSML: unknown tag <{tag}> (supported: "
                                             + ", ".join(f"<{t}>" for t in TAGS) + ")")
        for name in element.attrib:
            if name not in _ALLOWED_ATTRIBUTES[tag]:
                shown = "xml:lang" if name == _XML_LANG else name
                raise Refused(ErrorKind.INVALID, f"SSML: <{tag}> has no attribute {shown!r}")
        if tag == "break":
            self._break(element)
        elif tag == "sub":
            self._leaf(element, tag)
            alias = element.get("alias")
            if alias is None:
                raise Refused(ErrorKind.INVALID, "SSML: <sub> needs an alias")
            self.text.append(alias)
        elif tag == "say-as":
            self._leaf(element, tag)
            kind = element.get("interpret-as")
            if kind not in SPELLED:
                raise Refused(ErrorKind.INVALID, f"SSML: <say-as interpret-as={kind!r}> is not supported "
                                                 f"(supported: {', '.join(SPELLED)})")
            self.text.append(" " + " ".join(ch for ch in (element.text or "") if not ch.isspace()) + " ")
        else:
            boundary = tag in ("p", "s")
            if boundary:
                self._end_text()
            self.text.append(element.text or "")
            for child in element:
                self.element(child, depth + 1)
                self.text.append(child.tail or "")
            if boundary:
                self._end_text()

    def _break(self, element: ET.Element) -> None:
        if len(element) or (element.text or "").strip():
            raise Refused(ErrorKind.INVALID, "SSML: <break> takes no content")
        time, strength = element.get("time"), element.get("strength")
        if time is not None:
            match = _TIME.fullmatch(time)
            if match is None:
                raise Refused(ErrorKind.INVALID, f"SSML: <break time={time!r}>: a time is like '500ms' or '1.5s'")
            seconds = float(match.group(1)) / (1000.0 if match.group(2) == "ms" else 1.0)
        elif strength is not None:
            if strength not in STRENGTH_S:
                raise Refused(ErrorKind.INVALID, f"SSML: <break strength={strength!r}> is not one of "
                                                 f"{list(STRENGTH_S)}")
            seconds = STRENGTH_S[strength]
        else:
            seconds = STRENGTH_S["medium"]
        if seconds > MAX_BREAK_S:
            raise Refused(ErrorKind.TOO_LARGE, f"SSML: a break of {seconds:g}s, over {MAX_BREAK_S:g}s")
        if seconds > 0:
            self._end_text()
            if self.parts and isinstance(self.parts[-1], Pause):
                self.parts[-1] = Pause(self.parts[-1].seconds + seconds)
            else:
                self.parts.append(Pause(seconds))

    def _leaf(self, element: ET.Element, tag: str) -> None:
        if len(element):
            raise Refused(ErrorKind.INVALID, f"SSML: <{tag}> holds text only, not <{_tag(element[0])}>")

    def _end_text(self) -> None:
        text = " ".join("".join(self.text).split())
        self.text = []
        if text:
            self.parts.append(text)

    def finish(self) -> list[Part]:
        self._end_text()
        return self.parts
