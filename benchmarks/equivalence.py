"""The batched loop against the voxcpm package itself, on any device and dtype.

Five requests with different texts, lengths, voices, options and start times (four at once at
the peak) go through `BatchedVoxCPM2`; each request's audio is compared with what the package's
own `generate_streaming` produces for that request alone (same weights, same seed). The tests run
it on the tiny model on the CPU (`tests/test_voxcpm_equivalence.py`); `scripts/gpu-check.sh` on a
GPU, in float32 and bfloat16 (a checkpoint built with that dtype):

    python -m benchmarks.equivalence --model DIR --device cuda --json equivalence.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

# The largest difference allowed, per dtype (audio is in [-1, 1]): float32 round-off between
# batched and single-row kernels; bfloat16 keeps 8 bits of mantissa, and its error compounds
# over the steps of a long request.
TOLERANCE = {"float32": 1e-4, "bfloat16": 5e-2}


def voice_wavs(folder: Path) -> dict[str, Path]:
    """Two reference recordings at the VAE's own rate (16 kHz), so no resampler differs."""
    import soundfile

    rng = np.random.default_rng(1)
    paths = {}
    for name, seconds, pitch in (("a", 1.3, 180.0), ("b", 0.9, 260.0)):
        t = np.arange(int(seconds * 16000)) / 16000
        wav = 0.3 * np.sin(2 * np.pi * pitch * t) + 0.02 * rng.standard_normal(t.size)
        paths[name] = folder / f"{name}.wav"
        soundfile.write(paths[name], wav.astype(np.float32), 16000, subtype="FLOAT")
    return paths


def scenario(wavs: dict[str, Path]) -> list[tuple[str, int, int, tuple | None, dict[str, Any]]]:
    """(text, seed, joins at step, voice (mode, path, transcript), options) per request."""
    a, b = wavs["a"], wavs["b"]
    return [
        ("Hello world, this is the first request.", 11, 0, None,
         dict(max_len=24, cfg_value=2.0, inference_timesteps=10)),
        ("Short.", 22, 2, ("reference", a, None), dict(cfg_value=1.5, inference_timesteps=10)),
        ("A third one that joins later and speaks in a cloned voice.", 33, 5, ("both", b, "a prompt text"),
         dict(max_len=18, cfg_value=3.0, inference_timesteps=6)),
        ("Continuation only.", 44, 5, ("continuation", a, "hello there"),
         dict(max_len=12, cfg_value=2.5, inference_timesteps=4, min_len=3)),
        ("你好，世界。", 55, 9, None, dict(max_len=15, cfg_value=2.0, inference_timesteps=10)),
    ]


def reference_audio(tts: Any, text: str, seed: int, voice: tuple | None = None, **options: Any) -> np.ndarray:
    """The package alone: its public streaming API, one request, seeded global RNG."""
    import torch

    kwargs = {}
    if voice is not None:
        mode, path, transcript = voice
        if mode in ("reference", "both"):
            kwargs["reference_wav_path"] = str(path)
        if mode in ("continuation", "both"):
            kwargs.update(prompt_wav_path=str(path), prompt_text=transcript)
    torch.manual_seed(seed)
    chunks = list(tts.generate_streaming(text=text, retry_badcase=False, **kwargs, **options))
    return np.concatenate(chunks)


def run_batched(model: Any, requests: list, max_batch: int = 4,
                decode_process: bool | None = None) -> tuple[dict[int, np.ndarray], list[int], Any]:
    """Every request through one BatchedVoxCPM2, each joining at its step: (audio per request,
    batch size per step, the closed runner)."""
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2

    caches = {}
    for _, _, _, voice, _ in requests:
        if voice is not None and voice[:2] not in caches:
            mode, path, transcript = voice
            caches[voice[:2]] = model.build_prompt_cache(
                prompt_text=transcript if mode != "reference" else None,
                prompt_wav_path=str(path) if mode != "reference" else None,
                reference_wav_path=str(path) if mode != "continuation" else None,
            )
    runner = BatchedVoxCPM2(model, max_batch=max_batch, decode_process=decode_process)
    outputs: dict[int, list[np.ndarray]] = {i: [] for i in range(len(requests))}
    rows = {}
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    step = 0
    batch_sizes = []
    while pending or rows:
        while pending and requests[pending[0]][2] <= step and len(rows) < runner.max_batch:
            i = pending.pop(0)
            text, seed, _, voice, opts = requests[i]
            prompt = build_prompt(model, text, caches.get(voice[:2]) if voice else None)
            rows[i] = runner.prefill(prompt, seed=seed, cfg_value=opts.get("cfg_value", 2.0),
                                     timesteps=opts.get("inference_timesteps", 10), min_len=opts.get("min_len", 2),
                                     max_len=opts.get("max_len", 4096))
        if rows:
            ids = list(rows)
            batch_sizes.append(len(ids))
            for i, (audio, reason) in zip(ids, runner.step([rows[i] for i in ids])):
                if audio is not None:    # with the decoder process, a step's audio comes with the next
                    outputs[i].append(audio.float().cpu().numpy())
                if reason is not None:
                    runner.release(rows.pop(i))
        step += 1
    runner.close()
    return {i: np.concatenate(chunks) for i, chunks in outputs.items()}, batch_sizes, runner


def compare(model_dir: str, device: str, work_dir: Path, decode_process: bool | None = None) -> dict[str, Any]:
    """Both sides on one device; per request the largest difference, and whether every one is
    within the dtype's tolerance."""
    import torch

    from vox_ws.engines.voxcpm.loading import import_voxcpm

    voxcpm = import_voxcpm()
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False      # the same kernels' precision on both sides
        torch.backends.cudnn.allow_tf32 = False
    reference_model = voxcpm.VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False, device=device)
    batched_model = voxcpm.VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False, device=device)
    dtype = str(next(batched_model.tts_model.base_lm.parameters()).dtype).replace("torch.", "")
    requests = scenario(voice_wavs(work_dir))
    expected = [reference_audio(reference_model, text, seed, voice, **opts) for text, seed, _, voice, opts in requests]
    got, batch_sizes, runner = run_batched(batched_model.tts_model, requests, decode_process=decode_process)
    diffs = []
    for i, want in enumerate(expected):
        have = got[i]
        diffs.append(float(np.max(np.abs(have - want))) if have.shape == want.shape else float("inf"))
    tolerance = TOLERANCE.get(dtype, 1e-4)
    return {"device": device, "dtype": dtype, "requests": len(requests), "max_batch": max(batch_sizes),
            "max_abs_diff": diffs, "tolerance": tolerance, "equal": all(d < tolerance for d in diffs),
            "slots_returned": sorted(runner._free_slots) == list(range(runner.max_batch))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a VoxCPM2 checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    result = compare(args.model, args.device, Path(tempfile.mkdtemp(prefix="vox-ws-equivalence-")))
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
