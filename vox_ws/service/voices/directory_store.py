"""The voice store in a local directory (`--voice-store dir:PATH`, the default): the memory
store's voices, written through to one audio file and one JSON file per voice."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import stat
import time
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from ...files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, is_partial, make_private_dir, write_private_file
from .lookalikes import name_key
from .memory_store import MemoryStore
from .store import SECRET_BYTES, StoredVoice, StoreLimits, StoreUnavailable

log = logging.getLogger("vox_ws.service")


class DirectoryStore(MemoryStore):
    """A local directory, read at start: `ID.audio` and `ID.json` per voice, each written through
    a temporary file, synced, and a rename (a crash leaves no half voice). One server per
    directory.

    It is this user's alone: recordings and transcripts are personal, and an unnamed voice's id
    (its files' names) is a capability. It is made 0700 and its files 0600 whatever the umask.
    At start every part of it must be this user's (another user reads what it owns whatever its
    mode: refused, saying what to do), and one that group or others may reach (a store made by
    an earlier version: 0755, voices 0644) is tightened, with a warning saying what was. The
    secret is the one exception (`_secret_file`): one that others may have read is no secret,
    and is refused, as it always was."""

    name = "dir"

    def __init__(self, path: str | Path, limits: StoreLimits, clock: Callable[[], float] = time.time) -> None:
        super().__init__(limits, clock)
        self.path = Path(path).expanduser()

    # The secret named voices' ids are made under, beside the voices, readable by this user only.
    SECRET_FILE = "secret"

    async def open(self) -> None:
        try:
            self._voices = await asyncio.to_thread(self._read_all)
        except OSError as exc:
            raise StoreUnavailable(str(self.path), exc) from None
        self.public.names = {name_key(v.name): v.id for v in self._voices.values()
                             if v.public and v.name is not None}
        await super().open()

    async def _read_secret(self) -> bytes:
        try:
            return await asyncio.to_thread(self._secret_file)
        except OSError as exc:
            raise StoreUnavailable(str(self.path / self.SECRET_FILE), exc) from None

    def _secret_file(self) -> bytes:
        """The secret, made by the first start: written whole or not at all (a failed write
        leaves no file, and the next start makes it), 0600 from its creation, never through a
        link; refused where another user could have read or written it."""
        path = self.path / self.SECRET_FILE
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            made = secrets.token_bytes(SECRET_BYTES)
            if write_private_file(path, made, replace=False):
                return made
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)    # made meanwhile: read as found
        refused = PermissionError(f"{path} must be a file of this user's that no one else may read or write "
                                  "(delete it: named voices then get new ids)")
        with os.fdopen(fd, "rb") as file:
            info = os.fstat(file.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
                raise refused
            kept = file.read(SECRET_BYTES + 1)
        if len(kept) < SECRET_BYTES:
            return self._remade_secret(path, len(kept))
        if info.st_mode & 0o077:
            raise refused
        if len(kept) != SECRET_BYTES:
            raise OSError(f"{path} is not a secret this server made "
                          "(delete it: named voices then get new ids)")
        return kept

    def _remade_secret(self, path: Path, length: int) -> bytes:
        """A new secret in place of one cut short (`length` bytes).

        Versions before this one wrote the secret in place: a first start whose write failed (a
        full disk) left 0 bytes, or some, and every later start refused them. No server ever
        opened the store with such a secret (that write's error stopped its start, and later
        ones refused it), so no named voice's id was made under it, and a new one is made in
        its place. Were some named voices kept under a secret that was whole once and cut short
        since (a file system's crash), `rekey_named` moves them to their ids under the new one
        at start, as it moved those kept before the store had a secret: their owners speak
        with them by name as before; their old ids name nothing."""
        log.warning("%s held %d of the secret's %d bytes (an earlier version's write that failed): "
                    "a new secret is made", path, length, SECRET_BYTES)
        made = secrets.token_bytes(SECRET_BYTES)
        write_private_file(path, made)
        return made

    def _read_all(self) -> dict[str, StoredVoice]:
        make_private_dir(self.path)
        self._make_private()
        voices = {}
        for meta in self.path.glob("v_*.json"):
            audio = meta.with_suffix(".audio")
            try:
                fields = json.loads(meta.read_text(encoding="utf-8"))
                voices[fields["id"]] = StoredVoice(audio=audio.read_bytes(), **fields)
            except (OSError, ValueError, KeyError, TypeError):
                continue             # a voice half written by a crash, or not ours: skipped
        return voices

    def _make_private(self) -> None:
        """Refuses (PermissionError) a store that is not this user's alone; tightens one of this
        user's that others may reach, and removes the temporary files of writes a crash cut
        short. The secret's own rule is `_secret_file`'s."""
        uid = os.geteuid()
        found = os.stat(self.path)          # followed: the store may be a link to a volume's directory
        if not stat.S_ISDIR(found.st_mode) or found.st_uid != uid:
            raise PermissionError(f"{self.path} must be a directory of this user's (uid {uid}; it is uid "
                                  f"{found.st_uid}'s, mode {stat.S_IMODE(found.st_mode):04o}): its owner "
                                  f"reads every voice kept there (chown it to uid {uid}, or name in "
                                  "--voice-store a directory not made yet, which the server makes private)")
        loose, partial, strangers = [], [], 0
        for entry in os.scandir(self.path):
            if not (entry.name.startswith("v_") or is_partial(entry.name)):
                continue      # not a voice (the secret has its own rule); under 0700, out of others' reach
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != uid:
                strangers += 1
            elif is_partial(entry.name) or entry.name.endswith(".partial"):     # and an earlier version's
                partial.append(entry.path)
            elif info.st_mode & 0o077:
                loose.append(entry.path)
        if strangers:
            # Not named one by one: a voice's file is named by its id.
            raise PermissionError(f"{strangers} of the voice files in {self.path} are not regular files "
                                  f"of this user's (uid {uid}): their owners may read or change the voices "
                                  f"(find them with `find {self.path} ! -user {uid} -o ! -type f`, then "
                                  "delete or chown them)")
        for path in partial:
            os.unlink(path)
        tightened = []
        if found.st_mode & 0o077:
            os.chmod(self.path, PRIVATE_DIR_MODE)
            tightened.append(f"the directory, {stat.S_IMODE(found.st_mode):04o} -> {PRIVATE_DIR_MODE:04o}")
        for path in loose:
            os.chmod(path, PRIVATE_FILE_MODE, follow_symlinks=False)
        if loose:
            tightened.append(f"{len(loose)} voice files -> {PRIVATE_FILE_MODE:04o}")
        if tightened:
            log.warning("the voice store %s could be read by other local users (recordings, transcripts, the "
                        "ids that speak with them): made private to this user (%s)", self.path,
                        "; ".join(tightened))

    def describe(self) -> str:
        return f"dir:{self.path}"

    async def put(self, voice: StoredVoice) -> list[str]:
        async with self._lock:
            retired = self._put(voice)
            try:
                await asyncio.to_thread(self._write, voice, retired)
            except OSError as exc:
                self._voices.pop(voice.id, None)
                raise StoreUnavailable(str(self.path), exc) from None
            return retired

    def _write(self, voice: StoredVoice, retired: list[str]) -> None:
        for old in retired:
            self._unlink(old)
        write_private_file(self.path / f"{voice.id}.audio", voice.audio)
        self._write_fields(voice)

    @staticmethod
    def _fields(voice: StoredVoice) -> bytes:
        """A voice's JSON file: every field but its audio. `public` only where true: a private
        voice's file is as the versions before it wrote it (they read it; one that reads a
        field it does not know skips the voice), and one without it is private."""
        fields = {k: v for k, v in asdict(voice).items() if k != "audio" and (k != "public" or v)}
        return json.dumps(fields).encode()

    def _write_fields(self, voice: StoredVoice) -> None:
        write_private_file(self.path / f"{voice.id}.json", self._fields(voice))

    async def _rewrite(self, voice: StoredVoice) -> None:
        try:
            await asyncio.to_thread(self._write_fields, voice)
        except OSError as exc:
            raise StoreUnavailable(str(self.path), exc) from None

    def _unlink(self, voice: str) -> None:
        for suffix in (".json", ".audio"):
            (self.path / f"{voice}{suffix}").unlink(missing_ok=True)

    async def delete(self, voice: str, owner: str) -> bool:
        deleted = await super().delete(voice, owner)
        if deleted:
            await asyncio.to_thread(self._unlink, voice)
        return deleted

    async def expire(self) -> list[str]:
        async with self._lock:
            gone = self._expired()
            for voice in gone:
                await asyncio.to_thread(self._unlink, voice)
            return gone
