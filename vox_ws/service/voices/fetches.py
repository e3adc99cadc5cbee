"""Piper voices fetched by name while the server runs, and removed: an operator's act (the admin
routes `POST` and `DELETE /v1/admin/voices/{name}`), as Speaches fetches and removes its models
through its API. A voice goes into the folder the engine serves its voices from
(`Voices.folder`: `--piper-voices-dir`, or the one `models pull piper:NAME` fills, which is what
a container mounts), and is served once the answer is sent: the fetch ends with a rescan
(`voice_rescans`), and the answer says whether the voice is served or why not.

    catalogue   the voices repository's voices.json (`engines/piper_catalogue`), kept
                CATALOGUE_TTL_S; what may be fetched, and each file's size, which bounds the fetch
    fetch       on a thread (`engines/piper_hub.pull_voice`: checked, then placed whole), one at
                a time; a second fetch of the same name while one runs is refused (`under_way`)
    remove      a voice of the folder (not one named at start): its model, then its config

Every refusal is a `VoiceFetchRefused` with a `FetchRefusal` the front door answers by.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

from ...engine import Readiness, Refused, VoiceFolder
from ...engine_process.devices import Devices
from .rescans import VoiceRescans

log = logging.getLogger("vox_ws.service")

# How long the catalogue fetched is taken as the hub's: it changes when a voice is published
# (a few times a year), and each look at it costs the hub a request (huggingface_hub's own
# cache answers a HEAD each time); a fetch of a voice it does not list looks again.
CATALOGUE_TTL_S = 600.0


class FetchRefusal(str, enum.Enum):
    NO_FOLDER = "no_voices_folder"             # the engine serves no voices folder (VoxCPM2)
    NOT_READY = "not_ready"                    # the engine is loading
    BAD_NAME = "bad_name"                      # no Piper voice's name
    UNKNOWN_VOICE = "unknown_voice"            # not in the catalogue (fetch), not in the folder (remove)
    ALREADY_PRESENT = "already_present"        # in the folder, or served by that name
    UNDER_WAY = "fetch_under_way"              # the same voice being fetched now
    NAMED_AT_START = "named_at_start"          # a --piper-voice: the server needs it
    HUB_UNREACHABLE = "hub_unreachable"        # the hub did not answer, or the server is offline
    HUB_ERROR = "hub_error"                    # the hub answered an error, or a catalogue refused
    VOICE_REFUSED = "voice_refused"            # the hub's voice is none the server can serve
    NOT_WRITABLE = "folder_not_writable"       # the folder cannot be written (rights, a full disk)
    NO_HUB_CLIENT = "no_hub_client"            # huggingface_hub is not installed


class VoiceFetchRefused(Exception):
    def __init__(self, reason: FetchRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class VoiceFetches:
    """Create it beside the rescans; every verb runs on the event loop that serves."""

    def __init__(self, devices: Devices, rescans: VoiceRescans, catalogue_ttl_s: float = CATALOGUE_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.devices = devices
        self.rescans = rescans
        self.catalogue_ttl_s = catalogue_ttl_s
        self._clock = clock
        self._catalogue: tuple[float, Any] | None = None      # (fetched at, Catalogue)
        self._catalogue_lock: asyncio.Lock | None = None       # one look at the hub at a time
        self._one_at_a_time: asyncio.Lock | None = None        # fetches and removals, in turn
        self._fetching: set[str] = set()

    def folder(self) -> VoiceFolder:
        """The folder fetched voices go in; NO_FOLDER where the engine serves none."""
        folder = self.devices.engine.voices.folder()
        if folder is None:
            engine = self.devices.engine.name
            raise VoiceFetchRefused(FetchRefusal.NO_FOLDER, f"engine {engine} serves no voices folder: "
                                    "voices are fetched into Piper's (--piper-voices-dir)")
        return folder

    async def available(self, language: str | None = None) -> dict[str, Any]:
        """The catalogue (one language's voices, `en` or `en_GB`), each voice saying whether it is
        in the folder and whether it is served."""
        folder = self.folder()
        catalogue = await self._current_catalogue()
        from ...engines.piper_catalogue import on_disk

        here = await asyncio.to_thread(on_disk, Path(folder.path))
        served = set(self.devices.engine.voices.names())
        return {"folder": folder.path, "skipped": catalogue.skipped,
                "voices": [{**voice.as_dict(), "in_folder": voice.name in here,
                            "served": voice.name in served} for voice in catalogue.in_language(language)]}

    async def fetch(self, name: str) -> dict[str, Any]:
        """Fetch a voice of the catalogue into the folder and serve it; what was fetched, and
        `served: true` once it is."""
        from ...engines.piper_hub import looks_like_voice

        folder = self.folder()
        self._check_ready()
        if not looks_like_voice(name):
            raise VoiceFetchRefused(FetchRefusal.BAD_NAME, f"{name!r} is not a Piper voice's name "
                                    "(LANG_REGION-DATASET-QUALITY, e.g. en_US-lessac-medium)")
        if name in self._fetching:
            raise VoiceFetchRefused(FetchRefusal.UNDER_WAY, f"voice {name!r} is being fetched now")
        self._check_absent(folder, name)
        self._fetching.add(name)
        # Its own task: a caller that goes (a client that hung up) leaves it to finish, and the
        # name stays taken (`_fetching`) until the thread that downloads it has ended.
        job = asyncio.ensure_future(self._fetch_into(folder, name))
        job.add_done_callback(lambda done: done.cancelled() or done.exception())    # seen, if not awaited
        return await asyncio.shield(job)

    async def _fetch_into(self, folder: VoiceFolder, name: str) -> dict[str, Any]:
        try:
            entry = (await self._current_catalogue()).voices.get(name)
            if entry is None:                               # published since it was read?
                entry = (await self._current_catalogue(fresh=True)).voices.get(name)
            if entry is None:
                raise VoiceFetchRefused(FetchRefusal.UNKNOWN_VOICE, f"no voice {name!r} in the catalogue "
                                        "(GET /v1/admin/voices/available lists them)")
            async with self._lock():
                self._check_absent(folder, name)
                await asyncio.to_thread(_pull, name, folder, entry.files)
                why_not = await self._rescan_for(name)
                if why_not is not None:
                    # Fetched whole and checked, and still not served (its model does not load
                    # here): taken back out, so the folder holds no voice left out at each rescan.
                    await asyncio.to_thread(_remove_files, Path(folder.path), name)
                    await self.rescans.rescan()
                    raise VoiceFetchRefused(FetchRefusal.VOICE_REFUSED, f"{why_not}; its files were removed")
        finally:
            self._fetching.discard(name)
        log.info("piper voice %s fetched into %s and served", name, folder.path)
        return {**entry.as_dict(), "voice": name, "folder": folder.path, "served": True}

    async def remove(self, name: str) -> dict[str, Any]:
        """Remove a voice of the folder (its model, then its config) and stop serving it; a
        stream speaking it goes on to its end."""
        folder = self.folder()
        self._check_ready()
        if name in folder.named_at_start:
            raise VoiceFetchRefused(FetchRefusal.NAMED_AT_START, f"voice {name!r} is named at start "
                                    "(--piper-voice): the server needs it; remove it from its options first")
        root = Path(folder.path)
        if Path(name).name != name or name.startswith(".") or not (root / f"{name}.onnx").is_file():
            raise VoiceFetchRefused(FetchRefusal.UNKNOWN_VOICE, f"no voice {name!r} in the voices folder "
                                    f"{folder.path}")
        if name in self._fetching:
            raise VoiceFetchRefused(FetchRefusal.UNDER_WAY, f"voice {name!r} is being fetched now")
        async with self._lock():
            try:
                await asyncio.to_thread(_remove_files, root, name)
            except OSError as exc:
                raise VoiceFetchRefused(FetchRefusal.NOT_WRITABLE, f"voice {name!r} not removed from "
                                        f"{folder.path}: {exc.strerror or exc}") from None
            await self.rescans.rescan()
        log.info("piper voice %s removed from %s", name, folder.path)
        return {"voice": name, "folder": folder.path, "removed": True,
                "served": name in self.devices.engine.voices.names()}

    # ------------------------------------------------------------------ helpers

    def _lock(self) -> asyncio.Lock:
        if self._one_at_a_time is None:
            self._one_at_a_time = asyncio.Lock()
        return self._one_at_a_time

    def _check_ready(self) -> None:
        if self.devices.status != Readiness.READY:
            raise VoiceFetchRefused(FetchRefusal.NOT_READY, "the engine is not ready: voices are fetched and "
                                    "removed once it serves")

    def _check_absent(self, folder: VoiceFolder, name: str) -> None:
        if (Path(folder.path) / f"{name}.onnx").exists() or self.devices.engine.voices.has(name):
            raise VoiceFetchRefused(FetchRefusal.ALREADY_PRESENT, f"voice {name!r} is in the voices folder "
                                    "already (DELETE it first to fetch it again)")

    async def _current_catalogue(self, fresh: bool = False) -> Any:
        if self._catalogue_lock is None:
            self._catalogue_lock = asyncio.Lock()
        async with self._catalogue_lock:
            now = self._clock()
            if fresh or self._catalogue is None or now - self._catalogue[0] >= self.catalogue_ttl_s:
                folder = self.folder().path
                self._catalogue = (now, await asyncio.to_thread(_fetch_catalogue, folder))
            return self._catalogue[1]

    async def _rescan_for(self, name: str) -> str | None:
        """Rescan, and say why the voice is not served on some device (None: it is everywhere).
        A look of the poll may have served it first: what counts is what is served after."""
        await self.rescans.rescan()
        for engine_loop in self.devices.ready:
            try:
                engine_loop.engine.voices.check(name)
            except Refused as err:
                return err.message
        return None


def _fetch_catalogue(folder: str) -> Any:
    """The catalogue, its failures as refusals (on a worker thread)."""
    try:
        from huggingface_hub import constants
        from huggingface_hub.errors import LocalEntryNotFoundError

        from ...engines.piper_catalogue import CatalogueUnreadable, fetch_catalogue
        from ...engines.piper_hub import HubUnreachable
    except ImportError as exc:
        raise VoiceFetchRefused(FetchRefusal.NO_HUB_CLIENT, f"the hub's client is not installed "
                                f"({exc.name}): pip install 'vox-ws[piper]'") from None
    try:
        return fetch_catalogue(folder)
    except HubUnreachable as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, str(exc)) from None
    except LocalEntryNotFoundError:
        offline = " (HF_HUB_OFFLINE is set, and it is not cached)" if constants.HF_HUB_OFFLINE else ""
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE,
                                f"the catalogue could not be fetched{offline}") from None
    except CatalogueUnreadable as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, f"the hub's catalogue was refused: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - the hub's own errors (not found, a server error): one line
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, _hub_said(exc)) from None


def _pull(name: str, folder: VoiceFolder, sizes: dict[str, int]) -> None:
    """`pull_voice` into the folder, bounded by the catalogue's sizes, its failures as refusals
    (on a worker thread)."""
    from huggingface_hub import constants

    from ...engines.piper_hub import HubUnreachable, VoiceRefused, pull_voice

    if constants.HF_HUB_OFFLINE:
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, "the server runs with HF_HUB_OFFLINE set: it "
                                "fetches nothing (`vox-ws models pull piper:NAME` where the hub is reached)")
    blocked = _unwritable(Path(folder.path))
    if blocked is not None:
        raise VoiceFetchRefused(FetchRefusal.NOT_WRITABLE, f"the voices folder {folder.path} cannot be "
                                f"written ({blocked} is not writable by this process)")
    try:
        pull_voice(name, folder.path, sizes=sizes)
    except HubUnreachable as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, str(exc)) from None
    except VoiceRefused as exc:
        raise VoiceFetchRefused(FetchRefusal.VOICE_REFUSED, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the hub's own errors (not found, a server error): one line
        # huggingface_hub's not-found errors are OSErrors too: what the hub said is told apart
        # from a folder that could not be written by where the error comes from.
        if isinstance(exc, OSError) and not type(exc).__module__.startswith(("huggingface_hub", "httpx")):
            raise VoiceFetchRefused(FetchRefusal.NOT_WRITABLE, f"voice {name!r} not placed in {folder.path}: "
                                    f"{exc.strerror or exc}; nothing was left there") from None
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, _hub_said(exc)) from None


def _unwritable(folder: Path) -> Path | None:
    """The folder, or the nearest of its parents that exists where it does not yet, if this
    process cannot make files in it; None: it can."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), folder)
    return None if os.access(existing, os.W_OK | os.X_OK) else existing


def _remove_files(root: Path, name: str) -> None:
    """A voice's model first (the name that makes the folder serve it), then its config."""
    (root / f"{name}.onnx").unlink(missing_ok=True)
    for config in (root / f"{name}.onnx.json", root / f"{name}.json"):
        if config.is_file():
            config.unlink()
            break


def _hub_said(exc: Exception) -> str:
    return f"the hub answered {type(exc).__name__}: {exc}"
