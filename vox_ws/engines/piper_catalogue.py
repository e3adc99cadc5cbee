"""The Piper voices that can be fetched by name: the voices repository's own catalogue,
`voices.json` (rhasspy/piper-voices, as piper-tts's `--download-dir` and wyoming-piper read it),
downloaded through huggingface_hub's client within its bound (`hub_download`: `HF_ENDPOINT` for a
mirror, `HF_TOKEN`), a copy kept beside the hub's cache for `HF_HUB_OFFLINE`
(`kept_catalogue_path`), and read into typed entries.

    {"en_US-lessac-medium": {"language": {"code": "en_US", "name_english": "English", ...},
                             "quality": "medium", "num_speakers": 1,
                             "files": {"en/en_US/lessac/medium/en_US-lessac-medium.onnx":
                                           {"size_bytes": 63201294, "md5_digest": "..."}, ...}}, ...}

The file is read within MAX_CATALOGUE_BYTES, and refused by its size before it is fetched where
the hub says it is bigger; a document that is no such catalogue is refused whole, naming why
(`CatalogueUnreadable`); an entry that is not a voice's (no voice name, no files, sizes past what
the server reads, speakers past MAX_SPEAKERS) is skipped and counted, so one odd entry upstream
costs only itself. What an entry says is printed on terminals (`models list --available`): its
language code and quality are taken only where they are such (else the name's), and its
language's name is plain text of at most MAX_LANGUAGE_NAME characters (`plain`).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote

from ..files import NOT_AN_OBJECT, UnreadableJson, read_json_object
from .hub_download import TooLarge, Transfer, deadline_for, download
from .piper_hub import PIPER_VOICES_REPO, files_of, looks_like_voice, reach
from .piper_voices import MAX_CONFIG_BYTES, MAX_MODEL_BYTES

CATALOGUE_FILE = "voices.json"
# The catalogue listed 100-odd voices in about 1 MB when this was written (some 8 KB an entry,
# MODEL_CARDs' sizes and digests included): eight times that leaves room to grow, and bounds what
# a hostile mirror can make a server hold.
MAX_CATALOGUE_BYTES = 8 << 20
# How long the catalogue's download may take in all.
CATALOGUE_DEADLINE_S = deadline_for(MAX_CATALOGUE_BYTES)
# The most speakers an entry may list (LibriTTS's voice has 904), and the longest language name
# shown ("Norwegian Bokmål", "Chinese (Simplified)": under 30).
MAX_SPEAKERS = 1 << 16
MAX_LANGUAGE_NAME = 40
QUALITIES = ("x_low", "low", "medium", "high")
_LANGUAGE_CODE = re.compile(r"[a-z]{2,3}_[A-Z]{2}")


class CatalogueUnreadable(ValueError):
    """A catalogue that is too big, not JSON, or not a map of voices; the message says which."""


class CatalogueNotKept(LookupError):
    """Offline (`HF_HUB_OFFLINE`), and no catalogue was ever fetched here."""


@dataclass(frozen=True)
class CatalogueVoice:
    """One voice of the catalogue: what `models list --available` and the admin route show."""

    name: str                    # en_US-lessac-medium
    language: str                # its code, en_US
    language_name: str           # in English (the catalogue's name_english), else its own
    quality: str                 # x_low, low, medium, high
    speakers: int
    files: dict[str, int]        # repository path -> bytes, of the two files a fetch takes

    @property
    def size_bytes(self) -> int:
        return sum(self.files.values())

    def as_dict(self) -> dict[str, Any]:
        return {"name": self.name, "language": self.language, "language_name": self.language_name,
                "quality": self.quality, "speakers": self.speakers, "size_bytes": self.size_bytes}


@dataclass(frozen=True)
class Catalogue:
    voices: dict[str, CatalogueVoice]      # by name, in the catalogue's order
    skipped: int = 0                       # entries that were no voice's

    def in_language(self, language: str | None) -> list[CatalogueVoice]:
        """The voices of a language (`en`: every English one; `en_GB`: those of one region)."""
        if not language:
            return list(self.voices.values())
        wanted = language.replace("-", "_").lower()
        return [v for v in self.voices.values()
                if v.language.lower() == wanted or v.language.lower().split("_")[0] == wanted]


def fetch_catalogue(folder: Path | str | None = None, revision: str | None = None,
                    transfer: Transfer | None = None) -> Catalogue:
    """The catalogue from the hub, a copy kept (or, offline, the copy kept). HubUnreachable for
    a hub that does not answer (one request, unretried; its message names `folder`, where a
    voice goes by hand), CatalogueUnreadable for a catalogue refused, CatalogueNotKept offline
    without a copy; `hub_download`'s errors for a hub that sends other than it may or too
    slowly (`transfer`: the deadline and the stop; CATALOGUE_DEADLINE_S by default), and the
    hub's own (not found)."""
    from huggingface_hub import constants, hf_hub_url

    kept = kept_catalogue_path(revision)
    if constants.HF_HUB_OFFLINE:
        if not kept.is_file():
            raise CatalogueNotKept(f"HF_HUB_OFFLINE is set and no catalogue ({CATALOGUE_FILE}) was fetched here "
                                   f"before (it is kept at {kept})")
        return read_catalogue(kept)
    hub = f"{constants.ENDPOINT}/{PIPER_VOICES_REPO}/tree/{revision or 'main'}"
    by_hand = folder or "the voices folder"
    reach(CATALOGUE_FILE, revision, f"the voices are listed at {hub}; a voice is added by hand by "
                                    f"putting its NAME.onnx and NAME.onnx.json in {by_hand}")
    with tempfile.TemporaryDirectory(prefix="vox-ws-catalogue-") as staging:
        try:
            fetched = download(hf_hub_url(PIPER_VOICES_REPO, CATALOGUE_FILE, revision=revision), CATALOGUE_FILE,
                               Path(staging), MAX_CATALOGUE_BYTES, transfer or Transfer(CATALOGUE_DEADLINE_S))
        except TooLarge as exc:
            raise CatalogueUnreadable(f"{exc}, over {MAX_CATALOGUE_BYTES}: refused unfetched") from None
        catalogue = read_catalogue(fetched)
        _keep(fetched, kept)
    return catalogue


def kept_catalogue_path(revision: str | None = None) -> Path:
    """Where the last catalogue fetched is kept, for `HF_HUB_OFFLINE`: beside the hub's cache
    (`HF_HOME`), one a revision."""
    from huggingface_hub import constants

    return Path(constants.HF_HOME) / "vox-ws" / f"voices.{quote(revision or 'main', safe='')}.json"


def _keep(fetched: Path, kept: Path) -> None:
    """A copy of the catalogue read, put in place whole; none where it cannot be written (a
    home that is read-only): the catalogue is served all the same."""
    partial = kept.with_name(kept.name + ".partial")
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fetched, partial)
        os.replace(partial, kept)
    except OSError:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)


def read_catalogue(path: str | os.PathLike) -> Catalogue:
    """A catalogue file, read within MAX_CATALOGUE_BYTES and parsed; CatalogueUnreadable
    naming why it is none."""
    try:
        document = read_json_object(path, MAX_CATALOGUE_BYTES)
    except UnreadableJson as exc:
        why = "not a map of voices (a JSON object)" if str(exc) == NOT_AN_OBJECT else str(exc)
        raise CatalogueUnreadable(f"{CATALOGUE_FILE} unreadable: {why}") from None
    voices, skipped = {}, 0
    for name, entry in document.items():
        voice = _entry(name, entry)
        if voice is None:
            skipped += 1
        else:
            voices[name] = voice
    if document and not voices:
        raise CatalogueUnreadable(f"{CATALOGUE_FILE} lists no voice the server can fetch "
                                  f"({skipped} entries, none a Piper voice's)")
    return Catalogue(voices, skipped)


def _entry(name: str, entry: Any) -> CatalogueVoice | None:
    """One entry as a voice, or None for one that is none: a name that is no Piper voice's,
    fields of the wrong kind, the files a fetch takes missing, unsized or sized past what the
    server reads of such a file, or speakers past MAX_SPEAKERS."""
    if not looks_like_voice(name) or not isinstance(entry, dict):
        return None
    language, files = entry.get("language"), entry.get("files")
    if not isinstance(language, dict) or not isinstance(files, dict):
        return None
    sizes = {}
    for path, ceiling in zip(files_of(name), (MAX_MODEL_BYTES, MAX_CONFIG_BYTES)):
        size = (files.get(path) or {}).get("size_bytes") if isinstance(files.get(path), dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= ceiling:
            return None
        sizes[path] = size
    speakers = entry.get("num_speakers", 1)
    said = language.get("name_english") or language.get("name_native") or ""
    if not isinstance(speakers, int) or isinstance(speakers, bool) or speakers > MAX_SPEAKERS or \
            not isinstance(said, str):
        return None
    code, quality = language.get("code"), entry.get("quality")
    code = code if isinstance(code, str) and _LANGUAGE_CODE.fullmatch(code) else name.split("-", 1)[0]
    quality = quality if quality in QUALITIES else name.rsplit("-", 1)[1]
    return CatalogueVoice(name, code, plain(said, MAX_LANGUAGE_NAME), quality, max(1, speakers), sizes)


def plain(text: str, most: int) -> str:
    """`text` as one plain line of at most `most` characters: no control, format or
    line-breaking character (a terminal's escapes, a bidirectional override, a forged line)."""
    kept = "".join(ch for ch in text[:most * 4] if not unicodedata.category(ch).startswith(("C", "Zl", "Zp")))
    return kept[:most]


def on_disk(folder: Path | None) -> set[str]:
    """The voices in a voices folder, by name (a model with its config beside it)."""
    if folder is None or not folder.is_dir():
        return set()
    return {model.stem for model in folder.glob("*.onnx")
            if model.with_name(model.name + ".json").exists() or model.with_suffix(".json").exists()}

