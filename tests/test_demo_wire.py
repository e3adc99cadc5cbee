"""The demo's JavaScript (web/demo/*.mjs) against protocol v1 as `vox_ws.wire` declares it, without
a browser: every message type it dispatches on is a server message, every field it reads of one
is a field of that message's class, and every message it sends is a client message whose
fields it names. The JavaScript is read as text: its handlers keep to the shapes below
(`case "TYPE": return onX(msg);`, `msg.field`, `send({ type: "TYPE", ... })`)."""

import dataclasses
import re
from pathlib import Path

import pytest

from helpers import top_level_parts
from vox_ws import wire

DEMO = Path(__file__).resolve().parent.parent / "web" / "demo"
APP = DEMO / "app.mjs"

# A function or method definition: `function name(a, b) {`, `async function name(a) {`, `name(a) {`.
_DEFINITION = re.compile(r"^[ \t]*(?:async\s+)?(?:function\s+)?(\w+)\s*\(([^()]*)\)\s*\{", re.M)
_KEYWORDS = {"if", "for", "while", "switch", "catch", "function", "return"}


def _functions() -> dict[str, tuple[list[str], str]]:
    """Every function and method of the demo's modules: its parameters and its body."""
    found: dict[str, tuple[list[str], str]] = {}
    for path in sorted(DEMO.glob("*.mjs")):
        text = path.read_text()
        for match in _DEFINITION.finditer(text):
            name = match.group(1)
            if name in _KEYWORDS:
                continue
            params = [p.strip() for p in match.group(2).split(",") if p.strip()]
            found.setdefault(name, (params, _block(text, match.end() - 1)))
    return found


def _block(text: str, opening: int) -> str:
    """The text between the brace at `opening` and the one that closes it."""
    depth = 0
    for at in range(opening, len(text)):
        depth += {"{": 1, "}": -1}.get(text[at], 0)
        if depth == 0:
            return text[opening + 1:at]
    raise AssertionError(f"unbalanced braces after {text[opening:opening + 60]!r}")


def _fields_read(function: str, param: str, functions: dict, seen: set | None = None) -> set[str]:
    """The fields `function` reads of its parameter `param` (`param.field`), and those of the
    functions it hands `param` on to whole (`decodeOpus(s, msg)`, `track.addSegment(msg)`)."""
    seen = seen if seen is not None else set()
    if (function, param) in seen or function not in functions:
        return set()
    seen.add((function, param))
    body = functions[function][1]
    fields = set(re.findall(rf"\b{param}\??\.(\w+)", body))
    for callee, args in re.findall(r"\b(\w+)\(([^()]*)\)", body):
        parts = [a.strip() for a in args.split(",")]
        if param in parts and callee in functions:
            callee_params = functions[callee][0]
            position = parts.index(param)
            if position < len(callee_params):
                fields |= _fields_read(callee, callee_params[position], functions, seen)
    return fields


def _handlers() -> dict[str, str]:
    """What the page does with each server message: `case "TYPE": return HANDLER(msg);`."""
    return dict(re.findall(r'case "(\w+)":\s*return (\w+)\(msg\)', _functions()["handle"][1]))


def demo_reads() -> dict[str, set[str]]:
    """Each server message type the page dispatches on, and the fields it reads of it."""
    functions = _functions()
    reads = {}
    for kind, handler in _handlers().items():
        reads[kind] = _fields_read(handler, functions[handler][0][0], functions)
    # The hello is kept (`state.hello = hello`) and read later too.
    reads.setdefault("hello", set()).update(re.findall(r"\bstate\.hello\.(\w+)", APP.read_text()))
    return reads


def _keys(literal: str) -> set[str]:
    """The keys of a JavaScript object literal's inside: `type: "x", id, text: a(b, c)`."""
    return {re.match(r"\s*(\w+)", part).group(1) for part in top_level_parts(literal) if part.strip()}


def demo_sends() -> list[tuple[str, set[str]]]:
    """Each message the page sends (`send({...})`, or `const m = {...}` then `m.field = ...`
    and `send(m)`): its type and the fields it may carry, `type` aside."""
    sent = []
    for _, body in _functions().values():
        for literal in re.findall(r"\bsend\(\{(.*?)\}\);", body):
            keys = _keys(literal)
            sent.append((re.search(r'type: "(\w+)"', literal).group(1), keys - {"type"}))
        for name, literal in re.findall(r"\bconst (\w+) = \{(\s*type: \"\w+\".*?)\};", body):
            if re.search(rf"\bsend\({name}\)", body):
                keys = _keys(literal) | set(re.findall(rf"\b{name}\.(\w+) =", body))
                sent.append((re.search(r'type: "(\w+)"', literal).group(1), keys - {"type"}))
    return sent


def _field_names(cls: type) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def test_the_demo_is_read_as_expected():
    """The reading above finds what the page does (so the checks below check something)."""
    reads = demo_reads()
    handled = {"hello", "start", "chunk", "end", "error", "words", "segment", "voice", "voice_delete"}
    assert handled <= set(reads)
    assert {"sample_rate", "format", "queued", "ignored_options"} <= reads["start"]
    assert {"audio", "packets", "durations_us", "description", "pre_skip"} <= reads["chunk"]
    assert {"text", "start_s", "end_s"} <= reads["segment"]           # through CaptionTrack.addSegment
    assert {"features", "sample_rate", "engine"} <= reads["hello"]
    assert {kind for kind, _ in demo_sends()} == {"start", "chunk", "end", "cancel", "voice", "voice_delete"}


def test_every_server_message_the_demo_reads_is_wires_with_the_fields_it_reads():
    for kind, fields in demo_reads().items():
        assert kind in wire.SERVER_MESSAGES, f"the demo handles {kind!r}, which the server never sends"
        missing = fields - _field_names(wire.SERVER_MESSAGES[kind])
        assert not missing, f"the demo reads {sorted(missing)} of {kind!r}, which wire's " \
                            f"{wire.SERVER_MESSAGES[kind].__name__} lacks"


def test_every_message_the_demo_sends_is_wires_with_the_fields_it_sends():
    client_messages = getattr(wire, "CLIENT_MESSAGES", None)
    if client_messages is None:
        pytest.skip("wire declares no client messages here (CLIENT_MESSAGES)")
    for kind, fields in demo_sends():
        assert kind in client_messages, f"the demo sends {kind!r}, which is no client message"
        missing = fields - _field_names(client_messages[kind])
        assert not missing, f"the demo sends {sorted(missing)} in {kind!r}, which wire's " \
                            f"{client_messages[kind].__name__} lacks"
