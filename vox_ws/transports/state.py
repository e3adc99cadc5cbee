"""What every front door of one server shares: configuration, the stream service, metrics,
open sessions, and whether the server is draining."""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from typing import Any, Protocol

from starlette.requests import HTTPConnection

from .. import __version__
from ..config import Limits, ServerConfig
from ..engine import Readiness
from ..engines import installed, option_vocabulary
from ..service import StreamService
from ..service.metrics import Metrics
from .multipart import MultipartParser
from .spool import SpoolBudget

log = logging.getLogger("vox_ws.server")


class OpenSession(Protocol):
    """What the server needs of an open protocol v1 session (`v1_connection.V1Connection`, which
    imports this module): to close it, when it drains or stops."""

    async def close(self, code: int, reason: str) -> None: ...


class ServerState:
    def __init__(self, config: ServerConfig, service: StreamService, metrics: Metrics) -> None:
        self.config = config
        self.service = service
        self.metrics = metrics
        self.sessions: set[OpenSession] = set()
        self.per_address: Counter[str] = Counter()
        self.started_at = time.monotonic()
        self.started_wall = time.time()
        self.draining = False
        self.listening = False
        self.server_name = f"vox-ws/{__version__}"
        # Every option some engine knows is validated; the served engine's specs win.
        self.option_specs = option_vocabulary(service.engine)
        self.multipart = MultipartParser()       # voice uploads' multipart bodies, off the process
        # Whole responses' bytes (`stream: false`) held until sent.
        self.spools = SpoolBudget(config.limits.max_whole_bytes_per_owner, config.limits.max_whole_bytes)

    @property
    def limits(self) -> Limits:
        return self.config.limits

    def ready(self) -> bool:
        return self.service.devices.status == Readiness.READY and self.listening and not self.draining

    def full(self) -> bool:
        """Every generation slot is busy: a new stream would wait in the queue."""
        stats = self.service.devices.stats()
        return stats["active"] + stats["queued"] >= stats["slots"]

    def load(self) -> dict[str, Any]:
        """The balancers' and autoscalers' figure: cheap, no engine work."""
        stats = self.service.devices.stats()
        slots, busy = stats["slots"], stats["active"] + stats["queued"]
        return {
            "ready": self.ready(),
            "draining": self.draining,
            "slots": slots,
            "step_rows": stats["step_rows"],
            "active": stats["active"],
            "queued": stats["queued"],
            "free_slots": max(0, slots - busy),
            "mean_step_ms": stats["mean_step_ms"],
            "load": round(min(1.0, busy / slots), 4) if slots else 1.0,
            "sessions": len(self.sessions),
        }

    def status(self) -> Readiness:
        status = self.service.devices.status
        if status == Readiness.READY and (not self.listening or self.draining):
            return Readiness.DRAINING
        return status

    async def reload_lexicon(self) -> list[str]:
        """Read the lexicon file again (SIGHUP, `POST /v1/lexicon`); with errors, they are logged
        and returned, and the lexicon in use is kept."""
        path = self.config.lexicon
        if not path:
            return ["no lexicon: the server runs without --lexicon"]
        problems = await self.service.load_lexicon(path)
        if problems:
            log.error("lexicon %s not reloaded (the one in use is kept):\n  %s", path, "\n  ".join(problems))
        else:
            log.info("lexicon %s reloaded: %d pronunciations", path, len(self.service.lexicon))
        return problems

    def features(self) -> list[str]:
        """What this server can do, as `hello.features` and `/v1/info` name it."""
        engine = self.service.engine
        return (["input_streaming", "segment_events", "speed", "lookahead", "usage", "retry_after", "ssml",
                 "pronunciations", "language", "volume"]
                + (["voice_cloning"] if engine.supports_voices else [])
                + (["instructions"] if engine.text.follows_instructions(None) else [])
                + (["word_timestamps"] if self.service.word_timings.offered(engine) else [])
                + (["phoneme_timestamps"] if engine.phoneme_timings else [])
                + (["lora"] if self.service.loras.describe().get("configured") else []))

    def info(self) -> dict[str, Any]:
        devices = self.service.devices
        stats = devices.stats()
        stats.pop("status")
        for figures in [stats, *stats["devices"]]:    # slots' old name, kept for one release (0.x)
            figures["max_batch"] = figures["slots"]
        status = self.status()
        described = self.service.engine.describe()
        if "lora" in described:                    # its streams counted on every device
            described["lora"] = self.service.loras.describe()
        return {
            "status": status,
            "error": devices.error,
            **described,
            "device": ",".join(engine.device for engine in devices.engines),
            "voice_store": self.service.voices.store.describe(),
            "voices": self.service.voices.listed() if status == Readiness.READY else [],
            "languages": list(self.service.engine.languages),
            "aliases": {name: alias.describe() for name, alias in self.service.voices.aliases().items()},
            "features": self.features(),
            # Every engine this install has (built-in, other packages'), those it cannot serve with why.
            "engines": [found.describe() for found in installed()],
            "word_timings": self.service.word_timings.describe(self.service.engine),
            "lexicon": {"path": self.config.lexicon, "entries": len(self.service.lexicon)},
            "sessions": len(self.sessions),
            "streams_open": self.service.open_streams,
            **stats,
            "rss_mb": rss_mb(),
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "version": __version__,
        }


def rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)


def server_state(connection: HTTPConnection) -> ServerState:
    """The state of the server a request or WebSocket came to (`build_app` puts it on the app),
    for module-level endpoints, Starlette's way."""
    return connection.app.state.vox
