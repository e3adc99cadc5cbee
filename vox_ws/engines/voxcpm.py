"""VoxCPM2 behind the shared scheduler: loading, options, voices and LoRA.

Loading goes through the package's own `VoxCPM.from_pretrained`; generation goes through
`voxcpm_batch.BatchedVoxCPM2`, which advances every active stream in one batched step.
"""

from __future__ import annotations

import logging
import os
import re
import secrets
import sys
import threading
import types
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ..audio import decode_audio_file
from ..engine import Engine, GenerationRequest, StepResult
from ..protocol import BAD_REQUEST, OPTION_SPECS, TOO_LARGE, UNSUPPORTED, ProtocolError
from .voxcpm_batch import build_prompt, prompt_positions

log = logging.getLogger("vox_ws.engines.voxcpm")

DEFAULT_MODEL = "openbmb/VoxCPM2"
VOICE_MODES = ("reference", "continuation", "both")
MAX_VOICES = 256
# The package's own defaults, used when a request leaves an option out.
DEFAULTS = {"cfg_value": 2.0, "inference_timesteps": 10, "min_len": 2, "max_len": 4096}


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


class VoxCPMEngine(Engine):
    name = "voxcpm"
    supported_options = frozenset(OPTION_SPECS) - {"denoise"}
    OPTION_NAMES = frozenset({"model", "device", "threads", "optimize", "load_denoiser", "max_batch", "voices_dir",
                              "lora_rank", "lora_alpha", "lora_dir", "warm_normalizer"})

    def __init__(self, model: str | None = None, device: str = "auto", threads: int = 1, optimize: bool = False,
                 load_denoiser: bool = False, max_batch: int = 8, voices_dir: str | None = None,
                 lora_rank: int = 0, lora_alpha: int | None = None, lora_dir: str | None = None,
                 warm_normalizer: bool = False) -> None:
        self.model = model or DEFAULT_MODEL
        self.device = device or "auto"
        self.max_step_batch = max_batch
        self._threads = threads
        self._optimize = optimize
        self._load_denoiser = load_denoiser
        self._voices_dir = Path(voices_dir) if voices_dir else None
        self._lora_rank = lora_rank
        self._lora_alpha = lora_alpha if lora_alpha is not None else 2 * lora_rank
        self._lora_dir = Path(lora_dir) if lora_dir else None
        self._warm_normalizer = warm_normalizer
        self.lora: dict[str, Any] = {"configured": lora_rank > 0, "loaded": None, "enabled": False}
        self.tts = None            # voxcpm.VoxCPM
        self.runner = None         # BatchedVoxCPM2
        self._builtin: dict[str, dict] = {}
        self._registered: OrderedDict[str, dict] = OrderedDict()
        self._voices_lock = threading.Lock()
        self._normalizer = None
        self.dtype = ""
        self.architecture = ""

    # ------------------------------------------------------------------ loading

    def load(self) -> None:
        import torch

        from .voxcpm_batch import BatchedVoxCPM2

        if self._threads:
            torch.set_num_threads(self._threads)
        os.environ.setdefault("TQDM_DISABLE", "1")
        path = resolve_model_path(self.model)
        voxcpm = import_voxcpm()
        lora_config = None
        if self._lora_rank > 0:
            from voxcpm.model.voxcpm2 import LoRAConfig

            lora_config = LoRAConfig(enable_lm=True, enable_dit=True, enable_proj=False, r=self._lora_rank,
                                     alpha=self._lora_alpha)
        if self._load_denoiser:
            self._check_denoiser_dependencies()
        self.architecture = _architecture(path)
        if self.architecture != "voxcpm2":
            raise ValueError(f"{path} is a {self.architecture!r} checkpoint; the batched engine serves VoxCPM2 only")
        self.tts = voxcpm.VoxCPM.from_pretrained(
            str(path), load_denoiser=self._load_denoiser, optimize=self._optimize,
            device=None if self.device == "auto" else self.device, lora_config=lora_config,
        )
        model = self.tts.tts_model
        verify_weights(model, path)
        self.device = str(model.device)
        self.dtype = str(model.config.dtype)
        self.sample_rate = int(model.sample_rate)
        self.runner = BatchedVoxCPM2(model, self.max_step_batch)
        if self._warm_normalizer:
            self._normalize("Warm up 123.")
        if self._voices_dir is not None:
            self._load_builtin_voices(self._voices_dir)
        # One short generation warms every code path before the first user arrives.
        row = self.runner.prefill(self._prompt("Hello.", None), seed=0, cfg_value=2.0, timesteps=2, min_len=0,
                                  max_len=1)
        try:
            self.runner.step([row])
        finally:
            self.runner.release(row)
        self.runner.wait_ready()

    def _check_denoiser_dependencies(self) -> None:
        try:
            import modelscope  # noqa: F401
        except ImportError:
            raise RuntimeError(
                "--load-denoiser needs the `modelscope` package and the ZipEnhancer weights "
                "(iic/speech_zipenhancer_ans_multiloss_16k_base) in the local ModelScope cache; "
                "neither is installed by vox-ws"
            ) from None

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "dtype": self.dtype, "lora": dict(self.lora),
                "max_batch": self.max_step_batch}

    # ------------------------------------------------------------------ requests

    def voices(self) -> list[str]:
        return sorted(self._builtin)

    def _voice_cache(self, voice: str | None) -> dict | None:
        if voice is None:
            return None
        with self._voices_lock:
            cache = self._builtin.get(voice) or self._registered.get(voice)
            if voice in self._registered:
                self._registered.move_to_end(voice)
        return cache

    def has_voice(self, voice: str) -> bool:
        return self._voice_cache(voice) is not None

    def check(self, request: GenerationRequest) -> None:
        self.check_voice(request.voice)
        if request.options.get("denoise") and self.tts is not None and self.tts.denoiser is None:
            raise ProtocolError(BAD_REQUEST, "option 'options.denoise' needs a server started with --load-denoiser")
        text = clean_text(request.text)
        if not text:
            raise ProtocolError(BAD_REQUEST, "field 'text' has nothing to say after whitespace cleanup")
        if self.runner is not None and not request.options.get("normalize"):
            positions, tokens = prompt_positions(self.tts.tts_model, text, self._voice_cache(request.voice))
            if not self.runner.fits(positions, tokens, request.options.get("max_len", DEFAULTS["max_len"])):
                raise ProtocolError(TOO_LARGE, f"text and voice prompt take {positions} positions; with the audio "
                                               f"they need, the model's {self.runner.max_len} are not enough: "
                                               "send a shorter text")
        if "seed" not in request.options:
            # A fixed seed per request keeps its audio reproducible; the client may choose it.
            request.options = {**request.options, "seed": secrets.randbits(63)}

    def prefill(self, request: GenerationRequest) -> None:
        options = {**DEFAULTS, **request.options}
        text = clean_text(request.text)
        if options.get("normalize"):
            text = self._normalize(text)
        model = self.tts.tts_model
        cache = self._voice_cache(request.voice)
        if request.context is not None:
            # Continue from the previous segment of the same stream: its text and generated audio
            # become the prompt (after the voice's own), so prosody carries over.
            merged = model.merge_prompt_cache(cache, request.context["text"], request.context["audio_feat"])
            if self.runner.fits(*prompt_positions(model, text, merged), options["max_len"]):
                cache = merged
        if not self.runner.fits(*prompt_positions(model, text, cache), options["max_len"]):
            raise ValueError("text too long for the model's context after normalization")
        prompt = self._prompt(text, cache)
        request.state = self.runner.prefill(prompt, seed=options["seed"], cfg_value=options["cfg_value"],
                                            timesteps=options["inference_timesteps"], min_len=options["min_len"],
                                            max_len=options["max_len"])
        if request.keep_continuation:
            request.state.patches = []
            request.state.text = text

    def step(self, batch: list[GenerationRequest]) -> list[StepResult]:
        results = self.runner.step([r.state for r in batch])
        return [StepResult(audio=None if audio is None else audio.numpy(), finished=reason)
                for audio, reason in results]

    def release(self, request: GenerationRequest) -> None:
        row = request.state
        if row is not None:
            self.runner.release(row)
            if row.patches:
                import torch

                request.continuation = {"text": row.text, "audio_feat": torch.stack(row.patches)}
        request.state = None

    def _prompt(self, text: str, cache: dict | None):
        return build_prompt(self.tts.tts_model, text, cache)

    def _normalize(self, text: str) -> str:
        if self._normalizer is None:
            from voxcpm.utils.text_normalize import TextNormalizer

            self._normalizer = TextNormalizer()
        return self._normalizer.normalize(text)

    # ------------------------------------------------------------------ voices (scheduler thread)

    supports_voices = True

    def register_voice(self, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str,
                       name: str | None = None) -> dict[str, Any]:
        """Build a voice's prompt cache once; returns its id. Runs on the scheduler thread."""
        cache = self._encode_voice(audio, sample_rate, transcript, mode)
        voice_id = name or "v_" + secrets.token_urlsafe(12)
        with self._voices_lock:
            target = self._builtin if name else self._registered
            target[voice_id] = cache
            while len(self._registered) > MAX_VOICES:
                self._registered.popitem(last=False)
        return {"voice": voice_id, "mode": mode, "audio_s": round(len(audio) / sample_rate, 3)}

    def delete_voice(self, voice_id: str) -> bool:
        with self._voices_lock:
            return self._registered.pop(voice_id, None) is not None

    def _encode_voice(self, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str) -> dict:
        import soxr
        import torch

        model = self.tts.tts_model
        rate = model._encode_sample_rate
        pcm = np.asarray(audio, dtype=np.float32)
        if sample_rate != rate:
            pcm = soxr.resample(pcm, sample_rate, rate, quality="HQ").astype(np.float32)

        def encode(padding: str) -> torch.Tensor:
            # VoxCPM2Model._encode_wav, from samples instead of a file path.
            wav = torch.from_numpy(pcm).unsqueeze(0)
            patch_len = model.patch_size * model.chunk_size
            if wav.size(1) % patch_len:
                pad = patch_len - wav.size(1) % patch_len
                wav = torch.nn.functional.pad(wav, (pad, 0) if padding == "left" else (0, pad))
            with torch.inference_mode():
                feat = model.audio_vae.encode(wav.to(model.device), rate).cpu()
            return feat.view(model.audio_vae.latent_dim, -1, model.patch_size).permute(1, 2, 0)

        cache: dict[str, Any] = {}
        if mode in ("reference", "both"):
            cache["ref_audio_feat"] = encode("right")
        if mode in ("continuation", "both"):
            cache["prompt_text"] = clean_text(transcript or "")
            cache["audio_feat"] = encode("left")
        cache["mode"] = {"reference": "reference", "continuation": "continuation", "both": "ref_continuation"}[mode]
        return cache

    def _load_builtin_voices(self, folder: Path) -> None:
        for wav in sorted(folder.glob("*.wav")) + sorted(folder.glob("*.flac")):
            transcript_file = wav.with_suffix(".txt")
            transcript = transcript_file.read_text(encoding="utf-8").strip() if transcript_file.exists() else None
            audio, rate = decode_audio_file(wav.read_bytes())
            mode = "both" if transcript else "reference"
            self.register_voice(audio, rate, transcript, mode, name=wav.stem)
            log.info("built-in voice %r from %s (%s)", wav.stem, wav, mode)

    # ------------------------------------------------------------------ LoRA (scheduler thread)

    def lora_op(self, op: str, name: str | None) -> dict[str, Any]:
        """load / unload / enable / disable. Applied between two steps, so streams in flight
        continue with the new weights from their next chunk."""
        if not self.lora["configured"]:
            raise ProtocolError(UNSUPPORTED, "LoRA is not configured: start the server with --lora-rank N")
        model = self.tts.tts_model
        result: dict[str, Any] = {"op": op}
        if op == "load":
            path = self._lora_path(name)
            loaded, skipped = model.load_lora_weights(str(path))
            if not loaded:
                raise ProtocolError(BAD_REQUEST, f"LoRA {name!r} matched no parameter of this model "
                                                 f"({len(skipped)} skipped)")
            model.set_lora_enabled(True)
            self.lora.update(loaded=name, enabled=True)
            result.update(name=name, loaded=len(loaded), skipped=len(skipped))
        elif op == "unload":
            model.reset_lora_weights()
            self.lora.update(loaded=None, enabled=False)
        elif op in ("enable", "disable"):
            if self.lora["loaded"] is None:
                raise ProtocolError(BAD_REQUEST, "no LoRA is loaded")
            model.set_lora_enabled(op == "enable")
            self.lora["enabled"] = op == "enable"
        else:
            raise ProtocolError(BAD_REQUEST, f"field 'op' must be load, unload, enable or disable, got {op!r}")
        result["lora"] = dict(self.lora)
        return result

    def _lora_path(self, name: str | None) -> Path:
        if self._lora_dir is None:
            raise ProtocolError(UNSUPPORTED, "no --lora-dir configured: adapters load only from that directory")
        if not name or not re.fullmatch(r"[\w.-]+", name) or name.startswith("."):
            raise ProtocolError(BAD_REQUEST, "field 'name' must be an adapter name (letters, digits, '.', '_', '-')")
        for candidate in (self._lora_dir / name, self._lora_dir / f"{name}.safetensors",
                          self._lora_dir / f"{name}.ckpt", self._lora_dir / f"{name}.pth"):
            if candidate.exists():
                return candidate
        raise ProtocolError(BAD_REQUEST, f"no LoRA adapter named {name!r} in the LoRA directory")


def clean_text(text: str) -> str:
    """The package's own clean-up (VoxCPM._generate): newlines and runs of whitespace to one space."""
    return re.sub(r"\s+", " ", text.replace("\n", " ")).strip()


def _architecture(path: Path) -> str:
    import json

    with open(path / "config.json", encoding="utf-8") as f:
        return str(json.load(f).get("architecture", "voxcpm")).lower()


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
