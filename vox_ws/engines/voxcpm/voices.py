"""Voice prompts: built from reference audio once, kept by id, used by every stream that names them.

A voice is the package's prompt cache (reference features, continuation features and their
transcript). Built-in voices come from `--voices-dir` and stay. Registered ones are a cache of
the voice store, which is where they live (who may register and delete which is the stream
service's business): beyond `MAX_VOICES` the least recently used is dropped, and built again
from the store when a stream next names it. So voices registered and retired through other
replicas, which this one never hears of, cannot fill it. A stream holds its voice's prompt
itself (`pin_voice`): dropping it from the book never touches a stream speaking with it. The
event loop reads the book (`get`); the engine loop's thread writes it.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np

from ...audio import decode_audio_file
from ...engine import ErrorKind, Refused, Voices
from ...voice_tags import voice_tag
from ..accelerator import exclusive_on
from .positions import clean_text, frames

log = logging.getLogger("vox_ws.engines.voxcpm")

# Registered voices kept built, most recently used first kept (a cache of the store's).
MAX_VOICES = 1024
_CACHE_MODES = {"reference": "reference", "continuation": "continuation", "both": "ref_continuation"}


class VoiceBook:
    def __init__(self) -> None:
        self._builtin: dict[str, dict] = {}
        self._registered: OrderedDict[str, dict] = OrderedDict()     # least recently used first
        self._lock = threading.Lock()

    def builtin(self) -> list[str]:
        return sorted(self._builtin)

    def get(self, voice: str | None) -> dict | None:
        """A voice's prompt cache (None for the model's own voice or an unknown id)."""
        if voice is None:
            return None
        with self._lock:
            if voice in self._registered:
                self._registered.move_to_end(voice)
                return self._registered[voice]
            return self._builtin.get(voice)

    def add(self, cache: dict, name: str | None = None, voice_id: str | None = None) -> str:
        """Keep a voice; a name makes it built-in; else it is registered under `voice_id`, or
        an unguessable id made here."""
        voice_id = name or voice_id or "v_" + secrets.token_urlsafe(12)
        with self._lock:
            if name:
                self._builtin[voice_id] = cache
                return voice_id
            self._registered[voice_id] = cache
            self._registered.move_to_end(voice_id)
            while len(self._registered) > MAX_VOICES:
                dropped, _ = self._registered.popitem(last=False)
                log.info("voice %s dropped from the built voices (least recently used; the store keeps it)",
                         voice_tag(dropped))                # its id is a capability: never logged
        return voice_id

    def __len__(self) -> int:
        with self._lock:
            return len(self._registered)

    def registered(self) -> list[str]:
        """The registered voices built, the least recently used first."""
        with self._lock:
            return list(self._registered)

    def delete(self, voice_id: str) -> bool:
        with self._lock:
            return self._registered.pop(voice_id, None) is not None


def encode_voice(model: Any, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str) -> dict:
    """The prompt cache of a voice, from its reference audio (runs the VAE encoder)."""
    import soxr
    import torch

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
    cache["mode"] = _CACHE_MODES[mode]
    return cache


class VoxCPMVoices(Voices):
    """VoxCPM2's voices (`Engine.voices`): built-in ones from `--voices-dir` and registered ones,
    each a prompt cache in a `VoiceBook`; a stream pins the cache itself, so a voice deleted or
    dropped meanwhile still speaks to the stream's end."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.book = VoiceBook()

    def names(self) -> list[str]:
        return self.book.builtin()

    def has(self, voice: str) -> bool:
        return self.book.get(voice) is not None

    def pin(self, voice: str | None) -> dict | None:
        cache = self.book.get(voice)        # one look: the book may drop it at any time after
        if voice is not None and cache is None:
            self.check(voice)               # refused as any unknown voice
            raise Refused(ErrorKind.INVALID, f"unknown voice {voice!r}: it was just dropped", field="voice")
        return cache

    def register(self, audio: np.ndarray, sample_rate: int, transcript: str | None, mode: str,
                 voice_id: str | None = None, name: str | None = None) -> dict[str, Any]:
        """Build a voice's prompt cache once (`name`: a built-in voice). Runs on a worker thread
        beside the steps: the VAE encoder is only read (inference mode), the book is locked.
        That thread builds each voice on every device in turn: on this engine's as its current."""
        with exclusive_on(self.engine.device):
            cache = encode_voice(self.engine.tts.tts_model, audio, sample_rate, transcript, mode)
        voice_id = self.book.add(cache, name, voice_id)
        return {"voice": voice_id, "mode": mode, "audio_s": round(len(audio) / sample_rate, 3)}

    def delete(self, voice_id: str) -> bool:
        return self.book.delete(voice_id)

    def registered(self) -> list[str]:
        return self.book.registered()

    def summary(self, pin: dict | None) -> dict[str, Any] | None:
        """What the text rules read of a prompt cache (its mode, its transcript, its frames),
        without its tensors: the server process's copy of them counts positions with it."""
        if pin is None:
            return None
        summary: dict[str, Any] = {"mode": pin.get("mode", "continuation")}
        if "prompt_text" in pin:
            summary["prompt_text"] = pin["prompt_text"]
        for features in ("ref_audio_feat", "audio_feat"):
            if features in pin:
                summary[f"{features}_frames"] = frames(pin, features)
        return summary


def builtin_voice_files(folder: Path) -> list[tuple[str, np.ndarray, int, str | None]]:
    """(name, audio, rate, transcript) for every NAME.wav / NAME.flac (+ NAME.txt) in a folder."""
    voices = []
    for path in sorted(folder.glob("*.wav")) + sorted(folder.glob("*.flac")):
        transcript_file = path.with_suffix(".txt")
        transcript = transcript_file.read_text(encoding="utf-8").strip() if transcript_file.exists() else None
        audio, rate = decode_audio_file(path.read_bytes())
        voices.append((path.stem, audio, rate, transcript))
    return voices
