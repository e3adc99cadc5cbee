"""Loading a VoxCPM2 checkpoint through the package's own path, offline, and checking it loaded."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import types
from pathlib import Path
from typing import Any

from ...files import FileTooLarge, read_regular_file

log = logging.getLogger("vox_ws.engines.voxcpm")

DEFAULT_MODEL = "openbmb/VoxCPM2"


def import_voxcpm() -> types.ModuleType:
    """`import voxcpm`, also where torchaudio cannot load.

    voxcpm imports torchaudio at module level for VoxCPM 1.x prompt loading and the denoiser;
    VoxCPM2 never calls it. PyPI's torchaudio wheels are CUDA builds whose native library fails
    beside a CPU torch, which would make the whole package unimportable. When torchaudio is
    missing or broken, a placeholder module stands in that raises a clear error if anything
    actually uses it; vox-ws reads voice audio itself (soundfile + soxr), so nothing does.
    """
    if "torchaudio" not in sys.modules:
        try:
            import torchaudio  # noqa: F401
        except Exception as exc:  # ImportError, or OSError from a mismatched native library
            sys.modules.pop("torchaudio", None)
            sys.modules["torchaudio"] = _TorchaudioUnavailable(exc)
    import voxcpm

    return voxcpm


class _TorchaudioUnavailable(types.ModuleType):
    def __init__(self, cause: BaseException) -> None:
        import importlib.machinery

        super().__init__("torchaudio")
        # importlib.util.find_spec (which transformers calls) needs a spec on modules it finds.
        self.__spec__ = importlib.machinery.ModuleSpec("torchaudio", None)
        self.__cause = f"{type(cause).__name__}: {cause}"

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise ImportError(f"torchaudio.{name} is unavailable ({self.__cause}); VoxCPM2 does not need it")


def resolve_model_path(model: str) -> Path:
    """A checkpoint directory, or a hub id resolved from the local Hugging Face cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if os.sep in model and not re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        raise FileNotFoundError(f"model directory not found: {model}")
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id=model, local_files_only=True))
    except Exception as exc:
        raise FileNotFoundError(
            f"{model!r} is neither a directory nor in the local Hugging Face cache ({type(exc).__name__}); "
            "download it where a hub is reachable, or pass a checkpoint directory"
        ) from None


def weights_available(model: str) -> bool:
    try:
        return (resolve_model_path(model) / "config.json").is_file()
    except (FileNotFoundError, ImportError):
        return False


# A checkpoint's config.json is a few kilobytes: one past this is refused unread.
MAX_CONFIG_BYTES = 1 << 20


def read_config(path: Path) -> Any:
    """`path`/config.json, parsed: a regular file (a FIFO is refused, not waited on) of at most
    MAX_CONFIG_BYTES (FileTooLarge past it, before a byte is read)."""
    data = read_regular_file(path / "config.json", MAX_CONFIG_BYTES)
    if len(data) > MAX_CONFIG_BYTES:
        raise FileTooLarge(errno.EFBIG, f"over {MAX_CONFIG_BYTES} bytes")
    return json.loads(data.decode("utf-8"))


def architecture(path: Path) -> str:
    config = read_config(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path / 'config.json'} is not a JSON object")
    return str(config.get("architecture", "voxcpm")).lower()


def verify_weights(model: Any, path: Path) -> None:
    """The package loads with strict=False, so a misnamed tensor would load silently as random
    weights. Check that every parameter and buffer the checkpoint should provide came from it."""
    import torch
    from safetensors import safe_open

    def read(safetensors_file: Path, torch_file: Path) -> dict[str, torch.Tensor]:
        if safetensors_file.exists():
            with safe_open(str(safetensors_file), framework="pt") as f:
                return {key: f.get_tensor(key) for key in f.keys()}
        loaded = torch.load(torch_file, map_location="cpu", weights_only=True)
        return loaded.get("state_dict", loaded)

    live = model.state_dict()
    expected = {k for k in live if "lora_" not in k}
    saved = read(path / "model.safetensors", path / "pytorch_model.bin")
    saved.update({f"audio_vae.{k}": v for k, v in read(path / "audiovae.safetensors", path / "audiovae.pth").items()})
    # Buffers that the model computes itself (rope tables) are not in checkpoints.
    missing = sorted(k for k in expected - set(saved) if not k.endswith(("cos_cached", "sin_cached", "inv_freq")))
    unexpected = sorted(set(saved) - set(live))
    mismatched = [k for k in saved.keys() & live.keys()
                  if not torch.equal(live[k].detach().cpu(), saved[k].to(live[k].dtype))]
    problems = []
    if missing:
        problems.append(f"{len(missing)} model tensors missing from the checkpoint (e.g. {missing[:3]})")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensors match no model tensor (e.g. {unexpected[:3]})")
    if mismatched:
        problems.append(f"{len(mismatched)} tensors differ after loading (e.g. {mismatched[:3]})")
    if problems:
        raise ValueError(f"checkpoint {path} did not load cleanly: " + "; ".join(problems))
    log.info("verified %d checkpoint tensors against the loaded model", len(saved))
