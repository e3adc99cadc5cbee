"""The shared scheduler: one thread serves every stream's requests on one engine.

Data flows one way per turn of the scheduler thread (`Scheduler._turn`):

    schedule (under the lock: drop, expire, park, admit) -> prefill -> step -> hand off

and each request's `RequestStatus` says where it is:

    WAITING -> PREFILLING -> RUNNING -> FINISHED      (RUNNING <-> PARKED; any -> FINISHED)

Slots and turns are shared fairly among the clients a request names (`fair_share.py`: which
waiting request gets a free slot, which client gives a slot back or loses its place in a full
queue, which request an engine that cannot batch steps next); a request that waited longer
than `max_wait_s` for its first slot is failed (BUSY), so a queue never holds anyone forever.

An engine says how many requests one `step` call may advance (`max_step_batch`, its rows). A
batching engine advances every runnable request in one call while they fit; with more slots
than rows (KV memory for more streams than one step should carry), each step takes the rows
whose listeners will run out of audio soonest, and a stream far ahead waits. An engine that
cannot batch advances one request per turn, chosen by the fair-share policy (the owner served
the fewest steps lately, then the listener closest to running out of audio), so no stream
waits for another to finish.
The scheduler never touches asyncio: results go to each request's `RequestSink` (the stream service's thread-safe hand-off).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Callable, NamedTuple

from .engine import (EndReason, Engine, EngineFailure, ErrorKind, GenerationRequest, Readiness, Refused,
                     RequestStatus, StepResult)
from .fair_share import FairShare

log = logging.getLogger("vox_ws.scheduler")

# What a retry hint may say: never sooner than this, never later.
MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 60.0
# While the engine loads, nothing is measured yet: a client is told to try again after this.
LOADING_RETRY_AFTER_S = 2.0


class QueuePace:
    """How fast a queue moves: how long a request holds its slot, on average (a moving mean over
    the requests that left their slots lately, whatever ended them), and from it when a slot
    or a place is likely to free."""

    WEIGHT = 0.2                       # of the newest hold in the mean
    UNMEASURED_HOLD_S = 1.0            # until a hold has been measured

    def __init__(self) -> None:
        self.hold_s: float | None = None
        self.observed = 0

    def observe(self, hold_s: float) -> None:
        self.hold_s = hold_s if self.hold_s is None else self.hold_s + self.WEIGHT * (hold_s - self.hold_s)
        self.observed += 1

    def wait_s(self, holding: list[float], slots: int, after: int = 0) -> float:
        """Seconds until the next of `slots` slots frees (`holding`: how long each taken one has
        been held so far; fewer than `slots`: one is free now), and `after` more after it; the
        retry hint of a refusal, so clamped to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
        hold = self.hold_s if self.hold_s is not None else self.UNMEASURED_HOLD_S
        slots = max(slots, 1)
        first = 0.0 if len(holding) < slots else min(max(0.0, hold - held) for held in holding)
        estimate = first + max(after, 0) * hold / slots
        return round(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate)), 2)


class Scheduler:
    """Owns the engine thread. Thread-safe entry points: submit, cancel, wake, stats, stop."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int | None = 8,
        max_queue: int = 64,
        on_fatal: Callable[[BaseException, bool], None] | None = None,
        max_share: int | None = None,
        max_wait_s: float | None = None,
    ) -> None:
        self.engine = engine
        # None: the engine sizes its slots once loaded (`Engine.slots`: `--slots auto`).
        self.max_batch: int | None = max_batch
        self.slots_reason = "--slots" if max_batch is not None else "chosen when the engine has loaded"
        self.max_queue = max_queue
        self._max_share = max_share
        self.max_share = max_share or max(1, (max_batch or 2) // 2)
        self.fair = FairShare(self.max_share)
        self.max_wait_s = max_wait_s
        self.status = Readiness.LOADING
        self.error: str | None = None
        self.pace = QueuePace()
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._active: list[GenerationRequest] = []
        self._admitting = 0               # taken from the queue, being prefilled
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vox-ws-scheduler", daemon=True)
        self.ready_event = threading.Event()
        self.steps_total = 0
        self.last_step_s = 0.0
        self._recent_steps: deque[float] = deque(maxlen=20)   # the load signal's step time
        self.last_batch_size = 0
        # Optional observer of each step (batch size, seconds); used by metrics.
        self.on_step: Callable[[int, float], None] | None = None

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request. Returns its queue position (0: it gets a slot at the next turn)."""
        with self._cond:
            if self.status != Readiness.READY:
                raise Refused(ErrorKind.NOT_READY, f"engine is {self.status}" + (f": {self.error}" if self.error else ""),
                              self.not_ready_retry_s())
            ahead = self._ahead()
            if ahead >= self.max_queue:
                if not self._push_out_for(request):
                    raise Refused(ErrorKind.BUSY, f"all {self.max_batch} slots busy and {self.max_queue} requests queued",
                                  self._place_wait_s())
                ahead -= 1
            self._waiting.append(request)
            self._cond.notify()
            return max(0, ahead + 1)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the scheduler thread between two steps (LoRA swaps): no step sees
        half-changed weights. (Voices are built beside the steps, not here.)"""
        future: Future = Future()
        with self._cond:
            if self.status != Readiness.READY:
                future.set_exception(Refused(ErrorKind.NOT_READY, f"engine is {self.status}", self.not_ready_retry_s()))
                return future
            self._calls.append((fn, future))
            self._cond.notify()
        return future

    def cancel(self, request: GenerationRequest) -> None:
        """Stop a request; its slot is freed before the next step."""
        request.cancelled = True
        self.wake()

    def wake(self) -> None:
        with self._cond:
            self._cond.notify()

    def not_ready_retry_s(self) -> float | None:
        """The retry hint while the engine is not ready: while it loads, a short wait; once it
        has failed, none (trying again will not help)."""
        return LOADING_RETRY_AFTER_S if self.status == Readiness.LOADING else None

    def retry_after_s(self) -> float:
        """When a request refused for a full queue now should try again (its retry hint)."""
        with self._cond:
            return self._place_wait_s()

    def _place_wait_s(self) -> float:
        """Seconds until the queue has a place for one more request, at the pace measured: the
        next slot to free (the head of the queue takes it), and one more for every request
        beyond the queue's bound. Called with the lock held."""
        ahead = self._ahead()
        now = time.monotonic()
        holding = [now - r.admitted_at for r in self._active if r.admitted_at is not None]
        return self.pace.wait_s(holding, self.max_batch or 1, after=ahead - self.max_queue)

    def _ahead(self) -> int:
        """Requests waiting beyond the slots that the next turn frees. Called with the lock held."""
        return len(self._in_line()) - ((self.max_batch or 0) - len(self._active) - self._admitting)

    @property
    def step_rows(self) -> int:
        """The most requests one step carries: the engine's rows, at most the slots."""
        return min(self.engine.max_step_batch, self.max_batch or 0)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "status": self.status,
                "active": len(self._active),
                "queued": len(self._in_line()),
                "max_batch": self.max_batch or 0,
                "step_rows": self.step_rows,
                "slots_reason": self.slots_reason,
                "max_queue": self.max_queue,
                "parked": sum(1 for r in self._waiting if r.parked),
                "steps_total": self.steps_total,
                "last_step_ms": round(self.last_step_s * 1000, 3),
                "mean_step_ms": round(sum(self._recent_steps) / len(self._recent_steps) * 1000, 3)
                                if self._recent_steps else 0.0,
                "last_batch_size": self.last_batch_size,
                "slot_hold_s": None if self.pace.hold_s is None else round(self.pace.hold_s, 3),
            }

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        try:
            started = time.monotonic()
            self.engine.load()
            if self.max_batch is None:
                self.max_batch, self.slots_reason = self.engine.slots()
                self.max_share = self._max_share or max(1, self.max_batch // 2)
                self.fair = FairShare(self.max_share)
            log.info("engine %s loaded in %.2fs: %s; %d slots (%s)", self.engine.name, time.monotonic() - started,
                     self.engine.describe(), self.max_batch, self.slots_reason)
            with self._cond:
                self.status = Readiness.READY
            self.ready_event.set()
        except BaseException as exc:  # noqa: BLE001 - a failed load must be reported, not raised into nothing
            self._die(exc, "load failed", during_load=True)
            self._close_engine()
            return
        try:
            while self._turn():
                pass
        except BaseException as exc:  # noqa: BLE001 - the engine thread died: tell everyone
            self._die(exc, "engine thread died", during_load=False)
        finally:
            self._close_engine()

    def _close_engine(self) -> None:
        try:
            self.engine.close()
        except Exception:  # noqa: BLE001 - nothing is left to tell
            log.exception("closing engine %s failed", self.engine.name)

    # One turn reads top-down as nano-vllm's engine loop does: schedule (who gets a slot, who
    # leaves the queue, under the lock), prefill the newcomers, step every runnable request,
    # hand each result to its request's sink. Each request's `status` says where it is.

    def _turn(self) -> bool:
        """One turn of the loop; False when the scheduler is stopping."""
        plan = self._schedule()
        if plan is None:
            return False
        self._run_calls(plan.calls)
        for request in plan.dropped:
            self._finish(request, EndReason.CANCELLED)
        if plan.expired:
            retry_after = self.retry_after_s()   # hint: when one would get a place again
            for request in plan.expired:
                self._fail(request, ErrorKind.BUSY, f"waited over {self.max_wait_s:g}s for a slot: every slot "
                                                    "stayed busy", retry_after)
        self._retire_cancelled()
        fresh = self._prefill(plan.admitted)
        batch = fresh + [r for r in self._active
                         if r not in fresh and not r.cancelled and not r.sink.backlogged()]
        if not batch:
            if self._active:
                # Every active stream waits on its client; sleep until one drains (wake) or briefly.
                with self._cond:
                    self._cond.wait(0.02)
            return True
        for group in self._groups(batch):
            results = self._step(group)
            if results is not None:
                self._hand_off(group, results)
        self._retire_cancelled()
        return True

    def _schedule(self) -> "_Plan | None":
        """Under the lock: wait for work, then decide this turn: the engine calls to run, the
        waiting requests that leave the queue (cancelled, or waited too long), the streams that
        give their slots back (parked), and those admitted to the free slots."""
        with self._cond:
            while not self._stopping and not self._active and not self._waiting and not self._calls:
                self._cond.wait()
            if self._stopping:
                return None
            calls = list(self._calls)
            self._calls.clear()
            now = time.monotonic()
            dropped = [r for r in self._waiting if r.cancelled]   # cancelled before they (re)gained a slot
            expired = [r for r in self._waiting if not r.cancelled and not r.parked and self.max_wait_s is not None
                       and now - r.submitted_at > self.max_wait_s]
            for request in dropped + expired:
                self._waiting.remove(request)
            self._park_for_waiting()
            admitted = self.fair.admissions(deque(self._in_line()), self._active, self.max_batch - len(self._active))
            for request in admitted:
                self._waiting.remove(request)
            self._admitting = len(admitted)       # out of the queue, not yet in a slot
        return _Plan(calls, dropped, expired, admitted)

    def _run_calls(self, calls: list[tuple[Callable[[], Any], Future]]) -> None:
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets the error
                    future.set_exception(exc)

    def _in_line(self) -> list[GenerationRequest]:
        """The waiting requests that want a slot: not those parked while their readers lag (they
        come back once their reader has caught up, and meanwhile hold no place in the queue).
        Called with the lock held."""
        return [r for r in self._waiting if not (r.parked and r.sink.backlogged())]

    def _park_for_waiting(self) -> None:
        """With every slot taken and a stream waiting, a slot is given back (engines that can
        park only): first by streams waiting on their readers (a slot that generates nothing),
        then by clients over their share, to waiting clients that hold fewer. Called with the
        lock held."""
        if not self.engine.can_park or len(self._active) < self.max_batch:
            return
        claimants = sum(1 for r in self._waiting if not r.parked and not r.cancelled)
        lagging = [r for r in self._active if not r.cancelled and r.sink.backlogged()][:claimants]
        for victim in lagging:
            self._park(victim)
            log.debug("request %s parked: its reader lags while another stream waits", victim.id)
        if len(self._active) < self.max_batch:
            return
        for victim in self.fair.to_park(self._waiting, self._active):
            self._park(victim)
            log.debug("request %s parked: its client holds over %d slots while another waits", victim.id,
                      self.max_share)

    def _park(self, request: GenerationRequest) -> None:
        self._active.remove(request)
        request.status = RequestStatus.PARKED
        self._waiting.appendleft(request)

    def _push_out_for(self, request: GenerationRequest) -> bool:
        """The queue is full: fail the newest waiting request of a client that outweighs the
        newcomer's. Called with the lock held; False if none does."""
        victim = self.fair.push_out(self._waiting, self._active, request)
        if victim is None:
            return False
        self._waiting.remove(victim)
        self._fail(victim, ErrorKind.BUSY, "pushed out of the full queue by another client's stream: this client "
                                           "has more streams waiting or running than others", self._place_wait_s())
        return True

    def _prefill(self, admitted: list[GenerationRequest]) -> list[GenerationRequest]:
        """This turn's admitted requests into the active set (RUNNING), in their order: the new
        ones prefilled together (`Engine.prefill_many`), the parked ones resumed where they
        were. Returns those that got there."""
        try:
            new = []
            for request in admitted:
                if request.cancelled:
                    self._finish(request, EndReason.CANCELLED)
                elif request.status is RequestStatus.WAITING:
                    request.status = RequestStatus.PREFILLING
                    request.admitted_at = time.monotonic()
                    new.append(request)
            try:
                errors = self.engine.prefill_many(new) if new else []
            except Exception as exc:  # noqa: BLE001 - the engine's own fault: these requests fail, not the loop
                errors = [exc] * len(new)
            for request, error in zip(new, errors):
                if error is None:
                    continue
                if isinstance(error, Refused):    # the engine found, late, that it cannot serve this one
                    self._fail(request, error.kind, error.message)
                else:
                    log.error("prefill failed for request %s", request.id, exc_info=error)
                    self._fail(request, ErrorKind.INTERNAL, f"prefill failed: {type(error).__name__}: {error}")
            # Failed and cancelled ones are FINISHED by now; one cancelled meanwhile retires later.
            running = [r for r in admitted if r.status in (RequestStatus.PREFILLING, RequestStatus.PARKED)]
            for request in running:
                request.status = RequestStatus.RUNNING
            with self._cond:
                self._active.extend(running)
            return running
        finally:
            with self._cond:
                self._admitting -= len(admitted)

    def _retire_cancelled(self) -> None:
        gone = [r for r in self._active if r.cancelled]
        if not gone:
            return
        with self._cond:
            self._active = [r for r in self._active if not r.cancelled]
        for request in gone:
            self._finish(request, EndReason.CANCELLED)

    def _groups(self, batch: list[GenerationRequest]) -> list[list[GenerationRequest]]:
        """The engine call this turn makes: every runnable request where one step carries them
        all; else the rows one step carries (`Engine.max_step_batch`: fewer than the slots),
        those whose listeners run out of audio soonest (`FairShare.most_urgent`); an engine
        that cannot batch steps the one request whose turn it is."""
        rows = self.engine.max_step_batch
        if rows <= 1:
            return [[self.fair.next_turn(batch)]]
        if len(batch) <= rows:
            return [batch]
        return [self.fair.most_urgent(batch, rows)]

    def _step(self, group: list[GenerationRequest]) -> list[StepResult] | None:
        """One engine step for `group`; None where it failed (its requests failed, the others
        go on) or nothing in it is left to step."""
        group[:] = [r for r in group if not r.cancelled]
        if not group:
            return None
        started = time.perf_counter()
        try:
            results = self.engine.step(group)
            if len(results) != len(group):
                raise RuntimeError(f"engine returned {len(results)} results for {len(group)} requests")
        except EngineFailure:
            raise
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the rest
            log.exception("step failed for requests %s", [r.id for r in group])
            self._leave_active(group)
            for request in group:
                self._fail(request, ErrorKind.INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
            return None
        elapsed = time.perf_counter() - started
        self.steps_total += 1
        self.last_step_s = elapsed
        with self._cond:                  # stats() reads them from other threads
            self._recent_steps.append(elapsed)
        self.last_batch_size = len(group)
        if self.on_step is not None:
            self.on_step(len(group), elapsed)
        self.fair.charge(group)
        return results

    def _hand_off(self, group: list[GenerationRequest], results: list[StepResult]) -> None:
        """Each result to its request's sink; finished requests leave their slots."""
        finished = []
        for request, result in zip(group, results):
            request.steps += 1
            if request.cancelled:
                continue
            if result.audio is not None and result.audio.size:
                request.sink.deliver(result.audio, result.words, result.phonemes)
            if result.finished is not None:
                finished.append((request, result.finished))
        if finished:
            self._leave_active([r for r, _ in finished])
            for request, reason in finished:
                self._finish(request, reason)

    def _leave_active(self, requests: list[GenerationRequest]) -> None:
        with self._cond:
            self._active = [r for r in self._active if r not in requests]

    def _finish(self, request: GenerationRequest, reason: EndReason) -> None:
        self._release(request)
        request.sink.finish(reason)

    def _fail(self, request: GenerationRequest, kind: ErrorKind, message: str,
              retry_after_s: float | None = None) -> None:
        self._release(request)
        request.sink.fail(kind, message, retry_after_s)

    def _release(self, request: GenerationRequest) -> None:
        """FINISHED: the engine's state of a request that was prefilled is let go."""
        prefilled = request.status in (RequestStatus.PREFILLING, RequestStatus.RUNNING, RequestStatus.PARKED)
        request.status = RequestStatus.FINISHED
        if not prefilled:
            return
        if request.admitted_at is not None:
            held = time.monotonic() - request.admitted_at
            with self._cond:
                self.pace.observe(held)
        try:
            self.engine.release(request)
        except Exception:  # noqa: BLE001
            log.exception("release failed for request %s", request.id)

    def _die(self, exc: BaseException, what: str, during_load: bool) -> None:
        log.error("%s: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
        with self._cond:
            self.status = Readiness.FAILED
            self.error = f"{what}: {type(exc).__name__}: {exc}"
            orphans = list(self._active) + list(self._waiting)
            self._active.clear()
            self._waiting.clear()
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(Refused(ErrorKind.INTERNAL, self.error))
        self.ready_event.set()
        for request in orphans:
            request.status = RequestStatus.FINISHED
            request.sink.fail(ErrorKind.INTERNAL, self.error)
        if self._on_fatal is not None:
            self._on_fatal(exc, during_load)


class _Plan(NamedTuple):
    """What one turn does, decided under the lock (`Scheduler._schedule`)."""

    calls: list[tuple[Callable[[], Any], Future]]
    dropped: list[GenerationRequest]          # cancelled while waiting
    expired: list[GenerationRequest]          # waited over max_wait_s for a first slot
    admitted: list[GenerationRequest]         # to the free slots, in order
