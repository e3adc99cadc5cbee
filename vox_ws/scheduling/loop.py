"""The engine loop: one thread per device drives its engine and its slot queue, turn by turn.

It owns what the queue must not: the thread, the lock, readiness, the engine's calls and the
requests' sinks. Other threads talk to it through one inbox of typed messages (`Cancel`,
`Call`, `End`), drained at the top of each turn; `submit` alone answers at once, under the
lock, since its queue position (or its refusal) is part of the reply to a stream's start.

One turn, as vLLM v1's engine core steps (schedule -> execute -> update), taking the lock twice,
and once more where a request finished:

    lock:  the inbox is drained; the queue plans (expired, parked, admitted)
           the ended are told; engine calls run; the admitted are prefilled together
    lock:  the prefilled start (or leave, refused); the queue picks the step's rows
           one engine step; each result to its request's sink
    lock:  (where one finished) the finished leave their slots, and are then told: a stream's
           next segment, or another stream, takes the slot at the very next turn

The loop never touches asyncio: results go to each request's `RequestSink` (the stream service's
thread-safe hand-off), always from this thread.

Under `--slots auto`, an engine whose slots may be measured again (`Engine.slot_sizing`: Piper
after a start on a busy machine) has its measure run here, a piece per turn, only while no
request is queued or running: a request that comes drops it (a stream waits at most one piece
of it, as it would behind another stream's step), and it is taken again at the next idle moment.
The queue is resized to the slots a completed measure sizes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Literal, Union

from ..engine import (
    Engine,
    EngineFailure,
    ErrorKind,
    GenerationRequest,
    Readiness,
    Refused,
    RequestStatus,
    SlotSizing,
)
from ..engines import accelerator
from .queue import Ending, SlotQueue

log = logging.getLogger("vox_ws.scheduling")

# While the engine loads, nothing is measured yet: a client is told to try again after this.
LOADING_RETRY_AFTER_S = 2.0
# With every running stream waiting on its reader, the loop sleeps this long at most (a reader
# that drains wakes it sooner).
IDLE_WAIT_S = 0.02


@dataclass(frozen=True)
class Cancel:
    request: GenerationRequest


@dataclass(frozen=True)
class Call:
    """Run `fn` on the loop's thread between two steps (LoRA swaps): no step sees half-changed weights."""

    fn: Callable[[], Any]
    future: Future


@dataclass(frozen=True)
class End:
    """A request the queue let go outside a turn (pushed out by `submit`): told on the loop's thread."""

    ending: Ending


Message = Union[Cancel, Call, End]
# A turn's work: the ended to tell, the calls to run, the admitted to prefill or resume.
TurnPlan = tuple[list[Ending], list[Call], list[GenerationRequest]]
# `_plan`'s answer when the engine is idle and a measure of its speed is due (`SlotSizing`).
MEASURE: Literal["measure"] = "measure"


def engine_failure(engine: Engine, error: BaseException | None) -> EngineFailure | None:
    """What in an engine's error ends the engine: the `EngineFailure` it raised, or one for an
    error that means its device is lost (`accelerator.device_lost`: every later step would fail
    as well); None for an error that fails only its own requests (running out of memory too)."""
    if error is None or isinstance(error, EngineFailure):
        return error
    why = None if isinstance(error, Refused) else accelerator.device_lost(error)
    if why is None:
        return None
    failure = EngineFailure(f"the device {engine.device} is lost: {why}")
    failure.__cause__ = error
    return failure


def not_ready(status: Readiness, error: str | None = None) -> Refused:
    """The refusal of work while an engine is not ready, with its retry hint: while it loads, a
    short wait; once it has failed, none (trying again will not help)."""
    return Refused(ErrorKind.NOT_READY, f"engine is {status}" + (f": {error}" if error else ""),
                   LOADING_RETRY_AFTER_S if status in (Readiness.LOADING, Readiness.COMPILING) else None)


class SinkReaders:
    """The queue's questions about a request's reader, answered by its sink."""

    @staticmethod
    def lagging(request: GenerationRequest) -> bool:
        return request.sink.backlogged()

    @staticmethod
    def ahead_s(request: GenerationRequest) -> float:
        return request.sink.audio_ahead_s()


class EngineLoop:
    """Thread-safe entry points: submit, cancel, call, wake, stats, stop."""

    def __init__(self, engine: Engine, slots: int | None = 8, max_queue: int = 64,
                 on_fatal: Callable[[BaseException, bool], None] | None = None,
                 max_share: int | None = None, max_wait_s: float | None = None) -> None:
        self.engine = engine
        # None: the engine sizes its slots once loaded (`Engine.slots`: `--slots auto`).
        self.slots: int | None = slots
        self.slots_reason = "--slots" if slots is not None else "chosen when the engine has loaded"
        self.max_queue = max_queue
        self.status = Readiness.LOADING
        self.error: str | None = None
        self.ready_event = threading.Event()
        # Optional observer of each step (rows, seconds); used by metrics.
        self.on_step: Callable[[int, float], None] | None = None
        # Optional observer of each turn's end, on the loop's thread: every result of the turn
        # has gone to its sink (the engine process sends the turn's results as one message).
        self.on_turn_end: Callable[[], None] | None = None
        self.queue: SlotQueue | None = None       # made once the engine has loaded (its slots known)
        # `--slots auto` measured again while serving (the engine's, once loaded), the measure
        # under way, and how the slots were measured (/v1/info's `slots_measure`), as of the last.
        self._sizing: SlotSizing | None = None
        self._measuring: Iterator[None] | None = None
        self._slots_measure: dict[str, Any] | None = None
        self._queue_settings = (max_share, max_wait_s)
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._inbox: deque[Message] = deque()
        self._step_seconds: float | None = None    # the last step's, for the stats at the next turn's lock
        self._stopping = False
        self._close_by: float | None = None      # by when the engine closes (`stop`)
        self._thread = threading.Thread(target=self._run, name="vox-ws-engine-loop", daemon=True)
        # How the loop's thread makes the engine's device its own before anything else (a test
        # records it instead).
        self.enter_device: Callable[[str], None] = accelerator.enter_device
        self.steps_total = 0
        self.last_step_s = 0.0
        self.last_batch_size = 0
        self._recent_steps: deque[float] = deque(maxlen=20)   # the load signal's step time

    # ------------------------------------------------------------------ other threads

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request. Returns its queue position (0: it gets a slot at the next turn);
        raises `Refused` while the engine is not ready or the queue is full."""
        with self._cond:
            if self.status != Readiness.READY or self.queue is None:
                raise not_ready(self.status, self.error)
            added = self.queue.add(request, time.monotonic())
            if added.pushed_out is not None:
                self._inbox.append(End(added.pushed_out))
            self._cond.notify()
            return added.position

    def cancel(self, request: GenerationRequest) -> None:
        """Stop a request; its slot is freed at the loop's next turn."""
        with self._cond:
            self._inbox.append(Cancel(request))
            self._cond.notify()

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the loop's thread between two steps. (Voices are built beside the steps, not here.)"""
        future: Future = Future()
        with self._cond:
            if self.status != Readiness.READY:
                future.set_exception(not_ready(self.status))
                return future
            self._inbox.append(Call(fn, future))
            self._cond.notify()
        return future

    def wake(self) -> None:
        """A reader has caught up: a loop waiting on its readers looks again."""
        with self._cond:
            self._cond.notify()

    def retry_after_s(self) -> float:
        """When a request refused for a full queue now should try again (its retry hint)."""
        with self._cond:
            return self.queue.place_wait_s(time.monotonic()) if self.queue is not None else LOADING_RETRY_AFTER_S

    @property
    def step_rows(self) -> int:
        """The most requests one step carries: the engine's rows, at most the slots."""
        return min(self.engine.max_step_batch, self.slots or 0)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            queue = self.queue.stats() if self.queue is not None else {}
            return {
                "status": self.status,
                "active": queue.get("active", 0),
                "queued": queue.get("queued", 0),
                "slots": self.slots or 0,
                "step_rows": self.step_rows,
                "slots_reason": self.slots_reason,
                "max_queue": self.max_queue,
                "parked": queue.get("parked", 0),
                "steps_total": self.steps_total,
                "last_step_ms": round(self.last_step_s * 1000, 3),
                "mean_step_ms": round(sum(self._recent_steps) / len(self._recent_steps) * 1000, 3)
                                if self._recent_steps else 0.0,
                "last_batch_size": self.last_batch_size,
                "slot_hold_s": queue.get("slot_hold_s"),
                "slots_measure": self._slots_measure,
            }

    def stop(self, timeout: float = 5.0, *, deadline: float | None = None, wait: bool = True) -> None:
        """Have the loop end after its turn and close its engine by `deadline` (`time.monotonic()`;
        else `timeout` seconds from now): its helper processes still running then are killed
        (`Engine.close`). With `wait`, until the loop's thread has ended or the deadline passed;
        without, the caller stops several loops at once and waits for them after."""
        deadline = time.monotonic() + timeout if deadline is None else deadline
        with self._cond:
            self._close_by = deadline
            self._stopping = True
            self._cond.notify()
        if wait and self._thread.is_alive():
            self._thread.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ the loop's thread

    def _run(self) -> None:
        try:
            try:
                started = time.monotonic()
                # A thread's CUDA device is device 0 until set: an engine on cuda:1 would take
                # device 0's current stream, and capture its CUDA graphs there.
                self.enter_device(self.engine.device)
                self.engine.load()
                if self.slots is None:
                    self.slots, self.slots_reason = self.engine.slots()
                    self._sizing = self.engine.slot_sizing
                max_share, max_wait_s = self._queue_settings
                queue = SlotQueue(self.slots, self.max_queue, SinkReaders(),
                                  max_share=max_share or max(1, self.slots // 2),
                                  can_park=self.engine.can_park, max_wait_s=max_wait_s)
                log.info("engine %s loaded in %.2fs: %s; %d slots (%s)", self.engine.name, time.monotonic() - started,
                         self.engine.describe(), self.slots, self.slots_reason)
                with self._cond:
                    self.queue, self.status = queue, Readiness.READY
                    self._slots_measure = self._sizing.describe() if self._sizing is not None else None
                self.ready_event.set()
            except BaseException as exc:  # noqa: BLE001 - a failed load must be reported, not raised into nothing
                self._die(exc, "load failed", during_load=True)
                return
            try:
                while self._turn(self.queue):
                    if self.on_turn_end is not None:
                        self.on_turn_end()
            except BaseException as exc:  # noqa: BLE001 - the loop's thread died: tell everyone
                self._die(exc, "engine failed" if isinstance(exc, EngineFailure) else "engine thread died",
                          during_load=False)
        finally:
            try:
                self.engine.close(self._close_by)
            except Exception:  # noqa: BLE001 - nothing is left to tell
                log.exception("closing engine %s failed", self.engine.name)

    def _turn(self, queue: SlotQueue) -> bool:
        """One turn; False when the loop is stopping."""
        taken = self._plan(queue)
        if taken is None:
            return False
        if taken == MEASURE:
            self._measure_piece(queue)
            return True
        endings, calls, admitted = taken
        for ending in endings:
            self._tell(ending)
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                try:
                    call.future.set_result(call.fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets the error
                    call.future.set_exception(exc)
        refused = self._prefill([r for r in admitted if r.status is RequestStatus.PREFILLING])
        with self._cond:
            now = time.monotonic()
            for request, _ in refused:
                queue.left(request, now)
            for request in admitted:
                if request.status is RequestStatus.PREFILLING:
                    queue.started(request)
            group = queue.batch(self.engine.max_step_batch)
            idle = not group and not queue.stats()["empty"]
        for request, error in refused:
            self._tell(Ending(request, prefilled=True, kind=error.kind, message=error.message))
        if group:
            self._step(group)
        elif idle:
            with self._cond:          # every running stream waits on its reader: until one drains (wake)
                if not self._inbox:
                    self._cond.wait(IDLE_WAIT_S)
        return True

    def _plan(self, queue: SlotQueue) -> TurnPlan | None | Literal["measure"]:
        """Under the lock: wait for work; the last step's finished requests leave their slots, the
        inbox is drained, and the queue plans the turn. None when the loop is stopping; MEASURE
        when, idle, a measure of the engine's speed is due (or under way)."""
        with self._cond:
            while not self._stopping and not self._inbox and queue.stats()["empty"]:
                wait = 0.0 if self._measuring is not None else self._sizing.wait_s() if self._sizing else None
                if wait == 0.0:
                    return MEASURE
                self._cond.wait(wait)
            if self._stopping:
                return None
            if self._measuring is not None:     # work came: the measure gives way, taken again when idle
                self._measuring.close()
                self._measuring = None
            now = time.monotonic()
            if self._step_seconds is not None:
                self._recent_steps.append(self._step_seconds)
                self._step_seconds = None
            endings, calls = [], []
            while self._inbox:
                message = self._inbox.popleft()
                if isinstance(message, Call):
                    calls.append(message)
                elif isinstance(message, End):
                    endings.append(message.ending)
                elif (cancelled := queue.cancel(message.request, now)) is not None:
                    endings.append(cancelled)
            plan = queue.plan(now)
        for request in plan.parked:
            log.debug("request %s parked: its reader lags, or its client holds more slots, while another waits",
                      request.id)
        return endings + plan.expired, calls, plan.admitted

    def _measure_piece(self, queue: SlotQueue) -> None:
        """One piece of a measure of the engine's speed, the engine idle; once complete, the
        slots it sizes, the queue resized to them. A measure that fails costs only itself."""
        if self._measuring is None:
            self._measuring = self._sizing.measure()
        try:
            next(self._measuring)
            return
        except StopIteration:
            failed = False
        except Exception:  # noqa: BLE001 - a failed measure (its worker crashed) keeps the slots as they are
            log.warning("measuring engine %s's speed again failed; the slots stay as they are",
                        self.engine.name, exc_info=True)
            failed = True
        self._measuring = None
        slots, reason = self._sizing.slots()
        max_share = self._queue_settings[0]
        with self._cond:
            before, self.slots, self.slots_reason = self.slots, slots, reason
            queue.resize(slots, max_share or max(1, slots // 2))
            self._slots_measure = self._sizing.describe()
        if not failed:
            log.info("engine %s measured again: %d slots, %s %d (%s)", self.engine.name, slots,
                     "were" if slots != before else "as before:", before, reason)

    def _prefill(self, new: list[GenerationRequest]) -> list[tuple[GenerationRequest, Refused]]:
        """The new requests prefilled together (`Engine.prefill_many`); those refused or failed,
        with why (raises where an error ends the engine: `engine_failure`). Their engine state
        stays until they leave."""
        if not new:
            return []
        try:
            errors = self.engine.prefill_many(new)
        except Exception as exc:  # noqa: BLE001 - the engine's own fault: these requests fail, not the loop
            errors = [exc] * len(new)
        for error in errors:
            if (failure := engine_failure(self.engine, error)) is not None:
                raise failure
        refused = []
        for request, error in zip(new, errors):
            if isinstance(error, Refused):        # the engine found, late, that it cannot serve this one
                refused.append((request, error))
            elif error is not None:
                log.error("prefill failed for request %s", request.id, exc_info=error)
                refused.append((request,
                                Refused(ErrorKind.INTERNAL, f"prefill failed: {type(error).__name__}: {error}")))
        return refused

    def _step(self, group: list[GenerationRequest]) -> None:
        """One engine step for `group`, each result to its request's sink; the finished leave
        their slots, then are told. A failed step fails its requests and the others go on,
        unless its error ends the engine (`engine_failure`)."""
        started = time.perf_counter()
        try:
            results = self.engine.step(group)
            if len(results) != len(group):
                raise RuntimeError(f"engine returned {len(results)} results for {len(group)} requests")
        except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the rest
            if (failure := engine_failure(self.engine, exc)) is not None:
                raise failure
            log.exception("step failed for requests %s", [r.id for r in group])
            with self._cond:
                now = time.monotonic()
                for request in group:
                    self.queue.left(request, now)
            for request in group:
                self._tell(Ending(request, prefilled=True, kind=ErrorKind.INTERNAL,
                                  message=f"generation failed: {type(exc).__name__}: {exc}"))
            return
        elapsed = time.perf_counter() - started
        self.steps_total += 1
        self.last_step_s = elapsed
        self.last_batch_size = len(group)
        if self.on_step is not None:
            self.on_step(len(group), elapsed)
        self._step_seconds = elapsed
        finished = []
        for request, result in zip(group, results):
            request.steps += 1
            if result.audio is not None and result.audio.size:
                request.sink.deliver(result.audio, result.words, result.phonemes)
            if result.finished is not None:
                finished.append((request, result.finished))
        if finished:
            with self._cond:
                now = time.monotonic()
                endings = [Ending(request, self.queue.left(request, now), reason=reason)
                           for request, reason in finished]
            for ending in endings:
                self._tell(ending)

    def _tell(self, ending: Ending) -> None:
        """A request that has left the queue: the engine lets its state go, and its stream is told."""
        request = ending.request
        if ending.prefilled:
            try:
                self.engine.release(request)
            except Exception:  # noqa: BLE001
                log.exception("release failed for request %s", request.id)
        if ending.kind is not None:
            request.sink.fail(ending.kind, ending.message, ending.retry_after_s)
        else:
            request.sink.finish(ending.reason)

    def _die(self, exc: BaseException, what: str, during_load: bool) -> None:
        log.error("%s: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
        # An engine that says it cannot go on (`EngineFailure`: its device or a helper is gone)
        # fails no request of its own making: the same request may succeed on another engine.
        kind = ErrorKind.UNAVAILABLE if isinstance(exc, EngineFailure) else ErrorKind.INTERNAL
        with self._cond:
            self.status = Readiness.FAILED
            self.error = f"{what}: {type(exc).__name__}: {exc}"
            orphans = self.queue.close() if self.queue is not None else []
            calls = [m for m in self._inbox if isinstance(m, Call)]
            ended = [m.ending for m in self._inbox if isinstance(m, End)]
            self._inbox.clear()
        for call in calls:
            if call.future.set_running_or_notify_cancel():
                call.future.set_exception(Refused(kind, self.error))
        self.ready_event.set()
        for ending in ended:                      # pushed out before the engine died: told why
            self._tell(ending)
        for request in orphans:
            request.sink.fail(kind, self.error)
        if self._on_fatal is not None:
            self._on_fatal(exc, during_load)
