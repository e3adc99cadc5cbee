"""Benchmark: what per-row LoRA costs a batched step.

One batch of `--batch` rows (default 8) stepped on the served engine (`VoxCPMEngine`, as
`vox-ws serve` loads it, its VAE decode inline), with 0, 1, 4 and 8 distinct adapters among its rows (0: LoRA slots
loaded but every row on the base model), against the same engine built without LoRA. Per case
it prints the mean step time (and of it, the generation: CFM, LocEnc, stop head and both LMs,
where LoRA acts), audio seconds per wall second, and what one adapter slot holds in memory, also
for the released model's layer sizes at the same rank (computed from its shapes; checked here
against what the tiny model's slots allocate).

    python -m benchmarks.loras [--model DIR] [--rank 8] [--batch 8] [--steps 30] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from ._steps import decode_inline, time_steps

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TQDM_DISABLE", "1")

TEXT = "A batch of streams, each with its own fine-tuned voice, all in one step."
CASES = (("base model, no LoRA", None), ("LoRA slots, no row adapted", 0), ("1 adapter", 1), ("4 adapters", 4),
         ("8 adapters", 8))


def adapted_layer_shapes(size: str) -> list[tuple[int, int]]:
    """(in, out) of every layer the package adapts (q, k, v, o of the base LM, the residual LM
    and the LocDiT), for a model of `vox_ws.testing.tiny_voxcpm.SIZES[size]`."""
    from vox_ws.testing.tiny_voxcpm import SIZES

    s = SIZES[size]
    head = s["head_dim"]
    shapes = []
    for hidden, heads, kv_heads, layers in ((s["lm_hidden"], s["lm_heads"], s["lm_kv_heads"], s["lm_layers"]),
                                            (s["lm_hidden"], s["lm_heads"], s["lm_kv_heads"], s["res_layers"]),
                                            # the LocDiT keeps the LM's key-value heads
                                            (s["dit_hidden"], s["dit_heads"], s["lm_kv_heads"], s["dit_layers"])):
        per_layer = [(hidden, heads * head), (hidden, kv_heads * head), (hidden, kv_heads * head),
                     (heads * head, hidden)]
        shapes += per_layer * layers
    return shapes


def slot_bytes(size: str, rank: int, element: int = 4) -> int:
    return sum(rank * (i + o) * element for i, o in adapted_layer_shapes(size))


def measure(engine: Any, adapters: int | None, slots: list[int], batch: int, steps: int) -> dict[str, float]:
    from vox_ws.engines.voxcpm.lora import NO_ADAPTER

    row_slots = [slots[i % adapters] for i in range(batch)] if adapters else [NO_ADAPTER] * batch
    step_ms, generate_ms = time_steps(engine, TEXT, row_slots, steps)
    step_audio_s = engine.runner.samples_per_step / engine.tts.tts_model.sample_rate
    return {"step_ms": step_ms, "generate_ms": generate_ms, "audio_s_per_s": batch * step_audio_s / (step_ms / 1000)}


def run(model_dir: str, rank: int, batch: int, steps: int, repeats: int, threads: int) -> dict[str, Any]:
    from vox_ws.engines.voxcpm.engine import VoxCPMEngine
    from vox_ws.testing.lora_adapters import RandomAdapter, package_model, write_adapter

    folder = Path(tempfile.mkdtemp(prefix="vox-ws-loras-"))
    package = package_model(model_dir, rank, 2 * rank)
    for n in range(8):
        write_adapter(model_dir, folder / f"voice{n}", RandomAdapter(rank=rank, alpha=2 * rank, seed=n),
                      model=package)
    plain = VoxCPMEngine(model=model_dir, device="cpu", threads=threads, slots=batch)
    adapted = VoxCPMEngine(model=model_dir, device="cpu", threads=threads, slots=batch, lora_rank=rank,
                           max_loras=8, lora_dir=str(folder))
    for engine in (plain, adapted):
        engine.load()
        decode_inline(engine, batch)
    try:
        slots = [adapted.loras.load(adapted.loras.read(f"voice{n}"))["slot"] for n in range(8)]
        samples: dict[str, list[dict[str, float]]] = {name: [] for name, _ in CASES}
        for _ in range(repeats):                 # interleaved, so drift hits every case alike
            for name, adapters in CASES:
                engine = plain if adapters is None else adapted
                samples[name].append(measure(engine, adapters, slots, batch, steps))
        allocated = adapted.loras.describe()["slot_bytes"]
    finally:
        plain.close()
        adapted.close()
    cases = [{"case": name, **{k: round(statistics.median(s[k] for s in samples[name]), 2)
                               for k in ("step_ms", "generate_ms", "audio_s_per_s")}} for name, _ in CASES]
    base = cases[0]
    for case in cases:
        case["step_vs_base"] = round(case["step_ms"] / base["step_ms"], 3)
        case["generate_vs_base"] = round(case["generate_ms"] / base["generate_ms"], 3)
    return {"batch": batch, "rank": rank, "steps": steps, "repeats": repeats, "cases": cases,
            "slot_bytes_tiny": allocated, "slot_bytes_tiny_from_shapes": slot_bytes("tiny", rank),
            "slot_mib_real": {r: round(slot_bytes("real", r) / 2**20, 1) for r in (8, 16, 32, 64)}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="VoxCPM2 checkpoint directory (default: build the tiny model)")
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    model_dir = args.model
    if model_dir is None:
        from vox_ws.testing.tiny_voxcpm import build

        model_dir = str(build(tempfile.mkdtemp(prefix="vox-ws-tiny-"), stop="never"))
    result = run(model_dir, args.rank, args.batch, args.steps, args.repeats, args.threads)
    print(f"batch {result['batch']}, rank {result['rank']}, median of {result['repeats']} runs of "
          f"{result['steps']} steps")
    print(f"{'case':<30}{'step ms':>9}{'x base':>8}{'generate ms':>13}{'x base':>8}{'audio s/s':>11}")
    for c in result["cases"]:
        print(f"{c['case']:<30}{c['step_ms']:>9.2f}{c['step_vs_base']:>8.3f}{c['generate_ms']:>13.2f}"
              f"{c['generate_vs_base']:>8.3f}{c['audio_s_per_s']:>11.1f}")
    print(f"one adapter slot: {result['slot_bytes_tiny']} bytes on the tiny model (from its shapes: "
          f"{result['slot_bytes_tiny_from_shapes']}); the released model's layer sizes: "
          + ", ".join(f"rank {r}: {mib} MiB" for r, mib in result["slot_mib_real"].items()) + " (float32)")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
