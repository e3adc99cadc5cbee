"""The engine process's side of the boundary: the engine and its engine loop, driven by what the
server sends, and each turn's results sent back as one message.

    reader thread (serve)   Submit -> EngineLoop.submit, Cancel, Reader, Pin/Unpin, Forget,
                            Call -> a worker thread (a voice's build, a rescan, a LoRA file) or
                            the loop's thread between two steps; Stop or the socket's end -> stop
    the loop's thread       each request's `HostSink` collects the turn's audio and endings;
                            `on_turn_end` sends them as one `Step` (one buffer of audio)
    the report thread       readiness while the engine loads, then `Declared`, and `Figures`
                            (the loop's stats, the engine's `describe`) whenever they change
    the channel's writer    everything sent, in order (`channel.BlockingChannel`)

The slot queue asks each request's reader whether it lags and how far ahead of its listener it
is (`RequestSink.backlogged`, `audio_ahead_s`): the server says the first when it changes
(`Reader`) and gives the second's anchor with the request (`ReaderState`), which this side
moves on with the audio it produces, on the one clock every process of the machine shares.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import msgpack
import numpy as np

from ..engine import EndReason, Engine, ErrorKind, GenerationRequest, Readiness, Refused
from ..engines.lexicon import Lexicon, Pronunciation
from ..scheduling.loop import EngineLoop
from ..scheduling.queue import NEW_STREAM_AHEAD_S
from .channel import BlockingChannel
from .declaration import declare, declare_text
from .messages import (
    AUDIO_DTYPE,
    Call,
    Cancel,
    Declared,
    Ended,
    Failed,
    Figures,
    Forget,
    Pin,
    Reader,
    ReaderState,
    Refusal,
    Result,
    Row,
    State,
    Step,
    Stop,
    Submit,
    Unpin,
)
from .spec import LoopSettings

log = logging.getLogger("vox_ws.engine_process")

# Continuations kept for the next segment of their stream at most (a stream whose end never
# said so cannot hold one for ever): twice what the slots could use.
MAX_CONTINUATIONS = 256
# How often the report thread looks at the loop's figures and readiness; the engine's
# `describe` (VoxCPM2's compile state) at most every DESCRIBE_EVERY_S.
REPORT_EVERY_S = 0.25
DESCRIBE_EVERY_S = 1.0
# How long a stopping engine loop has to close its engine, when the server's end went away.
ORPHAN_CLOSE_S = 5.0
# The exit status of an engine process whose engine failed while serving (a lost device, a dead
# loop thread): what `/v1/info`'s `last_exit` and the log show, as the server's own status was
# before engines had processes of their own.
FAILED_EXIT_CODE = 3


class HostSink:
    """A request's sink in the engine process: its results go into the turn's message, and the
    slot queue's two questions are answered from what the server said of its reader."""

    def __init__(self, host: EngineHost, request: int, reader: ReaderState, sample_rate: int) -> None:
        self._host = host
        self.request = request
        self.lagging = reader.backlogged
        self._produced_s = reader.produced_s
        self._first_at = reader.first_at
        self._speed = reader.speed or 1.0
        self._rate = sample_rate or 1

    def deliver(self, pcm: np.ndarray, words: list[tuple[str, int, int]] | None = None,
                phonemes: list[tuple[str, int, int]] | None = None) -> None:
        if self._first_at is None:
            self._first_at = time.monotonic()
        self._produced_s += len(pcm) / self._rate
        self._host.outbox.row(self.request, pcm, words, phonemes)

    def finish(self, reason: EndReason) -> None:
        self._host.ended(self.request, reason)

    def fail(self, kind: ErrorKind, message: str, retry_after_s: float | None = None) -> None:
        self._host.failed(self.request, Failed(self.request, kind.value, message, retry_after_s))

    def backlogged(self) -> bool:
        return self.lagging

    def audio_ahead_s(self) -> float:
        if self._first_at is None:
            return NEW_STREAM_AHEAD_S
        return self._produced_s / self._speed - (time.monotonic() - self._first_at)


class Outbox:
    """One turn's results, in the order they came, until `take`."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._audio: list[np.ndarray] = []
        self._rows: list[Row] = []
        self._samples = 0
        self._ended: list[Ended] = []
        self._failed: list[Failed] = []
        self._step: tuple[int, float] = (0, 0.0)

    def row(self, request: int, pcm: np.ndarray, words: Any, phonemes: Any) -> None:
        pcm = np.asarray(pcm, dtype=AUDIO_DTYPE).reshape(-1)
        with self.lock:
            self._rows.append(Row(request, self._samples, len(pcm), _spans(words), _spans(phonemes)))
            self._audio.append(pcm)
            self._samples += len(pcm)

    def ended(self, ended: Ended) -> None:
        with self.lock:
            self._ended.append(ended)

    def failed(self, failed: Failed) -> None:
        with self.lock:
            self._failed.append(failed)

    def stepped(self, rows: int, seconds: float) -> None:
        with self.lock:
            self._step = (rows, seconds)

    def take(self, period_s: float | None, stats: Callable[[], dict[str, Any]]) -> Step | None:
        """The turn's message (None: nothing happened), emptied; under `lock`, held by the caller."""
        if not (self._rows or self._ended or self._failed or self._step[0]):
            return None
        # A copy, always: a row may be a view into the engine's own buffer, which its next step
        # writes while the channel's writer still sends this one.
        payload = np.concatenate(self._audio) if self._audio else np.empty(0, AUDIO_DTYPE)
        step = Step(tuple(self._rows), tuple(self._ended), tuple(self._failed), self._step[0], self._step[1],
                    period_s if self._step[0] else None, stats(), memoryview(payload).cast("B"))
        self._audio, self._rows, self._samples, self._ended, self._failed = [], [], 0, [], []
        self._step = (0, 0.0)
        return step


def _spans(spans: Any) -> tuple[tuple[str, int, int], ...] | None:
    return None if spans is None else tuple((str(w), int(a), int(b)) for w, a, b in spans)


class EngineHost:
    """Serves one engine over a channel (`serve`, on the calling thread, until the server stops
    it or goes): see the module's docstring."""

    def __init__(self, engine: Engine, channel: BlockingChannel, settings: LoopSettings = LoopSettings()) -> None:
        self.engine = engine
        self.channel = channel
        self.outbox = Outbox()
        self.loop = EngineLoop(engine, slots=settings.slots, max_queue=settings.max_queue, on_fatal=self._fatal,
                               max_share=settings.max_share, max_wait_s=settings.max_wait_s)
        self.loop.on_step = self._stepped
        self.loop.on_turn_end = self.flush
        self._requests: dict[int, GenerationRequest] = {}
        self._pins: dict[int, tuple[str, Any]] = {}        # pin -> its kind, what the engine's pin returned
        self._pin_refusals: dict[int, Refused] = {}
        self._continuations: OrderedDict[int, Any] = OrderedDict()
        self._state_lock = threading.Lock()
        self._last_step_at: float | None = None
        self._period_s: float | None = None
        # A voice's build beside the steps, one at a time; rescans, LoRA files and looks at the
        # disk on another, in the order asked.
        self._voice_worker = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-voice")
        self._call_worker = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-engine-calls")
        self._stopped = threading.Event()
        self.ended_by: str = ""                             # why `serve` returned
        self._reporter = threading.Thread(target=self._report, name="vox-ws-engine-report", daemon=True)

    # ------------------------------------------------------------------ the reader thread

    def serve(self) -> str:
        """Start the engine loop (the engine loads on its thread) and read the server's messages
        until it says stop, or its end of the channel closes; then the loop stops and closes the
        engine. What ended it: "stopped", "orphaned", or "failed" (the engine failed while
        serving: its host closed the channel)."""
        self.channel.send(State(Readiness.LOADING.value, loading_phase=self.engine.loading_phase,
                                name=self.engine.name, text=_text_as_built(self.engine)))
        self.loop.start()
        self._reporter.start()
        within = ORPHAN_CLOSE_S
        while True:
            message = self.channel.receive()
            if message is None:
                self.ended_by = self.ended_by or "orphaned"
                break
            if isinstance(message, Stop):
                self.ended_by, within = "stopped", message.within_s
                break
            try:
                self._handle(message)
            except Exception:  # noqa: BLE001 - one message's fault, never the engine's
                log.exception("engine process: handling %s failed", type(message).__name__)
        self._stopped.set()
        self.loop.stop(deadline=time.monotonic() + within)
        self._voice_worker.shutdown(wait=False, cancel_futures=True)
        self._call_worker.shutdown(wait=False, cancel_futures=True)
        self.flush()
        self.channel.flush(1.0)
        return self.ended_by

    def _handle(self, message: Any) -> None:
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Cancel):
            request = self._requests.get(message.request)
            if request is not None:
                self.loop.cancel(request)
        elif isinstance(message, Reader):
            request = self._requests.get(message.request)
            if request is not None:
                request.sink.lagging = message.backlogged
                if not message.backlogged:
                    self.loop.wake()
        elif isinstance(message, Pin):
            self._pin(message)
        elif isinstance(message, Unpin):
            self._unpin(message.pin)
        elif isinstance(message, Forget):
            with self._state_lock:
                self._continuations.pop(message.request, None)
        elif isinstance(message, Call):
            self._call(message)

    def _submit(self, message: Submit) -> None:
        try:
            request = self._request(message)
            self._requests[message.request] = request
            self.loop.submit(request)
        except Refused as err:
            self._requests.pop(message.request, None)
            self.failed(message.request, Failed(message.request, err.kind.value, err.message, err.retry_after_s))
            self.flush()

    def _request(self, message: Submit) -> GenerationRequest:
        voice_pin = self._held(message.voice_pin)
        lora_pin = self._held(message.lora_pin)
        with self._state_lock:
            context = self._continuations.pop(message.context_of, None) if message.context_of is not None else None
        pronunciations = None if message.pronunciations is None else \
            Lexicon(Pronunciation(**entry) for entry in message.pronunciations)
        sink = HostSink(self, message.request, message.reader, self.engine.sample_rate)
        return GenerationRequest(text=message.text, sink=sink, voice=message.voice, voice_pin=voice_pin,
                                 lora_pin=lora_pin, options=dict(message.options), id=message.request,
                                 context=context, keep_continuation=message.keep_continuation,
                                 prepared=message.prepared, pronunciations=pronunciations,
                                 instructions=message.instructions, language=message.language,
                                 owners=tuple(message.owners))

    def _held(self, pin: int | None) -> Any:
        if pin is None:
            return None
        if pin in self._pin_refusals:
            raise self._pin_refusals[pin]
        return self._pins.get(pin, (None, None))[1]

    def _pin(self, message: Pin) -> None:
        try:
            role = self.engine.voices if message.kind == "voice" else self.engine.loras
            self._pins[message.pin] = (message.kind, role.pin(message.name))
        except Refused as err:
            self._pin_refusals[message.pin] = err

    def _unpin(self, pin: int) -> None:
        self._pin_refusals.pop(pin, None)
        kind, held = self._pins.pop(pin, (None, None))
        if kind == "lora":
            self.engine.loras.unpin(held)          # a voice's pin is its prompt: let go with it

    # ------------------------------------------------------------------ calls

    def _call(self, message: Call) -> None:
        verb = message.verb
        voices, loras = self.engine.voices, self.engine.loras
        args = message.args
        if verb == "voices.register":
            audio = np.frombuffer(message.payload, dtype=AUDIO_DTYPE)
            self._answer(message.call, self._voice_worker, lambda: voices.register(
                audio, args["sample_rate"], args["transcript"], args["mode"], args["voice_id"]))
        elif verb == "voices.delete":
            self._answer(message.call, None, lambda: voices.delete(args["voice_id"]))
        elif verb == "voices.disk_stamp":
            self._answer(message.call, self._call_worker, voices.disk_stamp, declare=False)
        elif verb == "voices.rescan":
            self._answer(message.call, self._call_worker, self._rescan)
        elif verb == "loras.load":
            self._answer(message.call, self._call_worker,
                         lambda: self._between_steps(lambda file=loras.read(args["name"]): loras.load(file)))
        elif verb == "loras.unload":
            self._answer(message.call, None, lambda: self._between_steps(lambda: loras.unload(args["name"])))
        elif verb == "loras.set_default":
            self._answer(message.call, None, lambda: self._between_steps(lambda: loras.set_default(args["name"])))
        elif verb == "loras.clear_default":
            self._answer(message.call, None, lambda: self._between_steps(loras.clear_default))
        else:
            self.channel.send(Result(message.call, error=f"unknown verb {verb!r}"))

    def _between_steps(self, fn: Callable[[], Any]) -> Any:
        """`fn` on the loop's thread between two steps, waited for (on a worker thread)."""
        return self.loop.call(fn).result()

    def _rescan(self) -> Any:
        voices = self.engine.voices
        prepared = voices.prepare_rescan()
        if prepared is None:
            return None
        try:
            return self._between_steps(lambda: voices.apply_rescan(prepared))
        except BaseException:
            voices.discard_rescan(prepared)
            raise

    def _answer(self, call: int, worker: ThreadPoolExecutor | None, fn: Callable[[], Any],
                declare: bool = True) -> None:
        """`fn` (on `worker`, else the reader thread, or the loop's through `_between_steps`),
        its answer sent after the declaration it changed."""

        def run() -> None:
            try:
                value = fn()
            except Refused as err:
                result = Result(call, refusal=Refusal(err.kind.value, err.message, err.retry_after_s, err.field))
            except BaseException as exc:  # noqa: BLE001 - the caller's error, not the engine's
                result = Result(call, error=f"{type(exc).__name__}: {exc}")
            else:
                result = Result(call, value=_plain(value))
            if declare:
                self._send_declaration()
            self.channel.send(result)

        if worker is None:
            threading.Thread(target=run, name="vox-ws-engine-call", daemon=True).start()
        else:
            try:
                worker.submit(run)
            except RuntimeError:                     # stopping: the caller hears the channel end
                pass

    # ------------------------------------------------------------------ the loop's thread

    def _stepped(self, rows: int, seconds: float) -> None:
        now = time.monotonic()
        if self._last_step_at is not None:
            self._period_s = now - self._last_step_at
        self._last_step_at = now
        self.outbox.stepped(rows, seconds)

    def ended(self, request: int, reason: EndReason) -> None:
        engine_request = self._requests.pop(request, None)
        kept = False
        if engine_request is not None and engine_request.keep_continuation \
                and engine_request.continuation is not None:
            with self._state_lock:
                self._continuations[request] = engine_request.continuation
                while len(self._continuations) > MAX_CONTINUATIONS:
                    self._continuations.popitem(last=False)
            kept = True
        self.outbox.ended(Ended(request, reason.value, kept))

    def failed(self, request: int, failed: Failed) -> None:
        self._requests.pop(request, None)
        self.outbox.failed(failed)

    def flush(self) -> None:
        """The turn's results, as one message (nothing where nothing happened)."""
        with self.outbox.lock:
            step = self.outbox.take(self._period_s, self._stats)
            if step is not None:
                self.channel.send(step)

    def _stats(self) -> dict[str, Any]:
        return _plain(self.loop.stats())

    def _fatal(self, exc: BaseException, during_load: bool) -> None:
        """The loop's thread died (or the load failed): every request it held has been told."""
        self.flush()
        self.channel.send(State(Readiness.FAILED.value, self.loop.error, fatal=not during_load))
        if not during_load:
            # A device lost (or a thread that crashed) cannot be trusted again in this
            # process: it ends, and the server starts another.
            self.ended_by = "failed"
            self.channel.flush(2.0)
            self.channel.close()

    # ------------------------------------------------------------------ the report thread

    def _report(self) -> None:
        phase = object()
        while not self.loop.ready_event.wait(REPORT_EVERY_S):
            if self._stopped.is_set():
                return
            if self.engine.loading_phase != phase:
                phase = self.engine.loading_phase
                self.channel.send(State(Readiness.LOADING.value, loading_phase=phase, name=self.engine.name))
        if self.loop.status != Readiness.READY:
            return                                    # `_fatal` said why
        self._send_declaration()
        stats = self._stats()
        self.channel.send(Figures(stats=stats))
        self.channel.send(State(Readiness.READY.value))
        described = None
        described_at = 0.0
        while not self._stopped.wait(REPORT_EVERY_S):
            if self.loop.status != Readiness.READY:
                return
            now = time.monotonic()
            figures: dict[str, Any] = {}
            if (latest := self._stats()) != stats:
                stats = figures["stats"] = latest
            if now - described_at >= DESCRIBE_EVERY_S:
                described_at = now
                if (latest := _plain(self.engine.describe())) != described:
                    described = figures["described"] = latest
            if figures:
                self.channel.send(Figures(**figures))

    def _send_declaration(self) -> None:
        try:
            declared = _plain(declare(self.engine))
        except Exception:  # noqa: BLE001 - the server keeps the declaration before
            log.exception("engine process: declaring the engine failed")
            return
        self.channel.send(Declared(declared))
        self.channel.send(Figures(described=_plain(self.engine.describe())))


def _text_as_built(engine: Engine) -> dict[str, Any] | None:
    """How the engine takes text as built, before its load (None: its rules cannot say yet; the
    server's copy then follows the base rules until the engine declares itself)."""
    try:
        return _plain(declare_text(engine))
    except Exception:  # noqa: BLE001 - its full declaration, once loaded, says it again
        log.exception("engine process: declaring the engine's text rules before its load failed")
        return None


def _plain(value: Any) -> Any:
    """`value` in msgpack's types (enums as their values, tuples and sets as lists, numpy's
    numbers as Python's, anything else as its string)."""
    return msgpack.unpackb(msgpack.packb(value, default=_default, use_bin_type=True), raw=False,
                           strict_map_key=False)


def _default(value: Any) -> Any:
    if isinstance(value, (set, frozenset)):
        return sorted(value, key=str)
    if isinstance(value, np.generic):
        return value.item()
    if hasattr(value, "value") and isinstance(getattr(value, "value"), (str, int, float)):
        return value.value
    return str(value)


def run_thread(engine: Engine, channel: BlockingChannel,
               settings: LoopSettings) -> tuple[EngineHost, threading.Thread, Future]:
    """An engine served on a thread of this process (`launch.InProcess`): its host, the thread,
    and a future of why it ended."""
    ended: Future = Future()
    host = EngineHost(engine, channel, settings)

    def run() -> None:
        try:
            ended.set_result(host.serve())
        except BaseException as exc:  # noqa: BLE001 - told through the future
            ended.set_exception(exc)
        finally:
            channel.close()

    thread = threading.Thread(target=run, name="vox-ws-engine-host", daemon=True)
    thread.start()
    return host, thread, ended
