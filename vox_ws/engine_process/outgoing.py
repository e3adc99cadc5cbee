"""What the server sends one engine, from any thread and in order (the event loop writes at once;
another thread's go through it), and the answers to its calls (`Call` -> `Result`): the view's
`Calls`, and the stand-in's way to its engine."""

from __future__ import annotations

import asyncio
import itertools
from concurrent.futures import Future
from typing import Any

from ..engine import ErrorKind, Refused
from .channel import ChannelProtocol
from .messages import Call, Forget, Message, Pin, Result, Unpin


class ToEngine:
    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.channel: ChannelProtocol | None = None     # while an engine is connected
        self.ready = False                               # calls are refused while it is not
        self.not_ready: Any = None                       # the refusal they get then (a callable)
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count(1)

    def send(self, message: Message) -> None:
        loop = self.loop
        if loop is None or loop.is_closed():
            return
        if self.on_loop():
            self._write(message)
        else:
            loop.call_soon_threadsafe(self._write, message)

    def _write(self, message: Message) -> None:
        if self.channel is not None:
            self.channel.send(message)

    def on_loop(self) -> bool:
        try:
            return asyncio.get_running_loop() is self.loop
        except RuntimeError:
            return False

    # ------------------------------------------------------------------ the view's calls

    def pin(self, pin: int, kind: str, name: str | None) -> None:
        self.send(Pin(pin, kind, name))

    def unpin(self, pin: int) -> None:
        self.send(Unpin(pin))

    def forget(self, request: int) -> None:
        self.send(Forget(request))

    def call_engine(self, verb: str, args: dict[str, Any], payload: bytes = b"") -> Future:
        future: Future = Future()
        if not self.ready:
            future.set_exception(self.not_ready())
            return future
        call = next(self._call_ids)
        self._calls[call] = future
        self.send(Call(call, verb, args, payload))
        return future

    def answered(self, result: Result) -> None:
        future = self._calls.pop(result.call, None)
        if future is None or future.done():
            return
        if result.refusal is not None:
            r = result.refusal
            future.set_exception(Refused(ErrorKind(r.kind), r.message, r.retry_after_s, r.field))
        elif result.error is not None:
            future.set_exception(RuntimeError(result.error))
        else:
            future.set_result(result.value)

    def fail_calls(self, refusal: Refused) -> None:
        """The engine has ended: no call in flight will be answered."""
        calls, self._calls = self._calls, {}
        for future in calls.values():
            if not future.done():
                future.set_exception(refusal)
