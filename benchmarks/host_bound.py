"""What the server's own work costs a device's step: the simulated GPU engine's step period and
the time inside its step, alone and under many listeners, with the engine in a process of its
own and with the engine on a thread of the server's process.

The engine is `examples/simulated-gpu` (installed here, as any other package's engine is, into a
folder of this run's): its step launches 300 small torch operations (each releases the GIL and
takes it back, as a CUDA launch does), then waits 20 ms with the GIL released (a thread waiting
on the device), and copies every row's 160 ms of 48 kHz float32 audio out of the batch; it
steps every row at once (64) and writes each step's start, time inside and period to a trace
file, read here per phase.

Each run starts a server per mode:

    process   `vox-ws serve --engine simulated-gpu`: the engine in a process of its own (the default)
    thread    the same configuration (`config_from_args` of the same options) served by a small
              script: `VoxServer(config, engine)` with the engine object, which the server serves
              on a thread of its own process (`InProcess`) through the same messages
    pre-69    (`--before-tree DIR`: a checkout of the tree before issue 69, e.g.
              `git archive c96cb3a^ | tar -x -C DIR`) the same script on that tree: the engine
              loop on a thread of the server's process, its sinks called on that thread

and three phases, each with its own client process (asyncio, vox-ws's v1 client):

    alone     the probe: two streams on one connection, raw f32, read as fast as they come (no
              pacing), started again as each ends, so that the engine has a row at every turn
    opus      the probe and N listeners (64), one connection each, Opus, each reading as fast as
              the server sends (as issue 69 measured: the server encodes as much as it can, a
              stream's steps skipped while 10 s of its audio wait untaken); a listener's next
              stream starts as one ends. `--lookahead-s 2`: listeners at a player's pace instead
              (the server sends each at most that far ahead of real time)
    f32       the same with raw float32 listeners

For each phase: the steps whose start falls in its measured window (after a warm-up): the period
(start to start) and the time inside the step, p50, p95, mean; the rows a step carried; the
means of `/metrics` `voxws_step_seconds` and `voxws_step_period_seconds` over the window (the
engine loop's own figures, which the trace should agree with); the machine's CPU busy
(/proc/stat) and the CPU of the server process, its children (the engine process, its fork
server) and the clients; the load average at the window's start. Figures in milliseconds.

    python -m benchmarks.host_bound --runs 3 --json docs/bench-host-bound.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from . import ROOT, free_port, module_command, stop_server

PROBE_STREAMS = 2
PROBE_TEXT_CHARS = 2000          # 120 s of audio a probe stream: about 19 s of steps
LISTENER_TEXT_CHARS = (250, 420)  # 15-25 s of audio a listener's stream, so their ends spread out
READY_WITHIN_S = 120.0
WORDS = ("the quick brown fox jumps over a lazy dog while seven hungry whales sing in the deep "
         "blue sea and nobody minds the noise at all").split()

# The in-thread server: the same options parsed by the tree's own command line, the engine built
# by its registry (registered by hand: a tree before issue 69 reads no entry points, nor knows a
# plugin's `preload`) and served by `VoxServer(config, engine)` (benchmarks/_transport_server.py of
# that tree).
SERVE_IN_THREAD = """
import dataclasses
import sys
from vox_ws import engines
if "preload" not in {field.name for field in dataclasses.fields(engines.EnginePlugin)}:
    plugin_before_issue_69 = engines.EnginePlugin
    engines.EnginePlugin = lambda preload=(), **fields: plugin_before_issue_69(**fields)
import vox_ws_simulated_gpu
engines.register(vox_ws_simulated_gpu.PLUGIN)
from vox_ws.commands.cli import build_parser, config_from_args
from benchmarks._transport_server import run_server
config = config_from_args(build_parser().parse_args(["serve", *sys.argv[1:]]))
run_server(engines.create_engine(config.engine, config.engine_options()), config.port, config)
"""


# ------------------------------------------------------------------------------ the clients' process


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    while sum(len(w) + 1 for w in words) < chars:
        words.append(rng.choice(WORDS))
    return " ".join(words).capitalize() + "."


async def _speak_again_and_again(url: str, speech: dict[str, Any], chars: tuple[int, int], seed: int,
                                 figures: dict[str, Any], streams: int = 1) -> None:
    """One connection speaking `streams` streams at a time, each started again as it ends, until
    cancelled: its audio bytes, streams ended, errors by code."""
    from vox_ws.clients.v1 import VoxError, connect

    rng = random.Random(seed)

    async def one_after_another(client: Any) -> None:
        while True:
            try:
                stream = await client.start_stream(_text(rng, rng.randint(*chars)), **speech)
                async for chunk in stream:
                    figures["bytes"] += len(chunk)
                figures["streams"] += 1
            except VoxError as err:
                figures["errors"][err.code] = figures["errors"].get(err.code, 0) + 1
                await asyncio.sleep(0.5)

    async with connect(url) as client:
        await asyncio.gather(*(one_after_another(client) for _ in range(streams)))


async def _clients(url: str, listeners: int, fmt: str, lookahead_s: float | None) -> dict[str, Any]:
    probe = {"bytes": 0, "streams": 0, "errors": {}}
    heard = {"bytes": 0, "streams": 0, "errors": {}}
    probing = _speak_again_and_again(url, {"format": "f32"}, (PROBE_TEXT_CHARS,) * 2, 0, probe, PROBE_STREAMS)
    tasks = [asyncio.create_task(probing)]
    speech = {"format": fmt, **({"lookahead_s": lookahead_s} if lookahead_s else {})}
    tasks += [asyncio.create_task(_speak_again_and_again(url, speech, LISTENER_TEXT_CHARS, 1 + n, heard))
              for n in range(listeners)]
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    # A stream cancelled while it waits for its start leaves the connection's close to a future
    # nobody reads any more: nothing to report.
    asyncio.get_running_loop().set_exception_handler(lambda loop, context: None)
    for task in tasks:
        task.cancel()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    failed = [repr(r) for r in results
              if isinstance(r, BaseException) and not isinstance(r, asyncio.CancelledError)]
    return {"probe": probe, "listeners": heard, "failed": failed}


def run_clients(url: str, listeners: int, fmt: str, lookahead_s: float | None) -> None:
    """The clients' process: until SIGTERM, then its figures as one JSON line."""
    try:
        import uvloop
    except ImportError:
        figures = asyncio.run(_clients(url, listeners, fmt, lookahead_s))
    else:
        figures = uvloop.run(_clients(url, listeners, fmt, lookahead_s))
    print(json.dumps(figures), flush=True)


# ------------------------------------------------------------------------------ a server, measured


def install_engine(folder: Path) -> Path:
    """examples/simulated-gpu built and installed into `folder`/site (a copy built: pip builds a
    folder in place); the folder to put on PYTHONPATH."""
    source = shutil.copytree(ROOT / "examples" / "simulated-gpu", folder / "simulated-gpu")
    site = folder / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(source)], check=True)
    return site


@dataclass
class Server:
    mode: str
    proc: subprocess.Popen
    port: int
    trace: Path

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=30) as response:
            return response.read()

    def info(self) -> dict[str, Any]:
        return json.loads(self.get("/v1/info"))

    def metrics(self) -> dict[str, float]:
        """The step figures' sums and counts (`voxws_step_seconds`, `voxws_step_period_seconds`)."""
        text = self.get("/metrics").decode()
        found = {}
        for name in ("voxws_step_seconds", "voxws_step_period_seconds"):
            for part in ("sum", "count"):
                match = re.search(rf"^{name}_{part} ([0-9.e+-]+)$", text, re.M)
                found[f"{name}_{part}"] = float(match.group(1)) if match else float("nan")
        return found

    def engine_pid(self) -> int | None:
        """The engine process's (None: the engine runs in the server's process)."""
        devices = self.info().get("devices") or [{}]
        pid = devices[0].get("pid")
        return pid if pid and pid != self.proc.pid else None


def start_server(mode: str, site: Path, work: Path, listeners: int, before_tree: Path | None) -> Server:
    port = free_port()
    trace = work / f"{mode}-{time.monotonic_ns()}.trace"
    options = ["--engine", "simulated-gpu", "--port", str(port), "--slots", str(listeners + PROBE_STREAMS),
               "--max-connections-per-address", str(4 * listeners + 16), "--voice-store", "memory",
               "--simulated-gpu-trace", str(trace), "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(site)}
    if mode == "process":
        command, cwd = [sys.executable, "-m", "vox_ws", "serve", *options], ROOT
    else:
        cwd = before_tree if mode == "pre-69" else ROOT
        command = [sys.executable, "-c", SERVE_IN_THREAD, *options]
        env["PYTHONPATH"] = os.pathsep.join([str(cwd), str(site)])
    proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.DEVNULL)
    server = Server(mode, proc, port, trace)
    deadline = time.monotonic() + READY_WITHIN_S
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the {mode} server exited {proc.returncode}")
        try:
            if json.loads(server.get("/readyz")).get("status") == "ready":
                return server
        except OSError:
            pass
        if time.monotonic() > deadline:
            stop_server(proc)
            raise RuntimeError(f"the {mode} server was not ready in {READY_WITHIN_S:g} s")
        time.sleep(0.2)


def _cpu_seconds(pid: int | None, children: bool = False) -> float:
    if pid is None:
        return 0.0
    try:
        process = psutil.Process(pid)
        processes = [process, *process.children(recursive=True)] if children else [process]
        return sum(p.cpu_times().user + p.cpu_times().system for p in processes)
    except psutil.NoSuchProcess:
        return 0.0


def _machine() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat)."""
    with open("/proc/stat") as f:
        values = [float(v) for v in f.readline().split()[1:]]
    idle = values[3] + values[4]
    return sum(values) - idle, sum(values)


@dataclass
class Sample:
    at: float
    machine: tuple[float, float]
    server_s: float
    children_s: float
    clients_s: float
    metrics: dict[str, float]


def _sample(server: Server, clients: subprocess.Popen) -> Sample:
    return Sample(time.monotonic(), _machine(), _cpu_seconds(server.proc.pid),
                  _cpu_seconds(server.proc.pid, children=True) - _cpu_seconds(server.proc.pid),
                  _cpu_seconds(clients.pid), server.metrics())


def _steps(trace: Path, since: float, until: float) -> np.ndarray:
    """The trace's steps that began in [since, until): rows of (start, inside, period, rows,
    launches, wait)."""
    steps = [[float(v) for v in line.split()] for line in trace.read_text().splitlines() if line.strip()]
    table = np.array(steps or np.zeros((0, 6)))
    return table[(table[:, 0] >= since) & (table[:, 0] < until)] if len(table) else table


def _ms(values: np.ndarray) -> dict[str, float | None]:
    values = values[np.isfinite(values)]
    if not len(values):
        return {"p50": None, "p95": None, "mean": None}
    return {"p50": round(float(np.percentile(values, 50)) * 1000, 2),
            "p95": round(float(np.percentile(values, 95)) * 1000, 2),
            "mean": round(float(np.mean(values)) * 1000, 2)}


def measure_phase(server: Server, phase: str, args: argparse.Namespace) -> dict[str, Any]:
    fmt = {"alone": "f32", "opus": "opus", "f32": "f32"}[phase]
    count = 0 if phase == "alone" else args.listeners
    warm_up_s, measure_s = (args.warm_up_alone, args.measure_alone) if phase == "alone" else \
        (args.warm_up, args.measure)
    pace = ["--lookahead-s", str(args.lookahead_s)] if args.lookahead_s else []
    url = f"ws://127.0.0.1:{server.port}/v1/stream"
    clients = subprocess.Popen(module_command("host_bound", "--clients", url, "--listeners", str(count),
                                              "--format", fmt, *pace),
                               cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        time.sleep(warm_up_s)
        load = os.getloadavg()
        first = _sample(server, clients)
        time.sleep(measure_s)
        last = _sample(server, clients)
    finally:
        clients.send_signal(signal.SIGTERM)
        out, _ = clients.communicate(timeout=60)
    heard = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    _wait_idle(server)
    wall = last.at - first.at
    steps = _steps(server.trace, first.at, last.at)
    busy = (last.machine[0] - first.machine[0]) / max(1.0, last.machine[1] - first.machine[1])
    metric = {name: last.metrics[name] - first.metrics[name] for name in first.metrics}

    def metric_mean(name: str) -> float | None:
        n = metric[f"{name}_count"]
        return round(metric[f"{name}_sum"] / n * 1000, 2) if n > 0 else None

    return {
        "phase": phase, "listeners": count, "format": fmt, "window_s": round(wall, 1),
        "load_average": [round(x, 2) for x in load],
        "steps": int(len(steps)),
        "rows_per_step": round(float(steps[:, 3].mean()), 1) if len(steps) else None,
        "period_ms": _ms(steps[:, 2]), "inside_ms": _ms(steps[:, 1]),
        "launches_ms": _ms(steps[:, 4]), "wait_ms": _ms(steps[:, 5]),
        "metrics_mean_ms": {"step": metric_mean("voxws_step_seconds"),
                            "period": metric_mean("voxws_step_period_seconds")},
        "cpu_busy": round(busy, 3),
        "cpu_cores": {"server": round((last.server_s - first.server_s) / wall, 3),
                      "engine_process": round((last.children_s - first.children_s) / wall, 3),
                      "clients": round((last.clients_s - first.clients_s) / wall, 3)},
        "clients": heard,
    }


def _wait_idle(server: Server, within_s: float = 60.0) -> None:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        info = server.info()
        if info["streams_open"] == 0 and info["active"] == 0:
            return
        time.sleep(0.2)


def run_mode(mode: str, site: Path, work: Path, args: argparse.Namespace) -> dict[str, Any]:
    server = start_server(mode, site, work, args.listeners, args.before_tree)
    try:
        phases = [measure_phase(server, phase, args) for phase in args.phases.split(",")]
        engine = server.engine_pid()
    finally:
        stop_server(server.proc)
    alone = phases[0]
    for phase in phases[1:]:
        phase["ratio_to_alone"] = {
            "period_p50": _ratio(phase["period_ms"]["p50"], alone["period_ms"]["p50"]),
            "period_p95": _ratio(phase["period_ms"]["p95"], alone["period_ms"]["p95"]),
            "inside_p50": _ratio(phase["inside_ms"]["p50"], alone["inside_ms"]["p50"])}
    return {"mode": mode, "engine_in_own_process": engine is not None, "phases": phases}


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


# ------------------------------------------------------------------------------ the report


def summary(runs: list[dict[str, Any]], modes: list[str]) -> list[dict[str, Any]]:
    """Per mode and phase, the median over the runs of each figure."""
    rows = []
    for mode in modes:
        measured = [r for r in runs if r["mode"] == mode]
        for n, phase in enumerate(measured[0]["phases"]):
            same = [r["phases"][n] for r in measured]

            def median(*path: str) -> float | None:
                values = []
                for p in same:
                    value: Any = p
                    for key in path:
                        value = value.get(key) if isinstance(value, dict) else None
                    if value is not None:
                        values.append(value)
                return round(float(np.median(values)), 3) if values else None

            rows.append({"mode": mode, "phase": phase["phase"], "runs": len(same),
                         "period_p50": median("period_ms", "p50"), "period_p95": median("period_ms", "p95"),
                         "inside_p50": median("inside_ms", "p50"), "inside_p95": median("inside_ms", "p95"),
                         "metrics_step": median("metrics_mean_ms", "step"),
                         "metrics_period": median("metrics_mean_ms", "period"),
                         "rows": median("rows_per_step"), "cpu_busy": median("cpu_busy"),
                         "server_cores": median("cpu_cores", "server"),
                         "engine_cores": median("cpu_cores", "engine_process"),
                         "clients_cores": median("cpu_cores", "clients"),
                         "x_period_p50": median("ratio_to_alone", "period_p50"),
                         "x_period_p95": median("ratio_to_alone", "period_p95"),
                         "x_inside_p50": median("ratio_to_alone", "inside_p50")})
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def x(value: float | None) -> str:
        return f" (x{value:.2f})" if value is not None else ""

    print("| engine | clients | period p50 | p95 | inside the step p50 | p95 | rows/step | CPU busy | "
          "server / engine process / clients (cores) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        clients = {"alone": "the probe alone", "opus": "+ 64 Opus listeners", "f32": "+ 64 raw f32 listeners"}
        print(f"| {row['mode']} | {clients[row['phase']]} | {row['period_p50']} ms{x(row['x_period_p50'])} | "
              f"{row['period_p95']} ms{x(row['x_period_p95'])} | "
              f"{row['inside_p50']} ms{x(row['x_inside_p50'])} | "
              f"{row['inside_p95']} ms | {row['rows']} | {row['cpu_busy'] * 100:.0f} % | "
              f"{row['server_cores']} / {row['engine_cores']} / {row['clients_cores']} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3, help="each mode this many times, the modes in turn")
    parser.add_argument("--modes", default="process,thread",
                        help="process, thread, pre-69 (with --before-tree)")
    parser.add_argument("--before-tree", type=Path, help="a checkout of the tree before issue 69, for pre-69")
    parser.add_argument("--phases", default="alone,opus,f32", help="alone (first: the others' ratios are to it), "
                                                                  "opus, f32")
    parser.add_argument("--listeners", type=int, default=64)
    parser.add_argument("--lookahead-s", type=float,
                        help="listeners at a player's pace: the server sends each stream at most this far "
                             "ahead of real time")
    parser.add_argument("--warm-up-alone", type=float, default=4.0)
    parser.add_argument("--measure-alone", type=float, default=15.0)
    parser.add_argument("--warm-up", type=float, default=8.0, help="seconds before a loaded phase's window")
    parser.add_argument("--measure", type=float, default=20.0, help="a loaded phase's measured seconds")
    parser.add_argument("--json", help="write every run's figures and the medians here")
    parser.add_argument("--clients", metavar="URL", help=argparse.SUPPRESS)
    parser.add_argument("--format", default="opus", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.clients:
        run_clients(args.clients, args.listeners, args.format, args.lookahead_s)
        return 0
    modes = args.modes.split(",")
    if "pre-69" in modes and args.before_tree is None:
        parser.error("pre-69 needs --before-tree")
    runs = []
    with tempfile.TemporaryDirectory(prefix="host-bound-") as folder:
        work = Path(folder)
        site = install_engine(work)
        for run in range(args.runs):
            for mode in modes if run % 2 == 0 else modes[::-1]:
                print(f"run {run + 1}, {mode}: load average {os.getloadavg()[0]:.2f}", flush=True)
                result = run_mode(mode, site, work, args)
                result["run"] = run + 1
                runs.append(result)
                for phase in result["phases"]:
                    period, inside = phase["period_ms"], phase["inside_ms"]
                    print(f"  {phase['phase']:5s} period p50 {period['p50']} p95 {period['p95']} "
                          f"inside p50 {inside['p50']} p95 {inside['p95']} ms (launches p50 "
                          f"{phase['launches_ms']['p50']} p95 {phase['launches_ms']['p95']}, wait p50 "
                          f"{phase['wait_ms']['p50']} p95 {phase['wait_ms']['p95']}), rows {phase['rows_per_step']}, "
                          f"CPU {phase['cpu_busy'] * 100:.0f} %, load {phase['load_average'][0]}, "
                          f"errors {phase['clients'].get('listeners', {}).get('errors')}", flush=True)
    rows = summary(runs, modes)
    print_table(rows)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"command": "python -m benchmarks.host_bound " + " ".join(argv or sys.argv[1:]),
                       "cpus": os.cpu_count(), "medians": rows, "runs": runs}, out, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
