"""Several devices in one server: one engine loop (one engine, one copy of the model) per device.

    stream service ──open──▶ Devices.place() ──▶ the engine loop with the most free slots
                                                  (its open streams against its slots)
                   ──voices, LoRA──▶ every engine loop

A stream stays on the device it was placed on (its requests, its continuation, its voice pin
belong to that engine). Each device's engine loads, steps and may fail on its own thread (each
thread on its own device: `accelerator.enter_device`, so nothing of one device runs on
another's stream); a device that fails is taken out of placement (its streams got
`unavailable`, or `internal` where its thread crashed), and the others go on; the server is
ready while one device is. `Devices` answers the questions a single
engine loop answers (status, stats, readiness) for the whole set.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from concurrent.futures import Future
from typing import Any, Callable

from ..engine import Engine, Readiness, Refused
from .loop import EngineLoop, not_ready


def parse_devices(spec: str) -> list[str]:
    """`--device`: one device ("auto", "cpu", "cuda:1"), several ("cuda:0,cuda:1", "cpu,cpu"),
    or every CUDA device ("cuda:all")."""
    devices = [d.strip() for d in spec.split(",") if d.strip()] or ["auto"]
    if "cuda:all" in devices:
        if devices != ["cuda:all"]:
            raise ValueError("--device cuda:all stands alone")
        try:
            import torch
        except ImportError:
            raise ValueError("--device cuda:all needs torch") from None
        count = torch.cuda.device_count()
        if count == 0:
            raise ValueError("--device cuda:all: no CUDA device is visible")
        devices = [f"cuda:{i}" for i in range(count)]
    return devices


class Devices:
    def __init__(self, loops: list[EngineLoop]) -> None:
        if not loops:
            raise ValueError("at least one engine loop")
        self.loops = loops
        self._placed: Counter[int] = Counter()          # open streams per loop (by index)
        self.ready_event = threading.Event()
        self._waiter = threading.Thread(target=self._wait_loaded, name="vox-ws-devices", daemon=True)

    # ------------------------------------------------------------------ the set as one

    @property
    def ready(self) -> list[EngineLoop]:
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
        for loop in self.loops:
            loop.start()
        self._waiter.start()

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

    def place(self) -> EngineLoop:
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

    def release(self, loop: EngineLoop) -> None:
        index = self.loops.index(loop)
        self._placed[index] = max(0, self._placed[index] - 1)

    # ------------------------------------------------------------------ on every device

    def call_each(self, fn: Callable[[Engine], Any], loops: list[EngineLoop] | None = None) -> list[Future]:
        """Run `fn(engine)` on each device's loop thread (`loops`; default: every ready
        one), between two of its steps: a future for each."""
        return [s.call(lambda engine=s.engine: fn(engine)) for s in (self.ready if loops is None else loops)]
