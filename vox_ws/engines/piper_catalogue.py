"""The Piper voices that can be fetched by name: the voices repository's own catalogue,
`voices.json` (rhasspy/piper-voices, as piper-tts's `--download-dir` and wyoming-piper read it),
fetched by huggingface_hub (into its cache: `HF_ENDPOINT` for a mirror, `HF_TOKEN`, and
`HF_HUB_OFFLINE` served from the cache) and read into typed entries.

    {"en_US-lessac-medium": {"language": {"code": "en_US", "name_english": "English", ...},
                             "quality": "medium", "num_speakers": 1,
                             "files": {"en/en_US/lessac/medium/en_US-lessac-medium.onnx":
                                           {"size_bytes": 63201294, "md5_digest": "..."}, ...}}, ...}

The file is read within MAX_CATALOGUE_BYTES, and refused by its size before it is fetched where
the hub says it is bigger; a document that is no such catalogue is refused whole, naming why
(`CatalogueUnreadable`); an entry that is not a voice's (no voice name, no files) is skipped and
counted, so one odd entry upstream costs only itself.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..files import NOT_AN_OBJECT, UnreadableJson, read_json_object
from .piper_hub import PIPER_VOICES_REPO, files_of, looks_like_voice, reach

CATALOGUE_FILE = "voices.json"
# The catalogue listed 100-odd voices in about 1 MB when this was written (some 8 KB an entry,
# MODEL_CARDs' sizes and digests included): eight times that leaves room to grow, and bounds what
# a hostile mirror can make a server hold.
MAX_CATALOGUE_BYTES = 8 << 20


class CatalogueUnreadable(ValueError):
    """A catalogue that is too big, not JSON, or not a map of voices; the message says which."""


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


def fetch_catalogue(folder: Path | str | None = None, revision: str | None = None) -> Catalogue:
    """The catalogue from the hub (or its cache, offline). HubUnreachable for a hub that does not
    answer (one request, unretried; its message names `folder`, where a voice goes by hand),
    CatalogueUnreadable for a catalogue refused; the hub's own errors (huggingface_hub's: not
    found, offline and not cached) otherwise."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_download, hf_hub_url

    if not constants.HF_HUB_OFFLINE:
        hub = f"{constants.ENDPOINT}/{PIPER_VOICES_REPO}/tree/{revision or 'main'}"
        by_hand = folder or "the voices folder"
        reach(CATALOGUE_FILE, revision, f"the voices are listed at {hub}; a voice is added by hand by "
                                        f"putting its NAME.onnx and NAME.onnx.json in {by_hand}")
        url = hf_hub_url(PIPER_VOICES_REPO, CATALOGUE_FILE, revision=revision)
        size = get_hf_file_metadata(url).size or 0
        if size > MAX_CATALOGUE_BYTES:
            raise CatalogueUnreadable(f"the hub's {CATALOGUE_FILE} is {size} bytes, over "
                                      f"{MAX_CATALOGUE_BYTES}: refused unfetched")
    return read_catalogue(hf_hub_download(PIPER_VOICES_REPO, CATALOGUE_FILE, revision=revision))


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
    fields of the wrong kind, or the files a fetch takes missing or unsized."""
    if not looks_like_voice(name) or not isinstance(entry, dict):
        return None
    language, files = entry.get("language"), entry.get("files")
    if not isinstance(language, dict) or not isinstance(files, dict):
        return None
    sizes = {}
    for path in files_of(name):
        size = (files.get(path) or {}).get("size_bytes") if isinstance(files.get(path), dict) else None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0:
            return None
        sizes[path] = size
    speakers = entry.get("num_speakers", 1)
    code = language.get("code") or name.split("-", 1)[0]
    said = language.get("name_english") or language.get("name_native") or ""
    if not isinstance(speakers, int) or isinstance(speakers, bool) or not all(
            isinstance(v, str) for v in (code, said)):
        return None
    quality = entry.get("quality") if isinstance(entry.get("quality"), str) else name.rsplit("-", 1)[1]
    return CatalogueVoice(name, code, said, quality, max(1, speakers), sizes)


def on_disk(folder: Path | None) -> set[str]:
    """The voices in a voices folder, by name (a model with its config beside it)."""
    if folder is None or not folder.is_dir():
        return set()
    return {model.stem for model in folder.glob("*.onnx")
            if model.with_name(model.name + ".json").exists() or model.with_suffix(".json").exists()}

