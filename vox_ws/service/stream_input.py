"""A stream's text input, for streams opened to take it (`input_streaming`): text pieces, flushes
and the end of input go into its `TextPlan`; text without a boundary yet is spoken anyway once
the input pauses; input that stops coming without an end times the stream out.
"""

from __future__ import annotations

import asyncio
import time
from typing import AsyncIterator, Callable

from ..engine import ErrorKind, Refused
from .text_plan import TextPlan
from .validation import check_text


class StreamInput:
    """`advance` is the stream's one path that starts generation, called after each change to
    the plan; `failed(err)` ends the stream with a refusal or a broken iterator's error."""

    def __init__(self, plan: TextPlan, enabled: bool, pause_s: float, advance: Callable[[], object],
                 failed: Callable[[Refused], None], characters: int = 0) -> None:
        self._plan = plan
        self._enabled = enabled
        self._pause_s = pause_s
        self._advance = advance
        self._failed = failed
        self.characters = characters             # taken in so far
        self.last_at = time.monotonic()          # when input last came
        self._pause_timer: asyncio.TimerHandle | None = None
        self._feeder: asyncio.Task | None = None

    def send_text(self, text: str) -> None:
        """Append text to the stream."""
        self._check()
        check_text(text)
        self._plan.push(text)
        self._took()
        self.characters += len(text)
        if self._pause_timer is not None:
            self._pause_timer.cancel()
        if self._plan.has_partial:
            self._pause_timer = asyncio.get_running_loop().call_later(self._pause_s, self._paused)
        self._advance()

    def flush(self) -> None:
        """Speak what is buffered now; a `Flushed` event follows once its audio is yielded."""
        self._check()
        self._took()
        self._plan.flush()
        self._advance()

    def end(self) -> None:
        """No more text: the rest is spoken, then the stream ends."""
        self._check()
        self._took()
        self._plan.end_input()
        self._advance()

    def feed(self, text: AsyncIterator[str], stopped: Callable[[], bool]) -> None:
        """Read the input from an async iterator of text pieces, then end it (unless the stream
        `stopped` meanwhile)."""
        async def run() -> None:
            try:
                async for piece in text:
                    if stopped():
                        return
                    self.send_text(piece)
                if not stopped():
                    self.end()
            except Refused as err:
                self._failed(err)
            except Exception as exc:  # noqa: BLE001 - the caller's iterator broke: end the stream, say why
                self._failed(Refused(ErrorKind.INTERNAL, f"the text input failed: {type(exc).__name__}: {exc}"))
        self._feeder = asyncio.ensure_future(run())

    def stop(self) -> None:
        """The stream produces no more: no timer, no reading."""
        if self._pause_timer is not None:
            self._pause_timer.cancel()
        if self._feeder is not None and self._feeder is not asyncio.current_task():
            self._feeder.cancel()

    def _check(self) -> None:
        if not self._enabled:
            raise Refused(ErrorKind.INVALID, "this stream was not opened for text input")
        if self._plan.input_closed:
            raise Refused(ErrorKind.INVALID, "the input of this stream has already ended")

    def _took(self) -> None:
        self.last_at = time.monotonic()

    def _paused(self) -> None:
        """Text with no boundary yet is spoken anyway once the input pauses (whole words only)."""
        self._pause_timer = None
        self._plan.pause_elapsed()
        self._advance()
