"""Listening, admission and shutdown: ties the transport to sessions and the shared scheduler."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from typing import Any

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve

from . import __version__
from . import protocol as p
from .auth import presented_tokens, token_matches
from .config import ServerConfig
from .engine import Engine, Scheduler
from .http import HttpRoutes
from .session import Session

log = logging.getLogger("vox_ws.server")


class VoxServer:
    """One listening socket, one scheduler (one model), many sessions."""

    def __init__(self, config: ServerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.scheduler = Scheduler(engine, max_batch=config.max_batch, max_queue=config.limits.max_queue,
                                   on_fatal=self._engine_died)
        self.sessions: set[Session] = set()
        self.started_at = time.monotonic()
        self._ws: WsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None  # created on the running loop in start()
        self.exit_code = 0

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        self.scheduler.start()
        limits = self.config.limits
        self._ws = await serve(
            self._handle,
            self.config.host,
            self.config.port,
            process_request=HttpRoutes(self.info, self.ready),
            # Frames up to 4x the published limit are read and answered with `too_large`; beyond
            # that the transport closes with 1009 without buffering them.
            max_size=limits.max_frame_bytes * 4,
            ping_interval=self.config.ping_interval,
            ping_timeout=self.config.ping_timeout,
            compression=None,  # audio does not compress; deflate would only cost CPU
            server_header=f"vox-ws/{__version__}",
        )
        log.info("listening on ws://%s:%d%s (engine %s, loading)", self.config.host, self.port,
                 "/v1/stream", self.engine.name)

    @property
    def port(self) -> int:
        assert self._ws is not None
        return self._ws.sockets[0].getsockname()[1]

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    async def shutdown(self) -> None:
        """Stop accepting, tell every session we are going away, stop the engine."""
        if self._ws is None:
            return
        log.info("shutting down: %d sessions open", len(self.sessions))
        self._ws.close(close_connections=False)
        await asyncio.gather(*(s.close(p.CLOSE_GOING_AWAY, "server shutting down") for s in list(self.sessions)),
                             return_exceptions=True)
        await self._ws.wait_closed()
        await asyncio.to_thread(self.scheduler.stop)
        self._ws = None
        if self._stopped is not None:
            self._stopped.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda: asyncio.ensure_future(self.shutdown()))

    def _engine_died(self, exc: BaseException, during_load: bool) -> None:
        # Called on the scheduler thread. A failed load keeps the server up, answering 503 with
        # the reason, so an operator can read it. A dead engine thread cannot be trusted to
        # reload in-process (CUDA context, half-freed state): exit non-zero for a supervisor.
        if during_load:
            return
        self.exit_code = 3
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self.shutdown()))

    # ------------------------------------------------------------------ sessions

    async def _handle(self, ws: ServerConnection) -> None:
        is_admin = bool(self.config.admin_tokens) and token_matches(presented_tokens(ws.request),
                                                                    self.config.admin_tokens)
        session = Session(ws, self.scheduler, self.config.limits, self.hello(), is_admin=is_admin)
        self.sessions.add(session)
        log.info("session %d open from %s", session.number, ws.remote_address)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            log.info("session %d closed (code %s)", session.number, ws.close_code)

    # ------------------------------------------------------------------ state

    def ready(self) -> bool:
        return self.scheduler.status == "ready" and self._ws is not None

    def hello(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "type": "hello",
            "protocol": p.PROTOCOL_VERSION,
            "server": f"vox-ws/{__version__}",
            "status": self.scheduler.status,
            "engine": engine.name,
            "model": engine.model,
            "sample_rate": engine.sample_rate,
            "formats": list(p.FORMATS),
            "voices": engine.voices() if self.scheduler.status == "ready" else [],
            "options": sorted(engine.supported_options),
            "limits": self.config.limits.as_dict(),
        }

    def info(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        status = stats.pop("status")
        if status == "ready" and self._ws is None:
            status = "stopping"
        return {
            "status": status,
            "error": self.scheduler.error,
            **self.engine.describe(),
            "voices": self.engine.voices() if status == "ready" else [],
            "sessions": len(self.sessions),
            "streams_open": sum(len(s.streams) for s in self.sessions),
            **stats,
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "version": __version__,
        }
