"""The text plan on its own: no engine, no loop, no clock (`vox_ws/service/text_plan.py`)."""

from __future__ import annotations

import pytest

from vox_ws.engine import EndReason, ErrorKind, Refused
from vox_ws.service.events import Word
from vox_ws.service.text_plan import Pause, Speak, TextPlan


def speak_next(plan: TextPlan, start_s: float) -> str:
    step = plan.next()
    assert isinstance(step, Speak), step
    plan.started(step.text, start_s)
    return step.text


def test_a_one_shot_text_in_pieces_and_pauses_is_said_in_order_then_done():
    plan = TextPlan(input_streaming=False, max_text_chars=100)
    plan.say(["One.", Pause(0.5), "Two."])
    assert plan.continues and not plan.done
    assert speak_next(plan, 0.0) == "One."
    assert plan.in_flight                                   # one segment at a time
    plan.spoke(1.0, EndReason.DONE)
    assert plan.next() == Pause(0.5)
    assert speak_next(plan, 1.5) == "Two."
    assert not plan.done
    plan.spoke(2.5, EndReason.MAX_LEN)
    assert plan.next() is None and plan.done and plan.end_reason is EndReason.MAX_LEN
    assert plan.segments == [{"text": "One.", "start_s": 0.0, "end_s": 1.0},
                             {"text": "Two.", "start_s": 1.5, "end_s": 2.5}]


def test_streamed_input_waits_for_boundaries_and_a_flush_counts_what_was_sent_before_it():
    plan = TextPlan(input_streaming=True, max_text_chars=100)
    assert plan.idle and plan.continues
    plan.push("Hello there. How")
    assert plan.has_partial
    first = speak_next(plan, 0.0)               # the first sentence goes at once
    plan.push(" are you")
    plan.flush()                                # everything so far: the segment in flight, and the rest
    assert plan.due_flushes() == 0
    plan.spoke(1.0, EndReason.DONE)
    assert plan.due_flushes() == 0
    second = speak_next(plan, 1.0)
    assert (first, second) == ("Hello there.", "How are you")
    plan.spoke(2.0, EndReason.DONE)
    assert plan.due_flushes() == 1 and plan.due_flushes() == 0
    assert plan.idle and not plan.done
    plan.end_input()
    assert plan.done and plan.end_reason is EndReason.DONE


def test_a_prepared_text_cut_again_goes_first_and_a_flush_waits_for_all_its_pieces():
    plan = TextPlan(input_streaming=True, max_text_chars=100)
    plan.push("Twelve. ")
    plan.flush()
    step = plan.next()
    assert step == Speak("Twelve.")
    first = plan.cut(["twelve", "point", "five"])
    plan.started(first, 0.0)
    plan.push("After. ")
    plan.spoke(1.0, EndReason.DONE)
    assert plan.due_flushes() == 0
    assert plan.next() == Speak("point", prepared=True)
    plan.spoke(2.0, EndReason.DONE)
    assert plan.next() == Speak("five", prepared=True)
    plan.spoke(3.0, EndReason.DONE)
    assert plan.due_flushes() == 1
    assert plan.next() == Speak("After.")


def test_too_much_waiting_input_is_refused_and_nothing_is_lost():
    plan = TextPlan(input_streaming=True, max_text_chars=10)
    plan.push("12345")
    with pytest.raises(Refused) as refused:
        plan.push("1234567")
    assert refused.value.kind is ErrorKind.TOO_LARGE and refused.value.field == "text"
    plan.push("12345")
    plan.end_input()
    assert speak_next(plan, 0.0) == "1234512345"


def test_heard_at_a_cancel_names_the_whole_segments_and_the_cut_one_with_its_words():
    plan = TextPlan(input_streaming=False, max_text_chars=100)
    plan.say(["First one.", "Second one here."])
    speak_next(plan, 0.0)
    plan.spoke(1.0, EndReason.DONE)
    speak_next(plan, 1.0)
    words = [Word("Second", 1.0, 1.3), Word("one", 1.3, 1.6), Word("here.", 1.6, 2.0)]
    heard = plan.heard(taken_s=1.7, generated_s=2.0, timed_words=words)
    assert heard["text"] == "First one." and heard["audio_s"] == 1.7
    assert heard["partial"] == {"text": "Second one here.", "start_s": 1.0, "sent_s": 0.7, "fraction": None,
                                "words": ["Second", "one"]}
