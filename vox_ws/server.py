"""Listening, admission and shutdown: ties the transport to sessions and the shared scheduler."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections import Counter
from pathlib import Path
from typing import Any

from websockets.asyncio.server import Server as WsServer
from websockets.asyncio.server import ServerConnection, serve

from . import __version__
from . import protocol as p
from .auth import presented_tokens, token_matches
from .config import ServerConfig
from .engine import Engine, Scheduler
from .http import HttpRoutes, default_demo_dir
from .metrics import Metrics
from .session import Session

log = logging.getLogger("vox_ws.server")


class VoxServer:
    """One listening socket, one scheduler (one model), many sessions."""

    def __init__(self, config: ServerConfig, engine: Engine) -> None:
        self.config = config
        self.engine = engine
        self.scheduler = Scheduler(engine, max_batch=config.max_batch, max_queue=config.limits.max_queue,
                                   on_fatal=self._engine_died)
        self.metrics = Metrics()
        self.metrics.bind(
            active=lambda: self.scheduler.stats()["active"],
            queued=lambda: self.scheduler.stats()["queued"],
            sessions=lambda: len(self.sessions),
            ready=lambda: 1.0 if self.ready() else 0.0,
        )
        self.scheduler.on_step = self.metrics.observe_step
        self.sessions: set[Session] = set()
        self.per_address: Counter[str] = Counter()
        self.started_at = time.monotonic()
        self.draining = False
        self.exit_code = 0
        self._ws: WsServer | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None   # created on the running loop in start()
        self._shutdown: asyncio.Task | None = None

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
            process_request=HttpRoutes(self.info, self.ready, self.metrics,
                                       Path(self.config.demo_dir) if self.config.demo_dir else default_demo_dir()),
            # Browsers always send Origin; None admits clients that send none (servers).
            origins=[None, *self.config.allow_origins] if self.config.allow_origins else None,
            # Frames up to 4x the published limit are read and answered with `too_large`; beyond
            # that the transport closes with 1009 without buffering them.
            max_size=limits.max_frame_bytes * 4,
            ping_interval=self.config.ping_interval,
            ping_timeout=self.config.ping_timeout,
            compression=None,  # audio does not compress; deflate would only cost CPU
            server_header=f"vox-ws/{__version__}",
        )
        log.info("listening on ws://%s:%d/v1/stream (engine %s, loading)", self.config.host, self.port,
                 self.engine.name)

    @property
    def port(self) -> int:
        assert self._ws is not None
        return self._ws.sockets[0].getsockname()[1]

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    def request_shutdown(self, drain: bool = True, close_code: int = p.CLOSE_GOING_AWAY) -> None:
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(
                self.shutdown(self.config.drain_timeout if drain else 0.0, close_code))

    async def shutdown(self, drain_timeout: float = 0.0, close_code: int = p.CLOSE_GOING_AWAY) -> None:
        """Drain, then stop: readiness turns 503 and new streams are refused at once; streams in
        flight may finish for `drain_timeout` seconds; the rest are told (`going_away`) and
        every connection is closed with 1001."""
        if self._ws is None:
            return
        self.draining = True
        open_streams = sum(len(s.streams) for s in self.sessions)
        log.info("shutting down: %d sessions, %d streams open, draining up to %.1fs", len(self.sessions),
                 open_streams, drain_timeout)
        deadline = time.monotonic() + drain_timeout
        while time.monotonic() < deadline and any(s.streams for s in self.sessions):
            await asyncio.sleep(0.05)
        for session in list(self.sessions):
            session.abort_streams(p.GOING_AWAY, "server shutting down")
        self._ws.close(close_connections=False)
        reason = "server shutting down" if close_code == p.CLOSE_GOING_AWAY else "engine failed"
        await asyncio.gather(*(s.close(close_code, reason) for s in list(self.sessions)), return_exceptions=True)
        await self._ws.wait_closed()
        await asyncio.to_thread(self.scheduler.stop)
        self._ws = None
        log.info("stopped (exit code %d)", self.exit_code)
        if self._stopped is not None:
            self._stopped.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown)

    def _engine_died(self, exc: BaseException, during_load: bool) -> None:
        # Called on the scheduler thread. A failed load keeps the server up, answering 503 with
        # the reason, so an operator can read it. A dead engine thread cannot be trusted to
        # reload in-process (CUDA context, half-freed state): every stream has been told
        # (`internal`), readiness is 503, and the process exits with code 3 for its supervisor.
        if during_load:
            return
        self.exit_code = 3
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.request_shutdown, False, p.CLOSE_INTERNAL)

    # ------------------------------------------------------------------ sessions

    async def _handle(self, ws: ServerConnection) -> None:
        refusal = self._admission(ws)
        if refusal is not None:
            code, reason, label = refusal
            self.metrics.rejected.labels(label).inc()
            log.info("connection from %s refused: %s", ws.remote_address, reason)
            await ws.close(code, reason)
            return
        address = _address(ws)
        is_admin = bool(self.config.admin_tokens) and token_matches(presented_tokens(ws.request),
                                                                    self.config.admin_tokens)
        session = Session(ws, self.scheduler, self.config.limits, self.hello(), is_admin=is_admin,
                          metrics=self.metrics, accepting=self.accepting)
        self.sessions.add(session)
        self.per_address[address] += 1
        log.info("session %d open from %s", session.number, ws.remote_address)
        try:
            await session.run()
        finally:
            self.sessions.discard(session)
            self.per_address[address] -= 1
            if self.per_address[address] <= 0:
                del self.per_address[address]
            log.info("session %d closed (code %s)", session.number, ws.close_code)

    def _admission(self, ws: ServerConnection) -> tuple[int, str, str] | None:
        """Why this connection may not open a session (close code, reason, metric label), if so.
        Decided before any engine work."""
        accepted = self.config.tokens + self.config.admin_tokens
        if self.config.tokens and not token_matches(presented_tokens(ws.request), accepted):
            return p.CLOSE_UNAUTHORIZED, "unauthorized: present a valid token", "unauthorized"
        if self.draining:
            return p.CLOSE_GOING_AWAY, "server shutting down", "draining"
        limits = self.config.limits
        if len(self.sessions) >= limits.max_connections:
            return p.CLOSE_TRY_AGAIN_LATER, "try again later: server at its connection limit", "capacity"
        if self.per_address[_address(ws)] >= limits.max_connections_per_address:
            return (p.CLOSE_TOO_MANY_FROM_ADDRESS, "too many connections from your address",
                    "per_address")
        return None

    # ------------------------------------------------------------------ state

    def ready(self) -> bool:
        return self.scheduler.status == "ready" and self._ws is not None and not self.draining

    def accepting(self) -> bool:
        """Whether new streams are admitted (not while draining)."""
        return not self.draining

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
            "features": ["input_streaming", "segment_events"] + (["voice_cloning"] if engine.supports_voices else []),
            "limits": self.config.limits.as_dict(),
        }

    def info(self) -> dict[str, Any]:
        stats = self.scheduler.stats()
        status = stats.pop("status")
        if status == "ready" and (self._ws is None or self.draining):
            status = "draining"
        return {
            "status": status,
            "error": self.scheduler.error,
            **self.engine.describe(),
            "voices": self.engine.voices() if status == "ready" else [],
            "sessions": len(self.sessions),
            "streams_open": sum(len(s.streams) for s in self.sessions),
            **stats,
            "rss_mb": _rss_mb(),
            "uptime_s": round(time.monotonic() - self.started_at, 1),
            "version": __version__,
        }


def _address(ws: ServerConnection) -> str:
    remote = ws.remote_address
    return str(remote[0]) if isinstance(remote, tuple) else str(remote)


def _rss_mb() -> float | None:
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    import os

    return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**20, 1)
