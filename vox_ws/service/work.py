"""Engine work awaited from the event loop: on a device's engine loop's thread or a worker thread,
its failures typed."""

from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

from ..engine import Engine, ErrorKind, Refused
from ..engine_process.devices import Devices
from ..engine_process.proxy import EngineProxy


async def engine_work(work: Awaitable[Any], failed: str = "") -> Any:
    """Await engine work: refusals pass as they are; any other error becomes INTERNAL (the
    engine's failure is this request's, not the server's)."""
    try:
        return await work
    except Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - report it; the service goes on
        raise Refused(ErrorKind.INTERNAL, f"{failed}{type(exc).__name__}: {exc}") from exc


async def on_each(devices: Devices, loops: list[EngineProxy], fn: Callable[[Engine], Any]) -> list[Any]:
    """`fn(engine)` on each engine loop's thread, between two steps: each one's result or refusal."""
    calls = [engine_work(asyncio.wrap_future(done)) for done in devices.call_each(fn, loops)]
    return await asyncio.gather(*calls, return_exceptions=True)


async def off_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """Thread-safe engine work on a worker thread."""
    return await engine_work(asyncio.to_thread(fn, *args))
