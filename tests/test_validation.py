"""The rules every front door's requests must pass, in one place (`vox_ws/service/validation.py`):
each refusal names its field; a door parses, the stream service checks, and every rule runs
once per request whatever the door (counted below, on a real server)."""

from __future__ import annotations

import collections
import sys
import threading
from typing import Any, Callable

import httpx
import pytest

from conftest import assert_good_stream, connect_client
from vox_ws.config import Limits
from vox_ws.engine import ErrorKind, Refused
from vox_ws.engines.piper import PiperEngine
from vox_ws.service import validation
from vox_ws.service.validation import MAX_INSTRUCTIONS_CHARS, check_instructions, check_length, check_output
from vox_ws.service.voices.service import VoiceService
from vox_ws.transports import protocol as p


@pytest.mark.parametrize("speed", [0.1, 4.5, float("inf"), float("nan"), True, "fast", None])
def test_a_speed_outside_its_range_or_not_a_number_is_refused_naming_it(speed):
    with pytest.raises(Refused) as refused:
        check_output(speed, None)
    assert refused.value.kind is ErrorKind.INVALID and refused.value.field == "speed"
    assert "field 'speed'" in refused.value.message


def test_lengths_are_too_large_naming_their_field():
    check_length("x" * 10, 10, "input")
    with pytest.raises(Refused) as refused:
        check_length("x" * 11, 10, "input")
    assert (refused.value.kind, refused.value.field) == (ErrorKind.TOO_LARGE, "input")
    assert "input" in refused.value.message and "max_text_chars=10" in refused.value.message
    check_instructions("x" * MAX_INSTRUCTIONS_CHARS)
    with pytest.raises(Refused) as refused:
        check_instructions("x" * (MAX_INSTRUCTIONS_CHARS + 1))
    assert (refused.value.kind, refused.value.field) == (ErrorKind.TOO_LARGE, "instructions")


def test_a_lookahead_or_a_volume_out_of_range_is_refused_naming_it():
    check_output(1.0, None)
    for lookahead, volume, field in ((0.01, 1.0, "lookahead_s"), (None, 5.0, "volume"), (None, "loud", "volume")):
        with pytest.raises(Refused) as refused:
            check_output(1.0, lookahead, volume)
        assert refused.value.field == field and f"field '{field}'" in refused.value.message


def test_the_v1_door_parses_and_leaves_the_rules_to_the_service():
    """Types are the door's: a speed that is no number is refused as the frame is read. Ranges
    and lengths are the service's: such a `start` parses, and the service refuses it."""
    limits = Limits(max_text_chars=20)
    with pytest.raises(p.ProtocolError, match="field 'speed' must be a number"):
        p.parse_message({"type": "start", "id": "a", "text": "Hi.", "speed": "fast"}, limits, {})
    for over in ({"speed": 9}, {"text": "x" * 21}, {"text": " "}, {"instructions": "x" * 501},
                 {"language": "not a tag"}, {"volume": 9}):
        start = p.parse_message({"type": "start", "id": "a", "text": "Hi.", **over}, limits, {})
        assert isinstance(start, p.Start)


RULES = ("check_text", "check_length", "check_output", "check_language", "check_instructions", "check_options")


class Calls:
    """Each rule's calls, by what it was asked about: every function of `RULES` wherever a
    module of the package imported it, and the voice service's resolution of a voice name."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.count: collections.Counter = collections.Counter()
        for name in RULES:
            original = getattr(validation, name)
            counted = self._counting(name, original)
            for module in [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("vox_ws")]:
                if getattr(module, name, None) is original:
                    monkeypatch.setattr(module, name, counted)
        resolve = VoiceService.resolve
        monkeypatch.setattr(VoiceService, "resolve", self._counting("resolve", resolve, method=True))

    def _counting(self, name: str, fn: Callable, method: bool = False) -> Callable:
        def counted(*args: Any, **kwargs: Any) -> Any:
            subject = args[1] if method else args[0] if args else None
            self.count[(name, repr(subject))] += 1
            return fn(*args, **kwargs)
        return counted

    def twice(self) -> list:
        return [key for key, n in self.count.items() if n > 1]


@pytest.fixture()
def server(start_server):
    return start_server(PiperEngine(), slots=2)


async def test_every_rule_runs_once_for_a_v1_start(server, monkeypatch):
    calls = Calls(monkeypatch)
    async with connect_client(server) as c:
        result = await c.speak("Hello there, once.", "s", voice="alloy", speed=1.2, volume=0.8, language="en",
                               instructions="Calmly.", lookahead_s=2.0, options={"noise_scale": 0.5})
    assert_good_stream(result)
    assert {name for name, _ in calls.count} >= {"check_text", "check_length", "check_output", "check_language",
                                                 "check_instructions", "check_options", "resolve"}
    assert calls.twice() == [], calls.count


async def test_every_rule_runs_once_for_an_openai_request_the_voice_resolved_once(server, monkeypatch):
    calls = Calls(monkeypatch)
    body = {"model": "tts-1", "input": "Hello there, once.", "voice": "alloy", "response_format": "pcm",
            "speed": 1.2, "volume": 0.8, "language": "en", "instructions": "Calmly.", "noise_scale": 0.5}
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        answer = await http.post("/v1/audio/speech", json=body)
    assert answer.status_code == 200 and answer.content, answer.text
    assert [n for (name, _), n in calls.count.items() if name == "resolve"] == [1]
    assert calls.twice() == [], calls.count


async def test_the_services_refusals_are_worded_for_each_door(server):
    """The rules run in the service, each door names the field its own way: v1's error says
    the field, OpenAI's names it as its `param` (`input` for the text), an unknown voice is
    OpenAI's `voice_not_found`."""
    async with connect_client(server) as c:
        fast = await c.speak("Too fast.", "a", speed=9)
        empty = await c.speak("   ", "b")
        assert_good_stream(await c.speak("Then a good one.", "c"))      # the connection goes on
    assert (fast.error["code"], empty.error["code"]) == ("bad_request", "bad_request")
    assert "field 'speed'" in fast.error["message"] and "empty" in empty.error["message"]
    async with httpx.AsyncClient(base_url=server.http, timeout=60) as http:
        for body, param, code in (({"speed": 9}, "speed", "invalid_value"),
                                  ({"input": "x" * (Limits().max_text_chars + 1)}, "input", "too_large"),
                                  ({"input": " "}, "input", "invalid_value"),
                                  ({"language": "not a tag"}, "language", "invalid_value"),
                                  ({"voice": "nobody"}, "voice", "voice_not_found")):
            answer = await http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", **body})
            error = answer.json()["error"]
            assert answer.status_code in (400, 413) and (error["param"], error["code"]) == (param, code), error
            assert param != "input" or "'input'" in error["message"]
        good = await http.post("/v1/audio/speech", json={"model": "tts-1", "input": "Hi.", "response_format": "pcm"})
        assert good.status_code == 200 and good.content


class LoadsWhenLetGo(PiperEngine):
    """Piper, its load held until the test lets it go."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def load(self) -> None:
        assert self.go.wait(120)
        super().load()


async def test_a_bad_request_is_bad_while_the_model_loads_and_a_good_one_waits_for_it(start_server):
    engine = LoadsWhenLetGo()
    server = start_server(engine, wait=False)
    try:
        async with connect_client(server) as c:
            fast = await c.speak("Too fast.", "a", speed=9)
            early = await c.speak("Fine, but early.", "b")
        assert fast.error["code"] == "bad_request" and "field 'speed'" in fast.error["message"]
        assert early.error["code"] == "not_ready" and early.error["retryable"] is True
    finally:
        engine.go.set()
    server.wait_ready()
    async with connect_client(server) as c:
        assert_good_stream(await c.speak("Now it is ready.", "c"))
