"""Timing batched steps on a loaded VoxCPM2 engine, for the benchmarks that compare step costs
(`loras.py`, `compiled.py`)."""

from __future__ import annotations

import time
from typing import Any


def decode_inline(engine: Any, slots: int) -> None:
    """Give `engine` a runner that decodes its audio inline (its LoRA slots and compiled step
    kept, the VAE compiled here too): on a small CPU the decoder process would time-share the
    cores with the generation being timed."""
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    old = engine.runner
    old.close()
    engine.runner = BatchedVoxCPM2(engine.tts.tts_model, slots, decode_process=False, adapters=old.adapters)
    if old.compiled is not None:
        engine.runner.compile(old.compiled)


def time_steps(engine: Any, text: str, row_adapters: list[int], steps: int, warm_up: int = 3) -> tuple[float, float]:
    """One row per entry of `row_adapters` (its LoRA adapter slot), `warm_up` steps, then the
    mean of `steps` steps: (the step, of it the generation: CFM, LocEnc, stop head, LMs), in ms."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import PrefillInput

    runner = engine.runner
    rows = [runner.prefill(PrefillInput(build_prompt(engine.tts.tts_model, text, None), seed=i, cfg_value=2.0,
                                        timesteps=10, min_len=2, max_len=4096, adapter=slot))
            for i, slot in enumerate(row_adapters)]
    generate, generated = runner._generate, [0.0]

    def timed(step_rows):
        started = time.perf_counter()
        try:
            return generate(step_rows)
        finally:
            generated[0] += time.perf_counter() - started

    runner._generate = timed
    try:
        for _ in range(warm_up):
            runner.step(rows)
        generated[0] = 0.0
        started = time.perf_counter()
        for _ in range(steps):
            runner.step(rows)
        return (time.perf_counter() - started) / steps * 1000, generated[0] / steps * 1000
    finally:
        runner._generate = generate
        for row in rows:
            runner.release(row)
