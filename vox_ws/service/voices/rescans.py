"""The engine's built-in voices read again while the server runs, as wyoming-piper reads its
folder at each `describe`: on SIGHUP (`rescan`), and when the voices on disk change (a look every
`Voices.rescan_every_s`: Piper's `--piper-voices-poll`). Every list of voices (`/v1/audio/voices`,
`/v1/voices`, Wyoming's `describe`, `hello`) reads the engine's at each call, so each is current
once a rescan is served.

    a look (a worker thread)    engine.voices.disk_stamp()        a folder's listing: cheap
    rescan  (a worker thread)   engine.voices.prepare_rescan()    the voices read, new ones loaded
            (the engine loop)   engine.voices.apply_rescan(...)   served between two steps

The engine runs in a process of its own: `engine` here is its view (`engine_process/view.py`),
whose `disk_stamp` and `prepare_rescan` are calls to that process, which reads, loads and serves
the voices there (its `apply_rescan` between two of its steps) and declares itself again before
it answers; how often to look is known once the engine has loaded (`rescan_every_s`, declared).

Nothing here runs on the engine loop's thread but `apply_rescan` (a message to the loop, like a
LoRA change), and nothing blocking runs on the event loop. A change is acted on once the folder
has looked the same twice in a row: a voice being copied in is not loaded half-written.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable

from ...engine import Readiness
from ...engine_process.devices import Devices

log = logging.getLogger("vox_ws.service")


class VoiceRescans:
    """Create it, `await start()` on the event loop that serves; `rescan()` on SIGHUP."""

    def __init__(self, devices: Devices, loaded: Callable[[], Awaitable[Any]]) -> None:
        self.devices = devices
        self._loaded = loaded                      # until the engine's load is over (served or failed)
        self.done = 0                              # rescans finished (`until_done` waits on it)
        self._lock: asyncio.Lock | None = None     # one rescan at a time
        self._finished: asyncio.Condition | None = None
        self._watch: asyncio.Task | None = None

    async def start(self) -> None:
        self._lock, self._finished = asyncio.Lock(), asyncio.Condition()
        self._watch = asyncio.create_task(self._watch_disk(), name="vox-ws-voice-rescans")

    async def close(self) -> None:
        """Stop looking. A rescan still loading ends on its own thread: its engine stops what
        it loaded once it is closed (`PiperEngine.close`)."""
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)

    async def rescan(self) -> list[dict[str, Any]]:
        """Read every serving device's voices again now, and serve them; what changed on each
        device that changed. A device whose voices cannot be read as they are now keeps those
        it serves, and says why in the log."""
        assert self._lock is not None and self._finished is not None, "VoiceRescans.start() was not awaited"
        changes = []
        async with self._lock:
            for engine_loop in self.devices.ready:
                voices = engine_loop.engine.voices
                try:
                    prepared = await asyncio.to_thread(voices.prepare_rescan)
                except Exception as exc:  # noqa: BLE001 - the files' fault: the voices served stand
                    log.error("voices not read again (those served are kept): %s: %s",
                              type(exc).__name__, exc)
                    continue
                if prepared is None:
                    continue
                try:
                    applied = engine_loop.call(lambda: voices.apply_rescan(prepared))
                    changes.append(await asyncio.wrap_future(applied))
                except Exception as exc:  # noqa: BLE001 - its device stopped serving meanwhile
                    log.warning("voices read again but not served (%s: %s)", type(exc).__name__, exc)
                    await asyncio.to_thread(voices.discard_rescan, prepared)
            self.done += 1
        async with self._finished:
            self._finished.notify_all()
        return changes

    async def until_done(self, count: int) -> None:
        """Until `count` rescans have finished since the start (`done`): a test's hook, no timing."""
        assert self._finished is not None, "VoiceRescans.start() was not awaited"
        async with self._finished:
            await self._finished.wait_for(lambda: self.done >= count)

    async def _watch_disk(self) -> None:
        """How often to look is the engine's to say (`Voices.rescan_every_s`), which the server
        knows once the engine has loaded and declared itself (it runs in a process of its own):
        until then, no look."""
        await self._loaded()
        every = self.devices.engine.voices.rescan_every_s
        if every:
            await self._look_every(every)

    async def _look_every(self, every: float) -> None:
        last = acted = None
        while True:
            await asyncio.sleep(every)
            if self.devices.status != Readiness.READY:
                continue
            try:
                stamp = await asyncio.to_thread(self._stamps)
            except Exception:  # noqa: BLE001 - a look that failed: the next one tries again
                log.exception("looking at the voices on disk failed")
                continue
            settled, last = stamp == last, stamp
            if settled and stamp != acted:
                acted = stamp
                await self.rescan()

    def _stamps(self) -> list[Any]:
        return [engine_loop.engine.voices.disk_stamp() for engine_loop in self.devices.ready]
