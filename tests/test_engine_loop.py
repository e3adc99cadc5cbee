"""The engine loop's turn, request by request: where each request is (`RequestStatus`) at every
step, on an engine whose steps the test lets go one at a time (no timing involved). The queue's
policy itself is tested without a thread (`test_slot_queue.py`)."""

from __future__ import annotations

import queue
import threading

import numpy as np
import pytest

from vox_ws.engine import EndReason, ErrorKind, GenerationRequest, Refused, RequestStatus, StepResult
from vox_ws.scheduling.loop import EngineLoop
from vox_ws.testing.tone import ToneEngine

WAIT_S = 60.0        # a bound for a hang, never reached when the loop works


class HeldTone(ToneEngine):
    """The tone engine, each step held until the test lets it go; it can park (its state is
    where it is in its tone). One character is one step."""

    can_park = True

    def __init__(self) -> None:
        super().__init__(slots=8, chunk_s=0.08, seconds_per_char=0.08)
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
        """Wait until the loop's thread is held in a step; the ids of its batch."""
        assert self.entered.acquire(timeout=WAIT_S), "the loop never stepped"
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
    scheduler = EngineLoop(engine, slots=1, max_queue=4)
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
    scheduler = EngineLoop(engine, slots=4, max_queue=8)
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
