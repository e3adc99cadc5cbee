"""A stream's end held for the aligner's words (`vox_ws/service/aligner_end_wait.py`), with data:
the clock's readings are passed in, so nothing here waits."""

from vox_ws.engine import EndReason
from vox_ws.service.aligner_end_wait import AlignerEndWait
from vox_ws.service.events import Word


class Segment:
    """A segment as the end-wait sees it: a hashable that can leave the aligner's queue."""

    def __init__(self) -> None:
        self.dropped = False

    def drop_alignment(self) -> None:
        self.dropped = True


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


def test_an_end_whose_words_are_overdue_goes_without_them():
    wait = AlignerEndWait(Aligner())
    late = Segment()
    wait.expect(late)
    assert wait.holds(EndReason.DONE, now=10.0)
    assert wait.overdue(now=15.0) is None and not late.dropped       # within answer_within_s
    assert wait.overdue(now=15.5) == EndReason.DONE and late.dropped  # dropped from the queue
    assert wait.answer(late, (Word("a", 0, 1),)) == []                 # its words come too late


def test_clearing_drops_every_segment_waited_for():
    wait = AlignerEndWait(None)
    segments = [Segment(), Segment()]
    for segment in segments:
        wait.expect(segment)
    wait.clear()
    assert all(segment.dropped for segment in segments)
    assert not wait.holds(EndReason.DONE, now=0.0)
