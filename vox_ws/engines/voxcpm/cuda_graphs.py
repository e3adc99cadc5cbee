"""The whole step replayed from CUDA graphs (`--cuda-graphs`, off until the device check has
measured it): one graph per batch bucket and attention-length bucket, captured at start.

A step is thousands of small kernels; at small batches a GPU spends the step launching them.
nanovllm-voxcpm replays its whole decode step as one CUDA graph per batch size, captured at
start: so does this, over the whole-step graph (`whole_step.py`, compiled): the CFM solve, both
LMs' advance and the decode of every row, its state read and written by slot in static buffers.
A graph's shapes are fixed: the rows are padded to their bucket (padding rows sit in the padding
slot) and the attention runs over the key positions of the smallest length bucket that holds
the step's furthest row (positions past a row's own are masked, so the result is the same).

Captures are made so that none can capture the wrong thing:
- only on the engine's own thread (the one that made the runner and steps it), at start or at
  adoption, never while a step is being served;
- under `torch.cuda.device(dev)` (a thread's current device is device 0 until set: an engine
  on cuda:1 would capture on device 0's stream) and on an explicit side stream;
- in `thread_local` capture mode, and under `accelerator.DEVICE_LOCK`, which the voice
  thread, the loads and the background compile's reader take too: one capture at a time in a
  process, and no other thread's work in the middle of one;
- largest bucket first, all in one memory pool and on one side stream (the smaller graphs
  reuse the largest's blocks);
- each capture's replay compared with the uncompiled step on the serving's state before it
  serves (`verify`: `graph_check.replay_mismatch`, what the runner passes);
- a capture that fails, or whose replay differs, leaves its bucket uncaptured (the compiled
  whole step, replayed by none), with a log line and its reason in `failed`; timesteps outside
  the captured set never reach it.

The capture itself is a seam (`Capture`): CPU tests drive everything else with a fake one.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, ContextManager, NamedTuple

import torch

from ..accelerator import exclusive_on
from .whole_step import WHOLE_TIMESTEPS, StepInputs

log = logging.getLogger("vox_ws.engines.voxcpm")

# Runs before a capture, on its side stream, as CUDA graphs need (allocations settled, lazy
# initialisation done).
WARM_RUNS = 2
# The shortest attention length captured; each next one doubles, up to the model's positions.
FIRST_LENGTH = 256

Replay = Callable[[], tuple[torch.Tensor, ...]]
Capture = Callable[[Callable[[], tuple[torch.Tensor, ...]]], Replay]


class CapturedReplay(NamedTuple):
    """One captured graph of the whole step: what it was captured for, its static inputs and
    its replay."""

    bucket: int
    length: int
    timesteps: int
    decode: bool
    given: StepInputs
    replay: Replay


def length_buckets(max_len: int, first: int = FIRST_LENGTH) -> tuple[int, ...]:
    """The attention lengths captured: `first`, doubled, and `max_len` last."""
    lengths, length = [], min(first, max_len)
    while length < max_len:
        lengths.append(length)
        length *= 2
    return (*lengths, max_len)


class CudaCapture:
    """`Capture` on a CUDA device: warm runs and the capture on this capturer's one side stream,
    in `thread_local` mode, every graph in one pool. torch asks captures that share a pool to be
    made on the same stream (`torch.cuda.graphs`, torch 2.11): a pool's freed blocks are reused
    only by later captures on the stream that freed them, so a stream per capture would make the
    pool's memory the sum of the graphs', not the largest's. `cuda`: `torch.cuda`, or a test's
    stand-in with the same calls."""

    def __init__(self, device: torch.device, cuda: Any = None) -> None:
        if device.type != "cuda":
            raise ValueError(f"--cuda-graphs needs a CUDA device, not {device}")
        self.device = device
        self.cuda = torch.cuda if cuda is None else cuda
        self.pool = self.cuda.graph_pool_handle()
        self.stream = self.cuda.Stream(device)

    def __call__(self, run: Callable[[], tuple[torch.Tensor, ...]]) -> Replay:
        cuda, side = self.cuda, self.stream
        current = cuda.current_stream(self.device)
        side.wait_stream(current)
        with cuda.stream(side):
            for _ in range(WARM_RUNS):
                run()
        side.synchronize()
        graph = cuda.CUDAGraph()
        with cuda.graph(graph, pool=self.pool, stream=side, capture_error_mode="thread_local"):
            outputs = run()
        current.wait_stream(side)

        def replay() -> tuple[torch.Tensor, ...]:
            graph.replay()
            return outputs
        return replay


class CapturedSteps:
    """The whole step's CUDA graphs by (bucket, attention length, timesteps), and their static
    inputs; made by `capture_all` on the thread that made this, replayed by `replay`."""

    def __init__(self, step: Callable[[int, bool, StepInputs], tuple[torch.Tensor, ...]], device: torch.device,
                 capture: Capture, owner: int, exclusive: Callable[[str], ContextManager[Any]] = exclusive_on,
                 verify: Callable[[CapturedReplay], str | None] | None = None) -> None:
        """`step`: the whole step (`WholeSteps`), `capture`: how a graph is captured
        (`CudaCapture`, or a test's), `owner`: the engine thread's ident, the only one that
        may capture; `exclusive(device)`: what captures run under (`accelerator.exclusive_on`:
        `DEVICE_LOCK` held, the device current); `verify`: why a captured graph's replay
        differs from the uncompiled step (the runner's comparison), or None: run on each
        capture before it serves."""
        self.step = step
        self.device = device
        self._capture = capture
        self._exclusive = exclusive
        self._verify = verify
        self._owner = owner
        self._graphs: dict[tuple[int, int, int, bool], tuple[StepInputs, Replay]] = {}
        self.lengths: tuple[int, ...] = ()
        self.captured_s: dict[str, float] = {}
        self.failed: dict[str, str] = {}

    def capture_all(self, given_for: Callable[[int, int], StepInputs], buckets: tuple[int, ...],
                    lengths: tuple[int, ...], decode: bool) -> None:
        """Capture every bucket's step at every attention length, largest first, each on its
        static inputs `given_for(bucket, length)` (padding rows: what the warm runs and the
        capture write goes into the padding slot)."""
        if threading.get_ident() != self._owner:
            raise RuntimeError("CUDA graphs are captured on the engine's own thread only")
        self.lengths = tuple(sorted(lengths))
        with self._exclusive(str(self.device)):
            for bucket in sorted(buckets, reverse=True):
                for length in sorted(lengths, reverse=True):
                    for timesteps in WHOLE_TIMESTEPS:
                        self._capture_one(given_for(bucket, length), bucket, length, timesteps, decode)
        log.info("CUDA graphs of the whole step: %d captured, %d failed", len(self._graphs), len(self.failed))

    def _capture_one(self, given: StepInputs, bucket: int, length: int, timesteps: int, decode: bool) -> None:
        name = f"{bucket}x{length}x{timesteps}"
        started = time.perf_counter()
        try:
            with torch.inference_mode():
                replay = self._capture(lambda: self.step(timesteps, decode, given))
            # Its replay compared with the uncompiled step first: a graph that differs never serves.
            differs = self._verify(CapturedReplay(bucket, length, timesteps, decode, given, replay)
                                   ) if self._verify is not None else None
        except Exception as exc:  # noqa: BLE001 - that bucket stays uncaptured; the step still serves it
            differs = f"{type(exc).__name__}: {exc}"
        if differs is not None:
            self.failed[name] = differs
            log.warning("CUDA graph of the whole step for %d rows, %d positions, %d timesteps not captured "
                        "(%s): it runs uncaptured", bucket, length, timesteps, differs)
            return
        self._graphs[(bucket, length, timesteps, decode)] = (given, replay)
        self.captured_s[name] = round(time.perf_counter() - started, 3)

    def describe(self) -> dict[str, Any]:
        """For `/v1/info`: the seconds each graph took to capture, those that failed and why,
        and the attention lengths captured."""
        return {"captured_s": dict(self.captured_s), "failed": dict(self.failed), "lengths": list(self.lengths)}

    def replay(self, bucket: int, positions: int, timesteps: int, decode: bool, rows: torch.Tensor
               ) -> tuple[torch.Tensor, ...] | None:
        """The step of `rows` (int64 [bucket, 3] on the device) attending over `positions` key
        positions, replayed from its graph: its outputs (the graph's own tensors, overwritten
        by the next replay) with the static rows first; None where none was captured."""
        length = next((n for n in self.lengths if n >= positions), None)
        captured = self._graphs.get((bucket, length, timesteps, decode)) if length is not None else None
        if captured is None:
            return None
        given, replay = captured
        given.rows.copy_(rows)
        return (given.rows, *replay())


def capture_step(runner: Any, rows: int, compiled: Any = None) -> Callable[[list[Any]], Any]:
    """For the device check: the step of `rows` rows as `runner.step`, replayed from CUDA
    graphs of the whole step captured at every attention length: the compiled whole step
    (`compiled`, a `CompiledStep`: its graph for that bucket compiled first), or with none the
    whole step uncompiled, which a capture needs no compile for."""
    from .whole_step import EagerWholeSteps

    if compiled is not None:
        runner.whole = None
        runner.compile_whole(compiled, (rows,))
    else:
        runner.whole = EagerWholeSteps(runner.model, (rows,))
    runner.captured = None
    runner.capture_whole(CudaCapture(runner.device), buckets=(rows,))
    return runner.step
