"""The engine interface and the shared scheduler that serves every session from one model.

Data flows one way per turn of the scheduler thread:

    retire (cancelled) -> admit (waiting -> active, per-request prefill) -> step -> hand off

An engine says how many requests one `step` call may advance (`max_step_batch`): a batching
engine advances all active requests in one call; an engine that cannot batch gets one call per
request, round-robin, so no stream waits for another to finish. The scheduler never touches
asyncio: results go to each request's `RequestSink`, which is the session's thread-safe hand-off.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from .protocol import BAD_REQUEST, BUSY, END_CANCELLED, INTERNAL, NOT_READY, UNSUPPORTED, ProtocolError

log = logging.getLogger("vox_ws.engine")


class RequestSink(Protocol):
    """Where a request's results go. Called from the scheduler thread; must not block."""

    def deliver(self, pcm: np.ndarray) -> None: ...

    def finish(self, reason: str) -> None: ...

    def fail(self, code: str, message: str) -> None: ...

    def backlogged(self) -> bool:
        """True while the client has not read enough of what was already sent: skip stepping."""
        ...


class EngineFailure(Exception):
    """The engine can no longer serve anyone (a helper process died, the device is gone).

    Raised from `step`, it ends the scheduler thread like any crash of it would, instead of
    failing one batch and stepping a broken engine again."""


@dataclass(eq=False)
class GenerationRequest:
    """One stream's generation job: what to say, how, and where the audio goes."""

    text: str
    sink: RequestSink
    voice: str | None = None
    options: dict[str, Any] = field(default_factory=dict)
    id: int = field(default_factory=itertools.count(1).__next__)
    # Written by the event loop, read by the scheduler thread (a plain bool is enough in CPython).
    cancelled: bool = False
    # Engine-private per-request state, created by Engine.prefill.
    state: Any = None
    # Input streaming: what the previous segment left for this one to continue from (prosody),
    # and whether the engine should leave such a continuation for the next segment.
    context: Any = None
    keep_continuation: bool = False
    continuation: Any = None
    steps: int = 0
    submitted_at: float = field(default_factory=time.monotonic)


@dataclass
class StepResult:
    """What one step produced for one request. `finished` is an end reason when it is done."""

    audio: np.ndarray | None = None
    finished: str | None = None


class Engine(ABC):
    """A speech model behind the scheduler. Everything here runs on the scheduler thread,
    except `describe`, `voices` and `check`, which the event loop may call at any time."""

    name: str = "engine"
    model: str = ""
    device: str = "cpu"
    sample_rate: int = 0
    # How many requests one `step` call may advance together; 1 means it cannot batch.
    max_step_batch: int = 1
    # Which generation options this engine honours; others are accepted and reported ignored.
    supported_options: frozenset[str] = frozenset()

    @abstractmethod
    def load(self) -> None:
        """Load weights; slow; runs on the scheduler thread before any request."""

    def voices(self) -> list[str]:
        return []

    # Whether `register_voice` can clone a voice from reference audio.
    supports_voices: bool = False

    def register_voice(self, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str) -> dict[str, Any]:
        """Build a reusable voice prompt from reference audio; returns {voice, mode, audio_s}."""
        raise ProtocolError(UNSUPPORTED, f"engine {self.name} cannot clone voices")

    def delete_voice(self, voice_id: str) -> bool:
        return False

    def lora_op(self, op: str, name: str | None) -> dict[str, Any]:
        raise ProtocolError(UNSUPPORTED, f"engine {self.name} has no LoRA support")

    def has_voice(self, voice: str) -> bool:
        return voice in self.voices()

    def check_voice(self, voice: str | None) -> None:
        """Refuse an unknown voice with a ProtocolError (bad_request). Cheap: the event loop calls it."""
        if voice is not None and not self.has_voice(voice):
            raise ProtocolError(BAD_REQUEST, f"unknown voice {voice!r} (built-in: {self.voices()}"
                                               + ("; or register one with a `voice` message)" if self.supports_voices
                                                  else ")"))

    def check(self, request: GenerationRequest) -> None:
        """Refuse a request the engine cannot serve (unknown voice, ...) with a ProtocolError.

        Called on the event loop before the request is queued, so it must be cheap.
        """
        self.check_voice(request.voice)

    @abstractmethod
    def prefill(self, request: GenerationRequest) -> None:
        """Prepare a newly admitted request (tokenise, prompt, caches) in `request.state`."""

    @abstractmethod
    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        """Advance every request in `batch` by one generation step; one result per request."""

    def release(self, request: GenerationRequest) -> None:
        """Free what `prefill` allocated. Called once for every prefilled request."""
        request.state = None

    def close(self) -> None:
        """Free what `load` started (helper processes, threads). Called once, on the scheduler
        thread, when it stops or dies."""
        return None

    def describe(self) -> dict[str, Any]:
        return {"engine": self.name, "model": self.model, "device": self.device, "sample_rate": self.sample_rate}


class Scheduler:
    """Owns the engine thread. Thread-safe entry points: submit, cancel, wake, stats, stop."""

    def __init__(
        self,
        engine: Engine,
        max_batch: int = 8,
        max_queue: int = 64,
        on_fatal: Callable[[BaseException, bool], None] | None = None,
    ) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.status = "loading"          # loading -> ready | failed; ready -> failed
        self.error: str | None = None
        self._on_fatal = on_fatal
        self._cond = threading.Condition()
        self._waiting: deque[GenerationRequest] = deque()
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()
        self._active: list[GenerationRequest] = []
        self._rr = 0                      # round-robin start for engines that cannot batch
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="vox-ws-scheduler", daemon=True)
        self.ready_event = threading.Event()
        self.steps_total = 0
        self.last_step_s = 0.0
        self.last_batch_size = 0
        # Optional observer of each step (batch size, seconds); used by metrics.
        self.on_step: Callable[[int, float], None] | None = None

    # ------------------------------------------------------------------ public API

    def start(self) -> None:
        self._thread.start()

    def submit(self, request: GenerationRequest) -> int:
        """Queue a request. Returns its queue position (0: it gets a slot at the next turn)."""
        with self._cond:
            if self.status != "ready":
                raise ProtocolError(NOT_READY, f"engine is {self.status}" + (f": {self.error}" if self.error else ""))
            # Requests already waiting beyond the slots that the next turn frees.
            ahead = len(self._waiting) - (self.max_batch - len(self._active))
            if ahead >= self.max_queue:
                raise ProtocolError(BUSY, f"all {self.max_batch} slots busy and {self.max_queue} requests queued")
            self._waiting.append(request)
            self._cond.notify()
            return max(0, ahead + 1)

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on the scheduler thread between two steps (voice encoding, LoRA swaps):
        the model is never used by two threads, and no step sees half-changed weights."""
        future: Future = Future()
        with self._cond:
            if self.status != "ready":
                future.set_exception(ProtocolError(NOT_READY, f"engine is {self.status}"))
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

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {
                "status": self.status,
                "active": len(self._active),
                "queued": len(self._waiting),
                "max_batch": self.max_batch,
                "max_queue": self.max_queue,
                "steps_total": self.steps_total,
                "last_step_ms": round(self.last_step_s * 1000, 3),
                "last_batch_size": self.last_batch_size,
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
            log.info("engine %s loaded in %.2fs: %s", self.engine.name, time.monotonic() - started,
                     self.engine.describe())
            with self._cond:
                self.status = "ready"
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

    def _turn(self) -> bool:
        """One turn of the loop; False when the scheduler is stopping."""
        with self._cond:
            while not self._stopping and not self._active and not self._waiting and not self._calls:
                self._cond.wait()
            if self._stopping:
                return False
            calls = list(self._calls)
            self._calls.clear()
            dropped = [r for r in self._waiting if r.cancelled]   # cancelled before they got a slot
            for request in dropped:
                self._waiting.remove(request)
            admitted = []
            while self._waiting and len(self._active) + len(admitted) < self.max_batch:
                admitted.append(self._waiting.popleft())
        for request in dropped:
            request.sink.finish(END_CANCELLED)
        for fn, future in calls:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # noqa: BLE001 - the caller gets the error
                    future.set_exception(exc)
        self._retire_cancelled()
        fresh = [r for r in admitted if self._admit(r)]
        # New requests go first: for an engine stepped one request at a time, that is the
        # order of the round-robin, and first audio matters most.
        runnable = fresh + [r for r in self._active
                            if r not in fresh and not r.cancelled and not r.sink.backlogged()]
        if not runnable:
            if self._active:
                # Every active stream waits on its client; sleep until one drains (wake) or briefly.
                with self._cond:
                    self._cond.wait(0.02)
            return True
        self._step(runnable)
        return True

    def _admit(self, request: GenerationRequest) -> bool:
        """Prefill a request into the active set; False if it did not get there."""
        if request.cancelled:
            request.sink.finish(END_CANCELLED)
            return False
        try:
            self.engine.prefill(request)
        except Exception as exc:  # noqa: BLE001 - one bad request must not stop the others
            log.exception("prefill failed for request %s", request.id)
            self._release(request)
            request.sink.fail(INTERNAL, f"prefill failed: {type(exc).__name__}: {exc}")
            return False
        with self._cond:
            self._active.append(request)
        return True

    def _retire_cancelled(self) -> None:
        gone = [r for r in self._active if r.cancelled]
        if not gone:
            return
        with self._cond:
            self._active = [r for r in self._active if not r.cancelled]
        for request in gone:
            self._release(request)
            request.sink.finish(END_CANCELLED)

    def _step(self, runnable: list[GenerationRequest]) -> None:
        if self.engine.max_step_batch > 1:
            groups = [runnable[i:i + self.engine.max_step_batch]
                      for i in range(0, len(runnable), self.engine.max_step_batch)]
        else:
            # Rotate the start of the running ones so that, under backpressure or cancellation,
            # none is favoured; new requests stay in front.
            new = [r for r in runnable if r.steps == 0]
            old = [r for r in runnable if r.steps > 0]
            self._rr = (self._rr + 1) % max(1, len(old))
            groups = [[r] for r in new + old[self._rr:] + old[:self._rr]]
        for group in groups:
            group = [r for r in group if not r.cancelled]
            if not group:
                continue
            started = time.perf_counter()
            try:
                results = self.engine.step(group)
                if len(results) != len(group):
                    raise RuntimeError(f"engine returned {len(results)} results for {len(group)} requests")
            except EngineFailure:
                raise
            except Exception as exc:  # noqa: BLE001 - fail this step's requests, keep serving the rest
                log.exception("step failed for requests %s", [r.id for r in group])
                self._remove(group)
                for request in group:
                    request.sink.fail(INTERNAL, f"generation failed: {type(exc).__name__}: {exc}")
                continue
            elapsed = time.perf_counter() - started
            self.steps_total += 1
            self.last_step_s = elapsed
            self.last_batch_size = len(group)
            if self.on_step is not None:
                self.on_step(len(group), elapsed)
            finished = []
            for request, result in zip(group, results):
                request.steps += 1
                if request.cancelled:
                    continue
                if result.audio is not None and result.audio.size:
                    request.sink.deliver(result.audio)
                if result.finished is not None:
                    finished.append((request, result.finished))
            if finished:
                self._remove([r for r, _ in finished])
                for request, reason in finished:
                    request.sink.finish(reason)
        self._retire_cancelled()

    def _remove(self, requests: list[GenerationRequest]) -> None:
        with self._cond:
            self._active = [r for r in self._active if r not in requests]
        for request in requests:
            self._release(request)

    def _release(self, request: GenerationRequest) -> None:
        try:
            self.engine.release(request)
        except Exception:  # noqa: BLE001
            log.exception("release failed for request %s", request.id)

    def _die(self, exc: BaseException, what: str, during_load: bool) -> None:
        log.error("%s: %s: %s", what, type(exc).__name__, exc, exc_info=exc)
        with self._cond:
            self.status = "failed"
            self.error = f"{what}: {type(exc).__name__}: {exc}"
            orphans = list(self._active) + list(self._waiting)
            self._active.clear()
            self._waiting.clear()
            calls = list(self._calls)
            self._calls.clear()
        for _, future in calls:
            if future.set_running_or_notify_cancel():
                future.set_exception(ProtocolError(INTERNAL, self.error))
        self.ready_event.set()
        for request in orphans:
            request.sink.fail(INTERNAL, self.error)
        if self._on_fatal is not None:
            self._on_fatal(exc, during_load)
