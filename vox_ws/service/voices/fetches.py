"""Piper voices fetched by name while the server runs, and removed: an operator's act (the admin
routes `POST` and `DELETE /v1/admin/voices/{name}`), as Speaches fetches and removes its models
through its API. A voice goes into the folder the engine serves its voices from
(`Voices.folder`: `--piper-voices-dir`, or the one `models pull piper:NAME` fills, which is what
a container mounts), and is served once the answer is sent: the fetch ends with a rescan
(`voice_rescans`), and the answer says whether the voice is served or why not.

    catalogue   the voices repository's voices.json (`engines/piper_catalogue`), kept
                CATALOGUE_TTL_S; what may be fetched, and each file's size, which bounds the fetch.
                One look at the hub at a time, which every caller meanwhile waits for
    fetch       downloaded on a thread of its own into a temporary folder and checked there
                (`engines/piper_hub.fetch_voice`); then, in turn with the other fetches and the
                removals, placed whole and served (a rescan). A second fetch of the same name
                while one runs is refused (`under_way`)
    remove      a voice of the folder: its model, then its config; never a file a voice named at
                start is read through, by whatever name it is asked for

Whatever the hub does, it holds nothing but its own fetch: the routes' lock is taken only to
place and rescan, never across a download (a removal asked while a fetch holds it is answered
at once, `folder_busy`); each download has a deadline (`hub_download.deadline_for` its size; the
catalogue's CATALOGUE_DEADLINE_S) after which it is given up, and runs on a daemon thread that a
fetch given up, or the server's exit, abandons (told to stop, never waited for): the shutdown's
bound holds with a hub that stalls.

Every refusal is a `VoiceFetchRefused` with a `FetchRefusal` the front door answers by.
"""

from __future__ import annotations

import asyncio
import atexit
import enum
import logging
import os
import shutil
import tempfile
import threading
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
    HUB_ERROR = "hub_error"                    # the hub answered an error, sent more or fewer bytes than
                                               # it may, or a catalogue refused
    HUB_TOO_SLOW = "hub_too_slow"              # a download not done by its deadline
    BUSY = "folder_busy"                       # a removal while a voice is being placed in the folder
    VOICE_REFUSED = "voice_refused"            # the hub's voice is none the server can serve
    NOT_WRITABLE = "folder_not_writable"       # the folder cannot be written (rights, a full disk)
    NO_HUB_CLIENT = "no_hub_client"            # huggingface_hub is not installed


class VoiceFetchRefused(Exception):
    def __init__(self, reason: FetchRefusal, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class VoiceFetches:
    """Create it beside the rescans; every verb runs on the event loop that serves.
    `deadline_s`: how long a download of so many bytes may take in all (`hub_download`)."""

    def __init__(self, devices: Devices, rescans: VoiceRescans, catalogue_ttl_s: float = CATALOGUE_TTL_S,
                 clock: Callable[[], float] = time.monotonic,
                 deadline_s: Callable[[int], float] | None = None) -> None:
        from ...engines.hub_download import deadline_for

        self.devices = devices
        self.rescans = rescans
        self.catalogue_ttl_s = catalogue_ttl_s
        self.deadline_s = deadline_s or deadline_for
        self._clock = clock
        self._catalogue: tuple[float, Any] | None = None      # (fetched at, Catalogue)
        self._catalogue_look: asyncio.Future | None = None     # the look at the hub under way
        self._one_at_a_time: asyncio.Lock | None = None        # placing and removing, in turn
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
                                    "(LANG_REGION-DATASET-QUALITY, at most 64 characters, e.g. en_US-lessac-medium)")
        if name in self._fetching:
            raise VoiceFetchRefused(FetchRefusal.UNDER_WAY, f"voice {name!r} is being fetched now")
        self._check_absent(folder, name)
        self._fetching.add(name)
        # Its own task: a caller that goes (a client that hung up) leaves it to finish, and the
        # name stays taken (`_fetching`) until it has placed the voice or given the download up.
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
            fetched = await self._download(name, entry)       # holding nothing but the name
            try:
                async with self._lock():
                    self._check_absent(folder, name)
                    await asyncio.to_thread(_place, fetched, folder)
                    why_not = await self._rescan_for(name)
                    if why_not is not None:
                        # Fetched whole and checked, and still not served (its model does not load
                        # here): taken back out, so the folder holds no voice left out at each rescan.
                        await asyncio.to_thread(_remove_files, Path(folder.path), name)
                        await self.rescans.rescan()
                        raise VoiceFetchRefused(FetchRefusal.VOICE_REFUSED, f"{why_not}; its files were removed")
            finally:
                _discard(fetched.staging)
        finally:
            self._fetching.discard(name)
        log.info("piper voice %s fetched into %s and served", name, folder.path)
        return {**entry.as_dict(), "voice": name, "folder": folder.path, "served": True}

    async def _download(self, name: str, entry: Any) -> Any:
        """The voice's files, downloaded and checked on a thread of its own (`FetchedVoice`),
        within the deadline for its size; given up (the thread told to stop, its files removed
        once it ends) when that passes or this is cancelled."""
        from ...engines.hub_download import Transfer

        deadline_s = self.deadline_s(entry.size_bytes)
        transfer = Transfer(deadline_s)
        folder = self.folder().path
        return await _off_the_loop(lambda: _pull(name, folder, entry.files, transfer), transfer, f"voice {name!r}",
                                   orphaned=lambda fetched: _discard(fetched.staging))

    async def remove(self, name: str) -> dict[str, Any]:
        """Remove a voice of the folder (its model, then its config) and stop serving it; a
        stream speaking it goes on to its end."""
        from ...engines.piper_voices import servable_name

        folder = self.folder()
        self._check_ready()
        if name in folder.named_at_start:
            raise VoiceFetchRefused(FetchRefusal.NAMED_AT_START, f"voice {name!r} is named at start "
                                    "(--piper-voice): the server needs it; remove it from its options first")
        root = Path(folder.path)
        # A name no voice can have (a path, a hidden file, one too long for a file name) names none.
        if not servable_name(name) or not await asyncio.to_thread((root / f"{name}.onnx").is_file):
            raise VoiceFetchRefused(FetchRefusal.UNKNOWN_VOICE, f"no voice {name!r} in the voices folder "
                                    f"{folder.path}")
        kept = await asyncio.to_thread(_kept_file, root, name, folder.kept_files)
        if kept is not None:
            raise VoiceFetchRefused(FetchRefusal.NAMED_AT_START, f"voice {name!r} is read from {kept}, as a voice "
                                    "named at start (--piper-voice) is: the server needs it")
        if name in self._fetching:
            raise VoiceFetchRefused(FetchRefusal.UNDER_WAY, f"voice {name!r} is being fetched now")
        if self._lock().locked():
            raise VoiceFetchRefused(FetchRefusal.BUSY, "a voice is being placed in the voices folder, or "
                                    "removed, now: try again in a moment")
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
        """The catalogue kept, or a new look at the hub: one at a time, which every caller
        meanwhile shares (a caller that goes leaves it to the others)."""
        now = self._clock()
        if not fresh and self._catalogue is not None and now - self._catalogue[0] < self.catalogue_ttl_s:
            return self._catalogue[1]
        if self._catalogue_look is None:
            self._catalogue_look = asyncio.ensure_future(self._look_at_the_hub(now))
            self._catalogue_look.add_done_callback(lambda done: done.cancelled() or done.exception())
        return await asyncio.shield(self._catalogue_look)

    async def _look_at_the_hub(self, now: float) -> Any:
        from ...engines.hub_download import Transfer
        from ...engines.piper_catalogue import CATALOGUE_DEADLINE_S

        folder = self.folder().path
        transfer = Transfer(CATALOGUE_DEADLINE_S)
        try:
            catalogue = await _off_the_loop(lambda: _fetch_catalogue(folder, transfer), transfer,
                                            "the catalogue")
        finally:
            self._catalogue_look = None
        self._catalogue = (now, catalogue)
        return catalogue

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


async def _off_the_loop(work: Callable[[], Any], transfer: Any, what: str,
                       orphaned: Callable[[Any], None] = lambda _: None) -> Any:
    """`work()` (a download) on a daemon thread of its own, awaited within its transfer's
    deadline. Not on the loop's executor: `asyncio.run` and the interpreter's exit wait for that
    one's threads, and a download must never hold the exit. Given up past the deadline
    (HUB_TOO_SLOW), or when this is cancelled (a server that stops): the thread is told to stop,
    never waited for, and what it returns once nobody takes it goes to `orphaned`."""
    loop = asyncio.get_running_loop()
    outcome = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if error is not None:
            outcome.set_exception(error)
        else:
            outcome.set_result(result)

    def run() -> None:
        result, error = None, None
        try:
            result = work()
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits
            error = exc
        try:
            loop.call_soon_threadsafe(settle, result, error)
        except RuntimeError:                                 # the loop is closed: nobody will take it
            if error is None:
                orphaned(result)

    def unclaimed(done: asyncio.Future) -> None:
        if not done.cancelled() and done.exception() is None:
            orphaned(done.result())

    threading.Thread(target=run, name="vox-ws-voice-fetch", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(outcome), transfer.deadline_s)
    except BaseException as exc:
        transfer.stop.set()
        outcome.add_done_callback(unclaimed)
        if isinstance(exc, asyncio.TimeoutError):
            raise VoiceFetchRefused(FetchRefusal.HUB_TOO_SLOW, f"the hub did not send {what} in time: a "
                                    f"download must be done within {transfer.deadline_s:.0f} s") from None
        raise


def _fetch_catalogue(folder: str, transfer: Any) -> Any:
    """The catalogue, its failures as refusals (on a download's thread)."""
    try:
        from ...engines.hub_download import HubMisbehaved, HubTooSlow
        from ...engines.piper_catalogue import CatalogueNotKept, CatalogueUnreadable, fetch_catalogue
        from ...engines.piper_hub import HubUnreachable
    except ImportError as exc:
        raise VoiceFetchRefused(FetchRefusal.NO_HUB_CLIENT, f"the hub's client is not installed "
                                f"({exc.name}): pip install '.[piper]' in a checkout of vox-ws") from None
    try:
        return fetch_catalogue(folder, transfer=transfer)
    except HubUnreachable as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, str(exc)) from None
    except CatalogueNotKept as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, f"the catalogue could not be fetched: {exc}") from None
    except CatalogueUnreadable as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, f"the hub's catalogue was refused: {exc}") from None
    except HubTooSlow as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_TOO_SLOW, str(exc)) from None
    except HubMisbehaved as exc:
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - the hub's own errors (not found, a server error): one line
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, _hub_said(exc)) from None


def _pull(name: str, folder: str, sizes: dict[str, int], transfer: Any) -> Any:
    """The voice downloaded into a temporary folder of its own and checked (`FetchedVoice`),
    bounded by the catalogue's sizes and `transfer`; its failures as refusals, its temporary
    folder then removed (on a download's thread)."""
    from huggingface_hub import constants

    from ...engines.hub_download import DownloadStopped, HubMisbehaved, HubTooSlow
    from ...engines.piper_hub import HubUnreachable, VoiceRefused, by_hand_hint, fetch_voice, files_of, reach

    if constants.HF_HUB_OFFLINE:
        raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, "the server runs with HF_HUB_OFFLINE set: it "
                                "fetches nothing (`vox-ws models pull piper:NAME` where the hub is reached)")
    blocked = _unwritable(Path(folder))
    if blocked is not None:
        raise VoiceFetchRefused(FetchRefusal.NOT_WRITABLE, f"the voices folder {folder} cannot be "
                                f"written ({blocked} is not writable by this process)")
    staging = _staging()
    try:
        config_file = files_of(name)[1]
        reach(config_file, None, by_hand_hint(name, config_file, None, Path(folder)))
        return fetch_voice(name, staging, None, sizes, transfer)
    except BaseException as exc:
        _remove_staging(staging)
        if isinstance(exc, HubUnreachable):
            raise VoiceFetchRefused(FetchRefusal.HUB_UNREACHABLE, str(exc)) from None
        if isinstance(exc, VoiceRefused):
            raise VoiceFetchRefused(FetchRefusal.VOICE_REFUSED, str(exc)) from None
        if isinstance(exc, (HubTooSlow, DownloadStopped)):
            raise VoiceFetchRefused(FetchRefusal.HUB_TOO_SLOW, str(exc)) from None
        if isinstance(exc, HubMisbehaved):
            raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, str(exc)) from None
        if not isinstance(exc, Exception):
            raise
        # huggingface_hub's not-found errors are OSErrors too: what the hub said is told apart
        # from a folder that could not be written by where the error comes from.
        if isinstance(exc, OSError) and not type(exc).__module__.startswith(("huggingface_hub", "httpx")):
            raise VoiceFetchRefused(FetchRefusal.NOT_WRITABLE, f"voice {name!r} not downloaded into {staging}: "
                                    f"{exc.strerror or exc}") from None
        raise VoiceFetchRefused(FetchRefusal.HUB_ERROR, _hub_said(exc)) from None


def _place(fetched: Any, folder: VoiceFolder) -> None:
    """A voice fetched into the folder, whole or not at all (on a worker thread)."""
    from ...engines.piper_hub import place_voice

    try:
        place_voice(fetched, Path(folder.path))
    except OSError as exc:
        raise VoiceFetchRefused(FetchRefusal.NOT_WRITABLE, f"voice {fetched.name!r} not placed in {folder.path}: "
                                f"{exc.strerror or exc}; nothing was left there") from None


# The downloads' temporary folders not removed yet: each goes once its voice is placed or given
# up, and those left at the exit (a download abandoned mid-way: its thread is never waited for) then.
_STAGED: set[Path] = set()
_STAGED_LOCK = threading.Lock()


def _staging() -> Path:
    """A new temporary folder for a download, removed at the exit if it is still there then."""
    with _STAGED_LOCK:
        atexit.unregister(_discard_all)                  # registered once, however many downloads
        atexit.register(_discard_all)
        staging = Path(tempfile.mkdtemp(prefix="vox-ws-voice-"))
        _STAGED.add(staging)
    return staging


def _remove_staging(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    with _STAGED_LOCK:
        _STAGED.discard(staging)


def _discard(staging: Path) -> None:
    """A download's temporary folder removed, on a thread of its own (from the loop, or once the
    loop has closed)."""
    threading.Thread(target=_remove_staging, args=(staging,), name="vox-ws-voice-discard", daemon=True).start()


def _discard_all() -> None:
    for staging in list(_STAGED):
        _remove_staging(staging)


def _kept_file(root: Path, name: str, kept_files: frozenset[str]) -> str | None:
    """Which of the files removing `name` would delete is one a voice named at start is read
    through (by its own path, a link to it, or any other way to it), if any."""
    kept = {os.path.realpath(path) for path in kept_files}
    for path in _files_of(root, name):
        if os.path.lexists(path) and os.path.realpath(path) in kept:
            return str(path)
    return None


def _unwritable(folder: Path) -> Path | None:
    """The folder, or the nearest of its parents that exists where it does not yet, if this
    process cannot make files in it; None: it can."""
    existing = next((p for p in (folder, *folder.parents) if p.exists()), folder)
    return None if os.access(existing, os.W_OK | os.X_OK) else existing


def _files_of(root: Path, name: str) -> tuple[Path, Path, Path]:
    """A voice's model, then the two names its config may have."""
    return root / f"{name}.onnx", root / f"{name}.onnx.json", root / f"{name}.json"


def _remove_files(root: Path, name: str) -> None:
    """A voice's model first (the name that makes the folder serve it), then its config."""
    model, *configs = _files_of(root, name)
    model.unlink(missing_ok=True)
    for config in configs:
        if config.is_file():
            config.unlink()
            break


def _hub_said(exc: Exception) -> str:
    return f"the hub answered {type(exc).__name__}: {exc}"
