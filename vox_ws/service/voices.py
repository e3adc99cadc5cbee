"""Who registered which voice.

A voice belongs to the owner that registered it (a front door names owners: a client token, or
an address where no tokens are used). Only its owner may delete it; each owner keeps at most
`per_owner` voices, and registering one more retires that owner's oldest, never anyone
else's; when the server holds `total` voices, new registrations are refused until some are
deleted. Using a voice needs no ownership: its id is unguessable and given to the owner, who
may pass it on.
"""

from __future__ import annotations

from collections import OrderedDict

from ..engine import ErrorKind, Refused


class VoiceOwners:
    def __init__(self, per_owner: int, total: int) -> None:
        self.per_owner = per_owner
        self.total = total
        self._owner_of: dict[str, str] = {}
        self._by_owner: dict[str, OrderedDict[str, None]] = {}
        self._reserved = 0          # registrations under way

    def __len__(self) -> int:
        return len(self._owner_of)

    def reserve(self, owner: str) -> str | None:
        """Make room for one registration by `owner`: the owner's voice to retire first (at its
        cap), or None. Raises Refused(BUSY) when the server is full. `release()` after."""
        owned = self._by_owner.get(owner)
        if owned is not None and len(owned) >= self.per_owner:
            self._reserved += 1
            return next(iter(owned))
        if len(self._owner_of) + self._reserved >= self.total:
            raise Refused(ErrorKind.BUSY, f"the server holds {self.total} registered voices: try again later")
        self._reserved += 1
        return None

    def release(self) -> None:
        self._reserved -= 1

    def add(self, owner: str, voice: str) -> None:
        self._owner_of[voice] = owner
        self._by_owner.setdefault(owner, OrderedDict())[voice] = None

    def owns(self, owner: str, voice: str) -> bool:
        return self._owner_of.get(voice) == owner

    def remove(self, voice: str) -> None:
        owner = self._owner_of.pop(voice, None)
        if owner is not None:
            owned = self._by_owner[owner]
            owned.pop(voice, None)
            if not owned:
                del self._by_owner[owner]
