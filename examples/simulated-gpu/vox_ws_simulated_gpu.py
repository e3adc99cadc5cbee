"""A simulated GPU engine for vox-ws, for measuring what the host costs a device's step
(`benchmarks/host_bound.py`): a step's work is that of a GPU engine as its host sees it, with no
GPU.

A step of a model on a GPU, seen from its Python thread, is a few hundred kernel launches (each
a torch operation that releases the GIL, queues the work and takes the GIL back) and then a wait
for the device (GIL released), and its rows' audio copied back. This engine's step does exactly
that on a CPU: `--simulated-gpu-ops` small torch operations (300), `--simulated-gpu-wait-ms` of
waiting with the GIL released (20 ms), and every row's 160 ms of 48 kHz float32 audio (a tone
per stream) copied out of one batch buffer, as `.cpu()` would. It batches every row (64).

With `--simulated-gpu-trace FILE` each step appends one line there: when it began (the machine's
monotonic clock, seconds), the time inside it, the time since the step before began, its rows,
and of the time inside, the launches' and the wait's (seconds); the benchmark reads the steps
of each of its phases from it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from vox_ws.engine import EndReason, Engine, GenerationRequest, Role, StepResult, Voices
from vox_ws.engines import EnginePlugin, Setting

RATE = 48_000
CHUNK = 7_680                 # 160 ms at 48 kHz: VoxCPM2's chunk
SECONDS_PER_CHARACTER = 0.06  # about the pace of speech
OP_ELEMENTS = 65_536          # each operation's tensor: a few microseconds of host time, as a launch
TONES = 12


class SimulatedVoices(Voices):
    def names(self) -> list[str]:
        return ["tone"]


@dataclass
class Tone:
    remaining: int            # samples still to come
    tone: int                 # which of the tones
    at: int = 0               # where in its second of tone


class SimulatedGpuEngine(Engine):
    name = "simulated-gpu"
    model = "simulated-gpu"
    sample_rate = RATE
    max_step_batch = 64
    voices = Role(SimulatedVoices)

    def __init__(self, ops: int = 300, wait_s: float = 0.020, slots: int | None = None,
                 trace: str | None = None) -> None:
        self.ops = ops
        self.wait_s = wait_s
        self._slots = slots or self.max_step_batch
        self._trace_path = trace
        self._trace: Any = None
        self._last_start: float | None = None

    def load(self) -> None:
        # Here, on the engine's thread: the server's process never imports torch.
        import torch

        torch.set_num_threads(1)
        self._device_state = torch.zeros(OP_ELEMENTS)
        # A second of each tone (a whole number of periods) and a chunk more: a chunk never wraps.
        t = np.arange(RATE + CHUNK) / RATE
        tones = [0.3 * np.sin(2 * np.pi * (220 + 20 * k) * t) for k in range(TONES)]
        self._tones = np.stack(tones).astype(np.float32)
        if self._trace_path:
            self._trace = open(self._trace_path, "a", buffering=1)

    def slots(self) -> tuple[int, str]:
        return self._slots, "a step carries every row"

    def prefill(self, request: GenerationRequest) -> None:
        samples = max(1, round(len(request.text.strip()) * SECONDS_PER_CHARACTER * RATE))
        request.state = Tone(samples, request.id % TONES)

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        started = time.monotonic()
        for _ in range(self.ops):
            self._device_state.add_(1.0)           # a launch: the GIL released and taken back
        launched = time.monotonic()
        time.sleep(self.wait_s)                     # waiting on the device, the GIL released
        waited = time.monotonic()
        rows = np.empty((len(batch), CHUNK), dtype=np.float32)     # the batch copied back, as `.cpu()` does
        results = []
        for row, request in zip(rows, batch):
            tone: Tone = request.state
            n = min(CHUNK, tone.remaining)
            row[:n] = self._tones[tone.tone, tone.at:tone.at + n]
            tone.at = (tone.at + n) % RATE
            tone.remaining -= n
            done = EndReason.DONE if tone.remaining <= 0 else None
            results.append(StepResult(audio=row[:n], finished=done))
        self._record(len(batch), started, launched, waited, time.monotonic())
        return results

    def _record(self, rows: int, started: float, launched: float, waited: float, ended: float) -> None:
        period = started - self._last_start if self._last_start is not None else float("nan")
        self._last_start = started
        if self._trace is not None:
            # The monotonic clock: the one every process of the machine shares.
            self._trace.write(f"{started:.6f} {ended - started:.6f} {period:.6f} {rows} {launched - started:.6f} "
                              f"{waited - launched:.6f}\n")

    def close(self, deadline: float | None = None) -> None:
        if self._trace is not None:
            self._trace.close()
            self._trace = None


def _create(settings: dict[str, Any]) -> SimulatedGpuEngine:
    wait_s = settings["simulated_gpu_wait_ms"] / 1000
    return SimulatedGpuEngine(ops=settings["simulated_gpu_ops"], wait_s=wait_s, slots=settings.get("slots"),
                              trace=settings.get("simulated_gpu_trace"))


PLUGIN = EnginePlugin(
    name="simulated-gpu",
    summary="a GPU engine's step as its host sees it, on a CPU: launches, then a wait (for benchmarks)",
    create=_create,
    settings=(Setting("simulated-gpu-ops", int, 300, "torch operations a step launches"),
              Setting("simulated-gpu-wait-ms", float, 20.0, "milliseconds a step then waits on the device, "
                                                            "the GIL released"),
              Setting("simulated-gpu-trace", str, None, "a file each step appends a line to: its start "
                                                        "(monotonic s), time inside, period, rows, the "
                                                        "launches' time, the wait's")),
    preload=("torch",),
)
