"""The slot queue as plain data: plain requests, readers the test sets, and a clock the test
moves (`now`). No thread, no engine, no sleep."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from vox_ws.engine import EndReason, ErrorKind, GenerationRequest, Refused, RequestStatus
from vox_ws.scheduling.queue import MOVES, QueuePace, SlotQueue

S = RequestStatus


class Readers:
    """Whose reader lags, and how far ahead each listener is: the test says."""

    def __init__(self) -> None:
        self.lags: set[int] = set()
        self.ahead: dict[int, float] = {}

    def lagging(self, request: GenerationRequest) -> bool:
        return request.id in self.lags

    def ahead_s(self, request: GenerationRequest) -> float:
        return self.ahead.get(request.id, 1.0)


def request(owner: str, at: float = 0.0, connection: str | None = None) -> GenerationRequest:
    owners = (owner,) if connection is None else (owner, connection)
    return GenerationRequest(text="x", sink=None, owners=owners, submitted_at=at)


def queue(slots: int = 2, max_queue: int = 4, *, share: int | None = None, can_park: bool = False,
          max_wait_s: float | None = None) -> tuple[SlotQueue, Readers]:
    readers = Readers()
    return SlotQueue(slots, max_queue, readers, max_share=share or max(1, slots // 2), can_park=can_park,
                     max_wait_s=max_wait_s), readers


def run(q: SlotQueue, now: float) -> list[GenerationRequest]:
    """One turn's planning, every new request's prefill going through."""
    admitted = q.plan(now).admitted
    for each in admitted:
        if each.status is S.PREFILLING:
            q.started(each)
    return admitted


# ------------------------------------------------------------------ places and moves


def test_a_request_waits_is_prefilled_runs_and_leaves_through_the_table_of_moves():
    q, _ = queue(slots=1)
    first, second = request("a"), request("b")
    assert q.add(first, 0.0).position == 0
    assert q.add(second, 0.0).position == 1
    assert (first.status, second.status) == (S.WAITING, S.WAITING)
    assert q.plan(1.0).admitted == [first]
    assert first.status is S.PREFILLING and first.admitted_at == 1.0
    # Being prefilled, it holds the slot: a newcomer is told it waits behind the second.
    assert q.add(request("c"), 1.0).position == 2
    q.started(first)
    assert first.status is S.RUNNING and q.batch(rows=4) == [first]
    assert q.left(first, 3.5) is True                       # the engine held state for it
    assert first.status is S.FINISHED and q.pace.hold_s == 2.5
    assert q.plan(4.0).admitted == [second]


def test_any_other_move_is_refused_naming_the_moves_there_are():
    q, _ = queue()
    waiting = request("a")
    q.add(waiting, 0.0)
    with pytest.raises(ValueError, match="cannot move from waiting to running; from waiting it moves to "
                                         "finished, prefilling"):
        q.started(waiting)
    with pytest.raises(ValueError, match="from new it moves to waiting"):
        q.left(request("b"), 0.0)
    q.left(waiting, 0.0)
    with pytest.raises(ValueError, match="nowhere: it has ended"):
        q.add(waiting, 0.0)
    assert set(MOVES) == set(RequestStatus)


def test_the_queue_imports_no_thread_no_clock_and_no_engine():
    source = Path(__file__).resolve().parent.parent / "vox_ws" / "scheduling" / "queue.py"
    imported = set()
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add("." * node.level + (node.module or ""))
    assert not imported & {"threading", "time", "asyncio", "concurrent.futures"}
    assert not any("engines" in name or "service" in name or "loop" in name for name in imported), imported


# ------------------------------------------------------------------ admission


def test_a_free_slot_goes_to_the_client_holding_fewest_then_to_the_oldest():
    q, _ = queue(slots=3, max_queue=8)
    hog1, hog2, other, late_hog = request("hog", 0.0), request("hog", 1.0), request("other", 2.0), request("hog", 3.0)
    for each in (hog1, hog2, other, late_hog):
        q.add(each, each.submitted_at)
    # hog1 first (oldest, nobody holds anything), then `other` (holds none), then hog2 (oldest of hog's).
    assert run(q, 4.0) == [hog1, other, hog2]
    assert late_hog.status is S.WAITING
    assert q.stats() == {"active": 3, "queued": 1, "parked": 0, "slot_hold_s": None, "empty": False}


def test_connections_of_one_owner_are_told_apart_by_what_each_holds():
    q, _ = queue(slots=2, max_queue=8)
    first = [request("token:t", at, "connection:1") for at in (0.0, 1.0)]
    second = request("token:t", 2.0, "connection:2")
    for each in [*first, second]:
        q.add(each, each.submitted_at)
    assert run(q, 3.0) == [first[0], second]


# ------------------------------------------------------------------ a full queue: refusal and push-out


def test_a_full_queue_refuses_a_client_that_holds_as_much_with_a_retry_hint():
    q, _ = queue(slots=1, max_queue=1)
    holder, waiter = request("a"), request("b")
    q.add(holder, 0.0)
    run(q, 0.0)
    q.add(waiter, 0.0)
    with pytest.raises(Refused) as refused:
        q.add(request("b"), 0.4)
    assert refused.value.kind is ErrorKind.BUSY
    # Unmeasured pace (1 s a hold): the slot frees 0.6 s from now.
    assert refused.value.retry_after_s == pytest.approx(0.6)


def test_a_full_queue_pushes_out_the_newest_waiting_request_of_a_client_that_outweighs_the_newcomer():
    q, _ = queue(slots=1, max_queue=3, share=1)
    holder = request("heavy", 0.0)
    q.add(holder, 0.0)
    run(q, 0.0)
    older, newer = request("heavy", 1.0), request("heavy", 2.0)
    q.add(older, 1.0)
    q.add(newer, 2.0)
    q.add(request("light", 2.5), 2.5)
    newcomer = request("light2", 3.0)
    added = q.add(newcomer, 3.0)
    assert added.pushed_out is not None and added.pushed_out.request is newer
    assert (added.pushed_out.kind, added.pushed_out.prefilled) == (ErrorKind.BUSY, False)
    assert added.pushed_out.retry_after_s is not None and "pushed out" in added.pushed_out.message
    assert newer.status is S.FINISHED and newcomer.status is S.WAITING and added.position == 3
    # The heavy client itself cannot push its own out.
    with pytest.raises(Refused):
        q.add(request("heavy", 4.0), 4.0)


# ------------------------------------------------------------------ parking


def test_a_stream_whose_reader_lags_gives_its_slot_to_a_waiting_one_and_holds_no_place_meanwhile():
    q, readers = queue(slots=1, max_queue=1, can_park=True)
    lagging, newcomer = request("a"), request("b")
    q.add(lagging, 0.0)
    run(q, 0.0)
    readers.lags.add(lagging.id)
    assert q.batch(rows=1) == []                         # a lagging reader's stream is not stepped
    q.add(newcomer, 1.0)
    plan = q.plan(1.0)
    assert plan.parked == [lagging] and plan.admitted == [newcomer]
    assert lagging.status is S.PARKED
    q.started(newcomer)
    # Parked while its reader lags, it holds no place in line: the queue's one place is free.
    assert q.stats()["queued"] == 0 and q.add(request("c"), 1.0).position == 1
    q.left(newcomer, 2.0)
    readers.lags.clear()
    # Caught up, it is first in line and resumes where it was (RUNNING, no prefill).
    assert q.plan(2.0).admitted == [lagging] and lagging.status is S.RUNNING


def test_an_engine_that_cannot_park_keeps_a_lagging_stream_in_its_slot():
    q, readers = queue(slots=1, can_park=False)
    lagging = request("a")
    q.add(lagging, 0.0)
    run(q, 0.0)
    readers.lags.add(lagging.id)
    q.add(request("b"), 1.0)
    assert q.plan(1.0) == ([], [], [])


def test_a_client_over_its_share_gives_a_slot_back_to_a_waiting_client_that_holds_fewer():
    q, _ = queue(slots=2, share=1, can_park=True)
    hogs = [request("hog", at) for at in (0.0, 1.0)]
    for each in hogs:
        q.add(each, each.submitted_at)
    run(q, 1.0)
    newcomer = request("new", 2.0)
    q.add(newcomer, 2.0)
    plan = q.plan(2.0)
    assert plan.parked == [hogs[1]] and plan.admitted == [newcomer]


# ------------------------------------------------------------------ expiry and retry hints


def test_a_request_that_waited_too_long_for_a_first_slot_leaves_busy_and_a_parked_one_never_expires():
    q, readers = queue(slots=1, max_wait_s=5.0, can_park=True)
    holder, waiter = request("a", 0.0), request("b", 0.0)
    q.add(holder, 0.0)
    run(q, 0.0)
    q.add(waiter, 0.0)
    assert q.plan(5.0).expired == []                     # 5 s is not over 5 s
    expired = q.plan(5.5).expired
    assert [e.request for e in expired] == [waiter] and expired[0].kind is ErrorKind.BUSY
    assert "waited over 5s" in expired[0].message and expired[0].retry_after_s == pytest.approx(0.1)
    assert waiter.status is S.FINISHED
    readers.lags.add(holder.id)
    q.add(request("c", 6.0), 6.0)
    assert q.plan(6.0).parked == [holder]
    assert q.plan(60.0).expired == []                    # parked since 0.0: it never expires


def test_the_retry_hint_follows_the_measured_pace_and_shrinks_as_the_holder_holds():
    q, _ = queue(slots=1, max_queue=1)
    first = request("a")
    q.add(first, 0.0)
    run(q, 0.0)
    q.left(first, 30.0)                                  # a hold of 30 s measured
    assert q.stats()["slot_hold_s"] == 30.0
    holder = request("a", 40.0)
    q.add(holder, 40.0)
    run(q, 40.0)
    q.add(request("b"), 40.0)
    assert q.place_wait_s(41.0) == 29.0
    assert q.place_wait_s(50.0) == 20.0
    assert q.place_wait_s(100.0) == 0.1                  # held past the pace: as soon as may be


def test_the_pace_is_a_moving_mean_of_holds_and_a_hint_stays_in_its_bounds():
    pace = QueuePace()
    pace.observe(10.0)
    pace.observe(20.0)
    assert pace.hold_s == pytest.approx(12.0) and pace.observed == 2
    assert pace.wait_s([], slots=2) == 0.1               # a slot is free
    assert pace.wait_s([1.0, 2.0], slots=2, after=100) == 60.0


# ------------------------------------------------------------------ the rows of a step


def test_with_more_running_than_rows_a_step_carries_the_listeners_closest_to_running_out():
    q, readers = queue(slots=4, max_queue=4)
    streams = {name: request(name) for name in "abcd"}
    for each in streams.values():
        assert q.add(each, 0.0).position == 0           # every one has a slot at once
    run(q, 0.0)
    ids = {each.id: name for name, each in streams.items()}
    readers.ahead = {streams[n].id: s for n, s in {"a": 5.0, "b": -0.5, "c": 0.3, "d": 9.0}.items()}
    assert [ids[r.id] for r in q.batch(rows=2)] == ["b", "c"]
    readers.ahead = {streams[n].id: s for n, s in {"a": 0.1, "b": 3.0, "c": 4.0, "d": 0.2}.items()}
    assert [ids[r.id] for r in q.batch(rows=2)] == ["a", "d"]
    readers.lags.add(streams["a"].id)
    assert [ids[r.id] for r in q.batch(rows=2)] == ["b", "d"]       # a lagging reader's is left out


def test_one_row_a_step_takes_turns_by_client_then_by_the_listener_closest_to_running_out():
    q, readers = queue(slots=3, max_queue=4, share=3)
    one_a, one_b, two = request("one", 0.0), request("one", 1.0), request("two", 2.0)
    for each in (one_a, one_b, two):
        q.add(each, each.submitted_at)
    run(q, 2.0)
    readers.ahead = {one_a.id: 2.0, one_b.id: 0.5, two.id: 3.0}
    turns = [q.batch(rows=1)[0] for _ in range(4)]
    # Client one's more urgent listener, then client two, then client one again...
    assert turns == [one_b, two, one_b, two]


# ------------------------------------------------------------------ cancelling and closing


def test_a_cancelled_request_ends_where_it_is_and_only_once():
    q, _ = queue(slots=1)
    running, waiting = request("a"), request("b")
    q.add(running, 0.0)
    run(q, 0.0)
    q.add(waiting, 0.0)
    ended = q.cancel(waiting, 1.0)
    assert (ended.request, ended.reason, ended.prefilled) == (waiting, EndReason.CANCELLED, False)
    ended = q.cancel(running, 2.0)
    assert ended.prefilled is True and q.pace.hold_s == 2.0
    assert q.cancel(running, 3.0) is None and q.cancel(request("c"), 3.0) is None
    assert q.stats()["empty"] is True


def test_closing_finishes_every_request_still_in_the_queue():
    q, _ = queue(slots=1)
    everyone = [request(owner) for owner in "abc"]
    for each in everyone:
        q.add(each, 0.0)
    run(q, 0.0)
    assert sorted(r.id for r in q.close()) == sorted(r.id for r in everyone)
    assert all(r.status is S.FINISHED for r in everyone) and q.stats()["empty"]


# ------------------------------------------------------------------ resizing (`--slots auto` measured again)


def test_more_slots_admit_the_waiting_at_the_next_plan():
    q, _ = queue(slots=1, max_queue=8)
    requests = [request(owner) for owner in "abc"]
    for each in requests:
        q.add(each, 0.0)
    assert run(q, 0.0) == requests[:1]
    q.resize(3, max_share=1)
    assert run(q, 0.0) == requests[1:]
    assert [r.status for r in requests] == [S.RUNNING] * 3 and q.fair.max_share == 1


def test_fewer_slots_take_none_back_and_admit_none_until_fewer_hold_one():
    q, readers = queue(slots=3, max_queue=8, can_park=True)
    running = [request(owner) for owner in "abc"]
    for each in running:
        q.add(each, 0.0)
    run(q, 0.0)
    waiting = request("d")
    q.add(waiting, 0.0)
    readers.lags.add(running[0].id)                  # a lagging reader would be parked for it at 3 slots
    q.resize(1, max_share=1)
    assert run(q, 1.0) == [] and [r.status for r in running] == [S.RUNNING] * 3
    assert waiting.status is S.WAITING
    q.left(running[0], 2.0)
    q.left(running[1], 2.0)
    assert run(q, 2.0) == [] and waiting.status is S.WAITING      # one holds its slot: the count
    q.left(running[2], 3.0)
    assert run(q, 3.0) == [waiting]
