"""Piper voices by name, from the Piper voices repository on the Hugging Face hub
(rhasspy/piper-voices), as wyoming-piper fetches them: `vox-ws models pull piper:en_US-lessac-medium`.

A voice's name says where it is: `LANG_REGION-DATASET-QUALITY` lies at
`LANG/LANG_REGION/DATASET/QUALITY/NAME.onnx`, its config beside it (`NAME.onnx.json`). Both are
fetched by huggingface_hub (resumable, a progress bar, `HF_ENDPOINT` for a mirror, `HF_TOKEN`)
into its cache, checked (its config read as the server reads it, within its bound; its model not
plainly something else: `piper_voices`), and only then placed in the voices folder
(`DEFAULT_VOICES_DIR`, or `--dir`) under the voice's name, where the server serves every voice
by its file's name: a voice refused leaves nothing there.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from .piper_voices import UnreadableVoiceConfig, UnusableVoiceModel, check_model, read_voice

PIPER_VOICES_REPO = "rhasspy/piper-voices"
# Where pulled voices go, and what the server serves by default when it exists.
DEFAULT_VOICES_DIR = "~/.local/share/vox-ws/piper-voices"
_VOICE_NAME = re.compile(r"(?P<lang>[a-z]{2,3})_(?P<region>[A-Z]{2})-(?P<dataset>[A-Za-z0-9_]+)-"
                         r"(?P<quality>x_low|low|medium|high)")


def files_of(name: str) -> tuple[str, str]:
    """The repository paths of a voice's model and config; ValueError for a name that is not a
    Piper voice's (`en_US-lessac-medium`)."""
    match = _VOICE_NAME.fullmatch(name)
    if match is None:
        raise ValueError(f"{name!r} is not a Piper voice's name (LANG_REGION-DATASET-QUALITY, e.g. "
                         "en_US-lessac-medium; the list: https://huggingface.co/rhasspy/piper-voices)")
    folder = f"{match['lang']}/{match['lang']}_{match['region']}/{match['dataset']}/{match['quality']}"
    return f"{folder}/{name}.onnx", f"{folder}/{name}.onnx.json"


def default_voices_dir() -> Path | None:
    """The voices folder the server reads when none is given: the one pulls fill, if it exists."""
    folder = Path(DEFAULT_VOICES_DIR).expanduser()
    return folder if folder.is_dir() else None


class VoiceRefused(ValueError):
    """A voice fetched that is no voice the server could serve (its config unreadable or over
    its bound, its model plainly none); nothing of it was placed."""


def pull_voice(name: str, directory: str | None = None, revision: str | None = None) -> Path:
    """Fetch a voice into the voices folder; returns its model's path there. VoiceRefused for
    one the server could not serve: the folder is left as it was."""
    from huggingface_hub import hf_hub_download

    model_file, config_file = files_of(name)
    try:
        # The config first: one refused costs no model's download.
        config = Path(hf_hub_download(PIPER_VOICES_REPO, config_file, revision=revision))
        read_voice(name, model_file, str(config))
        model = Path(hf_hub_download(PIPER_VOICES_REPO, model_file, revision=revision))
        check_model(name, str(model))
    except (UnreadableVoiceConfig, UnusableVoiceModel) as exc:
        raise VoiceRefused(f"{exc}; nothing was placed") from None
    target = Path(directory or DEFAULT_VOICES_DIR).expanduser()
    target.mkdir(parents=True, exist_ok=True)
    # The config first: the model's name is what makes the folder serve a voice.
    _place(config, target / f"{name}.onnx.json")
    return _place(model, target / f"{name}.onnx")


def _place(cached: Path, path: Path) -> Path:
    """The cached file at `path`: a hard link where the two share a file system, else a copy,
    written through a temporary name (an interrupted pull leaves no half voice)."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        os.link(cached.resolve(), partial)
    except OSError:
        shutil.copyfile(cached, partial)
    os.replace(partial, path)
    return path
