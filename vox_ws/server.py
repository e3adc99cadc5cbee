"""The composition root: one engine, its engine loop, the stream service, the front doors, and
the ASGI server (uvicorn, with websockets' sans-I/O protocol) that carries them on one port.
Also the server's life: start, drain on SIGTERM, stop, and the engine's death."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import signal
import socket
import time
from pathlib import Path
from typing import Any, Iterator
from urllib.parse import urlsplit

import uvicorn

from .config import ServerConfig
from .engine import Engine, ErrorKind, Readiness
from .engine_process.devices import Devices
from .engine_process.launch import EngineProcesses, InProcess, Launcher
from .engine_process.proxy import EngineProxy
from .engine_process.restarts import RestartPolicy
from .engine_process.spec import EngineSpec, LoopSettings
from .engines import plugins
from .service import StreamService
from .service.metrics import Metrics
from .service.service import read_lexicon, store_limits
from .service.voices.aliases import load_aliases
from .service.voices.stores import open_store
from .service.word_timings import WordTimings
from .transports import protocol as p
from .transports.app import STREAM_PATH, build_app, cors_origins
from .transports.connections import ConnectionGuard, HttpProtocol, WebSocketProtocol
from .transports.hosts import AllowedHosts
from .transports.http_routes import default_demo_dir
from .transports.proxies import TrustedProxies
from .transports.state import OpenSession, ServerState

log = logging.getLogger("vox_ws.server")

# After the drain, how long closing every connection may take before the server stops anyway
# (connections still holding unsent data are then aborted: connections.SHUTDOWN_ABORT_S).
CLOSE_GRACE_S = 3.0
# After the drain, the most the rest of the shutdown takes (docs/PROTOCOL.md: "at most
# `--drain-timeout` + 4 s"): closing the connections (CLOSE_GRACE_S of it at most), the HTTP
# server, then the engines and their helper processes, each stage with what the ones before left.
# A helper process that has not ended by then (stopped, stuck) is killed: its own grace
# (`child.STOP_GRACE_S`, 5 s) alone took the shutdown to 6.1-7.4 s with `--drain-timeout 1`.
SHUTDOWN_BOUND_S = 4.0


class StartFailed(RuntimeError):
    """The server cannot start here, whatever its options: a package an option needs is not
    installed, an address cannot be listened on. The message says what, in one line (`vox-ws
    serve` prints it, exit 1); what the start had started is stopped."""


def wyoming_door(config: ServerConfig) -> Any:
    """The Wyoming door's class (`transports.wyoming.WyomingServer`) for --wyoming, None without:
    its options checked and its packages found before anything starts (a refusal once the model
    has loaded, or a traceback, is what Home Assistant's users met). ValueError for options that
    contradict each other, StartFailed for a package that is not installed."""
    uri, name = config.wyoming, config.zeroconf
    if name and not (uri or "").startswith("tcp://"):
        raise ValueError("--zeroconf advertises the Wyoming door: serve it with --wyoming tcp://HOST:PORT")
    if not uri:
        return None
    try:
        # Imported here: the wyoming and zeroconf packages are an optional extra.
        from .transports.wyoming import WyomingServer
        if name:
            import zeroconf  # noqa: F401
    except ImportError as exc:
        missing = (exc.name or "wyoming").partition(".")[0]
        raise StartFailed(f"--wyoming{' with --zeroconf' if name else ''} needs the {missing} package, not "
                          f"installed: pip install '.[wyoming]' in a checkout (or VOX_WS_EXTRAS=piper,wyoming "
                          f"scripts/serve.sh), or from a built wheel pip install "
                          f"'dist/vox_ws-VERSION-py3-none-any.whl[wyoming]'") from None
    return WyomingServer


class _Uvicorn(uvicorn.Server):
    """uvicorn without its own signal handling (this server drains first, see `shutdown`) and
    without its 100 ms polling for the exit flag (an idle server then costs no CPU)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._exit = asyncio.Event()

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    def stop(self) -> None:
        self.should_exit = True
        self._exit.set()

    async def main_loop(self) -> None:
        # on_tick(0) refreshes the Date header and says whether to exit.
        while not await self.on_tick(0):
            try:
                await asyncio.wait_for(self._exit.wait(), 1.0)
            except asyncio.TimeoutError:
                pass


class VoxServer:
    """One listening socket, one engine per device (one copy of the model each), every front door.
    An engine is given as an `EngineSpec` (what `vox-ws serve` gives: it runs in a process of its
    own) or as an `Engine` object (served on a thread of this process, over the same messages:
    tests, embedding)."""

    def __init__(self, config: ServerConfig, engines: Engine | EngineSpec | list[Engine] | list[EngineSpec]) -> None:
        self.config = config
        given = engines if isinstance(engines, list) else [engines]
        self.devices = Devices([self._proxy(engine) for engine in given])
        self.engine = self.devices.engines[0]
        self.metrics = Metrics(config.metrics_secret.encode() if config.metrics_secret else None)
        store = open_store(config.voice_store, store_limits(config.limits, int(config.voice_store_max_mb * 2**20)))
        cors_origins(config.cors_origins, config.allow_origins)      # refused before anything starts
        AllowedHosts(config.allowed_hosts)                           # likewise
        aliases = load_aliases(config.voice_aliases) if config.voice_aliases else None
        word_timings = WordTimings.for_mode(config.word_timings, config.aligners)
        self.service = StreamService(self.devices, config.limits, self.metrics, voice_store=store,
                                     voice_aliases=aliases, word_timings=word_timings)
        self.state = ServerState(config, self.service, self.metrics)
        self.proxies = TrustedProxies(config.trusted_proxies, config.proxy_header)
        self.guard = ConnectionGuard(config.limits, proxies=self.proxies, ipv6_prefix=config.ipv6_prefix)
        self.metrics.bind(
            active=lambda: self.devices.stats()["active"],
            queued=lambda: self.devices.stats()["queued"],
            sessions=lambda: len(self.state.sessions),
            ready=lambda: 1.0 if self.state.ready() else 0.0,
        )
        for index, engine_loop in enumerate(self.devices.loops):
            engine_loop.replay.on_step = self.metrics.observe_step
            engine_loop.on_period = self.metrics.observe_period
            self.metrics.bind_device(index, engine_loop.engine.device, engine_loop.stats)
        self.exit_code = 0
        self._uvicorn: _Uvicorn | None = None
        self._serving: asyncio.Task | None = None
        self._socket: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopped: asyncio.Event | None = None   # created on the running loop in start()
        self._shutdown: asyncio.Task | None = None
        self.wyoming: Any = None                      # transports.wyoming.WyomingServer, with --wyoming
        self._advert: Any = None                      # transports.discovery.WyomingAdvert, with --zeroconf
        door = wyoming_door(config)
        if door is not None:
            try:
                self.wyoming = door(config.wyoming, self.service, self.proxies, config.ipv6_prefix)
            except ValueError as exc:                 # the wyoming library's word on the URI
                raise ValueError(f"--wyoming {config.wyoming!r}: {exc}") from None

    def _proxy(self, engine: Engine | EngineSpec) -> EngineProxy:
        config = self.config
        launcher: Launcher
        if isinstance(engine, EngineSpec):
            launcher = EngineProcesses(engine)
            plugin = plugins().get(engine.plugin)
            name, options = engine.plugin, plugin.options if plugin is not None else {}
        else:
            limits = config.limits
            launcher = InProcess(engine, LoopSettings(config.slots, limits.max_queue, config.max_share,
                                                      limits.max_queue_wait_s))
            name, options = engine.name, engine.options
        return EngineProxy(launcher, name, options, on_fatal=self._engine_died,
                           restart_policy=RestartPolicy(max_deaths=config.engine_restarts,
                                                        window_s=config.engine_restart_window))

    @property
    def sessions(self) -> set[OpenSession]:
        return self.state.sessions

    @property
    def draining(self) -> bool:
        return self.state.draining

    # ------------------------------------------------------------------ life

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        lexicon = None
        if self.config.lexicon:                       # its form before a model loads
            lexicon, problems = await read_lexicon(self.config.lexicon)
            _refuse_lexicon(problems)
        # The voice store first: one this server may not use stops the start before a model loads.
        await self.service.start()
        self.devices.start()
        try:
            await self.devices.created()          # an engine its settings cannot build: said, exit 2
            if lexicon is not None:
                # Which pronunciations the engine can say is its own to declare, once it is built
                # (IPA where it takes phonemes: Piper, in the phonemes of its voices).
                _refuse_lexicon(self.service.use_lexicon(lexicon, self.config.lexicon))
                log.info("lexicon %s: %d pronunciations", self.config.lexicon, len(self.service.lexicon))
            await self._open_doors()
        except BaseException:
            # What had started is stopped (the engine's worker, a door already listening): the
            # process then exits with one line saying why, not a worker's broken pipe.
            self.exit_code = 1
            self.state.listening = True               # shutdown() stops a server that listens
            await self.shutdown(0.0)
            raise

    async def _open_doors(self) -> None:
        """The HTTP/WebSocket port, then the Wyoming door and its advert; StartFailed for an
        address that cannot be listened on or advertised."""
        demo = Path(self.config.demo_dir) if self.config.demo_dir else default_demo_dir()
        limits = self.config.limits
        uv_config = uvicorn.Config(
            build_app(self.state, demo),
            loop="none", lifespan="off", log_config=None, access_log=False,
            # Who the client is behind a balancer is decided by the connection protocols, from
            # trusted peers only (transports/proxies.py); uvicorn's own trusts loopback.
            proxy_headers=False,
            http=functools.partial(HttpProtocol, guard=self.guard, limits=limits),
            ws=functools.partial(WebSocketProtocol, limits=limits, guard=self.guard),
            # Frames up to 4x the published limit are read and answered with `too_large`; beyond
            # that the transport closes with 1009 without buffering them.
            ws_max_size=limits.max_frame_bytes * 4,
            ws_ping_interval=self.config.ping_interval,
            ws_ping_timeout=self.config.ping_timeout,
            ws_per_message_deflate=False,      # audio does not compress; deflate would only cost CPU
            server_header=False, headers=[("server", self.state.server_name)],
            timeout_graceful_shutdown=CLOSE_GRACE_S,
        )
        try:
            self._socket = _listen(self.config.host, self.config.port)
        except OSError as exc:                        # taken, or an address this machine has not
            raise StartFailed(f"cannot listen on {self.config.host}:{self.config.port}: "
                              f"{exc.strerror or exc}") from None
        self._uvicorn = _Uvicorn(uv_config)
        self._serving = asyncio.create_task(self._uvicorn.serve(sockets=[self._socket]), name="vox-ws-uvicorn")
        while not self._uvicorn.started:
            if self._serving.done():
                await self._serving            # raises what stopped it
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        if self.wyoming is not None:
            try:
                await self.wyoming.start()
            except OSError as exc:
                raise StartFailed(f"--wyoming {self.config.wyoming}: cannot listen: "
                                  f"{exc.strerror or exc}") from None
            if self.config.zeroconf:
                from .transports.discovery import WyomingAdvert

                self._advert = WyomingAdvert(self.config.zeroconf, urlsplit(self.config.wyoming).hostname or "",
                                             self.wyoming.port)
                try:
                    await self._advert.start()
                except Exception as exc:  # noqa: BLE001 - OSError or zeroconf's own: the start stops, saying why
                    self._advert = None
                    raise StartFailed(f"--zeroconf {self.config.zeroconf!r}: cannot advertise the Wyoming "
                                      f"door: {type(exc).__name__}: {exc}") from None
        self.state.listening = True
        log.info("listening on ws://%s:%d%s (engine %s, loading)", self.config.host, self.port, STREAM_PATH,
                 self.engine.name)

    @property
    def port(self) -> int:
        assert self._socket is not None
        return self._socket.getsockname()[1]

    @property
    def running(self) -> bool:
        return self.state.listening

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    def request_shutdown(self, drain: bool = True, close_code: int = p.CLOSE_SERVICE_RESTART) -> None:
        if self._shutdown is None:
            self._shutdown = asyncio.ensure_future(
                self.shutdown(self.config.drain_timeout if drain else 0.0, close_code))

    async def shutdown(self, drain_timeout: float = 0.0, close_code: int = p.CLOSE_SERVICE_RESTART,
                       bound_s: float = SHUTDOWN_BOUND_S) -> None:
        """Drain, then stop: readiness turns 503 and new streams are refused at once; streams in
        flight may finish for `drain_timeout` seconds; the rest are told (`going_away`) and
        every connection is closed with 1012 (Service Restart: reconnect, to another server).
        All of it within `drain_timeout` + `bound_s` seconds: each stage after the drain takes
        its time from what is left of that."""
        if not self.state.listening:
            return
        self.state.draining = True
        self.service.accepting = False
        log.info("shutting down: %d sessions, %d streams open, draining up to %.1fs", len(self.sessions),
                 self.service.open_streams, drain_timeout)
        started = time.monotonic()
        drained_by, deadline = started + drain_timeout, started + drain_timeout + bound_s

        def left(most: float = bound_s) -> float:
            return max(0.0, min(most, deadline - time.monotonic()))

        while time.monotonic() < drained_by and self.service.open_streams:
            await asyncio.sleep(0.05)
        self.service.abort_all(ErrorKind.GOING_AWAY, "server shutting down")
        reason = "server shutting down" if close_code == p.CLOSE_SERVICE_RESTART else "engine failed"
        closing = asyncio.gather(*(s.close(close_code, reason) for s in list(self.sessions)), return_exceptions=True)
        # A client that reads nothing cannot be sent a close frame: it is not waited for.
        await _within(closing, left(CLOSE_GRACE_S),
                      "some connections did not take their close frame in time: dropping them")
        self.state.listening = False
        if self._advert is not None:
            await _within(self._advert.close(), left(), "the zeroconf advert did not close in time")
        if self.wyoming is not None:
            await _within(self.wyoming.stop(), left(), "the Wyoming door did not stop in time")
        if self._uvicorn is not None:
            # Its connections have been closed above; what it still waits for has what is left.
            self._uvicorn.config.timeout_graceful_shutdown = left(CLOSE_GRACE_S)
            self._uvicorn.stop()
            await _within(asyncio.gather(self._serving, return_exceptions=True), left(),
                          "the HTTP server did not stop in time: stopped")
        await self.service.close(left())
        self.state.multipart.close()
        await asyncio.to_thread(self.devices.stop, left())
        log.info("stopped (exit code %d) %.1f s after the shutdown began", self.exit_code,
                 time.monotonic() - started)
        if self._stopped is not None:
            self._stopped.set()

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown)
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(self.reload()))

    async def reload(self) -> list[dict[str, Any]]:
        """SIGHUP: the lexicon read again (where there is one), and the engine's voices on disk
        (a voice added to the voices folder served, one removed no longer listed); what changed
        in the voices (`VoiceRescans.rescan`)."""
        if self.config.lexicon:
            await self.state.reload_lexicon()
        return await self.service.voice_rescans.rescan()

    def _engine_died(self, exc: BaseException, during_load: bool) -> None:
        # Called on the event loop, for an engine that will not serve again. A failed load keeps
        # the server up, answering 503 with the reason, so an operator can read it. An engine
        # process that died is started again (`EngineProxy`), unless it died too often: then,
        # as for an engine on this process's thread that failed, its device takes no more
        # streams (its streams were told `unavailable`). While another device serves, the
        # server goes on with it (`/v1/info` shows the failed one); once none is left,
        # readiness is 503 and the process exits with code 3 for its supervisor.
        if during_load or self.devices.status == Readiness.READY:
            if not during_load:
                log.error("a device failed and takes no more streams; %d of %d still serve",
                          sum(s.status == Readiness.READY for s in self.devices.loops), len(self.devices.loops))
            return
        self.exit_code = 3
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.request_shutdown, False, p.CLOSE_INTERNAL)

    def info(self) -> dict[str, Any]:
        return self.state.info()


def _refuse_lexicon(problems: list[str]) -> None:
    """A bad lexicon file stops the start, said in one line, as a bad option is (exit 2)."""
    if problems:
        raise ValueError(f"--lexicon: {len(problems)} error(s): " + "; ".join(problems))


async def _within(awaitable: Any, seconds: float, failing: str) -> None:
    """`awaitable`, given up (cancelled) after `seconds`, saying `failing` then."""
    try:
        await asyncio.wait_for(awaitable, seconds)
    except asyncio.TimeoutError:
        log.warning("shutdown: %s (%.1f s)", failing, seconds)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock
