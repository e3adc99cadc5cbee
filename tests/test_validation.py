"""The rules every front door applies, in one place (`vox_ws/service/validation.py`): each
refusal names its field, and protocol v1 and OpenAI's API word the same rule's refusal."""

from __future__ import annotations

import pytest

from vox_ws.config import Limits
from vox_ws.engine import ErrorKind, Refused
from vox_ws.service.validation import (MAX_INSTRUCTIONS_CHARS, check_instructions, check_length, check_output,
                                       check_speed)
from vox_ws.transports import protocol as p


@pytest.mark.parametrize("value", [0.1, 4.5, float("inf"), float("nan"), True, "fast", None])
def test_a_speed_outside_its_range_or_not_a_number_is_refused_naming_it(value):
    with pytest.raises(Refused) as refused:
        check_speed(value)
    assert refused.value.kind is ErrorKind.INVALID and refused.value.field == "speed"


def test_lengths_are_too_large_naming_the_doors_own_field():
    check_length("x" * 10, 10, "input")
    with pytest.raises(Refused) as refused:
        check_length("x" * 11, 10, "input")
    assert (refused.value.kind, refused.value.field) == (ErrorKind.TOO_LARGE, "input")
    assert "input" in refused.value.message and "max_text_chars=10" in refused.value.message
    check_instructions("x" * MAX_INSTRUCTIONS_CHARS)
    with pytest.raises(Refused) as refused:
        check_instructions("x" * (MAX_INSTRUCTIONS_CHARS + 1))
    assert (refused.value.kind, refused.value.field) == (ErrorKind.TOO_LARGE, "instructions")


def test_a_lookahead_out_of_range_is_refused_naming_it():
    check_output(1.0, None)
    with pytest.raises(Refused) as refused:
        check_output(1.0, 0.01)
    assert refused.value.field == "lookahead_s"


def test_protocol_v1_refuses_by_the_same_rules_with_the_same_words():
    limits = Limits(max_text_chars=20)
    for start, rule in (({"speed": 9}, lambda: check_speed(9)),
                        ({"text": "x" * 21}, lambda: check_length("x" * 21, 20, "text")),
                        ({"instructions": "x" * 501}, lambda: check_instructions("x" * 501))):
        with pytest.raises(p.ProtocolError) as wire:
            p.parse_message({"type": "start", "id": "a", "text": "Hi.", **start}, limits, {})
        with pytest.raises(Refused) as refused:
            rule()
        assert wire.value.message == refused.value.message
        assert wire.value.code == p.code_for(refused.value.kind)
