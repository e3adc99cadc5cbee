"""An engine started again after its process died (`engine_process/life.py`) gets back what the
one before held: the voices registered on it (built again from the voice store, which keeps
them), and the LoRA adapters loaded on it and its default one (read again from the disk)."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from ..engine import Refused
from ..engine_process.devices import Devices
from ..engine_process.proxy import EngineProxy
from ..voice_tags import voice_tag
from .loras import LoraService
from .voices.service import VoiceService

log = logging.getLogger("vox_ws.service")


class EngineRestores:
    def __init__(self, voices: VoiceService, loras: LoraService) -> None:
        self.voices = voices
        self.loras = loras

    def watch(self, devices: Devices) -> None:
        for engine_loop in devices.loops:
            engine_loop.on_restart = self.restore

    def restore(self, engine_loop: EngineProxy, held: dict[str, Any]) -> None:
        """On the event loop, once the engine started again serves."""
        asyncio.ensure_future(self._restore(engine_loop, held))

    async def _restore(self, engine_loop: EngineProxy, held: dict[str, Any]) -> None:
        voices = 0
        for voice in held.get("voices", ()):
            try:
                await self.voices.ensure(voice)
                voices += 1
            except Refused as err:                   # gone from the store meanwhile, or expired
                log.warning("voice %s not restored: %s", voice_tag(voice), err.message)
        loras = await self.loras.restore(engine_loop, held.get("loras", ()), held.get("default_lora"))
        log.info("engine %s serves again: %d of %d voices and %d of %d LoRA adapters restored",
                 engine_loop.engine.device, voices, len(held.get("voices", ())), loras, len(held.get("loras", ())))
