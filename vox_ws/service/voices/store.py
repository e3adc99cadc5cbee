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

This module holds what every store shares: the rules' figures (`StoreLimits`), a voice as kept,
owners' keys, ids and names, and the contract (`VoiceStore`, `PublicVoices`). The stores, one
module each (`stores.open_store` picks one by its spec):

    memory        this process only (tests, or a server that wants no state): `memory_store.py`
    dir:PATH      a local directory: one audio file and one JSON file per voice (the default):
                  `directory_store.py`
    redis://...   a Redis server, shared by replicas (the `redis` package's asyncio client):
                  `redis_store.py`
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import logging
import re
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from ...addresses import network_of
from ...engine import ErrorKind, Refused
from ...voice_tags import VOICE_ID, voice_tag
from .lookalikes import mixes_scripts

log = logging.getLogger("vox_ws.service")

ANY_OWNER = "admin"
# The owner a client without a token is: this and its address (its voices are the anonymous ones).
ADDRESS_OWNER_PREFIX = "address:"
# A page of another origin without a token is its visitor's address, this, and its origin's digest
# (`transports.auth.page_owner`): an owner without a token, of its address's network.
PAGE_OWNER_MARK = " page:"
# A page whose origin is opaque (`Origin: null`: sandboxed frames, `file:` pages, of any site at
# all) has no stable owner: this in place of its origin's digest. It registers nothing.
OPAQUE_PAGE = "null"
# A page owner's key (`owner_key`): its address owner's key, this, its origin's digest; so an
# admin's deletion by address reaches the voices that address's pages registered too.
PAGE_KEY_MARK = "~"


def is_anonymous(owner: str) -> bool:
    return owner.startswith(ADDRESS_OWNER_PREFIX)


def is_page_owner(owner: str) -> bool:
    """Whether `owner` is a page of another origin that presented no token (`auth.page_owner`)."""
    return PAGE_OWNER_MARK in owner


def is_opaque_page(owner: str) -> bool:
    """Whether `owner` is a page with an opaque origin (`Origin: null`), which no owner is."""
    return owner.endswith(PAGE_OWNER_MARK + OPAQUE_PAGE)


def refuse_page(owner: str, public: bool) -> None:
    """Refuses (INVALID) what a page of another origin without a token may not do: make a voice
    public (a drive-by page published names into every user's list: Hardening VII, 3), or, with
    an opaque origin, register one at all (every sandboxed or `file:` page would share it)."""
    if is_opaque_page(owner):
        raise Refused(ErrorKind.INVALID, "a page without an origin of its own (Origin: null) registers "
                                         "voices only with a token", field="voice")
    if public and is_page_owner(owner):
        raise Refused(ErrorKind.INVALID, "a page of another origin makes a voice public only with a token "
                                         "(its voices are its own until then)", field="public")


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
            raise Refused(ErrorKind.BUSY,
                          f"voices registered without a token hold their share of the store "
                          f"({self.anonymous}): try again once some expire, or register with a token")
        if in_network + 1 > self.per_network:
            raise Refused(ErrorKind.BUSY,
                          f"voices registered without a token from your network hold its share of the "
                          f"store ({self.per_network}): try again once some expire, or register "
                          "with a token")

    def refuse_full(self, voices: int, size: int, adding: int) -> None:
        if voices + 1 > self.max_voices:
            raise Refused(ErrorKind.BUSY,
                          f"the voice store holds {self.max_voices} voices: delete some first")
        if size + adding > self.max_bytes:
            raise Refused(ErrorKind.BUSY,
                          f"the voice store holds {self.max_bytes} bytes of audio: delete some first")


def owner_key(owner: str) -> str:
    """An owner as the stores keep it: a digest; a page owner's is its address owner's and its
    origin's digest (`PAGE_KEY_MARK`)."""
    address, page, origin = owner.partition(PAGE_OWNER_MARK)
    key = hashlib.sha256(b"vox-ws owner\0" + address.encode()).hexdigest()[:32]
    return key + PAGE_KEY_MARK + origin[:32] if page else key


def keyed_under(voice_owner: str, key: str) -> bool:
    """Whether a voice kept for `voice_owner` (a key) is the owner's whose key is `key`, or a
    page's of that owner's address (an admin names an address: its pages' voices are among its)."""
    return voice_owner == key or voice_owner.startswith(key + PAGE_KEY_MARK)


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
    """A voice's name as a client gives it; raises Refused (INVALID, field "name"), also for a
    name mixing scripts that look alike (`lookalikes.mixes_scripts`)."""
    if not isinstance(name, str) or not _VOICE_NAME.fullmatch(name) or name != name.strip() \
            or is_registered_id(name):
        raise Refused(ErrorKind.INVALID,
                      f"a voice's name is 1-{MAX_VOICE_NAME_CHARS} letters, digits, spaces or "
                      f"_.'- starting with a letter or digit, got {name!r}", field="name")
    if mixes_scripts(name):
        raise Refused(ErrorKind.INVALID, f"a voice's name is in one script (Latin may go with Han and kana, "
                                         f"Bopomofo or Hangul), got {name!r}: its letters would pass for "
                                         "another name's", field="name")
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
    return _digest_id(hmac.new(secret, digestmod=hashlib.sha256), b"vox-ws named voice", key.encode(),
                      name.encode())


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
    """The refusal of a public voice whose name another public voice has (as `name_key` reads
    names: `Narrator` and `narrator` are one)."""
    return Refused(ErrorKind.INVALID, f"another public voice is named {name!r}, or a name that reads the "
                                      "same: choose another name", field="name")


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
        super().__init__(ErrorKind.NOT_READY, f"the voice store is unavailable ({what}){why}",
                         STORE_RETRY_AFTER_S)


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
        """Delete every voice of the owner whose key (`owner_key`) is `key` (and of its address's
        pages: `keyed_under`); the ids deleted."""
        deleted = []
        for voice in await self.every_voice():
            if keyed_under(voice.owner, key) and await self.delete(voice.id, ANY_OWNER):
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
                       created=now, name=name, anonymous=anonymous, expires=expires,
                       network=network_key(owner))
