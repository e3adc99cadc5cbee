"""LoRA adapters across devices (VoxCPM2): loaded, unloaded and made the default on every
device between two of its steps, and described as one."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from ..config import Limits
from ..engine import Engine, Readiness
from ..engine_process.devices import Devices
from ..engine_process.proxy import EngineProxy
from .work import off_thread, on_each

log = logging.getLogger("vox_ws.service")


class LoraService:
    """The service's adapters (`StreamService.loras`). `end_streams_of(name)` ends the streams
    still speaking with an adapter whose unload's time is up."""

    def __init__(self, devices: Devices, limits: Limits, end_streams_of: Callable[[str], None]) -> None:
        self.devices = devices
        self.limits = limits
        self._end_streams_of = end_streams_of

    async def load(self, name: str | None) -> dict[str, Any]:
        """Read an adapter from disk once, off the engines' threads, and put it into a free slot
        of every device; a load refused by one device is undone on the others."""
        self._check_ready()
        adapter_file = await off_thread(self.devices.engine.loras.read, name)
        return await self._on_every_device("load", lambda engine: engine.loras.load(adapter_file), name)

    async def unload(self, name: str | None) -> dict[str, Any]:
        """New streams may no longer use it; each device frees its slot once its own streams
        have ended, and those still speaking after `lora_unload_timeout_s` end then."""
        result = await self._on_every_device("unload", lambda engine: engine.loras.unload(name), name)
        if not result["unloaded"]:
            asyncio.get_running_loop().call_later(self.limits.lora_unload_timeout_s, self._end_streams_of,
                                                  result["name"])
        return result

    async def set_default(self, name: str | None) -> dict[str, Any]:
        """The adapter of streams that name none (`name` None: the one loaded), from their start."""
        return await self._on_every_device("enable", lambda engine: engine.loras.set_default(name), name)

    async def clear_default(self) -> dict[str, Any]:
        return await self._on_every_device("disable", lambda engine: engine.loras.clear_default(), None)

    async def restore(self, engine_loop: EngineProxy, names: Any, default: str | None) -> int:
        """Load again, on an engine started again, the adapters the one before held (and its
        default): how many loaded."""
        loaded = 0
        for name in names:
            outcome, = await on_each(self.devices, [engine_loop],
                                     lambda engine, name=name: engine.loras.load(engine.loras.read(name)))
            if isinstance(outcome, BaseException):
                log.warning("LoRA adapter %r not restored: %s", name, getattr(outcome, "message", outcome))
            else:
                loaded += 1
        if default is not None:
            outcome, = await on_each(self.devices, [engine_loop], lambda engine: engine.loras.set_default(default))
            if isinstance(outcome, BaseException):
                log.warning("LoRA adapter %r not made the default again: %s", default,
                            getattr(outcome, "message", outcome))
        return loaded

    def describe(self) -> dict[str, Any]:
        """The adapters loaded (the same on every device), the slots and what a slot costs; an
        adapter's streams counted on every device, and unloading while any device has it so."""
        each = [engine.loras.describe() for engine in self.devices.engines]
        first = each[0]
        if not first.get("configured"):
            return first
        merged: dict[str, dict[str, Any]] = {}
        for described in each:
            for adapter in described["adapters"]:
                seen = merged.setdefault(adapter["name"], {**adapter, "streams": 0})
                seen["streams"] += adapter["streams"]
                if adapter["state"] == "unloading":
                    seen["state"] = "unloading"
        return {**first, "adapters": sorted(merged.values(), key=lambda a: a["slot"])}

    def _check_ready(self) -> None:
        if self.devices.status != Readiness.READY or not self.devices.ready:
            raise self.devices.not_ready()

    async def _on_every_device(self, op: str, verb: Callable[[Engine], dict[str, Any]],
                               name: str | None) -> dict[str, Any]:
        """`verb` on every ready device; the first refusal is raised (a load undone where it
        passed); the first device's result otherwise, with `op` and the adapters after it."""
        self._check_ready()
        ready = self.devices.ready
        outcomes = await on_each(self.devices, ready, verb)
        refusals = [o for o in outcomes if isinstance(o, BaseException)]
        if refusals:
            if op == "load":
                loaded = [s for s, o in zip(ready, outcomes) if not isinstance(o, BaseException)]
                await on_each(self.devices, loaded, lambda engine: engine.loras.unload(name))
            raise refusals[0]
        result = {"op": op, **outcomes[0], "lora": self.describe()}
        if op == "unload":
            result.update(unloaded=all(o["unloaded"] for o in outcomes),
                          streams_using=sum(o["streams_using"] for o in outcomes))
        return result
