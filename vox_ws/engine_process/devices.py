"""Several engines in one server: one engine process (one engine, one copy of the model) per
device, or several per device (`--engines-per-device`, for CUDA MPS), each with its stand-in
(`proxy.EngineProxy`).

    stream service ──open──▶ Devices.place() ──▶ the engine with the most free slots
                                                  (its open streams against its slots)
                   ──voices, LoRA──▶ every engine

A stream stays on the engine it was placed on (its requests, its continuation, its voice pin
belong to that engine). Each engine loads, steps and may fail on its own; one that fails is
taken out of placement while it is started again (its streams got `unavailable`), and the
others go on; the server is ready while one engine is. `Devices` answers the questions a single
engine answers (status, stats, readiness) for the whole set.

Each engine process sees its GPU as `cuda:0` (`CUDA_VISIBLE_DEVICES` set to that one GPU): the
compiled graphs one process writes into `--compile-cache` name device 0, and so serve every
other (inductor writes a graph's device index into its code and its cache key).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

from ..config import ServerConfig
from ..engine import Engine, Readiness, Refused
from ..engines import plugins
from ..scheduling.loop import not_ready
from .placement import placed
from .proxy import EngineProxy
from .spec import EngineSpec, LoopSettings

# How long counting the GPUs (a process that imports torch) may take.
COUNT_TIMEOUT_S = 120.0


def parse_devices(spec: str, count: Callable[[], int] | None = None) -> list[str]:
    """`--device`: one device ("auto", "cpu", "cuda:1"), several ("cuda:0,cuda:1", "cpu,cpu"),
    or every CUDA device ("cuda:all": counted by `count`, by default in a process of its own,
    this one never importing torch)."""
    devices = [d.strip() for d in spec.split(",") if d.strip()] or ["auto"]
    if "cuda:all" in devices:
        if devices != ["cuda:all"]:
            raise ValueError("--device cuda:all stands alone")
        found = (count or cuda_device_count)()
        if found == 0:
            raise ValueError("--device cuda:all: no CUDA device is visible")
        devices = [f"cuda:{i}" for i in range(found)]
    return devices


def cuda_device_count() -> int:
    """The CUDA devices torch sees, asked of a process of its own (this one has no torch)."""
    try:
        done = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                              capture_output=True, text=True, timeout=COUNT_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ValueError(f"--device cuda:all: the GPUs could not be counted ({exc})") from None
    if done.returncode != 0:
        if "No module named 'torch'" in done.stderr:
            raise ValueError("--device cuda:all needs torch")
        raise ValueError(f"--device cuda:all: the GPUs could not be counted: {done.stderr.strip()[-300:]}")
    return int(done.stdout.strip() or 0)


def seen_as(device: str, visible: str | None = None) -> tuple[str, dict[str, str]]:
    """How an engine process on `device` sees it, and the environment that makes it so: a CUDA
    device as `cuda:0`, the one GPU its `CUDA_VISIBLE_DEVICES` leaves (the N-th of the server's
    own list where it has one); any other as it is."""
    if not device.startswith("cuda"):
        return device, {}
    index = int(device.partition(":")[2] or 0)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    listed = [v.strip() for v in visible.split(",") if v.strip()] if visible else []
    if listed and index >= len(listed):
        raise ValueError(f"--device {device}: CUDA_VISIBLE_DEVICES={visible} has {len(listed)} device(s)")
    return "cuda:0", {"CUDA_VISIBLE_DEVICES": listed[index] if listed else str(index)}


def engine_specs(config: ServerConfig, devices: list[str],
                 log_setup: Callable[[], None] | None = None) -> tuple[list[EngineSpec], list[int] | None]:
    """One engine process's spec for each device (`--engines-per-device` each), and the CPUs the
    server keeps where they are pinned (`placement.py`; None: not pinned)."""
    plugin = plugins().get(config.engine)
    on = [device for device in devices for _ in range(max(1, config.engines_per_device))]
    server_cpus, engine_cpus = placed(len(on), config.engine_cpus)
    limits = config.limits
    loop = LoopSettings(config.slots, limits.max_queue, config.max_share, limits.max_queue_wait_s)
    specs = []
    for index, device in enumerate(on):
        seen, env = seen_as(device)
        specs.append(EngineSpec(config.engine, {**config.engine_options(), "device": seen}, device, loop, env,
                                engine_cpus[index] if engine_cpus else None, log_setup,
                                plugin.preload if plugin is not None else ()))
    return specs, server_cpus


class Devices:
    def __init__(self, loops: list[EngineProxy]) -> None:
        if not loops:
            raise ValueError("at least one engine loop")
        self.loops = loops
        self._placed: Counter[int] = Counter()          # open streams per loop (by index)
        self.ready_event = threading.Event()
        self._waiter = threading.Thread(target=self._wait_loaded, name="vox-ws-devices", daemon=True)

    # ------------------------------------------------------------------ the set as one

    @property
    def ready(self) -> list[EngineProxy]:
        """The loops of the devices that serve now."""
        return [s for s in self.loops if s.status == Readiness.READY]

    @property
    def engine(self) -> Engine:
        """The engine that speaks for all (every device serves the same model and options)."""
        ready = self.ready
        return (ready[0] if ready else self.loops[0]).engine

    @property
    def engines(self) -> list[Engine]:
        return [s.engine for s in self.loops]

    @property
    def status(self) -> Readiness:
        """Ready while one device is; loading while one loads and none is ready (compiling while
        every one still loading is compiling its step); else failed.
        The model's readiness: the rest of the server asks this."""
        statuses = {s.status for s in self.loops}
        if Readiness.READY in statuses:
            return Readiness.READY
        loading = [s for s in self.loops if s.status == Readiness.LOADING]
        if loading and all(s.engine.loading_phase == "compiling" for s in loading):
            return Readiness.COMPILING
        return Readiness.LOADING if loading else Readiness.FAILED

    @property
    def error(self) -> str | None:
        errors = [f"{s.engine.device}: {s.error}" for s in self.loops if s.error]
        return "; ".join(errors) or None

    @property
    def slots(self) -> int:
        """KV slots, all devices together: streams generated at once."""
        return sum(s.slots or 0 for s in self.loops)

    @property
    def step_rows(self) -> int:
        """Rows one step carries, all devices together (at most their slots)."""
        return sum(s.step_rows for s in self.loops)

    def start(self) -> None:
        """Start every engine (on the event loop that serves)."""
        for loop in self.loops:
            loop.start()
        self._waiter.start()

    async def created(self) -> None:
        """Until every engine is built (they then load); ValueError for the first whose
        settings could not build it."""
        for loop in self.loops:
            await loop.created()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop every loop and close its engine within `timeout` seconds, all at once: each
        engine's helper processes have the same time to end, not what the one before left."""
        deadline = time.monotonic() + timeout
        for loop in self.loops:
            loop.stop(deadline=deadline, wait=False)
        for loop in self.loops:
            loop.stop(deadline=deadline)

    def _wait_loaded(self) -> None:
        for loop in self.loops:
            loop.ready_event.wait()
        self.ready_event.set()

    def stats(self) -> dict[str, Any]:
        """The totals, and each device's own figures under `devices`."""
        each = [{"device": s.engine.device, **s.stats()} for s in self.loops]
        ready = [d for d in each if d["status"] == Readiness.READY]
        return {
            "status": self.status,
            "active": sum(d["active"] for d in each),
            "queued": sum(d["queued"] for d in each),
            "slots": sum(d["slots"] for d in ready) if ready else self.slots,
            "step_rows": sum(d["step_rows"] for d in ready) if ready else self.step_rows,
            "max_queue": sum(d["max_queue"] for d in each),
            "parked": sum(d["parked"] for d in each),
            "steps_total": sum(d["steps_total"] for d in each),
            "last_step_ms": max(d["last_step_ms"] for d in each),
            "mean_step_ms": round(sum(d["mean_step_ms"] for d in ready) / len(ready), 3) if ready else 0.0,
            "last_batch_size": max(d["last_batch_size"] for d in each),
            "slots_reason": "; ".join(sorted({d["slots_reason"] for d in each})),
            # How `--slots auto` measured the engine's speed (Piper: one device), the first
            # device's that measures; each device's under `devices`.
            "slots_measure": next((d["slots_measure"] for d in each if d["slots_measure"]), None),
            "devices": [{**d, "streams_open": self._placed[i]} for i, d in enumerate(each)],
        }

    # ------------------------------------------------------------------ placement

    def place(self) -> EngineProxy:
        """The ready loop with the most free slots (open streams against its slots; the
        first among equals). Call `release` when the stream ends."""
        best, best_free = None, None
        for index, loop in enumerate(self.loops):
            if loop.status != Readiness.READY:
                continue
            slots = loop.slots or 1
            free = (slots - self._placed[index]) / slots
            if best_free is None or free > best_free:
                best, best_free = index, free
        if best is None:
            raise self.not_ready()
        self._placed[best] += 1
        return self.loops[best]

    def not_ready(self) -> Refused:
        """The refusal of work while no device is ready, with a retry hint while one loads."""
        return not_ready(self.status, self.error)

    def release(self, loop: EngineProxy) -> None:
        index = self.loops.index(loop)
        self._placed[index] = max(0, self._placed[index] - 1)

    # ------------------------------------------------------------------ on every device

    def call_each(self, fn: Callable[[Engine], Any], loops: list[EngineProxy] | None = None) -> list[Future]:
        """Run `fn(engine)` on each device's loop thread (`loops`; default: every ready
        one), between two of its steps: a future for each."""
        return [s.call(lambda engine=s.engine: fn(engine)) for s in (self.ready if loops is None else loops)]
