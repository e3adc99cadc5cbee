"""Fixtures: a real vox-ws server on a loopback port (its own thread and event loop) and a real
WebSocket client speaking the msgpack protocol."""

from __future__ import annotations

import ast
import asyncio
import inspect
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import psutil
import pytest
from _pytest.mark.expression import Expression
from websockets.asyncio.client import ClientConnection, connect

from vox_ws.audio import bytes_to_pcm
from vox_ws.config import Limits, ServerConfig
from vox_ws.engine import Engine
from vox_ws.server import VoxServer

REPO_ROOT = Path(__file__).resolve().parents[1]

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

RECV_TIMEOUT = 60.0
# How long a test waits for a state before it calls it a hang. It is a failure detector, never
# a measurement: far beyond what anything awaited takes on a slow or loaded machine, and a
# fast machine reaches the state sooner and goes on at once.
WAIT_TIMEOUT = 120.0


class RunningServer:
    """A VoxServer running on a background thread's event loop, as in production."""

    def __init__(self, engine: Engine, config: ServerConfig) -> None:
        self.engine = engine
        self.config = config
        self.loop = asyncio.new_event_loop()
        self.server = VoxServer(config, engine)
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(30)
        self.port = self.server.port
        self.url = f"ws://127.0.0.1:{self.port}/v1/stream"
        self.http = f"http://127.0.0.1:{self.port}"

    @property
    def devices(self):
        return self.server.devices

    @property
    def engine_loops(self):
        """Each engine's own engine loop, on its side of the boundary (the server's are stand-ins,
        `EngineProxy`): what a test holds the engine's thread with, or reads the slot queue of."""
        return [proxy.launcher.host.loop for proxy in self.devices.loops]

    def wait_ready(self, timeout: float = 120.0) -> None:
        assert self.devices.ready_event.wait(timeout), "engine did not load in time"
        assert self.devices.status == "ready", self.devices.error

    def get(self, path: str) -> tuple[int, Any]:
        try:
            with urllib.request.urlopen(self.http + path, timeout=10) as response:
                body = response.read()
                status = response.status
                kind = response.headers.get("Content-Type", "")
        except urllib.error.HTTPError as err:
            body, status, kind = err.read(), err.code, err.headers.get("Content-Type", "")
        return status, json.loads(body) if "json" in kind else body.decode()

    def stop(self) -> None:
        self.finish_stopping(self.begin_stopping())

    def begin_stopping(self):
        """Start the shutdown (a future, or None if there is nothing to stop)."""
        if self._thread.is_alive() and self.server.running:
            return asyncio.run_coroutine_threadsafe(self.server.shutdown(), self.loop)
        return None

    def finish_stopping(self, shutdown) -> None:
        if shutdown is not None:
            shutdown.result(30)
        if self._thread.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(10)


def make_config(**overrides: Any) -> ServerConfig:
    limit_fields = set(Limits.__dataclass_fields__)
    limits = Limits(**{k: v for k, v in overrides.items() if k in limit_fields})
    rest = {k: v for k, v in overrides.items() if k not in limit_fields}
    return replace(ServerConfig(port=0, ping_interval=5.0, ping_timeout=10.0), limits=limits, **rest)


def _module_marks(path: Path) -> set[str]:
    """The marks a test module gives all its tests (`pytestmark = pytest.mark.X` or a list of
    them), read from its source without importing it."""
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets):
            values = node.value.elts if isinstance(node.value, (ast.List, ast.Tuple)) else [node.value]
            marks = set()
            for value in values:
                value = value.func if isinstance(value, ast.Call) else value
                if isinstance(value, ast.Attribute):
                    marks.add(value.attr)
            return marks
    return set()


_made_kernel_cache: str | None = None


def pytest_configure(config: pytest.Config) -> None:
    """One directory of inductor's kernels for the whole run (`VOX_WS_KERNEL_CACHE`), made by
    the controller before its workers start, so they and every server the tests start inherit
    it: a test that compiles the step into a compile cache of its own still compiles and saves
    its graphs there, but the C++ of a kernel another test built already is not built again
    (minutes each on a 2-core machine)."""
    global _made_kernel_cache
    from vox_ws.engines.voxcpm.cache_trust import KERNEL_CACHE_ENV

    if hasattr(config, "workerinput") or os.environ.get(KERNEL_CACHE_ENV):
        return
    import tempfile

    _made_kernel_cache = os.environ[KERNEL_CACHE_ENV] = tempfile.mkdtemp(prefix="vox-ws-test-kernels-")


def pytest_unconfigure(config: pytest.Config) -> None:
    if _made_kernel_cache is not None:
        shutil.rmtree(_made_kernel_cache, ignore_errors=True)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """A module whose every test the lane's `-m` leaves out is not imported at all: the quick
    lane's two workers each imported LiveKit Agents and Pipecat (about 160 MB apiece) only to
    deselect their tests."""
    markexpr = config.getoption("markexpr")
    if not markexpr or collection_path.suffix != ".py" or not collection_path.name.startswith("test_"):
        return None
    marks = _module_marks(collection_path)
    if marks and not Expression.compile(markexpr).evaluate(marks.__contains__):
        return True
    return None


# A test that calls one of these starts a real server itself (a `vox-ws serve` process, or one in
# this process): it is end-to-end whatever its fixtures.
_STARTS_A_SERVER = re.compile(r"\b(start_serve|_spawn|VoxServer|run_server)\(")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """A test that needs a real redis-server is in the `replicas` lane, and one that talks to a
    real server over loopback in the `e2e` lane, wherever they live."""
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if "redis_server" in fixtures:
            item.add_marker(pytest.mark.replicas)
        function = getattr(item, "function", None)
        if fixtures & {"start_server", "shared_servers"} or \
                (function is not None and _STARTS_A_SERVER.search(inspect.getsource(function))):
            item.add_marker(pytest.mark.e2e)


# The lanes' markers (pyproject.toml): a test in none of them is the quick lane's.
LANE_MARKERS = ("browser", "frameworks", "replicas", "packaging", "hardening", "slow", "docs")
_lane_seconds: dict[str, list[float]] = {}


def _lane_of(keywords: Any) -> str:
    return next((marker for marker in LANE_MARKERS if marker in keywords), "quick")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each test's time (set-up, call, tear-down) under its lane; with xdist, on the controller,
    from every worker's reports."""
    seconds = _lane_seconds.setdefault(_lane_of(report.keywords), [0.0, 0])
    seconds[0] += report.duration
    if report.when == "call":
        seconds[1] += 1


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Where the run's time went, by lane: the sum of its tests' times, across the workers
    (CONTRIBUTING.md keeps the table)."""
    if not _lane_seconds or hasattr(terminalreporter.config, "workerinput"):
        return
    terminalreporter.section("time by lane (summed over the tests, all workers)")
    for lane, (seconds, tests) in sorted(_lane_seconds.items(), key=lambda item: -item[1][0]):
        terminalreporter.write_line(f"{lane:>12}: {seconds:8.1f} s over {int(tests)} tests")


class ServerFactory:
    """start(engine, **config_or_limits) -> a ready server; `stop_all` stops every one it started."""

    def __init__(self) -> None:
        self.servers: list[RunningServer] = []

    def __call__(self, engine: Engine, wait: bool = True, **overrides: Any) -> RunningServer:
        running = RunningServer(engine, make_config(**overrides))
        self.servers.append(running)
        if wait:
            running.wait_ready()
        return running

    def stop_all(self) -> None:
        self.stop_since(0)

    def stop_since(self, first: int) -> None:
        """Stop the servers started since the `first` (all at once: each waits out its own close
        grace, and they have a loop each)."""
        started, self.servers[first:] = self.servers[first:], []
        stopping = [(running, running.begin_stopping()) for running in started]
        for running, shutdown in stopping:
            running.finish_stopping(shutdown)


@pytest.fixture(scope="module")
def start_server() -> Callable[..., RunningServer]:
    """Factory: start_server(engine, **config_or_limits) -> a ready server, stopped (with its
    engine's worker processes) when the module's tests are done, not kept for the session: a
    full run would otherwise hold every server it started to its end. One a test starts in its
    own body stops when that test ends (`stops_the_servers_it_starts`)."""
    factory = ServerFactory()
    yield factory
    factory.stop_all()


@pytest.fixture(autouse=True)
def stops_the_servers_it_starts(request):
    """Stops, when a test ends, the servers it started itself (in its body or a function-scoped
    fixture); a module fixture's stay for the module, being set up before this (a wider scope
    first). Kept to the module's end, a module whose tests each start a server or two held them
    all at once (test_wyoming.py: 13 Piper workers), the quick lane's peak memory."""
    if "start_server" not in request.fixturenames:
        yield
        return
    factory = request.getfixturevalue("start_server")
    first = len(factory.servers)
    yield
    factory.stop_since(first)


class SharedServerFactory(ServerFactory):
    """A ServerFactory whose servers' processes (engine workers, decoders, the aligner's) are
    the session's: the per-module check below does not count them against the module that
    first asked. One aligner process starts with a server whose engine times no words itself,
    so a first stream's words wait for none; none for Piper, which times its own words and never
    asks. The others start as streams need them, as in production, and the check below asks the
    servers for them: each xdist worker holds these servers for the whole lane, and their idle
    aligners (two a server, 110-190 MB each) were a fifth of the quick lane's peak memory."""

    def __call__(self, engine: Engine, wait: bool = True, **overrides: Any) -> RunningServer:
        before = set(child_processes())
        running = super().__call__(engine, wait, **overrides)
        aligner = running.server.service.word_timings.aligner
        if aligner is not None:
            # The end waits for the words this long (10 s in production): the aligners run at a
            # lower priority, and a loaded test machine starves them past 10 s (words dropped).
            aligner.answer_within_s = WAIT_TIMEOUT
        if aligner is not None and not engine.word_timings:
            aligner.start(1)
        SESSION_PROCESSES.update(set(child_processes()) - before)
        SHARED_SERVERS.append(running)
        return running


@pytest.fixture(scope="session")
def shared_servers() -> Callable[..., RunningServer]:
    """The factory of the few servers every module may share (`piper_server`, `tiny_voxcpm`)."""
    factory = SharedServerFactory()
    yield factory
    factory.stop_all()


# Processes the session keeps (its shared servers'), and those Python keeps for itself.
SESSION_PROCESSES: set[int] = set()
SHARED_SERVERS: list[RunningServer] = []
_PYTHONS_OWN = ("multiprocessing.resource_tracker", "multiprocessing.forkserver")
# How long a module's processes have to exit once its fixtures have stopped them.
EXIT_WAIT_S = 20.0


def session_processes() -> set[int]:
    """The session's processes: those its shared servers started with them, and their aligners'
    started since, as streams needed them."""
    aligners = (running.server.service.word_timings.aligner for running in SHARED_SERVERS)
    return SESSION_PROCESSES | {pid for aligner in aligners if aligner is not None for pid in aligner.pids()}


def child_processes() -> dict[int, str]:
    """This test process's live descendants: pid -> command line."""
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            found[child.pid] = " ".join(child.cmdline())[:240]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


@pytest.fixture(scope="module", autouse=True)
def stops_what_it_starts(request):
    """Fails the module that leaves a process running (a server, an engine's worker, a VAE
    decoder, a redis-server...) once its own fixtures are done: a full run would otherwise hold
    everything every module started until its end. Set up before, so torn down after, every
    other module fixture."""
    before = set(child_processes())
    yield
    deadline = time.monotonic() + EXIT_WAIT_S
    while True:
        session = session_processes()
        left = {pid: command for pid, command in child_processes().items()
                if pid not in before and pid not in session and not any(p in command for p in _PYTHONS_OWN)}
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if left:
        pytest.fail(f"{request.module.__name__} left {len(left)} processes running: "
                    + "; ".join(f"{pid}: {command}" for pid, command in left.items()))


@pytest.fixture(scope="session")
def piper_server(shared_servers) -> RunningServer:
    from vox_ws.engines.piper import PiperEngine

    return shared_servers(PiperEngine(), slots=4, max_streams=4)


# ------------------------------------------------------------------------------ client


@dataclass
class StreamResult:
    id: str
    start: dict[str, Any] | None = None
    chunks: list[dict[str, Any]] = field(default_factory=list)
    end: dict[str, Any] | None = None
    error: dict[str, Any] | None = None

    def pcm(self) -> np.ndarray:
        fmt = self.start["format"]
        return np.concatenate([bytes_to_pcm(c["audio"], fmt) for c in self.chunks]) if self.chunks else np.zeros(0)

    @property
    def seconds(self) -> float:
        return len(self.pcm()) / self.start["sample_rate"]


class Client:
    """A real WebSocket client; keeps messages for other streams while waiting on one."""

    def __init__(self, ws: ClientConnection, hello: dict[str, Any]) -> None:
        self.ws = ws
        self.hello = hello
        self.pending: list[dict[str, Any]] = []
        self.log: list[tuple[str, Any]] = []   # (type, id) of every message, in arrival order

    async def send(self, message: dict[str, Any] | bytes | str) -> None:
        await self.ws.send(message if isinstance(message, (bytes, str)) else msgpack.packb(message, use_bin_type=True))

    async def _read(self, timeout: float) -> dict[str, Any]:
        message = msgpack.unpackb(await asyncio.wait_for(self.ws.recv(), timeout), raw=False)
        self.log.append((message.get("type"), message.get("id")))
        return message

    async def recv(self, timeout: float = RECV_TIMEOUT) -> dict[str, Any]:
        if self.pending:
            return self.pending.pop(0)
        return await self._read(timeout)

    async def recv_where(self, match: Callable[[dict[str, Any]], bool],
                         timeout: float = RECV_TIMEOUT) -> dict[str, Any]:
        """The next message that matches; others are kept for later calls."""
        for i, message in enumerate(self.pending):
            if match(message):
                return self.pending.pop(i)
        while True:
            message = await self._read(timeout)
            if match(message):
                return message
            self.pending.append(message)

    async def error(self, stream_id: str | None = None) -> dict[str, Any]:
        return await self.recv_where(lambda m: m["type"] == "error" and m.get("id") == stream_id)

    async def collect(self, stream_id: str, timeout: float = RECV_TIMEOUT) -> StreamResult:
        """Everything for one stream, from its `start` reply to its `end` or `error`."""
        result = StreamResult(stream_id)
        while True:
            message = await self.recv_where(lambda m: m.get("id") == stream_id, timeout)
            kind = message["type"]
            if kind == "start":
                result.start = message
            elif kind == "chunk":
                result.chunks.append(message)
            elif kind == "end":
                result.end = message
                return result
            elif kind == "error":
                result.error = message
                return result

    async def speak(self, text: str, stream_id: str = "s", **fields: Any) -> StreamResult:
        await self.send({"type": "start", "id": stream_id, "text": text, **fields})
        return await self.collect(stream_id)


class connect_client:
    """`async with connect_client(server) as client:` -> a Client that has read `hello`."""

    def __init__(self, server: RunningServer, **kwargs: Any) -> None:
        self._cm = connect(server.url, max_size=None, **kwargs)

    async def __aenter__(self) -> Client:
        ws = await self._cm.__aenter__()
        hello = msgpack.unpackb(await asyncio.wait_for(ws.recv(), RECV_TIMEOUT), raw=False)
        assert hello["type"] == "hello", hello
        return Client(ws, hello)

    async def __aexit__(self, *exc: Any) -> None:
        await self._cm.__aexit__(*exc)


def assert_good_stream(result: StreamResult, min_seconds: float = 0.3, reason: str = "done") -> None:
    assert result.error is None, result.error
    assert result.start is not None and result.end is not None
    assert result.end["reason"] == reason
    assert [c["seq"] for c in result.chunks] == list(range(len(result.chunks)))
    assert result.end["chunks"] == len(result.chunks)
    pcm = result.pcm()
    assert abs(result.end["audio_s"] - len(pcm) / result.start["sample_rate"]) < 1e-3
    assert result.seconds >= min_seconds, result.seconds
    assert float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) > 0.01, "audio is silent"
    assert np.all(np.isfinite(pcm))


# ------------------------------------------------------------------------------ tiny VoxCPM2


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """A random-weight VoxCPM2 in the real checkpoint layout; its stop head never stops, so
    every request runs to its length cap and lengths are deterministic."""
    from vox_ws.testing.tiny_voxcpm import build

    return build(tmp_path_factory.mktemp("tiny-voxcpm"), stop="never")


@pytest.fixture(scope="session")
def tiny_voxcpm(shared_servers, tiny_model) -> RunningServer:
    """One server on the tiny VoxCPM2 for the tests that only speak on it; its engine keeps the
    text of every request it was given (`server.engine.given`)."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    class Recording(VoxCPMEngine):
        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.given: list[str] = []

        def prefill_many(self, requests):
            self.given.extend(r.text for r in requests)
            return super().prefill_many(requests)

    return shared_servers(Recording(model=str(tiny_model), device="cpu", slots=2), slots=2)


def loaded_loop(engine, slots=4, max_queue=8):
    """An engine loop on `engine`, started and loaded (the caller stops it)."""
    from vox_ws.scheduling.loop import EngineLoop

    loop = EngineLoop(engine, slots=slots, max_queue=max_queue)
    loop.start()
    assert loop.ready_event.wait(120) and loop.status == "ready", loop.error
    return loop


class HostedEngine:
    """An engine served on a thread of this process behind its stand-in (`EngineProxy`), as a
    server serves an engine object: the stream service under test talks to `proxy` over the same
    socket and messages as to an engine process. The stand-in runs on an event loop of its own
    (its verbs are thread-safe), so one may serve every test of a module."""

    def __init__(self, engine: Engine, slots: int = 4, max_queue: int = 8, max_wait_s: float | None = None) -> None:
        from vox_ws.engine_process.launch import InProcess
        from vox_ws.engine_process.proxy import EngineProxy
        from vox_ws.engine_process.spec import LoopSettings

        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-engine-host", daemon=True)
        self._thread.start()
        self.launcher = InProcess(engine, LoopSettings(slots, max_queue, max_wait_s=max_wait_s))
        self.proxy = EngineProxy(self.launcher, engine.name, engine.options)

        async def start() -> None:
            self.proxy.start()

        asyncio.run_coroutine_threadsafe(start(), self.loop).result(30)
        assert self.proxy.ready_event.wait(WAIT_TIMEOUT) and self.proxy.status == "ready", self.proxy.error

    @property
    def engine_loop(self):
        """The engine's own loop, on its side of the boundary."""
        return self.launcher.host.loop

    def stop(self) -> None:
        self.proxy.stop(10.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)


@pytest.fixture(scope="module")
def voxcpm_loop(tiny_model):
    """The tiny VoxCPM2, loaded behind its stand-in, for a module's tests of the service on it."""
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine

    hosted = HostedEngine(VoxCPMEngine(model=str(tiny_model), device="cpu", slots=2), slots=2)
    yield hosted.proxy
    hosted.stop()


@pytest.fixture(scope="session")
def tiny_model_stops(tmp_path_factory):
    """The same, with a stop head that stops as soon as min_len allows."""
    from vox_ws.testing.tiny_voxcpm import build

    return build(tmp_path_factory.mktemp("tiny-voxcpm-stop"), stop="always")


async def wait_until(condition: Callable[[], Any], timeout: float = WAIT_TIMEOUT) -> None:
    """Until `condition()` is true, polled; fails as a hang after `timeout`."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, (
            f"not reached in {timeout:g}s: {getattr(condition, '__doc__', None) or condition}")
        await asyncio.sleep(0.01)


async def wait_idle(server: RunningServer, timeout: float = WAIT_TIMEOUT) -> dict[str, Any]:
    """/v1/info once the server has no stream open or generating, or as it was after `timeout`
    (the caller's assertion then says what was left)."""
    deadline = time.monotonic() + timeout
    while True:
        info = server.get("/v1/info")[1]
        if (info["streams_open"] == 0 and info["active"] == 0) or time.monotonic() >= deadline:
            return info
        await asyncio.sleep(0.01)


def start_serve(command: list[str], log_path, **popen_args: Any) -> tuple[subprocess.Popen, int]:
    """Runs `command` (a `vox-ws serve --port 0 ...`, its output to `log_path`) until its engine
    is ready; gives the process and the port it chose (from its "listening on" log line).
    Fails if it exits first, or as a hang after WAIT_TIMEOUT."""
    with open(log_path, "w") as log:             # the child keeps its own copy
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **popen_args)
    log_path = Path(log_path)
    deadline = time.monotonic() + WAIT_TIMEOUT
    port = None
    while port is None or not _is_ready(port):
        if proc.poll() is not None:
            raise AssertionError(f"vox-ws serve exited {proc.returncode}:\n{log_path.read_text()[-4000:]}")
        if time.monotonic() >= deadline:
            proc.kill()
            raise AssertionError(f"vox-ws serve not ready in {WAIT_TIMEOUT:g}s:\n{log_path.read_text()[-4000:]}")
        if port is None and (found := re.search(r"listening on ws://[^:]+:(\d+)/", log_path.read_text())):
            port = int(found.group(1))
        time.sleep(0.05)
    return proc, port


def _is_ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=30) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError):
        return False                             # 503 while loading (HTTPError is a URLError)


# ------------------------------------------------------------------------------ redis-server


class RedisServer:
    """A real redis-server (Debian's) on a loopback port, its data in a directory of its own
    (append-only file on: a restart keeps what was written)."""

    def __init__(self, directory: str) -> None:
        import socket as _socket

        with _socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.directory = directory
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc = None
        self.start()

    def start(self) -> None:
        import subprocess
        import time as _time

        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.directory,
             "--appendonly", "yes", "--appendfsync", "always", "--save", "", "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = _time.monotonic() + WAIT_TIMEOUT
        while _time.monotonic() < deadline:
            if self.ping():
                return
            _time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def ping(self) -> bool:
        import socket as _socket

        try:
            with _socket.create_connection(("127.0.0.1", self.port), timeout=1) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(20)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    import shutil

    if shutil.which("redis-server") is None:
        pytest.fail("redis-server is not installed (scripts/test.sh installs Debian's)")
    server = RedisServer(str(tmp_path_factory.mktemp("redis")))
    yield server
    server.stop()


def speak_rows(runner: Any, texts: list[str], timesteps: int = 10, max_len: int = 8) -> list[Any]:
    """Each text a request (seed: its index) through a `BatchedVoxCPM2` runner, all admitted at
    once, stepped to their ends: each one's audio."""
    import numpy as np

    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import PrefillInput

    rows = runner.prefill_many([PrefillInput(build_prompt(runner.model, text, None), seed=i, cfg_value=2.0,
                                             timesteps=timesteps, min_len=2, max_len=max_len)
                                for i, text in enumerate(texts)])
    audio: dict[int, list] = {i: [] for i in range(len(rows))}
    live = dict(enumerate(rows))
    while live:
        ids = list(live)
        for i, (chunk, reason) in zip(ids, runner.step([live[i] for i in ids])):
            if chunk is not None:
                audio[i].append(chunk)
            if reason is not None:
                runner.release(live.pop(i))
    return [np.concatenate(audio[i]) for i in range(len(rows))]


def tiny_runner(tiny_model: Any, slots: int, decode_process: bool = False) -> Any:
    """A `BatchedVoxCPM2` over a fresh load of the tiny model (each its own modules: a runner
    patches its VAE's convolutions)."""
    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    model = import_voxcpm().VoxCPM.from_pretrained(str(tiny_model), load_denoiser=False, optimize=False,
                                                   device="cpu").tts_model
    return BatchedVoxCPM2(model, slots=slots, decode_process=decode_process)


def eager_speech(tiny_model: Any, texts: list[str], slots: int, decode_process: bool = False) -> list[Any]:
    """`texts` spoken by an eager runner (`speak_rows`): what a compiled or captured step must equal."""
    runner = tiny_runner(tiny_model, slots, decode_process)
    try:
        return speak_rows(runner, texts)
    finally:
        runner.close()


def checkout_copy(into: Path) -> Path:
    """This tree as actions/checkout gives it: the files git knows (tracked, and new ones not
    ignored), without the venvs, builds and caches beside them here."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = REPO_ROOT / name
        if source.is_file() and not source.is_symlink():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, into / name)
    return into


@pytest.fixture
def hub_client(monkeypatch, tmp_path) -> Callable[[str], None]:
    """huggingface_hub in this process online (telemetry off: it asks the hub nothing of its own),
    its home a tmp dir, pointed at the hub the test runs on loopback by `hub_client(url)`, as
    HF_ENDPOINT points a process started with it (huggingface_hub makes its file URLs' template
    from it once, at import)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_TELEMETRY", True)
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))

    def point_at(url: str) -> None:
        monkeypatch.setattr(constants, "ENDPOINT", url)
        monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")

    return point_at


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """The hub's address; it serves openbmb/VoxCPM2 (main, and a tag `v2` with a changed
    config), and rhasspy/piper-voices holding one voice, en_GB-test-medium, laid out as that
    repository lays out its voices (the bundled joe's model, a config naming en_GB), two
    hostile ones (en_US-evil-medium, en_US-huge-medium: their configs), and its catalogue,
    voices.json, in that repository's format (`catalogue_entry`): the test voice; en_GB-liar-medium,
    a good voice whose model the catalogue says is 1,000 bytes; de_DE-absent-low, listed and not
    there; and one entry that is no voice's. For tests/test_models.py and test_voice_fetches.py."""
    from helpers import OLAH, catalogue_entry, git  # here: helpers imports this module
    from vox_ws.testing.tiny_voxcpm import build

    if not OLAH.exists():
        pytest.fail(f"{OLAH} missing: scripts/test.sh installs it (Olah, the hub mirror)")
    root = tmp_path_factory.mktemp("hub")
    repo = build(root / "mirrors" / "models" / "openbmb" / "VoxCPM2")
    git(repo, "init", "-q", "-b", "main")
    git(repo, "add", "-A")
    git(repo, "commit", "-qm", "tiny VoxCPM2")
    config = json.loads((repo / "config.json").read_text())
    config["max_length"] = 4096
    (repo / "config.json").write_text(json.dumps(config, indent=2))
    git(repo, "commit", "-qam", "max_length 4096")
    git(repo, "tag", "v2")
    git(repo, "reset", "-q", "--hard", "HEAD~1")           # main: the first commit
    from vox_ws.engines.piper_voices import bundled

    joe = bundled()
    voices = root / "mirrors" / "models" / "rhasspy" / "piper-voices"
    folder = voices / "en" / "en_GB" / "test" / "medium"
    folder.mkdir(parents=True)
    shutil.copyfile(joe.model_path, folder / "en_GB-test-medium.onnx")
    config = json.loads(Path(joe.config_path).read_text())
    config["language"] = {**config["language"], "code": "en_GB"}
    (folder / "en_GB-test-medium.onnx.json").write_text(json.dumps(config))
    # A hostile hub's voices: a config of 200,000 nested arrays (130 KB), one over its 1 MiB bound.
    for dataset, hostile in (("evil", b"[" * 200_000 + b"]" * 200_000),
                             ("huge", json.dumps({**config, "pad": "x" * (2 << 20)}).encode())):
        folder = voices / "en" / "en_US" / dataset / "medium"
        folder.mkdir(parents=True)
        shutil.copyfile(joe.model_path, folder / f"en_US-{dataset}-medium.onnx")
        (folder / f"en_US-{dataset}-medium.onnx.json").write_bytes(hostile)
    folder = voices / "en" / "en_GB" / "liar" / "medium"
    folder.mkdir(parents=True)
    shutil.copyfile(joe.model_path, folder / "en_GB-liar-medium.onnx")
    (folder / "en_GB-liar-medium.onnx.json").write_text(json.dumps(config))
    catalogue = {name: catalogue_entry(voices, name)
                 for name in ("en_GB-test-medium", "en_GB-liar-medium", "de_DE-absent-low")}
    liar = catalogue["en_GB-liar-medium"]["files"]
    liar["en/en_GB/liar/medium/en_GB-liar-medium.onnx"]["size_bytes"] = 1000
    catalogue["_README"] = {"note": "no voice"}
    (voices / "voices.json").write_text(json.dumps(catalogue, indent=4))
    git(voices, "init", "-q", "-b", "main")
    git(voices, "add", "-A")
    git(voices, "commit", "-qm", "one voice")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (root / "olah.toml").write_text(f"""
[basic]
host = "127.0.0.1"
port = {port}
mirror-netloc = "127.0.0.1:{port}"
mirror-lfs-netloc = "127.0.0.1:{port}"
repos-path = "{root / 'repos'}"
mirrors-path = ["{root / 'mirrors'}"]
[accessibility]
offline = true
""")
    process = subprocess.Popen([str(OLAH), "-c", "olah.toml"], cwd=root, stdout=subprocess.DEVNULL,
                               stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, "the hub mirror exited"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the hub mirror never listened"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
