"""The engine loop's turn, request by request: where each request is (`RequestStatus`) at every
step, on an engine whose steps the test lets go one at a time (no timing involved). The queue's
policy itself is tested without a thread (`test_queue.py`)."""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import numpy as np
import pytest

from attackers import ATTACKER, attacker_socket
from conftest import WAIT_TIMEOUT, HostedEngine, assert_good_stream, connect_client, wait_until
from helpers import LONG, SENTENCE, drain, service_on
from vox_ws.engine import EndReason, ErrorKind, GenerationRequest, Refused, RequestStatus, StepResult
from vox_ws.engines.piper import PiperEngine
from vox_ws.engines.speed_slots import RemeasurePolicy, SpeedMeasure, SpeedSlots
from vox_ws.scheduling.loop import EngineLoop
from vox_ws.service import Audio, Ended, Failed, StreamRequest
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


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


class MeasuredTone(ToneEngine):
    """The tone engine, its slots sized as Piper's are (`SpeedSlots`: half its speed), from
    measures whose times the test says: how fast a machine is, and how busy, is not the
    test's to know. The first piece of the first measure taken again submits `arrives`,
    from the loop's own thread, in the middle of the measure."""

    def __init__(self, policy: RemeasurePolicy) -> None:
        super().__init__(slots=64)
        self.policy = policy
        self.arrives: GenerationRequest | None = None
        self.loop: EngineLoop | None = None
        self.spoken: list[int] = []              # pieces spoken, each measure's

    def load(self) -> None:
        super().load()
        busy = SpeedMeasure.of((4.0, 1.0, 0.25), threads=1)    # 4x, a quarter of the CPU: 2 slots
        self.slot_sizing = SpeedSlots(busy, lambda speed: (max(1, int(speed / 2)), "half"), self._pieces,
                                      self.policy, engine="tone")

    def slots(self) -> tuple[int, str]:
        return self.slot_sizing.slots()

    def _pieces(self):
        self.spoken.append(0)
        return [self._piece, self._piece]

    def _piece(self) -> tuple[float, float, float]:
        self.spoken[-1] += 1
        if self.arrives is not None:
            arrives, self.arrives = self.arrives, None
            self.loop.submit(arrives)
        return 8.0, 0.5, 0.5                    # quiet now: 16x, the whole CPU: 8 slots


async def test_a_busy_start_is_measured_again_when_idle_giving_way_to_a_request_and_the_slots_follow():
    clock = Clock()
    engine = MeasuredTone(RemeasurePolicy(backoff_s=(30.0,), clock=clock))
    scheduler = EngineLoop(engine, slots=None, max_queue=4)
    engine.loop = scheduler
    scheduler.start()
    try:
        assert scheduler.ready_event.wait(WAIT_S) and scheduler.status == "ready"
        stats = scheduler.stats()
        assert stats["slots"] == 2 and stats["slots_measure"]["contended"] and engine.spoken == []
        arrived = engine.arrives = request("aaa", "one")
        clock.now = 30.0                         # the back-off is over: measured at the next idle moment
        scheduler.wake()
        assert await asyncio.to_thread(arrived.sink.last) == ("finish", EndReason.DONE)
        await wait_until(lambda: scheduler.stats()["slots_measure"]["remeasures"] == 1)
        # The measure the request interrupted was dropped after its first piece, and taken again whole.
        assert engine.spoken == [1, 2]
        stats = scheduler.stats()
        assert stats["slots"] == 8 == scheduler.queue.slots and scheduler.queue.fair.max_share == 4
        assert stats["slots_measure"]["contended"] is False and "measured again" in stats["slots_reason"]
        assert stats["slots_measure"]["next_at"] is None
        many = [request("a", f"c{i}") for i in range(9)]
        with scheduler._cond:                   # the loop's lock (reentrant): no turn until all are in
            assert [scheduler.submit(each) for each in many] == [0] * 8 + [1]      # 8 slots at the next turn
        for each in many:
            assert await asyncio.to_thread(each.sink.last) == ("finish", EndReason.DONE)
    finally:
        scheduler.stop()


@pytest.mark.hardening
async def test_streams_waiting_on_slow_readers_give_their_slots_to_a_waiting_stream(start_server):
    import msgpack
    from websockets.asyncio.client import connect

    # Neither a stall time-out, nor a queue wait, nor the keepalive in reach: the victim can
    # speak only if the readers' slots are given back while they lag.
    server = start_server(PiperEngine(), slots=2, write_stall_timeout_s=3600.0, max_queue_wait_s=3600.0,
                          ping_interval=3600.0, ping_timeout=3600.0, max_buffered_audio_s=1.0)
    readers = []
    for address in (ATTACKER, "127.0.0.3"):             # two clients, one slot each: their share
        sock = attacker_socket(server.port, rcvbuf=4096, source=address)
        ws = await connect(server.url, sock=sock, max_queue=1)
        await ws.recv()                                  # hello
        await ws.send(msgpack.packb({"type": "start", "id": "slow", "text": LONG * 3}))
        readers.append(ws)
    await wait_until(lambda: server.devices.stats()["active"] + server.devices.stats()["parked"] == 2)
    async with connect_client(server) as c:
        assert_good_stream(await c.speak(SENTENCE, "victim"))
    assert server.devices.stats()["parked"] >= 1        # still lagging: still parked
    # A reader that catches up gets its slot back and its stream goes on to the end.
    ws = readers[0]
    kinds = []
    while "end" not in kinds:
        kinds.append(msgpack.unpackb(await asyncio.wait_for(ws.recv(), WAIT_TIMEOUT))["type"])
    assert "error" not in kinds
    for ws in readers:
        ws.transport.abort()


@pytest.mark.hardening
async def test_a_stream_parked_while_its_reader_lags_holds_no_place_in_the_queue():
    """One slot, a queue of one: two readers that take nothing rest parked, and a third stream
    still finds room in the queue (it is not refused `busy` for streams that wait on nobody).
    The service speaks to the engine through its stand-in, as a server's does (`HostedEngine`):
    a reader that lags is told to the engine's slot queue across the boundary (`Reader`), and the
    queue's figures are those the stand-in has been sent."""

    from vox_ws.engine import EndReason
    from vox_ws.service import Ended, StreamRequest

    hosted = HostedEngine(PiperEngine(), slots=1, max_queue=1)
    service = await service_on(hosted.proxy, max_buffered_audio_s=1.0, write_stall_timeout_s=3600.0,
                               max_queue_wait_s=3600.0)
    try:
        lagging = [service.open_stream(StreamRequest(LONG), owners=(f"address:{n}", f"connection:{n}"))
                   for n in (1, 2)]
        # The first lags (nobody reads it), the second claims its slot: the first rests parked;
        # then the second lags with nobody waiting, and keeps the slot.
        await wait_until(lambda: hosted.proxy.stats()["parked"] == 1 and lagging[1].backlogged())
        assert hosted.proxy.stats()["queued"] == 0
        third = service.open_stream(StreamRequest(SENTENCE), owners=("address:3", "connection:3"))
        assert third.queued == 1
        events = await drain(third)
        assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
        for stream in lagging:
            stream.cancel()
    finally:
        hosted.stop()
        await service.close()


@pytest.mark.hardening
async def test_a_client_holding_every_slot_gives_one_back_to_a_newcomer():
    """Through the engine's stand-in (`HostedEngine`), as a server serves it; the slot queue
    read on the engine's side of the boundary."""
    hosted = HostedEngine(PiperEngine(), slots=2)
    assert hosted.engine_loop.queue.fair.max_share == 1
    # No stall time-out in reach: a stream whose reader takes nothing keeps its slot for good.
    service = await service_on(hosted.proxy, write_stall_timeout_s=3600.0)
    try:
        hog = [service.open_stream(StreamRequest(LONG * 3), owners=("connection:1",)) for _ in range(2)]
        first = [await hog[0].__anext__(), await hog[1].__anext__()]
        assert all(isinstance(e, Audio) for e in first)
        newcomer = service.open_stream(StreamRequest(SENTENCE), owners=("connection:2",))
        assert newcomer.queued == 1
        # The hog reads nothing more, so its streams hold their slots for good: the newcomer
        # speaks only because one was given back (parked), not after the hog's long texts.
        events = await drain(newcomer)
        assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
        assert not any(s.done for s in hog)
        for stream in hog:
            stream.cancel()
    finally:
        hosted.stop()
        await service.close()


class UnparkedHeldTone(HeldTone):
    """The held tone engine, unable to park: a stream holds its slot until it ends."""

    can_park = False


@pytest.mark.hardening
async def test_a_stream_queued_too_long_ends_busy():
    """The one slot's holder is held in a step by the test until the waiter has waited past
    `max_wait_s`, on an engine that cannot park it: the next turn refuses the waiter, whatever
    the machine's speed. (With Piper the holder, once far ahead of its idle reader, was parked
    for the waiter, before the time-out on one machine and after it on another.)"""
    max_wait_s = 0.5
    engine = UnparkedHeldTone()
    hosted = HostedEngine(engine, slots=1, max_queue=4, max_wait_s=max_wait_s)   # through its stand-in
    service = await service_on(hosted.proxy)
    holder_text = "x" * 40
    try:
        holder = service.open_stream(StreamRequest(holder_text), owners=("connection:1",))
        await asyncio.to_thread(engine.inside_step)              # the holder has the slot, held
        waiter = service.open_stream(StreamRequest(SENTENCE), owners=("connection:1",))
        started = time.monotonic()
        await wait_until(lambda: time.monotonic() - started > max_wait_s)
        engine.go.release()                                      # one step; then the turn that refuses
        events = await drain(waiter, timeout=WAIT_TIMEOUT)
        assert isinstance(events[-1], Failed) and events[-1].kind == ErrorKind.BUSY, events[-1]
        assert not any(isinstance(e, Audio) for e in events)
        holder.cancel()
    finally:
        for _ in holder_text:
            engine.go.release()                                  # whatever steps are left go through
        hosted.stop()
        await service.close()


class RecordingPiper(PiperEngine):
    """The real voice, recording which request each step served."""

    def __init__(self):
        super().__init__()
        self.served: list[str] = []

    def step(self, batch):
        self.served.append(batch[0].text)
        return super().step(batch)


@pytest.mark.hardening
async def test_two_streams_of_dense_text_do_not_hold_up_a_newcomer():
    """Dense text on two streams (85 s of speech each, once one step) cannot hold up a third:
    the newcomer's client had the least of the engine, so its steps run back to back."""
    engine = RecordingPiper()
    hosted = HostedEngine(engine, slots=4)                       # through its stand-in
    service = await service_on(hosted.proxy)
    try:
        dense = ("我们今天去公园散步，天气非常好。" * 15)[:240]
        hogs = [service.open_stream(StreamRequest(dense), owners=(f"connection:{n}",)) for n in (1, 2)]
        readers = [asyncio.create_task(drain(h, 120)) for h in hogs]
        # Both hogs served long enough for their clients' share of the engine to settle (it
        # decays by SERVICE_DECAY a step: after 20 steps each holds about its steady share).
        await wait_until(lambda: engine.served.count(dense) >= 20)
        newcomer_text = SENTENCE + " " + SENTENCE
        events = await drain(service.open_stream(StreamRequest(newcomer_text), owners=("connection:3",)))
        assert isinstance(events[-1], Ended) and events[-1].reason == EndReason.DONE
        served = engine.served
        mine = [i for i, text in enumerate(served) if text == newcomer_text]
        assert len(mine) >= 2
        assert sum(1 for i in range(mine[0], mine[-1]) if served[i] != newcomer_text) == 0, \
            served[mine[0]:mine[-1]]
        for hog in hogs:
            hog.cancel()
        await asyncio.gather(*readers)
    finally:
        hosted.stop()
        await service.close()


@pytest.mark.hardening
async def test_a_full_queue_makes_room_for_a_client_that_holds_less():
    """Through the engine's stand-in (`HostedEngine`), as a server serves it: the slot queue is
    the engine's, across the boundary, so a stream it refuses opens and fails at once (`busy`),
    as PROTOCOL.md allows, where an engine on the service's thread refused the open itself."""
    hosted = HostedEngine(PiperEngine(), slots=1, max_queue=2)
    service = await service_on(hosted.proxy)
    try:
        flooder = [service.open_stream(StreamRequest(LONG), owners=("address:a", "connection:1"))
                   for _ in range(3)]
        # Another connection of the same address is told apart by its connection.
        other = service.open_stream(StreamRequest(SENTENCE), owners=("address:a", "connection:2"))
        assert other.queued
        pushed = await drain(flooder[2], 30)
        assert isinstance(pushed[-1], Failed) and pushed[-1].kind == ErrorKind.BUSY \
            and "pushed out" in pushed[-1].message
        # The flooder's next stream finds the queue full: it outweighs nobody.
        refused = await drain(service.open_stream(StreamRequest(SENTENCE), owners=("address:a", "connection:1")), 30)
        assert [type(e) for e in refused] == [Failed] and refused[0].kind == ErrorKind.BUSY, refused
        # Another address is told apart by its address: the busiest connection of address a
        # (the flooder's, not the other's) gives way.
        third = service.open_stream(StreamRequest(SENTENCE), owners=("address:b", "connection:3"))
        pushed = await drain(flooder[1], 30)
        assert isinstance(pushed[-1], Failed) and pushed[-1].kind == ErrorKind.BUSY
        assert not other.done
        for stream in flooder + [other, third]:
            stream.cancel()
    finally:
        hosted.stop()
        await service.close()
