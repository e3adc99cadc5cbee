"""The batched loop against the voxcpm package itself, on any device and dtype.

Five requests with different texts, lengths, voices, options and start times (four at once at
the peak) go through `BatchedVoxCPM2`; each request's audio is compared with what the package's
own `generate_streaming` produces for that request alone (same weights, same seed). The tests run
it on the tiny model on the CPU (`tests/test_voxcpm_equivalence.py`); `python -m benchmarks.device_check` on a
GPU, in float32 and bfloat16 (a checkpoint built with that dtype):

    python -m benchmarks.equivalence --model DIR --device cuda --json equivalence.json [--loras]

`--compile 1,2,4` runs the batched side with the step compiled for those batch sizes.
`--loras` adds the LoRA case (`compare_loras`): requests with two different adapters and none
in one batch, each against the package with only its own adapter loaded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

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


class SeededNoise:
    """What `torch` is to the package's CFM module while the package speaks one request: the
    same module, but its noise draws are the runner's for that request's seed, one step a draw
    (`noise.noise_for`). The runner's noise is counter-based, not a generator's sequence; given
    the same noise, the package and the runner must make the same audio."""

    def __init__(self, torch: Any, seed: int) -> None:
        self._torch = torch
        self._seed = seed
        self._step = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._torch, name)

    def randn(self, shape: tuple[int, ...], *, device: Any = None, dtype: Any = None, **_: Any) -> Any:
        from vox_ws.engines.voxcpm.noise import noise_for

        rows, *rest = shape
        noise = self._torch.cat([noise_for(self._seed, self._step, tuple(rest), dtype, device) for _ in range(rows)])
        self._step += 1
        return noise


@contextlib.contextmanager
def package_noise(seed: int) -> Iterator[None]:
    """While the package speaks one request in the block, its CFM draws the runner's noise for
    `seed` (`SeededNoise`)."""
    import torch
    from voxcpm.modules.locdit import unified_cfm

    unified_cfm.torch = SeededNoise(torch, seed)
    try:
        yield
    finally:
        unified_cfm.torch = torch


def reference_audio(tts: Any, text: str, seed: int, voice: tuple | None = None, **options: Any) -> np.ndarray:
    """The package alone: its public streaming API, one request, its CFM's noise the runner's
    for `seed` (`SeededNoise`)."""
    kwargs = {}
    if voice is not None:
        mode, path, transcript = voice
        if mode in ("reference", "both"):
            kwargs["reference_wav_path"] = str(path)
        if mode in ("continuation", "both"):
            kwargs.update(prompt_wav_path=str(path), prompt_text=transcript)
    with package_noise(seed):
        chunks = list(tts.generate_streaming(text=text, retry_badcase=False, **kwargs, **options))
    return np.concatenate(chunks)


def run_batched(model: Any, requests: list, slots: int = 4, decode_process: bool | None = None,
                adapters: Any = None, adapter_slots: list[int] | None = None,
                compiled_buckets: tuple[int, ...] | None = None, compile_cache: Any = None,
                ) -> tuple[dict[int, np.ndarray], list[int], Any]:
    """Every request through one BatchedVoxCPM2, each joining at its step: (audio per request,
    batch size per step, the closed runner). With `adapters` (the model's LoRA slots), request
    i speaks with adapter slot `adapter_slots[i]`; with `compiled_buckets`, the step compiled
    for those batch sizes (`compiled.py`)."""
    from vox_ws.engines.voxcpm.lora import NO_ADAPTER
    from vox_ws.engines.voxcpm.prompt import build_prompt
    from vox_ws.engines.voxcpm.runner import BatchedVoxCPM2, PrefillInput

    caches = {}
    for _, _, _, voice, _ in requests:
        if voice is not None and voice[:2] not in caches:
            mode, path, transcript = voice
            caches[voice[:2]] = model.build_prompt_cache(
                prompt_text=transcript if mode != "reference" else None,
                prompt_wav_path=str(path) if mode != "reference" else None,
                reference_wav_path=str(path) if mode != "continuation" else None,
            )
    runner = BatchedVoxCPM2(model, slots=slots, decode_process=decode_process, adapters=adapters)
    if compiled_buckets:
        from vox_ws.engines.voxcpm.compiled import CompiledStep

        runner.compile(CompiledStep(model, compiled_buckets, compile_cache, adapters=adapters))
    outputs: dict[int, list[np.ndarray]] = {i: [] for i in range(len(requests))}
    rows = {}
    pending = sorted(range(len(requests)), key=lambda i: requests[i][2])
    step = 0
    batch_sizes = []
    while pending or rows:
        joining = []
        while pending and requests[pending[0]][2] <= step and len(rows) + len(joining) < runner.slots:
            joining.append(pending.pop(0))
        # Those joining at one step are prefilled together, as the scheduler's turn does.
        inputs = []
        for i in joining:
            text, seed, _, voice, opts = requests[i]
            prompt = build_prompt(model, text, caches.get(voice[:2]) if voice else None)
            inputs.append(PrefillInput(prompt, seed=seed, cfg_value=opts.get("cfg_value", 2.0),
                                       timesteps=opts.get("inference_timesteps", 10), min_len=opts.get("min_len", 2),
                                       max_len=opts.get("max_len", 4096),
                                       adapter=adapter_slots[i] if adapter_slots else NO_ADAPTER))
        for i, row in zip(joining, runner.prefill_many(inputs) if inputs else []):
            if isinstance(row, BaseException):
                raise row
            rows[i] = row
        if rows:
            ids = list(rows)
            batch_sizes.append(len(ids))
            for i, (audio, reason) in zip(ids, runner.step([rows[i] for i in ids])):
                if audio is not None:    # with the decoder process, a step's audio comes with the next
                    outputs[i].append(audio)
                if reason is not None:
                    runner.release(rows.pop(i))
        step += 1
    runner.close()
    return {i: np.concatenate(chunks) for i, chunks in outputs.items()}, batch_sizes, runner


def compare(model_dir: str, device: str, work_dir: Path, decode_process: bool | None = None,
            compiled_buckets: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Both sides on one device; per request the largest difference, and whether every one is
    within the dtype's tolerance (with `compiled_buckets`: the step compiled for those sizes)."""
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
    got, batch_sizes, runner = run_batched(batched_model.tts_model, requests, decode_process=decode_process,
                                           compiled_buckets=compiled_buckets, compile_cache=work_dir / "compiled")
    diffs = []
    for i, want in enumerate(expected):
        have = got[i]
        diffs.append(float(np.max(np.abs(have - want))) if have.shape == want.shape else float("inf"))
    tolerance = TOLERANCE.get(dtype, 1e-4)
    return {"device": device, "dtype": dtype, "compiled": list(compiled_buckets or ()),
            "requests": len(requests), "slots": max(batch_sizes),
            "max_abs_diff": diffs, "tolerance": tolerance, "equal": all(d < tolerance for d in diffs),
            "slots_returned": sorted(runner._free_slots) == list(range(runner.slots))}


# LoRA: per request of `scenario`, its adapter (None: the base model): one alone at first, then
# a mix of two adapters and none in one batch.
LORA_PLAN = ("a", None, "b", "a", "b")
# Adapter a: the server's rank and alpha (8 / 4); b: rank 2 under a rank-4 slot (zero-padded),
# with its own lora_config.json (alpha 2: scaling 1).
LORA_ADAPTERS = {"a": dict(rank=4, alpha=8, seed=1, scale=0.25, with_config=False),
                 "b": dict(rank=2, alpha=2, seed=2, scale=0.25, with_config=True)}
SLOT_RANK, SLOT_ALPHA = 4, 8


def compare_loras(model_dir: str, device: str, work_dir: Path,
                  compiled_buckets: tuple[int, ...] | None = None) -> dict[str, Any]:
    """Requests with different adapters (and none) batched together, each against the package
    alone with only its own adapter loaded (`load_lora_weights`); with `compiled_buckets`, the
    step compiled for those sizes."""
    from vox_ws.engines.voxcpm.adapters import AdapterBook
    from vox_ws.engines.voxcpm.loading import import_voxcpm
    from vox_ws.engines.voxcpm.lora import NO_ADAPTER, install_row_lora
    from vox_ws.testing.lora_adapters import RandomAdapter, package_model, write_adapter

    voxcpm = import_voxcpm()
    references = {None: voxcpm.VoxCPM.from_pretrained(model_dir, load_denoiser=False, optimize=False, device=device)}
    for name, spec in LORA_ADAPTERS.items():
        tts = package_model(model_dir, spec["rank"], spec["alpha"], device)
        write_adapter(model_dir, work_dir / "loras" / name, RandomAdapter(**spec), model=tts)
        loaded, skipped = tts.tts_model.load_lora_weights(str(work_dir / "loras" / name))
        if not loaded or skipped:
            raise RuntimeError(f"the package took {len(loaded)} keys of adapter {name} and skipped {skipped}")
        references[name] = tts
    requests = scenario(voice_wavs(work_dir))
    expected = [reference_audio(references[LORA_PLAN[i]], text, seed, voice, **opts)
                for i, (text, seed, _, voice, opts) in enumerate(requests)]
    served = package_model(model_dir, SLOT_RANK, SLOT_ALPHA, device).tts_model
    keys = frozenset(k for k, _ in served.named_parameters() if "lora_" not in k)
    adapters, layers = install_row_lora(served, slots=3, rank=SLOT_RANK)
    book = AdapterBook(adapters, layers, str(work_dir / "loras"), SLOT_ALPHA, keys)
    slots = {name: book.load(book.read(name))["slot"] for name in LORA_ADAPTERS}
    got, batch_sizes, _ = run_batched(served, requests, adapters=adapters,
                                      adapter_slots=[slots[name] if name else NO_ADAPTER for name in LORA_PLAN],
                                      compiled_buckets=compiled_buckets, compile_cache=work_dir / "compiled")
    diffs = [float(np.max(np.abs(got[i] - want))) if got[i].shape == want.shape else float("inf")
             for i, want in enumerate(expected)]
    # Each adapter must change its requests' audio, or the comparison proves nothing.
    plain = [reference_audio(references[None], text, seed, voice, **opts) for text, seed, _, voice, opts in requests]
    changes = [None if LORA_PLAN[i] is None else float("inf") if want.shape != plain[i].shape
               else float(np.max(np.abs(want - plain[i]))) for i, want in enumerate(expected)]
    return {"device": device, "compiled": list(compiled_buckets or ()), "plan": list(LORA_PLAN),
            "slots": max(batch_sizes), "max_abs_diff": diffs,
            "change_by_adapter": changes,
            "adapters_change_audio": all(c is None or c > 100 * TOLERANCE["float32"] for c in changes),
            "equal": all(d < TOLERANCE["float32"] for d in diffs)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a VoxCPM2 checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--loras", action="store_true", help="also requests with different LoRA adapters in one batch")
    ap.add_argument("--compile", help="with the step compiled for these batch sizes, e.g. 1,2,4")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="vox-ws-equivalence-"))
    buckets = tuple(int(b) for b in args.compile.split(",")) if args.compile else None
    result = compare(args.model, args.device, work, compiled_buckets=buckets)
    if args.loras:
        result["loras"] = compare_loras(args.model, args.device, work, compiled_buckets=buckets)
        result["equal"] = result["equal"] and result["loras"]["equal"] and result["loras"]["adapters_change_audio"]
    print(json.dumps(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0 if result["equal"] else 1


if __name__ == "__main__":
    sys.exit(main())
