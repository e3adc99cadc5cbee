"""The server's stand-in for one engine (in its own process, or on a thread): the engine loop's
verbs as the stream service uses them (`submit`, `cancel`, `status`, `stats`, `stop`...), over
the engine's socket, and the engine itself as it declared it (`engine`: `view.EngineView`).

    stream service ── submit / cancel / reader ──▶ EngineProxy ── Submit, Cancel, Reader ──▶ engine
    a request's sink ◀── deliver, finish, fail ── StepReplay ◀── Step (one a turn) ── engine
    the engine's view ◀── Declared, Figures; readiness ◀── State; a call's future ◀── Result

Each message is read by the event loop (no thread per engine); each `Step` is replayed into its
requests' sinks on this engine's produce thread (`replay.py`). The engine's life (started,
started again when it dies, stopped) is `life.py`'s; when it dies, every request it held fails
`unavailable`, retryable, with when to try again, and the engine started again has its
registered voices and LoRA adapters restored (`on_restart`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Mapping

from ..engine import ErrorKind, GenerationRequest, OptionSpec, Readiness, Refused, RequestStatus
from ..scheduling.loop import LOADING_RETRY_AFTER_S, not_ready
from .channel import ChannelProtocol
from .launch import Launcher
from .life import EngineLife
from .messages import Cancel, Declared, Figures, Reader, ReaderState, Result, State, Step, Submit
from .outgoing import ToEngine
from .replay import Continuation, StepReplay, held_pin
from .restarts import RestartPolicy
from .view import EngineView

log = logging.getLogger("vox_ws.engine_process")


class EngineProxy:
    """Thread-safe: `submit`, `cancel`, `reader` and the pins are sent from any thread (the event
    loop's writes at once; another's go through it, in order)."""

    def __init__(self, launcher: Launcher, name: str, options: Mapping[str, OptionSpec] | None = None, *,
                 on_fatal: Callable[[BaseException, bool], None] | None = None,
                 restart_policy: RestartPolicy | None = None) -> None:
        self.launcher = launcher
        self.to_engine = ToEngine()
        self.to_engine.not_ready = lambda: not_ready(self.status, self.error)
        self.engine = EngineView(self.to_engine, name, options, launcher.device)
        self.status = Readiness.LOADING
        self.error: str | None = None
        self.refused: str | None = None
        self.failed_loading = False
        self.ready_event = threading.Event()
        self.on_period: Callable[[float], None] | None = None
        # Once an engine started again serves: what the one before held, to restore (voices, adapters).
        self.on_restart: Callable[[EngineProxy, dict[str, Any]], Any] | None = None
        self._on_fatal = on_fatal
        self.life = EngineLife(launcher, self, restart_policy, lambda: self.engine.device)
        self._stats: dict[str, Any] = {}
        self._unplaced = 0                      # submitted since the last figures
        self._outstanding: dict[int, GenerationRequest] = {}
        self._load_s: float | None = None
        self.replay = StepReplay(launcher.device, self._outstanding, self.to_engine.forget, self._reading)
        self._workers = ThreadPoolExecutor(2, thread_name_prefix="vox-ws-engine-call")

    # ------------------------------------------------------------------ life

    def start(self) -> None:
        """Start the engine (on the event loop that serves)."""
        self.to_engine.loop = asyncio.get_running_loop()
        self.life.start()

    async def created(self) -> None:
        """Until the engine is built (it then loads); ValueError where its settings could not
        build it (the start fails, saying why)."""
        await self.life.created()
        if self.refused is not None:
            raise ValueError(self.refused)

    def connected(self, channel: ChannelProtocol | None) -> None:
        self.to_engine.channel = channel

    def restarting(self) -> None:
        self._set_status(Readiness.LOADING, None)

    def ended(self) -> dict[str, Any]:
        """The engine has ended: every request and call it held fails (its streams may try again,
        here once it has started again, or elsewhere). What it held, for the next one."""
        described = self.engine.loras.describe()
        held = {"voices": self.engine.voices.registered(),
                "loras": [a["name"] for a in described.get("adapters", ()) if a.get("state") == "loaded"],
                "default_lora": described.get("default")}
        if self.status != Readiness.FAILED or self.error is None:
            self._set_status(Readiness.FAILED, "the engine process ended")
        retry_after = round(self.life.restarts.policy.first_delay_s + (self._load_s or LOADING_RETRY_AFTER_S), 1)
        message = f"the engine serving this stream ended ({self.error}): try again"
        # Failed on the replay's thread, after the steps read before the end: a request the
        # engine's last step ended or failed keeps that end.
        self.replay.fail_all(list(self._outstanding), message, retry_after)
        self.to_engine.fail_calls(Refused(ErrorKind.UNAVAILABLE, message, retry_after))
        return held

    def exited(self, why: str) -> None:
        if self.status == Readiness.FAILED and self.error == "the engine process ended":
            self.error = f"the engine process ended: {why}"

    def fatal(self, exc: BaseException, during_load: bool) -> None:
        if self._on_fatal is not None:
            self._on_fatal(exc, during_load)

    def _set_status(self, status: Readiness, error: str | None) -> None:
        self.status, self.error = status, error
        self.to_engine.ready = status == Readiness.READY
        if status in (Readiness.READY, Readiness.FAILED):
            self.ready_event.set()

    # ------------------------------------------------------------------ the engine's messages (event loop)

    def on_message(self, message: Any) -> None:
        if isinstance(message, Step):
            if message.stats is not None:
                self._stats, self._unplaced = message.stats, 0
            if message.period_s is not None and self.on_period is not None:
                self.on_period(message.period_s)
            self.replay.step(message)
        elif isinstance(message, Figures):
            if message.stats is not None:
                self._stats, self._unplaced = message.stats, 0
            if message.described is not None:
                self.engine.described = message.described
                self.engine.loras.described = message.described.get("lora", self.engine.loras.described)
        elif isinstance(message, Declared):
            self.engine.declare(message.declaration)
        elif isinstance(message, Result):
            self.to_engine.answered(message)
        elif isinstance(message, State):
            self._state(message)

    def _state(self, state: State) -> None:
        if state.name and self.engine.declaration is None:
            self.engine.name = state.name
        if state.text is not None and self.engine.declaration is None:
            self.engine.declare_text(state.text)
        self.engine.loading_phase = state.loading_phase
        status = Readiness(state.status)
        self._set_status(status, state.error if status == Readiness.FAILED else None)
        if status == Readiness.FAILED:
            if state.refused:
                self.refused = state.error or "the engine could not be built"
                log.error("engine %s: cannot be built: %s", self.launcher.device, state.error)
            elif not state.fatal:                # it stays, failed: the server answers why
                self.failed_loading = True
                self.fatal(RuntimeError(state.error or "the engine's load failed"), True)
        elif status == Readiness.READY:
            self._load_s = time.monotonic() - self.life.started_at
            lost, self.life.lost = self.life.lost, None
            if lost and self.on_restart is not None:
                self.on_restart(self, lost)
        self.life.settled()

    def _reading(self, on: bool) -> None:
        channel = self.to_engine.channel
        transport = channel.transport if channel is not None else None
        if transport is not None and not transport.is_closing():
            transport.resume_reading() if on else transport.pause_reading()

    # ------------------------------------------------------------------ the engine loop's verbs

    def submit(self, request: GenerationRequest) -> int:
        """Send a request to the engine; its queue position, as the last figures tell it. The
        engine's slot queue may yet refuse it (`busy`, a full queue, with when a place frees as
        that queue measures it): its stream then hears so, right after it started."""
        if self.status != Readiness.READY:
            raise not_ready(self.status, self.error)
        sink, context = request.sink, request.context
        reader = sink.reader_state() if hasattr(sink, "reader_state") else ReaderState()
        if isinstance(context, Continuation):
            context.used()
        pronunciations = None
        if request.pronunciations is not None:
            # Those the text matches, found off the loop as it was prepared (`service.segments`):
            # sent as they are, never matched here, on the event loop.
            pronunciations = tuple({"match": item.match, "say": item.say, "ipa": item.ipa,
                                    "case_sensitive": item.case_sensitive}
                                   for item in request.pronunciations.entries)
        message = Submit(request.id, request.text, request.voice, held_pin(request.voice_pin),
                         held_pin(request.lora_pin), dict(request.options), tuple(request.owners), request.prepared,
                         context.request if isinstance(context, Continuation) else None,
                         request.keep_continuation, request.instructions, request.language, pronunciations, reader)
        request.status = RequestStatus.WAITING
        self._outstanding[request.id] = request
        self.to_engine.send(message)
        self._unplaced += 1
        stats = self._stats
        free = max(0, stats.get("slots", 0) - stats.get("active", 0))
        return max(0, stats.get("queued", 0) + self._unplaced - free)

    def cancel(self, request: GenerationRequest) -> None:
        """Stop a request: its slot frees at the engine's next turn."""
        if request.id in self._outstanding:
            self.to_engine.send(Cancel(request.id))

    def reader(self, request: GenerationRequest, backlogged: bool) -> None:
        """A request's reader has too much audio not taken, or no longer."""
        if request.id in self._outstanding:
            self.to_engine.send(Reader(request.id, backlogged))

    def call(self, fn: Callable[[], Any]) -> Future:
        """Run `fn` on a worker thread of the server (it calls the engine's verbs through its
        view, each a message to the engine, answered when done)."""
        if self.status != Readiness.READY:
            future: Future = Future()
            future.set_exception(not_ready(self.status, self.error))
            return future
        return self._workers.submit(fn)

    # ------------------------------------------------------------------ figures, stopping

    @property
    def slots(self) -> int | None:
        return self._stats.get("slots")

    @property
    def step_rows(self) -> int:
        return self._stats.get("step_rows", 0)

    def stats(self) -> dict[str, Any]:
        """The engine loop's figures as last reported, its readiness as of now, and its life:
        its process (`pid`), the restarts, the last exit and why."""
        stats = self._stats
        return {"status": self.status, "active": stats.get("active", 0), "queued": stats.get("queued", 0),
                "slots": stats.get("slots", 0), "step_rows": stats.get("step_rows", 0),
                "slots_reason": stats.get("slots_reason", "chosen when the engine has loaded"),
                "max_queue": stats.get("max_queue", 0), "parked": stats.get("parked", 0),
                "steps_total": stats.get("steps_total", 0), "last_step_ms": stats.get("last_step_ms", 0.0),
                "mean_step_ms": stats.get("mean_step_ms", 0.0), "last_batch_size": stats.get("last_batch_size", 0),
                "slot_hold_s": stats.get("slot_hold_s"), "slots_measure": stats.get("slots_measure"),
                "pid": self.life.pid, "restarts": self.life.restarts.count, "last_exit": self.life.last_exit}

    def stop(self, timeout: float = 5.0, *, deadline: float | None = None, wait: bool = True) -> None:
        """Have the engine end by `deadline` (else `timeout` seconds from now), killed where it
        has not; with `wait`, until it has (from any thread but the event loop's)."""
        deadline = time.monotonic() + timeout if deadline is None else deadline
        self.engine.close(deadline)
        if not self.life.started:
            return
        self.life.stop(deadline, wait, self.to_engine.on_loop)
        if wait and self.life.ended.is_set():
            self.replay.close()
            self._workers.shutdown(wait=False)
