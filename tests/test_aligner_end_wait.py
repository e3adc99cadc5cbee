"""A stream's end held for the aligner's words (`vox_ws/service/aligner_end_wait.py`), with data:
the clock's readings are passed in, so nothing here waits."""

import pytest

from vox_ws.engine import EndReason
from vox_ws.service.aligner_end_wait import AlignerEndWait
from vox_ws.service.events import Word


class Segment:
    """A segment as the end-wait sees it: a hashable that can leave the aligner's queue, and
    estimate its words."""

    def __init__(self, *words: str) -> None:
        self.dropped = False
        self.words = words

    def drop_alignment(self) -> None:
        self.dropped = True

    def estimated_words(self) -> tuple[Word, ...]:
        return tuple(Word(word, i, i + 1, True) for i, word in enumerate(self.words))


class Aligner:
    answer_within_s = 5.0


def test_an_end_with_no_words_waited_for_goes_at_once():
    wait = AlignerEndWait(Aligner())
    assert not wait.holds(EndReason.DONE, now=0.0)
    assert wait.released() is None and wait.overdue(now=100.0) is None


def test_an_end_waits_for_the_last_words_then_is_released_with_them_in_order():
    wait = AlignerEndWait(Aligner())
    first, second = Segment(), Segment()
    wait.expect(first)
    wait.expect(second)
    assert wait.holds(EndReason.DONE, now=10.0)
    words = (Word("b", 1, 2),)
    assert wait.answer(second, words) == [] and wait.released() is None      # the first still out
    assert wait.answer(first, None) == [words]                                 # the first failed: none
    assert wait.released() == EndReason.DONE
    assert not first.dropped and not second.dropped


def test_a_cancel_never_waits_for_words():
    wait = AlignerEndWait(Aligner())
    wait.expect(Segment())
    assert not wait.holds(EndReason.CANCELLED, now=0.0)
    assert wait.released() is None


@pytest.mark.hardening
def test_an_end_whose_words_are_overdue_sends_them_estimated_in_order_then_goes():
    """Hardening VII (found on the way): under load the aligner's answer came past its deadline
    and the end went without the words still waited for, so captions lost them. Past the
    deadline (the clock passed in: nothing waits) every segment still waited for now leaves
    the aligner's queue with its words estimated, each marked, in the order spoken, after the
    words of a segment answered already but held behind them; an answer that comes later is
    not sent twice."""
    wait = AlignerEndWait(Aligner())
    late, answered, later = Segment("one", "two"), Segment("three"), Segment("four")
    for segment in (late, answered, later):
        wait.expect(segment)
    aligned = (Word("three", 5, 6),)
    assert wait.answer(answered, aligned) == []                          # behind the late one
    assert wait.holds(EndReason.DONE, now=10.0)
    assert wait.overdue(now=15.0) is None and not late.dropped       # within answer_within_s
    reason, words = wait.overdue(now=15.5)
    assert reason == EndReason.DONE and late.dropped and later.dropped and not answered.dropped
    assert words == [late.estimated_words(), aligned, later.estimated_words()]
    assert all(w.estimated for w in words[0] + words[2]) and not words[1][0].estimated
    assert wait.answer(late, (Word("one", 0, 1),)) == [] and wait.released() is None   # too late: not twice
    assert not wait.holds(EndReason.DONE, now=16.0)


def test_clearing_drops_every_segment_waited_for():
    wait = AlignerEndWait(None)
    segments = [Segment(), Segment()]
    for segment in segments:
        wait.expect(segment)
    wait.clear()
    assert all(segment.dropped for segment in segments)
    assert not wait.holds(EndReason.DONE, now=0.0)
