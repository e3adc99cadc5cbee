"""What a voice a client names is: a built-in voice, an alias, a registered id, or the name an
owner gave a voice it registered. The same answer at every front door.

    built-in ("joe")          the engine's own voice
    alias ("alloy")           `aliases.py`: another voice, or one designed from words
    registered id ("v_...")   a voice in the store, by the id registration answered
    name ("my voice")         the caller's own registered voice of that name (the store's `named_id`)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from ...engine import Engine, ErrorKind, Readiness, Refused
from .aliases import Alias, check_aliases, default_aliases, for_engine, with_defaults
from .store import VoiceStore, is_registered_id, is_voice_name, owner_key

log = logging.getLogger("vox_ws.service")


def with_speaker(voice: str | None, speaker: str | None) -> str | None:
    """The voice a request names with a `speaker` of a multi-speaker voice: `voice:speaker`
    (`:speaker`: of the default voice), the speaker by name or by number (`"1"` or `1`). Refused
    (INVALID, field "speaker") for a speaker that is neither."""
    if speaker is None:
        return voice
    if isinstance(speaker, int) and not isinstance(speaker, bool) and speaker >= 0:
        speaker = str(speaker)                   # a speaker's number, as Piper's own server takes it
    if not isinstance(speaker, str) or not speaker or ":" in speaker or len(speaker) > 128:
        raise Refused(ErrorKind.INVALID, f"field 'speaker' must name a speaker of the voice, got {speaker!r}",
                      field="speaker")
    return f"{voice or ''}:{speaker}"


@dataclass(frozen=True)
class ResolvedVoice:
    voice: str | None                 # what the engine is asked for (None: its default voice)
    alias: Alias | None = None        # the alias named, whose instructions and options apply
    named: str | None = None          # the registered voice's name, where it was named by it


class VoiceNames:
    """The aliases in force (configured, else the engine's defaults once it has loaded) and
    the resolution of a name. Event loop only."""

    def __init__(self, store: VoiceStore, configured: dict[str, Alias | None] | None = None) -> None:
        self._store = store
        self._configured = configured
        self._aliases: dict[str, Alias] | None = None
        self._for_voices: tuple[str, ...] = ()   # the engine's voices they were worked out for

    def aliases(self, engine: Engine, status: Readiness) -> dict[str, Alias]:
        if status is not Readiness.READY:
            return self._aliases or {}           # the defaults depend on the loaded engine's voices
        voices = tuple(engine.voices.names())
        if self._aliases is None or voices != self._for_voices:
            # Worked out again when the voices change (a rescan of the voices folder): no alias
            # stands for a voice no longer served, and a default name moves only if its voice did.
            self._aliases, self._for_voices = self._checked(engine), voices
        return self._aliases

    def named_in_file(self, engine: Engine, status: Readiness) -> dict[str, Alias]:
        """The aliases in force that the aliases file names (none of the defaults it leaves as
        they are): those a client should be shown beside the engine's own voices where OpenAI's
        names mean nothing (Home Assistant's picker)."""
        named = for_engine(self._configured or {}, engine)[0]
        return {name: alias for name, alias in self.aliases(engine, status).items() if name in named}

    def _checked(self, engine: Engine) -> dict[str, Alias]:
        if self._configured is None:
            return default_aliases(engine)
        configured, elsewhere = for_engine(self._configured, engine)
        if elsewhere:                            # one file for several engines: not a mistake
            log.info("--voice-aliases: %s for another engine than %s: left out", ", ".join(elsewhere),
                     engine.name)
        given = {name: alias for name, alias in configured.items() if alias is not None}
        problems = check_aliases(given, engine)
        for name, why in problems:
            log.error("--voice-aliases: alias %r is not served: %s", name, why)
        bad = {name for name, _ in problems}
        return with_defaults({name: alias for name, alias in configured.items() if name not in bad}, engine)

    def resolve(self, engine: Engine, status: Readiness, voice: str | None, owner: str) -> ResolvedVoice:
        if voice is None or engine.voices.has(voice) or is_registered_id(voice):
            return ResolvedVoice(voice)
        alias = self.aliases(engine, status).get(voice)
        if alias is not None:
            return ResolvedVoice(alias.voice, alias)
        if engine.supports_voices and is_voice_name(voice):
            return ResolvedVoice(self._store.named_id(owner_key(owner), voice), named=voice)
        return ResolvedVoice(voice)              # unknown: the engine refuses it, naming it
