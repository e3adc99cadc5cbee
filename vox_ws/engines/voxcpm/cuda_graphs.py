"""The CFM solve replayed from CUDA graphs (`--cuda-graphs`, off until the device check has
measured it): one graph per batch bucket and number of timesteps, captured on its first use.

A step's CFM solve is some ten LocDiT calls with classifier-free guidance, each dozens of small
kernels: at small batches a GPU spends the step launching them (nanovllm-voxcpm and vLLM-Omni run
their decode as CUDA graphs for that reason). A captured solve launches them all at once. Its
inputs (mu, cond, noise, cfg) are copied into the graph's own tensors before each replay, and its
output copied out after, since the next replay writes over it. Shapes are fixed per graph: the
compiled step's buckets bound them. The LMs' decode step is not captured: its attention length
grows every step.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import torch

log = logging.getLogger("vox_ws.engines.voxcpm")

# Graphs kept per step: buckets times the timesteps requests ask for (a solve past it runs as is).
MAX_GRAPHS = 64
# Runs before the capture, on a side stream, as CUDA graphs need (allocations settled, lazy
# initialisation done).
WARM_RUNS = 2

Solve = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int, torch.Tensor], torch.Tensor]


class CapturedSolves:
    """`solve(mu, cond, noise, timesteps, cfg) -> x` replayed from a CUDA graph per (rows,
    timesteps), each captured at its first call."""

    def __init__(self, solve: Solve, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a CUDA device, not {device}")
        self._solve = solve
        self._device = device
        self._graphs: dict[tuple[int, int], tuple[list[torch.Tensor], torch.Tensor, torch.cuda.CUDAGraph]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        self.captured_s: dict[str, float] = {}     # "rows x timesteps" -> seconds to capture

    def __call__(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, timesteps: int,
                 cfg: torch.Tensor) -> torch.Tensor:
        key = (mu.shape[0], timesteps)
        captured = self._graphs.get(key)
        if captured is None:
            if len(self._graphs) >= MAX_GRAPHS:
                return self._solve(mu, cond, noise, timesteps, cfg)
            captured = self._graphs[key] = self._capture(mu, cond, noise, timesteps, cfg)
        inputs, output, graph = captured
        for static, given in zip(inputs, (mu, cond, noise, cfg)):
            static.copy_(given)
        graph.replay()
        return output.clone()

    def _capture(self, mu: torch.Tensor, cond: torch.Tensor, noise: torch.Tensor, timesteps: int,
                 cfg: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, torch.cuda.CUDAGraph]:
        started = time.perf_counter()
        inputs = [t.clone() for t in (mu, cond, noise, cfg)]
        current = torch.cuda.current_stream(self._device)
        side = torch.cuda.Stream(self._device)
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(WARM_RUNS):
                self._solve(inputs[0], inputs[1], inputs[2], timesteps, inputs[3])
        current.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            output = self._solve(inputs[0], inputs[1], inputs[2], timesteps, inputs[3])
        self.captured_s[f"{mu.shape[0]}x{timesteps}"] = round(time.perf_counter() - started, 3)
        log.info("CUDA graph of the CFM solve for %d rows, %d timesteps, captured in %.2f s", mu.shape[0], timesteps,
                 time.perf_counter() - started)
        return inputs, output, graph
