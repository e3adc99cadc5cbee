"""Loading a VoxCPM2 checkpoint through the package's own path, offline, and checking it loaded."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import sys
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator

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


def from_pretrained(path: str | os.PathLike, **kwargs: Any) -> Any:
    """`voxcpm.VoxCPM.from_pretrained(path, **kwargs)` for a VoxCPM2 checkpoint directory, without
    the random initialisation that the checkpoint replaces (`skip_init`: seconds, where the
    package spends most of a minute at the released size); a parameter the checkpoint lacks is
    refused (`skip_init.NotInCheckpoint`). Anything else loads as the package loads it.

    A safetensors checkpoint's tensors stay memory-mapped on a CPU (the file's pages are the
    weights, shared with the page cache, not copied): replace its files (a new file renamed
    over), never rewrite one in place, while a server that loaded it runs."""
    voxcpm = import_voxcpm()
    if not Path(path).is_dir() or architecture(Path(path)) != "voxcpm2":    # as the package would
        return voxcpm.VoxCPM.from_pretrained(str(path), **kwargs)
    from voxcpm.model.voxcpm2 import VoxCPM2Model

    from .skip_init import NotInCheckpoint, built_for_checkpoint

    try:
        with built_for_checkpoint(VoxCPM2Model):
            return voxcpm.VoxCPM.from_pretrained(str(path), **kwargs)
    except NotInCheckpoint as exc:
        raise NotInCheckpoint(f"checkpoint {path} did not load cleanly: {exc}") from None


def verify_weights(model: Any, path: Path) -> None:
    """The package loads with strict=False, so a misnamed tensor would load silently as random
    weights. Check that every parameter and buffer the checkpoint should provide came from it,
    equal to it: each checkpoint tensor (memory-mapped, where the file allows) compared where the
    model's is (its device), never the model copied back to the host."""
    import torch

    live = model.state_dict()
    expected = {k for k in live if "lora_" not in k}

    def differs(item: tuple[str, torch.Tensor]) -> bool:
        tensor = live[item[0]]
        return tensor.is_meta or not same_tensor(tensor, item[1])

    with torch.no_grad():
        saved = list(checkpoint_tensors(path))
        seen = {key for key, _ in saved}
        unexpected = sorted(key for key, _ in saved if key not in live)
        known = [(key, tensor) for key, tensor in saved if key in live]
        # On a CPU the comparisons (memcmp, which lets the GIL go) run on the torch threads: each
        # mostly waits for pages of the memory-mapped files. To a GPU, one tensor at a time.
        on_cpu = all(t.device.type == "cpu" for t in live.values())
        with ThreadPoolExecutor(max(1, torch.get_num_threads()) if on_cpu else 1) as pool:
            mismatched = sorted(key for (key, _), bad in zip(known, pool.map(differs, known)) if bad)
    # Buffers that the model computes itself (rope tables) are not in checkpoints.
    missing = sorted(k for k in expected - seen if not k.endswith(("cos_cached", "sin_cached", "inv_freq")))
    problems = []
    if missing:
        problems.append(f"{len(missing)} model tensors missing from the checkpoint (e.g. {missing[:3]})")
    if unexpected:
        problems.append(f"{len(unexpected)} checkpoint tensors match no model tensor (e.g. {unexpected[:3]})")
    if mismatched:
        problems.append(f"{len(mismatched)} tensors differ after loading (e.g. {mismatched[:3]})")
    if problems:
        raise ValueError(f"checkpoint {path} did not load cleanly: " + "; ".join(problems))
    log.info("verified %d checkpoint tensors against the loaded model", len(seen))


def same_tensor(live: Any, saved: Any) -> bool:
    """Whether `live` holds exactly `saved` (the checkpoint's tensor, cast to `live`'s dtype as the
    load casts it): compared bit for bit on `live`'s device (a NaN the checkpoint holds is
    loaded as itself). On a CPU by `memcmp`, several times faster there than `torch.equal`."""
    import torch

    saved = saved.to(device=live.device, dtype=live.dtype)
    if saved.shape != live.shape:
        return False
    if not (live.is_contiguous() and saved.is_contiguous()):
        return bool(torch.equal(live, saved))
    if live.device.type == "cpu":
        return live.nbytes == 0 or _libc().memcmp(live.data_ptr(), saved.data_ptr(), live.nbytes) == 0
    return bool(torch.equal(live.reshape(-1).view(torch.uint8), saved.reshape(-1).view(torch.uint8)))


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
        libc.memcmp.restype = ctypes.c_int
        _LIBC = libc
    return _LIBC


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, Any]]:
    """Every tensor of the checkpoint in `path` by the model's name for it (the VAE's under
    `audio_vae.`), memory-mapped where the file allows (a legacy torch file is read whole)."""
    for prefix, safetensors_file, torch_file in (("", "model.safetensors", "pytorch_model.bin"),
                                                  ("audio_vae.", "audiovae.safetensors", "audiovae.pth")):
        if (path / safetensors_file).exists():
            from safetensors import safe_open

            with safe_open(str(path / safetensors_file), framework="pt") as f:
                for key in f.keys():
                    yield prefix + key, f.get_tensor(key)
            continue
        import torch

        try:
            loaded = torch.load(path / torch_file, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError:     # saved in the legacy format, which cannot be mapped
            loaded = torch.load(path / torch_file, map_location="cpu", weights_only=True)
        loaded = loaded.get("state_dict", loaded)
        for key in list(loaded):
            yield prefix + key, loaded.pop(key)
