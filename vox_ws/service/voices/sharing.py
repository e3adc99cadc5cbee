"""Public voices: a voice its owner shares by its name with everyone the server serves.

A registered voice is its owner's (`store.may_speak_with`); its owner may make it public
(at registration, `VoiceService.register(public=True)`, or later, `set_public`): then any
caller, at any door (another token, a Wyoming client with none), speaks it by its name and is
shown it in the lists, unless the caller has a voice of its own by that name (its own comes
first) or the server's voices or aliases took the name since. One public voice per name
(`store.PublicVoices`); only its owner (or an admin) makes it private again or deletes it.
"""

from __future__ import annotations

from typing import Callable

from ...engine_process.devices import Devices
from .lookalikes import name_key
from .store import (
    VoiceStore,
    VoiceSummary,
    is_registered_id,
    is_voice_name,
    owner_key,
    public_name_taken,
    refuse_page,
)


class VoiceSharing:
    """The service's public voices (`VoiceService.sharing`): in `store`, for the engine of
    `devices`, beside the names `server_names` gives (its voices and aliases, now)."""

    def __init__(self, store: VoiceStore, devices: Devices, server_names: Callable[[], set[str]]) -> None:
        self._store = store
        self._devices = devices
        self._server_names = server_names          # their normal forms (`lookalikes.name_key`)

    def reads_as_the_servers(self, name: str) -> bool:
        """Whether `name` reads as one of the server's voices or aliases (`lookalikes.name_key`):
        no registered voice is named so."""
        return name_key(name) in self._server_names()

    async def listed_for(self, owner: str | None,
                         owned: list[VoiceSummary] | None = None) -> list[VoiceSummary]:
        """The public voices `owner` speaks by their names (None: a caller with no voices of its
        own), oldest first: not one whose name is its own private voice's, nor a server voice's
        or alias's (an aliases file or a voices folder may have taken the name since: the
        server's voice is what the name says). Its own public voices are among them. `owned`:
        `owner`'s voices where the caller has read them already (a list of its own and the
        public ones reads the store once for them, not twice)."""
        if not self._devices.engine.supports_voices:
            return []
        public = await self._store.public.listed()
        if not public:
            return []
        server = self._server_names()
        taken: set[str] = set()
        if owner is not None:
            if owned is None:
                owned = await self._store.owned_by(owner)
            taken = {v.name for v in owned if v.name and not v.public}
        return [v for v in public if v.name not in taken and name_key(v.name or "") not in server]

    async def others_for(self, owner: str | None,
                         owned: list[VoiceSummary] | None = None) -> list[VoiceSummary]:
        """`listed_for`, less `owner`'s own (listed as its own)."""
        key = owner_key(owner) if owner is not None else None
        return [v for v in await self.listed_for(owner, owned) if v.owner != key]

    async def set_public(self, voice: str, owner: str, public: bool) -> VoiceSummary | None:
        """Make a voice of `owner`'s (ANY_OWNER: any; `voice` its id or name) public, or private
        again: its summary, or None where there is none it may change (another owner's voice
        looks like no voice). Refused (INVALID, field "name") for a voice without a name, or
        one whose name another public voice has; (field "public") made public by a page of
        another origin without a token (`store.refuse_page`). Streams speaking it go on to their
        end."""
        if not self._devices.engine.supports_voices:
            return None
        refuse_page(owner, public)
        if not is_registered_id(voice) and is_voice_name(voice):
            voice = self._store.named_id(owner_key(owner), voice)
        if public:
            stored = await self._store.get(voice)
            if stored is not None and stored.name is not None and self.reads_as_the_servers(stored.name):
                raise public_name_taken(stored.name)
        return await self._store.public.set(voice, owner, public)
