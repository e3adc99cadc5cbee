"""Registered voices, kept where every replica finds them and a restart does not lose them.

What is stored is what rebuilds a voice on any server: the reference audio as uploaded, its
transcript and mode, under an id made from their content and the owner's (so registering the
same audio twice gives the same id), with its owner and when it was stored. The prompt an
engine computes from it is not stored: each server builds it on first use (a VAE pass).

Rules, enforced by every store (atomically in Redis, across replicas):
- an owner keeps at most `per_owner` voices (a client token's), or `per_address` (a client
  without a token, known by its address): one more retires that owner's oldest, never anyone
  else's;
- a voice of an owner without a token expires `ttl_s` after it was registered: with the small
  per-address quota, no handful of addresses fills the store for good;
- voices of owners without a token hold at most half the store's places together, and those
  of one network (`addresses.network_of`: a /24, an IPv6 /48) at most a sixteenth (never
  fewer than one owner's quota): beyond, a registration without a token is refused (`busy`),
  so no set of addresses locks every new owner out, and clients with tokens never;
- the store holds at most `max_voices` voices and `max_bytes` bytes of audio: beyond either a
  registration is refused (`busy`) until voices are deleted: nothing is evicted for it;
- only the owner (or an admin) deletes a voice; another owner's voice looks like no voice.
- a public voice (`public`, its owner's choice: at registration or later, `public.set`) has a
  name no other public voice has (a second is refused, `public_name_taken`); caps, shares and
  expiry are its owner's as for its other voices (an anonymous owner's public voice expires
  with its others: publishing a voice gives it no place in the store that it did not have).

Owners are stored as a hash of their name (a name may be a client token).

A voice's id is a capability or a name. One registered without a name has an id made from its
audio and owner: whoever holds it may speak with it, and nobody computes it without the audio.
A named voice's id is an HMAC of its owner and name under the store's own secret (made once,
kept with the voices, shared by the replicas of a shared store): no client computes it, and
only its owner (or an admin) speaks with it, by name or by id, unless its owner made it public:
then anyone the server serves speaks with it by its name (`PublicVoices.resolve`: a caller's own voice
of that name first), and it is listed to them; its id stays its owner's named id, so publishing
or not never moves it.

    memory        this process only (tests, or a server that wants no state)
    dir:PATH      a local directory: one audio file and one JSON file per voice (the default)
    redis://...   a Redis server, shared by replicas (the `redis` package's asyncio client)
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import stat
import time
from abc import ABC, abstractmethod
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

from ..addresses import network_of
from ..engine import ErrorKind, Refused
from ..files import PRIVATE_DIR_MODE, PRIVATE_FILE_MODE, is_partial, make_private_dir, write_private_file
from ..logs import VOICE_ID, voice_tag

log = logging.getLogger("vox_ws.service")

ANY_OWNER = "admin"
# The owner a client without a token is: this and its address (its voices are the anonymous ones).
ADDRESS_OWNER_PREFIX = "address:"
# A page of another origin without a token is its visitor's address, this, and its origin's digest
# (`transports.auth.page_owner`): an owner without a token, of its address's network.
PAGE_OWNER_MARK = " page:"


def is_anonymous(owner: str) -> bool:
    return owner.startswith(ADDRESS_OWNER_PREFIX)


@dataclass(frozen=True)
class StoredVoice:
    id: str
    audio: bytes               # the reference audio file, as uploaded (WAV, FLAC or OGG)
    transcript: str | None
    mode: str
    owner: str                 # the owner's hash (`owner_key`)
    created: float
    name: str | None = None    # what its owner calls it (its id is then made from the name)
    anonymous: bool = False    # its owner presented no token
    expires: float | None = None   # when it is gone (time.time()); None: never
    network: str | None = None     # an anonymous owner's network, hashed (`network_key`)
    public: bool = False           # anyone served speaks with it by its name (a named voice only)

    def expired(self, now: float) -> bool:
        return self.expires is not None and self.expires <= now

    def summary(self) -> VoiceSummary:
        return VoiceSummary(self.id, self.mode, self.transcript, len(self.audio), self.created, self.name,
                            self.owner, self.expires, self.public)


@dataclass(frozen=True)
class VoiceSummary:
    """What an owner is told of one of its voices (never the audio); an admin also its owner's
    key."""
    id: str
    mode: str
    transcript: str | None
    audio_bytes: int
    created: float
    name: str | None = None
    owner: str = ""
    expires: float | None = None
    public: bool = False


@dataclass(frozen=True)
class StoreLimits:
    per_owner: int
    max_voices: int
    max_bytes: int
    per_address: int = 4
    ttl_s: float = 0.0                      # an anonymous voice's life; 0: for ever

    def cap_of(self, anonymous: bool) -> int:
        return self.per_address if anonymous else self.per_owner

    @property
    def anonymous(self) -> int:
        """Places that voices of owners without a token may hold together."""
        return max(self.per_address, self.max_voices // 2)

    @property
    def per_network(self) -> int:
        """Places that voices of owners without a token in one network may hold together."""
        return max(self.per_address, self.max_voices // 16)

    def refuse_share(self, anonymous: int, in_network: int) -> None:
        """Refuses (BUSY) one more voice without a token beside `anonymous` such voices, of which
        `in_network` in its network."""
        if anonymous + 1 > self.anonymous:
            raise Refused(ErrorKind.BUSY, f"voices registered without a token hold their share of the store "
                                          f"({self.anonymous}): try again once some expire, or register with a token")
        if in_network + 1 > self.per_network:
            raise Refused(ErrorKind.BUSY, f"voices registered without a token from your network hold its share of the "
                                          f"store ({self.per_network}): try again once some expire, or register "
                                          "with a token")

    def refuse_full(self, voices: int, size: int, adding: int) -> None:
        if voices + 1 > self.max_voices:
            raise Refused(ErrorKind.BUSY, f"the voice store holds {self.max_voices} voices: delete some first")
        if size + adding > self.max_bytes:
            raise Refused(ErrorKind.BUSY, f"the voice store holds {self.max_bytes} bytes of audio: delete some first")


def owner_key(owner: str) -> str:
    return hashlib.sha256(b"vox-ws owner\0" + owner.encode()).hexdigest()[:32]


def network_key(owner: str) -> str | None:
    """The network of an owner without a token (its address's), hashed as owners are; None for
    an owner with a token."""
    if not is_anonymous(owner):
        return None
    address = owner[len(ADDRESS_OWNER_PREFIX):].partition(PAGE_OWNER_MARK)[0]
    return owner_key("network:" + network_of(address))


def is_registered_id(voice: str) -> bool:
    """Whether a name has the shape of a registered voice's id (built-in names never do; no log
    line holds one: `logs.VOICE_ID`)."""
    return VOICE_ID.fullmatch(voice) is not None


# A voice's name: what a client speaks it by, unique per owner. Letters of any script, digits
# and " _.'-", as a person names a voice; not the shape of an id.
MAX_VOICE_NAME_CHARS = 64
_VOICE_NAME = re.compile(r"[^\W_][\w .'-]{0,%d}" % (MAX_VOICE_NAME_CHARS - 1))


def check_voice_name(name: Any) -> str:
    """A voice's name as a client gives it; raises Refused (INVALID, field "name")."""
    if not isinstance(name, str) or not _VOICE_NAME.fullmatch(name) or name != name.strip() \
            or is_registered_id(name):
        raise Refused(ErrorKind.INVALID, f"a voice's name is 1-{MAX_VOICE_NAME_CHARS} letters, digits, spaces or "
                                         f"_.'- starting with a letter or digit, got {name!r}", field="name")
    return name


def is_voice_name(name: str) -> bool:
    try:
        check_voice_name(name)
    except Refused:
        return False
    return True


# The secret named voices' ids are made under: this many random bytes, made once per store.
SECRET_BYTES = 32


def named_voice_id(secret: bytes, key: str, name: str) -> str:
    """The id of the voice called `name` by the owner whose key (`owner_key`) is `key`: an HMAC
    of the two under the store's `secret`, so that every server sharing the store finds the
    voice by its name without a lookup, one owner's names never reach another's voices, and
    no client computes another's id."""
    return _digest_id(hmac.new(secret, digestmod=hashlib.sha256), b"vox-ws named voice", key.encode(), name.encode())


def voice_id(owner: str, audio: bytes, transcript: str | None, mode: str) -> str:
    """The id of a voice: its content and its owner's, hashed; unguessable without the audio."""
    return _digest_id(hashlib.sha256(), b"vox-ws voice", owner_key(owner).encode(), mode.encode(),
                      (transcript or "").encode(), audio)


def _digest_id(digest: Any, *parts: bytes) -> str:
    for part in parts:
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    return "v_" + base64.b32encode(digest.digest()[:20]).decode().lower().rstrip("=")


def may_speak_with(stored_owner: str, name: str | None, owner: str, public: bool = False) -> bool:
    """Whether `owner` may speak with a voice kept for `stored_owner` (a key) under `name`: any
    holder of an unnamed voice's id may; a named voice is its owner's (and an admin's), or, made
    public, anyone's."""
    return name is None or public or owner == ANY_OWNER or stored_owner == owner_key(owner)


def public_name_taken(name: str) -> Refused:
    """The refusal of a public voice whose name another public voice has."""
    return Refused(ErrorKind.INVALID, f"another public voice is named {name!r}: choose another name",
                   field="name")


def nameless_public() -> Refused:
    return Refused(ErrorKind.INVALID, "a public voice needs a name (what others speak it by): give it one",
                   field="name")


# How long an unavailable store is given before a client tries again: nothing measures when it
# comes back (a Redis fail-over takes seconds).
STORE_RETRY_AFTER_S = 1.0


class StoreUnavailable(Refused):
    """The store cannot be reached or refuses the operation: voice operations fail
    (`not_ready`, retryable), built-in voices are unaffected."""

    def __init__(self, what: str, exc: BaseException | None = None) -> None:
        why = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        super().__init__(ErrorKind.NOT_READY, f"the voice store is unavailable ({what}){why}", STORE_RETRY_AFTER_S)


class VoiceStore(ABC):
    """Where registered voices live. Every method is a coroutine; none blocks the loop."""

    name = "store"
    # Whether other servers use it too (a voice may appear or go through them).
    shared = False

    def __init__(self, limits: StoreLimits, clock: Callable[[], float] = time.time) -> None:
        self.limits = limits
        self.clock = clock
        self._secret: bytes | None = None
        self.opened = False                  # its secret read: named voices are known from then
        self.public: PublicVoices            # its public voices (each store's kind of `PublicVoices`)

    async def open(self) -> None:
        """Read what the store keeps (its secret, and for some its voices); StoreUnavailable
        when it cannot be read. Named voices are unknown until it has been."""
        if self._secret is None:
            self._secret = await self._read_secret()
        self.opened = True

    @abstractmethod
    async def _read_secret(self) -> bytes:
        """The store's secret, made by the first server to ask for it."""

    def named_id(self, key: str, name: str) -> str:
        """The id of the voice called `name` by the owner whose key (`owner_key`) is `key`
        (`named_voice_id`)."""
        if self._secret is None:
            raise StoreUnavailable("it has not been read yet")
        return named_voice_id(self._secret, key, name)

    async def has(self, voice: str) -> bool:
        return await self.get(voice) is not None

    def usable_now(self, voice: str, owner: str) -> bool | None:
        """Whether the store has the voice and `owner` may speak with it (`may_speak_with`; for
        ANY_OWNER: whether it has it), where that is known without waiting (a store in this
        process); None where it must be asked (`usable`)."""
        return None

    async def usable(self, voice: str, owner: str) -> bool:
        stored = await self.get(voice)
        return stored is not None and may_speak_with(stored.owner, stored.name, owner, stored.public)

    @abstractmethod
    async def get(self, voice: str) -> StoredVoice | None:
        """The voice, or None when there is none by that id."""

    @abstractmethod
    async def put(self, voice: StoredVoice) -> list[str]:
        """Keep a voice under the rules above; returns the ids retired to make room (the owner's
        oldest). Raises Refused(BUSY) when the store is full."""

    async def check_room(self, voice: StoredVoice) -> None:
        """Refuses (BUSY) a voice that the store as it is now could not take, so that a
        registration into a full store fails before its prompt is built. Only a forecast: other
        servers may change the store meanwhile, and `put` decides, atomically."""
        if await self.has(voice.id) or await self._owned(voice.owner) >= self.limits.cap_of(voice.anonymous):
            return                                   # put keeps it as is, or retires the owner's oldest
        usage = await self.usage()
        self.limits.refuse_full(usage["voices"], usage["bytes"], len(voice.audio))
        if voice.network is not None:
            self.limits.refuse_share(*await self._anonymous(voice.network))

    @abstractmethod
    async def _anonymous(self, network: str) -> tuple[int, int]:
        """How many voices of owners without a token the store holds: in all, and in `network`."""

    @abstractmethod
    async def _owned(self, owner: str) -> int:
        """How many voices `owner` (hashed, as StoredVoice.owner) has."""

    @abstractmethod
    async def owned_by(self, owner: str) -> list[VoiceSummary]:
        """The voices `owner` registered (at most `per_owner`), oldest first."""

    @abstractmethod
    async def delete(self, voice: str, owner: str) -> bool:
        """Delete a voice of `owner` (ANY_OWNER: any voice); False when there is none it may delete."""

    @abstractmethod
    async def every_voice(self) -> list[VoiceSummary]:
        """Every voice kept, oldest first, with its owner's key (for an admin)."""

    async def delete_owned(self, key: str) -> list[str]:
        """Delete every voice of the owner whose key (`owner_key`) is `key`; the ids deleted."""
        deleted = []
        for voice in await self.every_voice():
            if voice.owner == key and await self.delete(voice.id, ANY_OWNER):
                deleted.append(voice.id)
        return deleted

    @abstractmethod
    async def expire(self) -> list[str]:
        """Drop the voices whose time is up; the ids dropped."""

    @abstractmethod
    async def usage(self) -> dict[str, int]:
        """{voices, bytes}."""

    async def close(self) -> None:
        return None

    def describe(self) -> str:
        return self.name

class MemoryStore(VoiceStore):
    """This process only; the rules as every store's."""

    name = "memory"

    def __init__(self, limits: StoreLimits, clock: Callable[[], float] = time.time) -> None:
        super().__init__(limits, clock)
        self._voices: dict[str, StoredVoice] = {}
        self._lock = asyncio.Lock()
        self.public: MemoryPublic = MemoryPublic(self)
        if type(self) is MemoryStore:
            self._secret = secrets.token_bytes(SECRET_BYTES)      # its voices go with the process
            self.opened = True

    async def _read_secret(self) -> bytes:
        return secrets.token_bytes(SECRET_BYTES)

    async def get(self, voice: str) -> StoredVoice | None:
        stored = self._voices.get(voice)
        return None if stored is None or stored.expired(self.clock()) else stored

    def usable_now(self, voice: str, owner: str) -> bool | None:
        stored = self._voices.get(voice)
        return stored is not None and not stored.expired(self.clock()) and \
            may_speak_with(stored.owner, stored.name, owner, stored.public)

    async def put(self, voice: StoredVoice) -> list[str]:
        async with self._lock:
            return self._put(voice)

    def _put(self, voice: StoredVoice) -> list[str]:
        """Keeps `voice`; the ids let go: expired ones, and the owner's oldest beyond its cap."""
        expired = self._expired()
        if voice.id in self._voices:
            return expired
        if voice.public:
            self.public.check_name(voice)
        owned = self._voices_of(voice.owner)
        retired = [v.id for v in owned[:max(0, len(owned) - self.limits.cap_of(voice.anonymous) + 1)]]
        remaining = [v for v in self._voices.values() if v.id not in retired]
        self.limits.refuse_full(len(remaining), sum(len(v.audio) for v in remaining), len(voice.audio))
        if voice.network is not None:
            self.limits.refuse_share(*self._count_anonymous(remaining, voice.network))
        for old in retired:
            self._drop(old)
        self._keep(voice)
        return expired + retired

    def _expired(self) -> list[str]:
        now = self.clock()
        gone = [v.id for v in self._voices.values() if v.expired(now)]
        for voice in gone:
            self._drop(voice)
        return gone

    async def expire(self) -> list[str]:
        async with self._lock:
            return self._expired()

    async def every_voice(self) -> list[VoiceSummary]:
        now = self.clock()
        return [v.summary() for v in sorted(self._voices.values(), key=lambda v: v.created) if not v.expired(now)]

    async def _owned(self, owner: str) -> int:
        return len(self._voices_of(owner))

    async def _anonymous(self, network: str) -> tuple[int, int]:
        now = self.clock()
        return self._count_anonymous([v for v in self._voices.values() if not v.expired(now)], network)

    @staticmethod
    def _count_anonymous(voices: list[StoredVoice], network: str) -> tuple[int, int]:
        anonymous = [v for v in voices if v.anonymous]
        return len(anonymous), sum(1 for v in anonymous if v.network == network)

    async def owned_by(self, owner: str) -> list[VoiceSummary]:
        return [v.summary() for v in self._voices_of(owner_key(owner))]

    def _voices_of(self, owner: str) -> list[StoredVoice]:
        """The owner's voices, oldest first."""
        now = self.clock()
        return sorted((v for v in self._voices.values() if v.owner == owner and not v.expired(now)),
                      key=lambda v: v.created)

    def _keep(self, voice: StoredVoice) -> None:
        self._voices[voice.id] = voice
        self.public.kept(voice)

    def _drop(self, voice: str) -> None:
        stored = self._voices.pop(voice, None)
        if stored is not None:
            self.public.dropped(stored)

    async def _rewrite(self, voice: StoredVoice) -> None:
        """Keep what changed of a voice kept already (`public`), where it is kept."""

    async def delete(self, voice: str, owner: str) -> bool:
        async with self._lock:
            stored = self._voices.get(voice)
            if stored is None or stored.expired(self.clock()) or (
                    owner != ANY_OWNER and stored.owner != owner_key(owner)):
                return False
            self._drop(voice)
            return True

    async def usage(self) -> dict[str, int]:
        now = self.clock()
        kept = [v for v in self._voices.values() if not v.expired(now)]
        return {"voices": len(kept), "bytes": sum(len(v.audio) for v in kept)}


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
        self.public.names = {v.name: v.id for v in self._voices.values() if v.public and v.name is not None}
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
            raise OSError(f"{path} is not a secret this server made (delete it: named voices then get new ids)")
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


# Let go of one voice and every index of it. Defined first in each script that drops voices.
_DROP = """
local function drop(prefix, id)
  local key = prefix .. 'voice:' .. id
  local fields = redis.call('HMGET', key, 'owner', 'size', 'network', 'name')
  redis.call('DECRBY', prefix .. 'bytes', tonumber(fields[2] or '0'))
  if fields[4] and fields[4] ~= '' and redis.call('HGET', prefix .. 'public', fields[4]) == id then
    redis.call('HDEL', prefix .. 'public', fields[4])
  end
  redis.call('DEL', key)
  redis.call('ZREM', prefix .. 'voices', id)
  redis.call('ZREM', prefix .. 'expiry', id)
  redis.call('ZREM', prefix .. 'anonymous', id)
  if fields[1] then redis.call('ZREM', prefix .. 'owner:' .. fields[1], id) end
  if fields[3] and fields[3] ~= '' then redis.call('ZREM', prefix .. 'network:' .. fields[3], id) end
end
"""

# Drop the voices whose time is up (the `expiry` zset: id -> when), as a delete would. Needs
# `prefix` and `now` set; leaves their ids in `expired`.
_PURGE = """
local expired = redis.call('ZRANGEBYSCORE', prefix .. 'expiry', '-inf', now)
for _, old in ipairs(expired) do drop(prefix, old) end
"""

# ARGV: the key prefix, now. Returns the ids dropped.
_EXPIRE = _DROP + "local prefix, now = ARGV[1], ARGV[2]\n" + _PURGE + "return expired\n"

# Keep a voice in Redis under the rules, atomically: drop expired voices, retire the owner's
# oldest beyond its cap, refuse when the store (or, without a token, its share) is full, then
# write. KEYS: voices (zset id -> created), owner's (zset), bytes (counter), the voice (hash).
# ARGV: id, owner, created, size, the owner's cap, max_voices, max_bytes, audio, transcript,
# mode, the key prefix, the name ('' for none), anonymous ('1' or '0'), expires ('' for never),
# now, network ('' for an owner with a token), the anonymous share, the network's share, public
# ('1' or '0': then the `public` hash, name -> id, names it). Returns {status, ids let go...}.
_PUT = _DROP + "local prefix, now = ARGV[11], ARGV[15]\n" + _PURGE + """
if redis.call('EXISTS', KEYS[4]) == 1 then table.insert(expired, 1, 'exists') return expired end
if ARGV[19] == '1' then
  if ARGV[12] == '' then table.insert(expired, 1, 'nameless') return expired end
  local holder = redis.call('HGET', prefix .. 'public', ARGV[12])
  if holder and holder ~= ARGV[1] and redis.call('EXISTS', prefix .. 'voice:' .. holder) == 1 then
    table.insert(expired, 1, 'name_taken') return expired
  end
end
local cap, max_voices, max_bytes = tonumber(ARGV[5]), tonumber(ARGV[6]), tonumber(ARGV[7])
local size = tonumber(ARGV[4])
local owned = redis.call('ZRANGE', KEYS[2], 0, -1)
local retire = {}
local freed_voices, freed_bytes = 0, 0
for i = 1, #owned - cap + 1 do
  local old = owned[i]
  table.insert(retire, old)
  freed_voices = freed_voices + 1
  freed_bytes = freed_bytes + tonumber(redis.call('HGET', prefix .. 'voice:' .. old, 'size') or '0')
end
local voices = redis.call('ZCARD', KEYS[1]) - freed_voices
local bytes = tonumber(redis.call('GET', KEYS[3]) or '0') - freed_bytes
if voices + 1 > max_voices then table.insert(expired, 1, 'full_voices') return expired end
if bytes + size > max_bytes then table.insert(expired, 1, 'full_bytes') return expired end
local network = ARGV[16]
if network ~= '' then
  -- the owner's voices retired are its own: without a token, and of its network
  if redis.call('ZCARD', prefix .. 'anonymous') - freed_voices + 1 > tonumber(ARGV[17]) then
    table.insert(expired, 1, 'full_anonymous') return expired
  end
  if redis.call('ZCARD', prefix .. 'network:' .. network) - freed_voices + 1 > tonumber(ARGV[18]) then
    table.insert(expired, 1, 'full_network') return expired
  end
end
for _, old in ipairs(retire) do
  drop(prefix, old)
  table.insert(expired, old)
end
redis.call('INCRBY', KEYS[3], size)
redis.call('HSET', KEYS[4], 'audio', ARGV[8], 'transcript', ARGV[9], 'mode', ARGV[10], 'owner', ARGV[2],
           'created', ARGV[3], 'size', ARGV[4], 'name', ARGV[12], 'anonymous', ARGV[13], 'expires', ARGV[14],
           'network', network, 'public', ARGV[19])
if ARGV[19] == '1' then redis.call('HSET', prefix .. 'public', ARGV[12], ARGV[1]) end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[1])
if ARGV[14] ~= '' then redis.call('ZADD', prefix .. 'expiry', ARGV[14], ARGV[1]) end
if network ~= '' then
  redis.call('ZADD', prefix .. 'anonymous', ARGV[3], ARGV[1])
  redis.call('ZADD', prefix .. 'network:' .. network, ARGV[3], ARGV[1])
end
table.insert(expired, 1, 'ok')
return expired
"""

# Delete one voice if `owner` owns it (ARGV[2] empty: any owner) and it has not expired (that is
# for the purge). KEYS: the voice. ARGV: id, owner, the key prefix, now.
_DELETE = _DROP + """
local owner = redis.call('HGET', KEYS[1], 'owner')
if not owner then return 0 end
if ARGV[2] ~= '' and owner ~= ARGV[2] then return 0 end
local expires = redis.call('HGET', KEYS[1], 'expires')
if expires and expires ~= '' and tonumber(expires) <= tonumber(ARGV[4]) then return 0 end
drop(ARGV[3], ARGV[1])
return 1
"""

# Make one voice public ('1') or private ('0') if `owner` owns it (ARGV[2] empty: any owner) and
# it has not expired; a public one needs a name no other public voice has. KEYS: the voice.
# ARGV: id, owner, the key prefix, now, public. Returns 'none', 'nameless', 'name_taken' or 'ok'.
_SET_PUBLIC = """
local fields = redis.call('HMGET', KEYS[1], 'owner', 'expires', 'name')
local owner, expires, name = fields[1], fields[2], fields[3]
if not owner then return 'none' end
if ARGV[2] ~= '' and owner ~= ARGV[2] then return 'none' end
if expires and expires ~= '' and tonumber(expires) <= tonumber(ARGV[4]) then return 'none' end
local index = ARGV[3] .. 'public'
if ARGV[5] == '1' then
  if not name or name == '' then return 'nameless' end
  local holder = redis.call('HGET', index, name)
  if holder and holder ~= ARGV[1] and redis.call('EXISTS', ARGV[3] .. 'voice:' .. holder) == 1 then
    return 'name_taken'
  end
  redis.call('HSET', index, name, ARGV[1])
elseif name and name ~= '' and redis.call('HGET', index, name) == ARGV[1] then
  redis.call('HDEL', index, name)
end
redis.call('HSET', KEYS[1], 'public', ARGV[5])
return 'ok'
"""


class RedisStore(VoiceStore):
    """A Redis server (`redis://HOST:PORT/DB`) shared by every replica. Keys under `voxws:`."""

    name = "redis"
    shared = True
    PREFIX = "voxws:"
    TIMEOUT_S = 2.0

    def __init__(self, url: str, limits: StoreLimits, clock: Callable[[], float] = time.time) -> None:
        super().__init__(limits, clock)
        import redis.asyncio as redis

        self.url = url
        self._redis = redis.from_url(url, socket_timeout=self.TIMEOUT_S, socket_connect_timeout=self.TIMEOUT_S)
        self._put_script = self._redis.register_script(_PUT)
        self._delete_script = self._redis.register_script(_DELETE)
        self._expire_script = self._redis.register_script(_EXPIRE)
        self._set_public_script = self._redis.register_script(_SET_PUBLIC)
        self.public: RedisPublic = RedisPublic(self)

    def describe(self) -> str:
        return "redis:" + self.url.split("@")[-1]          # no password in what is shown

    async def _call(self, what: str, work: Any) -> Any:
        import redis

        try:
            return await work
        except (redis.RedisError, OSError) as exc:
            # Unreachable, or refusing: READONLY after a fail-over, OOM at maxmemory, a script
            # killed... whatever the cause, the store cannot serve now; the caller may retry.
            raise StoreUnavailable(what, exc) from None

    def _key(self, kind: str, name: str = "") -> str:
        return f"{self.PREFIX}{kind}{':' + name if name else ''}"

    async def get(self, voice: str) -> StoredVoice | None:
        fields = await self._call("get", self._redis.hgetall(self._key("voice", voice)))
        if not fields:
            return None
        text = {k.decode(): v for k, v in fields.items()}
        transcript = text["transcript"].decode()
        name = text.get("name", b"").decode()
        expires = text.get("expires", b"").decode()
        network = text.get("network", b"").decode()
        stored = StoredVoice(id=voice, audio=text["audio"], transcript=transcript or None, mode=text["mode"].decode(),
                             owner=text["owner"].decode(), created=float(text["created"]), name=name or None,
                             anonymous=text.get("anonymous") == b"1", expires=float(expires) if expires else None,
                             network=network or None, public=text.get("public") == b"1")
        return None if stored.expired(self.clock()) else stored

    async def _read_secret(self) -> bytes:
        """Made by the first replica to ask (SET NX), read by every one after."""
        key = self._key("secret")
        await self._call("secret", self._redis.set(key, secrets.token_bytes(SECRET_BYTES), nx=True))
        kept = await self._call("secret", self._redis.get(key))
        if kept is None or len(kept) != SECRET_BYTES:
            raise StoreUnavailable(f"its key {key} does not hold a secret of {SECRET_BYTES} bytes")
        return kept

    async def usable(self, voice: str, owner: str) -> bool:
        stored, name, expires, public = await self._call("get", self._redis.hmget(
            self._key("voice", voice), "owner", "name", "expires", "public"))
        return stored is not None and not (expires and float(expires) <= self.clock()) and \
            may_speak_with(stored.decode(), (name or b"").decode() or None, owner, public == b"1")

    async def has(self, voice: str) -> bool:
        expires = await self._call("has", self._redis.hmget(self._key("voice", voice), "owner", "expires"))
        return expires[0] is not None and not (expires[1] and float(expires[1]) <= self.clock())

    async def _owned(self, owner: str) -> int:
        return len(await self._summaries(self._key("owner", owner)))

    async def owned_by(self, owner: str) -> list[VoiceSummary]:
        return await self._summaries(self._key("owner", owner_key(owner)))

    async def _anonymous(self, network: str) -> tuple[int, int]:
        # Expired voices still counted until the next purge: a forecast, which `put` decides.
        pipe = self._redis.pipeline(transaction=False)
        pipe.zcard(self._key("anonymous"))
        pipe.zcard(self._key("network", network))
        anonymous, in_network = await self._call("usage", pipe.execute())
        return int(anonymous), int(in_network)

    async def every_voice(self) -> list[VoiceSummary]:
        return await self._summaries(self._key("voices"))

    async def _summaries(self, index: str) -> list[VoiceSummary]:
        """The voices a zset of ids lists, oldest first, not expired."""
        ids = await self._call("list", self._redis.zrange(index, 0, -1))
        return await self._described([voice.decode() for voice in ids])

    async def _described(self, ids: list[str]) -> list[VoiceSummary]:
        """The voices of these ids, in their order, that are there and not expired."""
        pipe = self._redis.pipeline(transaction=False)
        for voice in ids:
            pipe.hmget(self._key("voice", voice), "mode", "transcript", "size", "created", "name", "owner",
                       "expires", "public")
        rows = await self._call("list", pipe.execute()) if ids else []
        now = self.clock()
        return [VoiceSummary(voice, mode.decode(), transcript.decode() or None, int(size), float(created),
                             (name or b"").decode() or None, owner.decode(),
                             float(expires) if expires else None, public == b"1")
                for voice, (mode, transcript, size, created, name, owner, expires, public) in zip(ids, rows)
                if mode is not None                  # deleted between the two reads
                and not (expires and float(expires) <= now)]

    async def expire(self) -> list[str]:
        gone = await self._call("expire", self._expire_script(keys=[], args=[self.PREFIX, repr(self.clock())]))
        return [voice.decode() for voice in gone]

    async def put(self, voice: StoredVoice) -> list[str]:
        limits = self.limits
        keys = [self._key("voices"), self._key("owner", voice.owner), self._key("bytes"), self._key("voice", voice.id)]
        args = [voice.id, voice.owner, repr(voice.created), len(voice.audio), limits.cap_of(voice.anonymous),
                limits.max_voices, limits.max_bytes, voice.audio, voice.transcript or "", voice.mode, self.PREFIX,
                voice.name or "", "1" if voice.anonymous else "0",
                repr(voice.expires) if voice.expires is not None else "", repr(self.clock()), voice.network or "",
                limits.anonymous, limits.per_network, "1" if voice.public else "0"]
        answer = await self._call("put", self._put_script(keys=keys, args=args))
        status = answer[0].decode() if isinstance(answer[0], bytes) else answer[0]
        if status in ("exists", "ok"):
            return [old.decode() for old in answer[1:]]
        if status == "nameless":
            raise nameless_public()
        if status == "name_taken":
            raise public_name_taken(voice.name or "")
        if status == "full_voices":
            raise Refused(ErrorKind.BUSY, f"the voice store holds {limits.max_voices} voices: delete some first")
        if status == "full_bytes":
            raise Refused(ErrorKind.BUSY, f"the voice store holds {limits.max_bytes} bytes of audio: delete some first")
        if status == "full_anonymous":
            self.limits.refuse_share(limits.anonymous, 0)
        if status == "full_network":
            self.limits.refuse_share(0, limits.per_network)
        raise AssertionError(f"the put script answered {status!r}")

    async def delete(self, voice: str, owner: str) -> bool:
        keys = [self._key("voice", voice)]
        who = "" if owner == ANY_OWNER else owner_key(owner)
        return bool(await self._call("delete", self._delete_script(keys=keys, args=[voice, who, self.PREFIX, repr(self.clock())])))

    async def usage(self) -> dict[str, int]:
        voices = await self._call("usage", self._redis.zcard(self._key("voices")))
        size = await self._call("usage", self._redis.get(self._key("bytes")))
        return {"voices": int(voices), "bytes": int(size or 0)}

    async def close(self) -> None:
        await self._redis.aclose()


class PublicVoices(ABC):
    """A store's public voices (`VoiceStore.public`): the voice each public name is, the list,
    and their owners' choice to make a voice public or private again."""

    def __init__(self, store: VoiceStore) -> None:
        self._store = store

    def resolve_now(self, own: str, name: str, owner: str) -> str | None:
        """The id `owner` speaks with by `name`, its own voice of that name being `own`: that one
        where it has it, else the public voice of that name, else `own` (which the use then
        refuses as unknown); None where that is not known without waiting (`resolve`)."""
        return None

    async def resolve(self, own: str, name: str, owner: str) -> str:
        """`resolve_now`, asking the store."""
        if await self._store.usable(own, owner):
            return own
        public = await self.id(name)
        return public if public is not None and await self._store.usable(public, owner) else own

    @abstractmethod
    async def id(self, name: str) -> str | None:
        """The id of the public voice called `name`, if there is one."""

    async def listed(self) -> list[VoiceSummary]:
        """Every public voice, oldest first."""
        return [voice for voice in await self._store.every_voice() if voice.public]

    @abstractmethod
    async def set(self, voice: str, owner: str, public: bool) -> VoiceSummary | None:
        """Make a voice of `owner` (ANY_OWNER: any voice) public, or private again; its summary
        then, or None where there is none it may change. Refused (INVALID, field "name") for a
        voice without a name, or one whose name another public voice has."""


class MemoryPublic(PublicVoices):
    """The public voices of a store in this process (`MemoryStore`, `DirectoryStore`): an index
    of their names kept with the voices, under the store's lock."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self._memory = store
        self.names: dict[str, str] = {}           # a public voice's name -> its id

    def kept(self, voice: StoredVoice) -> None:
        if voice.public and voice.name is not None:
            self.names[voice.name] = voice.id

    def dropped(self, voice: StoredVoice) -> None:
        if voice.name is not None and self.names.get(voice.name) == voice.id:
            del self.names[voice.name]

    def check_name(self, voice: StoredVoice) -> None:
        """Refuses a public voice without a name, or whose name another public voice has."""
        if voice.name is None:
            raise nameless_public()
        holder = self.names.get(voice.name)
        if holder is not None and holder != voice.id and self._memory.usable_now(holder, ANY_OWNER):
            raise public_name_taken(voice.name)

    def resolve_now(self, own: str, name: str, owner: str) -> str | None:
        if self._memory.usable_now(own, owner):
            return own
        public = self.names.get(name)
        return public if public is not None and self._memory.usable_now(public, owner) else own

    async def id(self, name: str) -> str | None:
        public = self.names.get(name)
        return public if public is not None and self._memory.usable_now(public, ANY_OWNER) else None

    async def set(self, voice: str, owner: str, public: bool) -> VoiceSummary | None:
        store = self._memory
        async with store._lock:
            stored = store._voices.get(voice)
            if stored is None or stored.expired(store.clock()) or (
                    owner != ANY_OWNER and stored.owner != owner_key(owner)):
                return None
            changed = dataclasses.replace(stored, public=public)
            if public:
                self.check_name(changed)
            store._drop(stored.id)
            store._keep(changed)
            try:
                await store._rewrite(changed)
            except BaseException:
                store._drop(changed.id)
                store._keep(stored)
                raise
            return changed.summary()


class RedisPublic(PublicVoices):
    """The public voices of a Redis store: its `public` hash (name -> id), kept with the voices
    by its scripts, atomically."""

    def __init__(self, store: RedisStore) -> None:
        super().__init__(store)
        self._kept = store

    async def id(self, name: str) -> str | None:
        store = self._kept
        public = await store._call("get", store._redis.hget(store._key("public"), name))
        return public.decode() if public is not None and await store.has(public.decode()) else None

    async def listed(self) -> list[VoiceSummary]:
        store = self._kept
        ids = await store._call("list", store._redis.hvals(store._key("public")))
        return sorted(await store._described([voice.decode() for voice in ids]), key=lambda v: v.created)

    async def set(self, voice: str, owner: str, public: bool) -> VoiceSummary | None:
        store = self._kept
        who = "" if owner == ANY_OWNER else owner_key(owner)
        args = [voice, who, store.PREFIX, repr(store.clock()), "1" if public else "0"]
        answer = await store._call("set_public", store._set_public_script(keys=[store._key("voice", voice)],
                                                                           args=args))
        status = answer.decode() if isinstance(answer, bytes) else answer
        if status == "none":
            return None
        if status == "nameless":
            raise nameless_public()
        stored = await store.get(voice)
        if stored is None:
            raise StoreUnavailable("set_public: the voice went meanwhile")
        if status == "name_taken":
            raise public_name_taken(stored.name or "")
        return stored.summary()


def open_store(spec: str, limits: StoreLimits) -> VoiceStore:
    """`memory`, `dir:PATH` or a `redis://` URL (`rediss://` for TLS)."""
    if spec == "memory":
        return MemoryStore(limits)
    if spec.startswith("dir:"):
        return DirectoryStore(spec[4:], limits)
    if spec.startswith(("redis://", "rediss://", "unix://")):
        return RedisStore(spec, limits)
    raise ValueError(f"unknown voice store {spec!r}: memory, dir:PATH or redis://HOST:PORT/DB")


async def rekey_named(store: VoiceStore) -> list[str]:
    """Move named voices kept under ids made before the store kept a secret to their ids now;
    the ids let go. Each is deleted, then put back under its new id."""
    moved = []
    for summary in await store.every_voice():
        if summary.name is None or summary.id == store.named_id(summary.owner, summary.name):
            continue
        stored = await store.get(summary.id)
        if stored is None or not await store.delete(summary.id, ANY_OWNER):
            continue                                    # gone meanwhile, or moved by another server
        moved.append(summary.id)
        try:
            await store.put(dataclasses.replace(stored, id=store.named_id(stored.owner, summary.name)))
        except Refused as err:
            log.error("the named voice %s could not be moved to its new id: %s", voice_tag(summary.id),
                      err.message)
    return moved


@dataclass(frozen=True)
class Lifetime:
    """How long a voice registered without a token is kept (`ttl_s`; 0: for ever), by `clock`."""

    ttl_s: float = 0.0
    clock: Callable[[], float] = time.time


def new_voice(owner: str, audio: bytes, transcript: str | None, mode: str, lifetime: Lifetime = Lifetime(),
              named: tuple[str, str] | None = None) -> StoredVoice:
    """A voice to keep; an anonymous owner's expires after its `lifetime`. A named one is kept
    under the id its store makes of its name: `named` is (its name, that id)."""
    name, made = named or (None, voice_id(owner, audio, transcript, mode))
    now = lifetime.clock()
    anonymous = is_anonymous(owner)
    expires = now + lifetime.ttl_s if anonymous and lifetime.ttl_s > 0 else None
    return StoredVoice(id=made, audio=audio, transcript=transcript, mode=mode, owner=owner_key(owner),
                       created=now, name=name, anonymous=anonymous, expires=expires, network=network_key(owner))
