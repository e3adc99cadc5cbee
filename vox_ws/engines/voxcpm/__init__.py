"""VoxCPM2, batched: every active stream advances in one generation step.

    loading.py          the package's own loading path, offline, and a check that it loaded
    options.py          the generation options it honours
    settings.py         its command-line settings (--compile, --lora-rank, ...)
    prompt.py           one request's model inputs (text, voice prompt, continuation)
    voices.py           voice prompts from reference audio, kept by id
    kv.py               KV caches in slots; one LM decode step over rows at different positions
    runner.py           prefill and the batched step (CFM, stop head, LMs, VAE hand-off)
    vae.py              the causal streaming VAE decode for a batch of streams
    decoder_process.py  the VAE decode in a process of its own (CPU), overlapped with generation
    decoder_main.py     that process's entry point
    compiled.py         the step compiled per batch bucket (`--compile`): CFM velocity, LocEnc +
                        stop head + both LMs' decode step, and (vae.py) the streaming VAE decode
    graphs.py           compiled graphs kept on disk, keyed, shape-checked, saved whole
    background.py       compiling in a child process while the server serves eager
    compile_main.py     that process's entry point
    lora.py             per-row LoRA layers: every adapter slot's weights, each row its own
    adapters.py         LoRA adapters by name: files, slots, the streams that use them
    engine.py           the Engine the engine loop drives

This module registers the engine and must import cheaply: no torch here.
"""

from __future__ import annotations

from typing import Any

from .. import EnginePlugin
from .loading import DEFAULT_MODEL, weights_available
from .options import OPTIONS
from .settings import COMPILE_MODES, SETTINGS, parse_buckets, parse_compile

__all__ = ["COMPILE_MODES", "PLUGIN", "SETTINGS", "parse_buckets", "parse_compile"]

def _create(settings: dict[str, Any]):
    from .engine import VoxCPMEngine

    names = {"device", "threads", "slots"} | {s.key for s in SETTINGS}
    return VoxCPMEngine(**{k: v for k, v in settings.items() if k in names})


def _probe(settings: dict[str, Any]) -> tuple[bool, str]:
    device = str(settings.get("device") or "auto")
    if device != "auto" and not device.startswith("cuda"):
        return False, f"device {device!r} is not a GPU"
    try:
        import torch
    except ImportError:
        return False, "torch is not installed"
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    model = settings.get("model") or DEFAULT_MODEL
    if not weights_available(model):
        return False, f"VoxCPM2 weights for {model!r} not found locally"
    try:
        from .loading import import_voxcpm

        import_voxcpm()
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken native dependency
        return False, f"the voxcpm package cannot be imported ({type(exc).__name__}: {exc})"
    return True, f"GPU and weights for {model!r} available"


def _notice(settings: dict[str, Any], why: str) -> str | None:
    """Where a CUDA GPU is present but VoxCPM2 is not served: why, and what fixes it."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    model = settings.get("model") or DEFAULT_MODEL
    if "not found locally" in why:
        fix = ("run `vox-ws models pull`, then start again" if model == DEFAULT_MODEL
               else f"run `vox-ws models pull {model}`, then start again"
               if "/" in model and not model.startswith(("/", "."))
               else "pass --model with a VoxCPM2 checkpoint directory (`vox-ws models list` shows what is on disk)")
    else:
        fix = "see the log line above for why (README, \"Quick start\"; docs/DEPLOY.md)"
    return f"a CUDA GPU is present but VoxCPM2 is not served ({why}): {fix}"


PLUGIN = EnginePlugin(
    name="voxcpm",
    summary="OpenBMB VoxCPM2 (48 kHz, voice cloning, LoRA), batched across streams",
    create=_create,
    options=OPTIONS,
    settings=SETTINGS,
    auto_priority=10,
    probe=_probe,
    notice=_notice,
    preload=("vox_ws.engines.voxcpm.engine",),
)
