"""The voice store in this process only (`--voice-store memory`): tests, or a server that
wants no state; the base of the directory store. Its rules are every store's (`store.py`)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from typing import Callable

from .lookalikes import name_key
from .store import (
    ANY_OWNER,
    SECRET_BYTES,
    PublicVoices,
    StoredVoice,
    StoreLimits,
    VoiceStore,
    VoiceSummary,
    may_speak_with,
    nameless_public,
    owner_key,
    public_name_taken,
)


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
        return [v.summary() for v in sorted(self._voices.values(), key=lambda v: v.created)
                if not v.expired(now)]

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


class MemoryPublic(PublicVoices):
    """The public voices of a store in this process (`MemoryStore`, `DirectoryStore`): an index
    of their names kept with the voices, under the store's lock."""

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store)
        self._memory = store
        self.names: dict[str, str] = {}           # a public name's normal form (`name_key`) -> its id

    def kept(self, voice: StoredVoice) -> None:
        if voice.public and voice.name is not None:
            self.names[name_key(voice.name)] = voice.id

    def dropped(self, voice: StoredVoice) -> None:
        if voice.name is not None and self.names.get(name_key(voice.name)) == voice.id:
            del self.names[name_key(voice.name)]

    def check_name(self, voice: StoredVoice) -> None:
        """Refuses a public voice without a name, or whose name another public voice has."""
        if voice.name is None:
            raise nameless_public()
        holder = self.names.get(name_key(voice.name))
        if holder is not None and holder != voice.id and self._memory.usable_now(holder, ANY_OWNER):
            raise public_name_taken(voice.name)

    def resolve_now(self, own: str, name: str, owner: str) -> str | None:
        if self._memory.usable_now(own, owner):
            return own
        public = self.names.get(name_key(name))
        return public if public is not None and self._memory.usable_now(public, owner) else own

    async def id(self, name: str) -> str | None:
        public = self.names.get(name_key(name))
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
