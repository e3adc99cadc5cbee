"""An engine's steps replayed into its requests' sinks, on a produce thread of its own (one per
engine): each row (a view into the step's one buffer of audio) to its request's sink, then the
requests that ended or failed, in order, as the engine loop's thread did when the engine shared
this process. The sink then resamples and packs its rows off the event loop, as before.

Steps read and not yet replayed past `MAX_STEPS_BEHIND` pause the channel's reading: the
engine's writer then holds its next turn (back-pressure, not memory).
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

from ..engine import EndReason, ErrorKind, GenerationRequest, RequestStatus
from .messages import Step
from .view import Held

log = logging.getLogger("vox_ws.engine_process")

MAX_STEPS_BEHIND = 8


class Continuation(Held):
    """What a finished request left for the next segment of its stream (`Submit.context_of`),
    held in the engine process until used, or let go (`Forget`)."""

    def __init__(self, forget: Callable[[int], None], request: int) -> None:
        self.request = request
        self._release = weakref.finalize(self, forget, request)

    def used(self) -> None:
        self._release.detach()


class StepReplay:
    """`outstanding`: the engine's requests by id (the stand-in's); `forget`: lets a
    continuation go; `reading(bool)`: pauses or resumes the channel (on the event loop)."""

    def __init__(self, device: str, outstanding: dict[int, GenerationRequest], forget: Callable[[int], None],
                 reading: Callable[[bool], None]) -> None:
        self._device = device
        self._outstanding = outstanding
        self._forget = forget
        self._reading = reading
        self.on_step: Callable[[int, float], None] | None = None
        self._behind = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._producer = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-produce")

    def step(self, step: Step) -> None:
        """A step read (the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._behind += 1
        if self._behind == MAX_STEPS_BEHIND:
            self._reading(False)
        try:
            self._producer.submit(self._replay, step)
        except RuntimeError:                 # the server has stopped
            pass

    def fail_all(self, requests: list[int], message: str, retry_after_s: float) -> None:
        """The engine ended: each of these requests (ids) still outstanding once what was read
        of it is replayed fails `unavailable`; one the engine's last step ended or failed keeps
        that end (an engine that failed says `internal` to what it held, then ends)."""
        try:
            self._producer.submit(self._fail_remaining, requests, message, retry_after_s)
        except RuntimeError:                 # the server has stopped: no stream is left to tell
            pass

    def _fail_remaining(self, requests: list[int], message: str, retry_after_s: float) -> None:
        for request in (self._outstanding.pop(i, None) for i in requests):
            if request is not None:
                request.status = RequestStatus.FINISHED
                request.sink.fail(ErrorKind.UNAVAILABLE, message, retry_after_s)

    def close(self) -> None:
        self._producer.shutdown(wait=False)

    def _replay(self, step: Step) -> None:
        try:
            # The step first, as the engine loop reports it before the requests it ended finish:
            # whoever waits for a request's end has then seen the step that ended it.
            if step.step_rows and self.on_step is not None:
                self.on_step(step.step_rows, step.step_s)
            for row in step.rows:
                request = self._outstanding.get(row.request)
                if request is not None:
                    request.steps += 1
                    request.sink.deliver(step.audio(row), list(row.words) if row.words else None,
                                         list(row.phonemes) if row.phonemes else None)
            for ended in step.ended:
                request = self._outstanding.pop(ended.request, None)
                if request is not None:
                    request.status = RequestStatus.FINISHED
                    if ended.continuation:
                        request.continuation = Continuation(self._forget, ended.request)
                    request.sink.finish(EndReason(ended.reason))
            for failed in step.failed:
                request = self._outstanding.pop(failed.request, None)
                if request is not None:
                    request.status = RequestStatus.FINISHED
                    request.sink.fail(ErrorKind(failed.kind), failed.message, failed.retry_after_s)
        except Exception:  # noqa: BLE001 - one step's replay must not stop the next
            log.exception("replaying a step of engine %s failed", self._device)
        finally:
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._caught_up)
                except RuntimeError:
                    pass

    def _caught_up(self) -> None:
        self._behind -= 1
        if self._behind == MAX_STEPS_BEHIND - 1:
            self._reading(True)


def held_pin(pin: Any) -> int | None:
    """The number of a pin the engine holds (`Held`), None for anything else."""
    return pin.pin if isinstance(pin, Held) else None
