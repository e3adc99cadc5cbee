"""The operations one batched step dispatches, by batch size: the host work a GPU step pays.

    python -m benchmarks.step_ops [--batches 1,8,32,64] [--compiled] [--vae-rows-per-call 8]

Every aten operation that reaches PyTorch's dispatcher during `runner.step(rows)` is a kernel
launch on a GPU unless a captured graph replays it: their count is the step's host work, and
it should not grow with the batch. Counted with a `TorchDispatchMode` on the tiny VoxCPM2 (the
same code as the real model, one or two layers a module), configured as on a GPU: every row
decoded in the step's own thread, the VAE in one call for all rows. With `--compiled`, the
step through its whole-step graph (`whole_step.py`, compiled first for each batch size),
counting only what runs outside it: a graph's own kernels are one replay on a GPU.

Prints one JSON line: per batch size, the operations of one step (after warm-up steps) and the
ten most frequent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OperationCounter(TorchDispatchMode):
    """Counts the aten operations dispatched while it is on, except inside `paused()`."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if not self._paused:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def graphs_uncounted(counter: OperationCounter) -> Iterator[None]:
    """Calls of compiled graphs counted as nothing: on a GPU each is one replay."""
    from vox_ws.engines.voxcpm import graphs

    call = graphs.GraphsBySize.__call__

    def paused_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        with counter.paused():
            return call(self, *args, **kwargs)

    graphs.GraphsBySize.__call__ = paused_call
    try:
        yield
    finally:
        graphs.GraphsBySize.__call__ = call


def count_step(runner: Any, rows: list, counter: OperationCounter) -> Counter[str]:
    """The operations of one `runner.step(rows)`."""
    counter.counts.clear()
    with counter:
        runner.step(rows)
    return Counter(counter.counts)


def step_operations(model: Any, batches: list[int], compiled: bool = False, rows_per_call: int | None = None,
                    warm_up: int = 3) -> dict[str, Any]:
    """Per batch size, the operations one step dispatches (outside compiled graphs); the VAE
    decodes `rows_per_call` rows a call (None: all, as on a GPU)."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    runner = BatchedVoxCPM2(model, slots=max(batches), decode_process=False, warm_rows=1)
    runner.vae.rows_per_call = rows_per_call
    if compiled:
        from vox_ws.engines.voxcpm.compiled import CompiledStep

        # As a GPU steps: the whole step, one graph per bucket (here a bucket per batch counted).
        step = CompiledStep(model, tuple(batches), cache_dir=tempfile.mkdtemp(prefix="vox-ws-step-ops-"))
        runner.compile_whole(step)
    prompt = build_prompt(model, "A sentence for counting the operations of the runner's step.", None)
    counter = OperationCounter()
    result: dict[str, Any] = {}
    try:
        for batch in batches:
            rows = [runner.prefill(PrefillInput(prompt, seed=i, cfg_value=2.0, timesteps=10, min_len=100,
                                                max_len=4096)) for i in range(batch)]
            for _ in range(warm_up):
                runner.step(rows)
            with graphs_uncounted(counter) if compiled else contextlib.nullcontext():
                counts = count_step(runner, rows, counter)
            for row in rows:
                runner.release(row)
            result[str(batch)] = {"operations": sum(counts.values()), "top": dict(counts.most_common(10))}
    finally:
        runner.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--compiled", action="store_true", help="count what runs outside the compiled graphs")
    parser.add_argument("--vae-rows-per-call", type=int, default=None,
                        help="rows per VAE call (default: all, as on a GPU; a CPU's runner takes 8)")
    args = parser.parse_args(argv)

    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.testing.tiny_voxcpm import build

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        build(Path(folder), stop="never")
        model = import_voxcpm().VoxCPM.from_pretrained(folder, load_denoiser=False, optimize=False,
                                                       device="cpu").tts_model
    batches = [int(b) for b in args.batches.split(",")]
    result = step_operations(model, batches, compiled=args.compiled, rows_per_call=args.vae_rows_per_call)
    print(json.dumps({"compiled": args.compiled, "operations": {b: r["operations"] for b, r in result.items()},
                      "top": {b: r["top"] for b, r in result.items()}}))


if __name__ == "__main__":
    main()
