"""The scheduler's turn, request by request: where each request is (`RequestStatus`) at every
step, on an engine whose steps the test lets go one at a time (no timing involved)."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from vox_ws.engine import EndReason, ErrorKind, GenerationRequest, Refused, RequestStatus, StepResult
from vox_ws.scheduler import Scheduler
from vox_ws.testing.tone import ToneEngine

WAIT_S = 60.0        # a bound for a hang, never reached when the scheduler works


class HeldTone(ToneEngine):
    """The tone engine, each step held until the test lets it go; it can park (its state is
    where it is in its tone). One character is one step."""

    can_park = True

    def __init__(self) -> None:
        super().__init__(max_batch=8, chunk_s=0.08, seconds_per_char=0.08)
        self.entered = threading.Semaphore(0)
        self.go = threading.Semaphore(0)
        self.batches: list[list[int]] = []
        self.prefilled: list[int] = []

    def prefill(self, request: GenerationRequest) -> None:
        self.prefilled.append(request.id)
        super().prefill(request)

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        self.batches.append([r.id for r in batch])
        self.entered.release()
        assert self.go.acquire(timeout=WAIT_S)
        return super().step(batch)

    def inside_step(self) -> list[int]:
        """Wait until the scheduler thread is held in a step; the ids of its batch."""
        assert self.entered.acquire(timeout=WAIT_S), "the scheduler never stepped"
        return self.batches[-1]


class RecordingSink:
    """What a stream would be told, and whether its reader lags (the test says)."""

    def __init__(self) -> None:
        self.told: queue.Queue = queue.Queue()
        self.lagging = False
        self.ahead_s = 0.0

    def deliver(self, pcm: np.ndarray, words=None, phonemes=None) -> None:
        self.told.put(("audio", len(pcm)))

    def finish(self, reason: EndReason) -> None:
        self.told.put(("finish", reason))

    def fail(self, kind, message: str, retry_after_s: float | None = None) -> None:
        self.told.put(("fail", kind))

    def backlogged(self) -> bool:
        return self.lagging

    def audio_ahead_s(self) -> float:
        return self.ahead_s

    def last(self) -> tuple:
        """The next thing it is told that is not audio."""
        while True:
            told = self.told.get(timeout=WAIT_S)
            if told[0] != "audio":
                return told


@pytest.fixture()
def held():
    engine = HeldTone()
    scheduler = Scheduler(engine, max_batch=1, max_queue=4)
    scheduler.start()
    assert scheduler.ready_event.wait(WAIT_S)
    yield engine, scheduler
    scheduler.stop()


def request(text: str, owner: str) -> GenerationRequest:
    return GenerationRequest(text=text, sink=RecordingSink(), owners=(owner,))


def test_a_request_waits_runs_and_finishes_and_the_next_takes_its_slot(held):
    engine, scheduler = held
    first, second = request("a", "one"), request("a", "two")
    assert scheduler.submit(first) == 0
    assert scheduler.submit(second) == 1
    assert engine.inside_step() == [first.id]
    assert (first.status, second.status) == (RequestStatus.RUNNING, RequestStatus.WAITING)
    engine.go.release()
    assert engine.inside_step() == [second.id]
    assert first.status is RequestStatus.FINISHED and first.sink.last() == ("finish", EndReason.DONE)
    assert second.status is RequestStatus.RUNNING
    engine.go.release()
    assert second.sink.last() == ("finish", EndReason.DONE)
    assert second.status is RequestStatus.FINISHED
    assert engine.prefilled == [first.id, second.id]


def test_a_request_cancelled_while_it_waits_finishes_without_being_prefilled(held):
    engine, scheduler = held
    running, waiting = request("a" * 40, "one"), request("a", "two")
    scheduler.submit(running)
    scheduler.submit(waiting)
    assert engine.inside_step() == [running.id]
    scheduler.cancel(waiting)
    engine.go.release()
    assert engine.inside_step() == [running.id]
    assert waiting.status is RequestStatus.FINISHED and waiting.sink.last() == ("finish", EndReason.CANCELLED)
    assert waiting.id not in engine.prefilled
    scheduler.cancel(running)
    engine.go.release()
    assert running.sink.last() == ("finish", EndReason.CANCELLED)
    assert running.status is RequestStatus.FINISHED


def test_a_stream_whose_reader_lags_is_parked_for_a_waiting_one_and_resumes_unprefilled(held):
    engine, scheduler = held
    lagging, newcomer = request("a" * 40, "one"), request("a", "two")
    scheduler.submit(lagging)
    assert engine.inside_step() == [lagging.id]
    lagging.sink.lagging = True
    scheduler.submit(newcomer)
    engine.go.release()
    assert engine.inside_step() == [newcomer.id]
    assert (lagging.status, newcomer.status) == (RequestStatus.PARKED, RequestStatus.RUNNING)
    assert scheduler.stats()["parked"] == 1
    lagging.sink.lagging = False
    engine.go.release()
    assert engine.inside_step() == [lagging.id]
    assert lagging.status is RequestStatus.RUNNING and newcomer.status is RequestStatus.FINISHED
    assert engine.prefilled == [lagging.id, newcomer.id]      # it resumed where it was
    scheduler.cancel(lagging)
    engine.go.release()
    assert lagging.sink.last() == ("finish", EndReason.CANCELLED)


def test_with_more_slots_than_rows_each_step_carries_the_listeners_closest_to_running_out():
    engine = HeldTone()
    engine.max_step_batch = 2                 # rows a step: compute
    scheduler = Scheduler(engine, max_batch=4, max_queue=4)     # KV slots: memory
    scheduler.start()
    try:
        assert scheduler.ready_event.wait(WAIT_S)
        assert (scheduler.stats()["max_batch"], scheduler.stats()["step_rows"]) == (4, 2)
        ahead = {"a": 5.0, "b": -0.5, "c": 0.3, "d": 9.0}         # seconds ahead of each listener
        streams = {name: request("a" * 40, name) for name in ahead}
        for name, each in streams.items():
            each.sink.ahead_s = ahead[name]
            assert scheduler.submit(each) == 0               # every one has a slot at once
        ids = {each.id: name for name, each in streams.items()}
        assert [ids[i] for i in engine.inside_step()] == ["b", "c"]
        assert all(each.status is RequestStatus.RUNNING for each in streams.values())
        for name, seconds in {"a": 0.1, "b": 3.0, "c": 4.0, "d": 0.2}.items():
            streams[name].sink.ahead_s = seconds
        engine.go.release()
        assert [ids[i] for i in engine.inside_step()] == ["a", "d"]
        for each in streams.values():
            scheduler.cancel(each)
        engine.go.release()
        for each in streams.values():
            assert each.sink.last() == ("finish", EndReason.CANCELLED)
    finally:
        scheduler.stop()


class BatchPrefillTone(HeldTone):
    """HeldTone that records each prefill call's requests and refuses a text of "!"."""

    def __init__(self) -> None:
        super().__init__()
        self.prefill_calls: list[list[int]] = []

    def prefill_many(self, requests: list[GenerationRequest]) -> list[BaseException | None]:
        self.prefill_calls.append([r.id for r in requests])
        return super().prefill_many(requests)

    def prefill(self, request: GenerationRequest) -> None:
        if request.text == "!":
            raise Refused(ErrorKind.TOO_LARGE, "no room for this one")
        super().prefill(request)


def test_the_requests_admitted_in_one_turn_are_prefilled_together_and_a_refused_one_fails_alone():
    engine = BatchPrefillTone()
    scheduler = Scheduler(engine, max_batch=4, max_queue=8)
    scheduler.start()
    try:
        assert scheduler.ready_event.wait(WAIT_S)
        first = request("a" * 10, "one")
        scheduler.submit(first)
        assert engine.inside_step() == [first.id]          # held: the others arrive meanwhile
        burst = [request("aa", "two"), request("!", "three"), request("aaa", "four")]
        for r in burst:
            scheduler.submit(r)
        engine.go.release()
        assert sorted(engine.inside_step()) == sorted([first.id, burst[0].id, burst[2].id])
        assert engine.prefill_calls == [[first.id], [r.id for r in burst]]
        assert burst[1].sink.last() == ("fail", ErrorKind.TOO_LARGE)
        assert burst[1].status is RequestStatus.FINISHED
        assert (burst[0].status, burst[2].status) == (RequestStatus.RUNNING, RequestStatus.RUNNING)
        # The refused request's slot is free: a newcomer takes it at the next turn.
        late = request("a", "five")
        scheduler.submit(late)
        engine.go.release()
        assert late.id in engine.inside_step()
        for _ in range(20):
            engine.go.release()
        for r in (first, burst[0], burst[2], late):
            assert r.sink.last() == ("finish", EndReason.DONE)
    finally:
        for _ in range(50):
            engine.go.release()
        scheduler.stop()
