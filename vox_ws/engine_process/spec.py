"""What an engine is started from: the engine loop's settings, and, for an engine process, the
plugin, its settings and what the process needs of its own (`EngineSpec`). Plain data: an
engine process receives it from the fork server."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class LoopSettings:
    """The engine loop's settings (`EngineLoop`), the same for every engine of a server."""

    slots: int | None = 8
    max_queue: int = 64
    max_share: int | None = None
    max_wait_s: float | None = None


@dataclass(frozen=True)
class EngineSpec:
    """What an engine process builds its engine from: a registered plugin's name (or "auto"),
    the settings it takes (`EnginePlugin.create`'s), the device as that process sees it, and
    what the process needs of its own: environment variables (`CUDA_VISIBLE_DEVICES`), the CPUs
    it is pinned to, how it logs (a picklable callable: the command line's set-up)."""

    plugin: str
    settings: dict[str, Any]
    # The server's name for its device ("cuda:1"), which its process sees as `settings["device"]`.
    label: str = ""
    loop: LoopSettings = LoopSettings()
    env: dict[str, str] = field(default_factory=dict)
    cpus: tuple[int, ...] | None = None
    log_setup: Callable[[], None] | None = None
    # Modules the fork server imports once for every engine process it forks.
    preload: tuple[str, ...] = ()

    @property
    def device(self) -> str:
        return self.label or str(self.settings.get("device") or "auto")
