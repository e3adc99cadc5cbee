"""Piper voices by name, from the Piper voices repository on the Hugging Face hub
(rhasspy/piper-voices), as wyoming-piper fetches them: `vox-ws models pull piper:en_US-lessac-medium`.

A voice's name says where it is: `LANG_REGION-DATASET-QUALITY` lies at
`LANG/LANG_REGION/DATASET/QUALITY/NAME.onnx`, its config beside it (`NAME.onnx.json`). Both are
downloaded through huggingface_hub's client (`HF_ENDPOINT` for a mirror, `HF_TOKEN`) within
bounds (`hub_download`: each file at most what the catalogue says with SIZE_SLACK and never
past what the server would read, the whole by a deadline, stoppable) into a temporary folder,
checked there (its config read as the server reads it, within its bound; its model not plainly
something else: `piper_voices`), and only then placed in the voices folder (`DEFAULT_VOICES_DIR`,
or `--dir`) under the voice's name, where the server serves every voice by its file's name: a
voice refused leaves nothing there, nor anywhere else.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .hub_download import TooLarge, Transfer, deadline_for, download
from .piper_voices import (
    MAX_CONFIG_BYTES,
    MAX_MODEL_BYTES,
    MAX_NAME_CHARS,
    UnreadableVoiceConfig,
    UnusableVoiceModel,
    check_model,
    read_voice,
)

PIPER_VOICES_REPO = "rhasspy/piper-voices"
# Where pulled voices go, and what the server serves by default when it exists.
DEFAULT_VOICES_DIR = "~/.local/share/vox-ws/piper-voices"
# A file bigger than its catalogue says by more than this is refused (unfetched where the hub says
# so, else read no further): a voice re-exported in place changes by a few bytes, not by a factor.
SIZE_SLACK = 1.25
_VOICE_NAME = re.compile(r"(?P<lang>[a-z]{2,3})_(?P<region>[A-Z]{2})-(?P<dataset>[A-Za-z0-9_]+)-"
                         r"(?P<quality>x_low|low|medium|high)")


def _voice_match(name: str) -> re.Match | None:
    """A Piper voice's name, no longer than a voice served may be named (a file name the file
    system takes)."""
    return _VOICE_NAME.fullmatch(name) if len(name) <= MAX_NAME_CHARS else None


def files_of(name: str) -> tuple[str, str]:
    """The repository paths of a voice's model and config; ValueError for a name that is not a
    Piper voice's (`en_US-lessac-medium`)."""
    match = _voice_match(name)
    if match is None:
        raise ValueError(f"{name!r} is not a Piper voice's name (LANG_REGION-DATASET-QUALITY, at most "
                         f"{MAX_NAME_CHARS} characters, e.g. en_US-lessac-medium; the list: "
                         "https://huggingface.co/rhasspy/piper-voices)")
    folder = f"{match['lang']}/{match['lang']}_{match['region']}/{match['dataset']}/{match['quality']}"
    return f"{folder}/{name}.onnx", f"{folder}/{name}.onnx.json"


def looks_like_voice(name: str) -> bool:
    """Whether `name` is a Piper voice's (`en_US-lessac-medium`): what `models pull` given it
    without `piper:` meant, as no hub checkpoint is named so."""
    return _voice_match(name) is not None


def pulled_voices_dir() -> Path:
    """Where `models pull piper:NAME` puts a voice without `--dir`: the folder the server serves,
    VOX_WS_PIPER_VOICES_DIR (`serve --piper-voices-dir`'s variable, which the images set), else
    DEFAULT_VOICES_DIR. In a container, a pull then lands in its mounted voices folder."""
    return Path(os.environ.get("VOX_WS_PIPER_VOICES_DIR") or DEFAULT_VOICES_DIR).expanduser()


def default_voices_dir() -> Path | None:
    """The voices folder the server reads when none is given: the one pulls fill, if it exists."""
    folder = pulled_voices_dir()
    return folder if folder.is_dir() else None


class VoiceRefused(ValueError):
    """A voice fetched that is no voice the server could serve (its config unreadable or over
    its bound, its model plainly none); nothing of it was placed."""


class HubUnreachable(ConnectionError):
    """The hub did not answer at all; the message says how to place the voice by hand."""


@dataclass(frozen=True)
class FetchedVoice:
    """A voice's two files downloaded and checked, in a temporary folder (`staging`), not yet
    placed."""

    name: str
    staging: Path
    config: Path
    model: Path


def pull_voice(name: str, directory: str | None = None, revision: str | None = None,
               sizes: Mapping[str, int] | None = None, transfer: Transfer | None = None) -> Path:
    """Fetch a voice into the voices folder; returns its model's path there. VoiceRefused for
    one the server could not serve, or (`sizes`: the catalogue's, by repository path) one the
    hub says is bigger than the catalogue does: the folder is left as it was. `transfer`: the
    download's deadline and stop (by default the time the biggest voice the server reads may take)."""
    config_file = files_of(name)[1]
    target = Path(directory).expanduser() if directory else pulled_voices_dir()
    reach(config_file, revision, by_hand_hint(name, config_file, revision, target))
    transfer = transfer or Transfer(deadline_for(MAX_CONFIG_BYTES + MAX_MODEL_BYTES))
    with tempfile.TemporaryDirectory(prefix="vox-ws-voice-") as staging:
        return place_voice(fetch_voice(name, Path(staging), revision, sizes, transfer), target)


def fetch_voice(name: str, staging: Path, revision: str | None, sizes: Mapping[str, int] | None,
                transfer: Transfer) -> FetchedVoice:
    """A voice's config, then its model, downloaded into `staging` and checked: VoiceRefused for
    a voice the server could not serve (the config first: one refused costs no model's
    download), HubMisbehaved (`hub_download`) for a hub that sends other than it may."""
    model_file, config_file = files_of(name)
    try:
        config = _download(config_file, revision, staging, _most(config_file, sizes, MAX_CONFIG_BYTES), transfer)
        read_voice(name, model_file, str(config))
        model = _download(model_file, revision, staging, _most(model_file, sizes, MAX_MODEL_BYTES), transfer)
        check_model(name, str(model))
    except (UnreadableVoiceConfig, UnusableVoiceModel) as exc:
        raise VoiceRefused(f"{exc}; nothing was placed") from None
    return FetchedVoice(name, staging, config, model)


def place_voice(fetched: FetchedVoice, target: Path) -> Path:
    """A fetched voice into the voices folder `target` (made where it is not), its config
    first, under its name; its model's path there. An OSError (a full disk, a folder not
    writable) leaves no half voice, nor a folder made for it."""
    made = [folder for folder in (target, *target.parents) if not folder.exists()]    # innermost first
    target.mkdir(parents=True, exist_ok=True)
    placed: list[Path] = []
    try:
        # The config first: the model's name is what makes the folder serve a voice.
        placed.append(_place(fetched.config, target / f"{fetched.name}.onnx.json"))
        return _place(fetched.model, target / f"{fetched.name}.onnx")
    except OSError:
        # No half voice, nor a folder left empty that the server would then serve by default.
        for path in placed:
            path.unlink(missing_ok=True)
        for folder in made:
            try:
                folder.rmdir()                              # only while empty
            except OSError:
                break
        raise


def _most(path: str, sizes: Mapping[str, int] | None, ceiling: int) -> tuple[int, str]:
    """The most bytes a file of a voice may be, and why: what its catalogue says with
    SIZE_SLACK, never past what the server reads of such a file (`ceiling`)."""
    if sizes is not None and path in sizes and sizes[path] * SIZE_SLACK + 4096 < ceiling:
        return int(sizes[path] * SIZE_SLACK) + 4096, f"its catalogue says {sizes[path]}"
    return ceiling, f"over {ceiling} bytes"


def _download(path: str, revision: str | None, staging: Path, most: tuple[int, str], transfer: Transfer) -> Path:
    from huggingface_hub import hf_hub_url

    bound, why = most
    try:
        return download(hf_hub_url(PIPER_VOICES_REPO, path, revision=revision), path, staging, bound, transfer)
    except TooLarge as exc:
        raise VoiceRefused(f"{exc}, {why}; nothing was placed") from None


def reach(path: str, revision: str | None, hint: str) -> None:
    """One request to the hub for a file of the voices repository, unretried: huggingface_hub
    retries a hub that does not answer five times over some 23 s (its warnings each time) and
    then names no way around it; HubUnreachable says `hint` instead. A hub that answers,
    whatever it answers, is left to hf_hub_download."""
    from huggingface_hub import constants, get_session, hf_hub_url
    from huggingface_hub.utils import build_hf_headers

    url = hf_hub_url(PIPER_VOICES_REPO, path, revision=revision)
    try:
        get_session().head(url, headers=build_hf_headers(), follow_redirects=False,
                           timeout=constants.HF_HUB_ETAG_TIMEOUT)
    except Exception as exc:  # noqa: BLE001 - the HTTP client's transport errors: no answer at all
        raise HubUnreachable(f"the hub ({constants.ENDPOINT}) did not answer ({type(exc).__name__}: {exc}); "
                             f"{hint}") from None


def by_hand_hint(name: str, config_file: str, revision: str | None, target: Path) -> str:
    """How to add a voice without the hub's client: the two files to put in the voices folder."""
    from huggingface_hub import constants

    tree = f"{constants.ENDPOINT}/{PIPER_VOICES_REPO}/tree/{revision or 'main'}"
    folder = f"{tree}/{config_file.rsplit('/', 1)[0]}"
    return f"to add the voice by hand, put {name}.onnx and {name}.onnx.json (from {folder}) in {target}"


def _place(cached: Path, path: Path) -> Path:
    """A downloaded file at `path`: a hard link where the two share a file system, else a copy,
    written through a temporary name (an interrupted pull leaves no half voice; the folder's
    rescans read `*.onnx` and its configs only), taken back out where it cannot be finished (a
    full disk)."""
    partial = path.with_name(path.name + ".partial")
    partial.unlink(missing_ok=True)
    try:
        try:
            os.link(cached.resolve(), partial)
        except OSError:
            shutil.copyfile(cached, partial)
        os.replace(partial, path)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise
    return path
