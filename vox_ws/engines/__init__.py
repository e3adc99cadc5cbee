"""Engine back-ends, one module each, and the choice between them."""

from __future__ import annotations

import logging
from typing import Any

from ..engine import Engine

log = logging.getLogger("vox_ws.engines")

ENGINES = ("auto", "voxcpm", "piper")


def create_engine(name: str, **options: Any) -> Engine:
    """Build the named engine (not loaded yet). `auto` picks VoxCPM2 when a GPU and its
    weights are available, else the CPU voice, and logs why."""
    if name == "auto":
        name, why = _choose_auto(options)
        log.info("engine auto -> %s (%s)", name, why)
    if name == "piper":
        from .piper import PiperEngine

        return PiperEngine(threads=options.get("threads") or 1)
    if name == "voxcpm":
        from .voxcpm import VoxCPMEngine

        return VoxCPMEngine(**{k: v for k, v in options.items() if k in VoxCPMEngine.OPTION_NAMES})
    raise ValueError(f"unknown engine {name!r} (choose from {', '.join(ENGINES)})")


def _choose_auto(options: dict[str, Any]) -> tuple[str, str]:
    try:
        from .voxcpm import weights_available
    except ImportError as exc:
        return "piper", f"voxcpm engine unavailable: {exc}"
    if str(options.get("device") or "auto") not in ("auto",) and not str(options["device"]).startswith("cuda"):
        return "piper", f"device {options['device']!r} is not a GPU"
    try:
        import torch
    except ImportError:
        return "piper", "torch is not installed"
    if not torch.cuda.is_available():
        return "piper", "no CUDA GPU"
    model = options.get("model") or "openbmb/VoxCPM2"
    if not weights_available(model):
        return "piper", f"VoxCPM2 weights for {model!r} not found locally"
    return "voxcpm", f"GPU and weights for {model!r} available"
