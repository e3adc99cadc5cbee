"""Where each row's patch is decoded to audio: in the step's own thread, or in the decoder process.

On a GPU every row is decoded in the step (in its whole-step graph, or by `BatchedStreamingVAE`
after the generation). On a CPU with a core to spare the decoder process decodes most rows'
patches while the next step is generated (`decoder_process.py`): a row's first patch is decoded
here at once (first audio never waits for the pipeline), its later ones there, their audio
coming back with the next step; or here, where the balance keeps the row because this thread
has been waiting on the process.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import numpy as np
import torch

from .decoder_process import DecoderProcess
from .vae import BatchedStreamingVAE


class RowDecoding:
    """The runner's decode: its VAE here, and the decoder process where it has one."""

    def __init__(self, vae: BatchedStreamingVAE, decoder: DecoderProcess | None) -> None:
        self.vae = vae
        self.process = decoder
        self._balance = DecodeBalance()

    def here(self, rows: list[Any]) -> list[int]:
        """The rows (indices) whose patch this step decodes here: all, without a process; else a
        row's first, and those the balance keeps here. A row stays where it is first put: its
        carried state lives there."""
        if self.process is None:
            return list(range(len(rows)))
        here = []
        for i, row in enumerate(rows):
            if row.step > 0 and row.decoded_here is None:
                row.decoded_here = self._balance.take_one()
            if row.step == 0 or row.decoded_here:
                here.append(i)
        return here

    @torch.inference_mode()
    def decode(self, rows: list[Any], here: list[int], latents: torch.Tensor, slots: torch.Tensor
               ) -> torch.Tensor | None:
        """The rows `here` decoded here, now: their audio [len(here), samples]; the others'
        patches submitted to the decoder process (each row's `pending` names its job)."""
        if len(here) == len(rows):
            return self.vae.decode(latents, slots)
        there = [i for i in range(len(rows)) if i not in set(here)]
        # Rows new to the process take along the state their first patch left here.
        entering = [rows[i].slot for i in there if not rows[i].in_process]
        states = self.vae.export_states(torch.tensor(entering)) if entering else None
        job = self.process.submit(latents[there], [rows[i].slot for i in there],
                                  (entering, states) if entering else None)
        for j, i in enumerate(there):
            rows[i].in_process = True
            rows[i].pending = (job, j)
        if not here:
            return None
        index = torch.tensor(here)
        return self.vae.decode(latents.index_select(0, index), slots.index_select(0, index))

    def gather(self, rows: list[Any], earlier: dict[int, tuple[Future, int]], now: dict[int, np.ndarray],
               stepped: bool) -> list[np.ndarray | None]:
        """Each row's audio: what the decoder process made of its previous patch (`earlier`: its
        job, by row), then what was decoded here in this step (`now`)."""
        results: list[np.ndarray | None] = []
        waited, jobs = 0.0, {}
        for row in rows:
            parts = []
            if id(row) in earlier:
                job, j = earlier[id(row)]
                started = time.perf_counter()
                decoded = self.process.wait(job)
                waited += time.perf_counter() - started
                parts.append(decoded[j])
                jobs[id(job)] = (len(decoded), job.decode_s)
            if id(row) in now:
                parts.append(now[id(row)])
            results.append(parts[0] if len(parts) == 1 else (np.concatenate(parts) if parts else None))
        for job_rows, job_seconds in jobs.values():
            self._balance.decoded_there(job_rows, job_seconds)
        if self.process is not None and stepped:
            self._balance.waited(waited)
        return results


class DecodeBalance:
    """When the decoder process is the slower side of a step, the engine thread waits on it; a
    row decoded here instead moves its share of the decode from one side of that wait to the
    other. Tracks moving averages of the wait per step and of the decoder's time per row."""

    def __init__(self, smoothing: float = 0.2) -> None:
        self.smoothing = smoothing
        self.wait_s = 0.0
        self.row_s: float | None = None
        self._taken = 0.0

    def waited(self, seconds: float) -> None:
        self.wait_s += self.smoothing * (seconds - self.wait_s)
        self._taken = 0.0

    def decoded_there(self, rows: int, seconds: float) -> None:
        per_row = seconds / rows
        self.row_s = per_row if self.row_s is None else self.row_s + self.smoothing * (per_row - self.row_s)

    def take_one(self) -> bool:
        """Whether one more row should be decoded here; counts it against this step's slack."""
        if self.row_s is None or self.wait_s - self._taken < 2 * self.row_s:
            return False
        self._taken += 2 * self.row_s
        return True
