"""Voices across devices: the built-in ones, aliases and names, and the voices clients register.

A registered voice is kept in the voice store (`store.py`: its reference audio, owner and
limits) and built on every device that speaks it; a device that lacks one (another server
registered it, or this one restarted) builds it from the store when a stream next names it.
Reference audio is decoded and encoded on one worker thread of its own, beside the engines'
steps, one registration at a time, owners taking turns (`registrations.py`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial
from typing import Any, Awaitable, Callable

from ...audio import AudioTooLong, decode_audio_file
from ...config import Limits
from ...engine import VOICE_MODES, Engine, ErrorKind, Readiness, Refused
from ...engine_process.devices import Devices
from ..memory import release_memory
from ..validation import check_text
from ..work import engine_work
from .aliases import Alias
from .lookalikes import name_key
from .names import ResolvedVoice, VoiceNames
from .registrations import Registration, RegistrationQueue
from .sharing import VoiceSharing
from .store import (
    ANY_OWNER,
    STORE_RETRY_AFTER_S,
    Lifetime,
    StoreUnavailable,
    VoiceStore,
    VoiceSummary,
    check_voice_name,
    is_registered_id,
    is_voice_name,
    keyed_under,
    nameless_public,
    new_voice,
    owner_key,
    public_name_taken,
    refuse_page,
    rekey_named,
)

log = logging.getLogger("vox_ws.service")

# Reference audio shorter than this cannot carry a voice.
MIN_VOICE_AUDIO_S = 0.2
# Reference audio files decoded and encoded at once: CPU work beside the engine's.
MAX_CONCURRENT_VOICE_JOBS = 1
# Seconds between two sweeps of expired voices.
VOICE_SWEEP_S = 60.0


class VoiceService:
    """The service's voices (`StreamService.voices`). Create it, `await start()` on the loop
    that will use it."""

    def __init__(self, devices: Devices, limits: Limits, store: VoiceStore,
                 aliases: dict[str, Alias | None] | None = None) -> None:
        self.devices = devices
        self.limits = limits
        self.store = store
        self.registrations = RegistrationQueue(limits.max_pending_voices_per_owner, limits.max_pending_voices)
        # Aliases and names (`names.py`); None: the defaults (`aliases.py`).
        self.names = VoiceNames(store, aliases)
        # Public voices (`sharing.py`), beside the server's own voices' and aliases' names.
        self.sharing = VoiceSharing(store, devices,
                                    lambda: {name_key(name) for name in (*self.listed(), *self.aliases())})
        self._fetching: dict[str, asyncio.Future] = {}      # voices being rebuilt from the store
        self._jobs: asyncio.Semaphore | None = None
        self._sweeper: asyncio.Task | None = None
        # Reference audio is decoded and encoded on one thread of its own: its peaks come from one
        # malloc arena, which is trimmed after each voice (a pool of threads keeps a peak per arena).
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-voice")

    async def start(self) -> None:
        """Open the store; one shared by other servers that cannot be reached now is opened
        later (until then, voice operations fail `not_ready`)."""
        self._jobs = asyncio.Semaphore(MAX_CONCURRENT_VOICE_JOBS)
        try:
            await _open_store(self.store, self.devices)
        except StoreUnavailable as err:
            if not self.store.shared:
                raise
            log.warning("%s: registered voices wait for it", err.message)
        self._sweeper = asyncio.create_task(self._sweep(), name="vox-ws-voice-sweeper")

    async def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            await asyncio.gather(self._sweeper, return_exceptions=True)
        self._worker.shutdown(wait=False, cancel_futures=True)
        await self.store.close()

    # ------------------------------------------------------------------ names

    def listed(self) -> list[str]:
        """The built-in voices, once the engine serves."""
        return self.devices.engine.voices.names() if self.devices.status == Readiness.READY else []

    def aliases(self, in_file_only: bool = False) -> dict[str, Alias]:
        """The voice aliases; `in_file_only`: those the aliases file names, not OpenAI's defaults
        (`VoiceNames.named_in_file`)."""
        listed = self.names.named_in_file if in_file_only else self.names.aliases
        return listed(self.devices.engine, self.devices.status)

    def resolve(self, voice: str | None, owner: str = ANY_OWNER) -> ResolvedVoice:
        """What the voice a client named is, for `owner` (whose voice names count): a name is
        `owner`'s own voice of that name, else the public voice of that name
        (`sharing.py`); where the store cannot tell without waiting (a shared one),
        `owner`'s own, and `ensure` settles it."""
        resolved = self.names.resolve(self.devices.engine, self.devices.status, voice, owner)
        if resolved.named is None or resolved.voice is None:
            return resolved
        chosen = self.store.public.resolve_now(resolved.voice, resolved.named, owner)
        return resolved if chosen in (None, resolved.voice) else dataclasses.replace(resolved, voice=chosen)

    async def owned_by(self, owner: str) -> list[VoiceSummary]:
        """The voices `owner` registered, oldest first (none where the engine cannot clone)."""
        if not self.devices.engine.supports_voices:
            return []
        return await self.store.owned_by(owner)

    def may_be_registered(self, voice: str) -> bool:
        """Whether `voice` could name a registered voice (only the store can tell whether it does)."""
        return self.devices.engine.supports_voices and is_registered_id(voice)

    def needs_store(self, voice: str | None, engine: Engine) -> bool:
        """Whether a stream with this voice must first ask the store: a registered voice this
        device has not built (registered through another server, or before a restart), or, with
        a store shared by several servers, any registered voice (it may have been deleted)."""
        if voice is None or not self.devices.engine.supports_voices or not is_registered_id(voice):
            return False
        return self.store.shared or not engine.voices.has(voice) or self.store.usable_now(voice, ANY_OWNER) is False

    # ------------------------------------------------------------------ registering

    def admit_registration(self, owner: str = ANY_OWNER) -> Registration:
        """A place among the voice registrations waiting (`registrations.py`), taken before the
        reference audio is read; raises Refused(BUSY) when `owner`, or everyone, has too many
        waiting. `register` releases it."""
        if not self.devices.engine.supports_voices:
            raise Refused(ErrorKind.UNSUPPORTED, f"engine {self.devices.engine.name} cannot clone voices")
        refuse_page(owner, public=False)
        return self.registrations.admit(owner)

    async def register(self, audio: bytes, transcript: str | None = None, mode: str | None = None,
                       owner: str | Registration = ANY_OWNER, name: str | None = None,
                       public: bool = False) -> dict:
        """Clone a voice from reference audio (WAV, FLAC or OGG bytes) for `owner`; returns
        {voice, mode, audio_s, public} (and `name`, where given). The same audio, transcript and
        mode from the same owner give the same id; a `name` (unique per owner: another voice of
        that name is refused) gives an id made from it, and streams may name the voice by it.
        A `public` voice (it needs a name no other public voice has: `sharing.py`) is
        spoken by its name by anyone served, and listed to them; registering a voice kept
        already with `public` makes it public. The voice is kept in the store (the rules of
        `store.py`: an owner at its cap loses its own oldest voice; a full store refuses)
        and built on every device. It waits its turn among the owners' registrations
        (`admit_registration`, here unless the caller did it first and passes the Registration
        as `owner`)."""
        registration = owner if isinstance(owner, Registration) else self.admit_registration(owner)
        owner = registration.owner
        try:
            refuse_page(owner, public)
            if name is not None and (self.devices.engine.voices.has(name)
                                     or self.sharing.reads_as_the_servers(name)):
                raise Refused(ErrorKind.INVALID, f"{name!r} is, or reads as, a voice of the server's: "
                              "name yours otherwise", field="name")
            mode, transcript = checked_registration(transcript, mode, name, self.limits.max_text_chars,
                                                    public)
            if self.devices.status != Readiness.READY:
                raise self.devices.not_ready()
            assert self._jobs is not None, "VoiceService.start() was not awaited"
            # Hashing megabytes would hold the loop for milliseconds; hashlib lets go of the GIL.
            stored = await asyncio.to_thread(new_voice, owner, audio, transcript, mode,
                                             Lifetime(self.limits.voice_ttl_s, self.store.clock),
                                             None if name is None
                                             else (name, self.store.named_id(owner_key(owner), name)))
            stored = dataclasses.replace(stored, public=public)
            existing = None
            if name is not None:
                existing = await self.store.get(stored.id)
                if existing is not None and (existing.audio, existing.transcript, existing.mode) != \
                        (stored.audio, stored.transcript, stored.mode):
                    raise Refused(ErrorKind.INVALID, f"you have a voice named {name!r} already: delete it first, or "
                                                     "choose another name", field="name")
                holder = await self.store.public.id(name) if public else None
                if holder is not None and holder != stored.id:
                    raise public_name_taken(name)       # refused before the build; `put` decides
            await self.store.check_room(stored)
            # One reference at a time is decoded and encoded, on a worker thread: beside the
            # engine's steps (which go on), never between them; owners take turns.
            async with registration, self._jobs:
                result = await self._build(audio, stored.transcript, mode, stored.id)
            if name is not None:
                result["name"] = name
            try:
                retired = await self.store.put(stored)
            except BaseException:
                _delete_everywhere(self.devices, stored.id)
                raise
            for old in retired:
                _delete_everywhere(self.devices, old)
            if public and existing is not None and not existing.public:
                await self.store.public.set(stored.id, owner, True)     # kept already: made public now
            result["public"] = public or (existing is not None and existing.public)
            return result
        finally:
            registration.release()

    def check_use_now(self, voice: str | None, owner: str, named: str | None = None) -> None:
        """Refuse (INVALID, as an unknown voice) a registered voice that `owner` may not speak
        with (`store.may_speak_with`: another owner's named voice), or that the store no
        longer has, where the store tells without waiting; `ensure` asks one that cannot."""
        if voice is not None and self.may_be_registered(voice) and self.store.usable_now(voice, owner) is False:
            raise _unknown(self.devices, named or voice)

    async def ensure(self, voice: str, named: str | None = None, owner: str = ANY_OWNER) -> str:
        """Make a registered voice ready on every device, from the store, for `owner`; Refused
        (INVALID) when the store has no such voice or `owner` may not speak with it (naming it
        as the client did: `named`, or its id). Named, where `resolve` could not tell which
        voice the name is (a shared store), the store settles it. Returns the voice's id.
        Concurrent callers share one build."""
        usable = self.store.usable_now(voice, owner)
        if usable is None and named is not None:
            voice = await self.store.public.resolve(voice, named, owner)
        if not (await self.store.usable(voice, owner) if usable is None else usable):
            raise _unknown(self.devices, named or voice)
        pending = self._fetching.get(voice)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch(voice, named or voice))
            self._fetching[voice] = pending
            pending.add_done_callback(lambda _: self._fetching.pop(voice, None))
        await asyncio.shield(pending)
        return voice

    async def _fetch(self, voice: str, named: str) -> None:
        missing = [e for e in self.devices.engines if not e.voices.has(voice)]
        if not missing:
            if ((self.store.shared or self.store.usable_now(voice, ANY_OWNER) is False)
                    and not await self.store.has(voice)):
                _delete_everywhere(self.devices, voice)            # deleted through another server, or expired
                raise Refused(ErrorKind.INVALID, f"unknown voice {named!r}", field="voice")
            return
        stored = await self.store.get(voice)
        if stored is None:
            raise _unknown(self.devices, named)
        assert self._jobs is not None, "VoiceService.start() was not awaited"
        async with self._jobs:
            await self._build(stored.audio, stored.transcript, stored.mode, voice)

    async def _build(self, audio: bytes, transcript: str | None, mode: str, voice: str) -> dict:
        """Decode a reference and build its voice, under its id, on every device that lacks it,
        on the voice thread, whose freed memory then goes back to the system (the decode's peak
        is not kept)."""
        pcm, cancelled = None, False
        try:
            pcm, rate = await decode_reference(audio, self.limits.max_voice_audio_s,
                                               self.devices.engine.voice_sample_rate, partial(_on, self._worker))
            built = []
            try:
                for engine in self.devices.engines:
                    if not engine.voices.has(voice):
                        building = self._worker.submit(engine.voices.register, pcm, rate, transcript, mode, voice)
                        try:
                            await engine_work(asyncio.wrap_future(building))
                        except BaseException:
                            _undo_once_built(building, engine, voice)
                            raise
                        built.append(engine)
            except BaseException:
                for engine in built:
                    engine.voices.delete(voice)
                raise
            return {"voice": voice, "mode": mode, "audio_s": round(len(pcm) / rate, 3)}
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            pcm = None                         # the samples are let go before the trim, not after
            if cancelled:
                # Its client is gone, its build may still hold the voice thread (the engine
                # answers once built): the trim follows it there, and the cancel is not held.
                with contextlib.suppress(RuntimeError):        # the service closed meanwhile
                    self._worker.submit(release_memory)
            else:
                await _on(self._worker, release_memory)

    # ------------------------------------------------------------------ deleting

    async def delete(self, voice: str, owner: str = ANY_OWNER) -> bool:
        """Delete a registered voice; False if there is none by that id that `owner` may delete
        (another owner's voice looks like no voice at all); `voice` may be its name. Streams
        using it keep it to their end."""
        if self.devices.engine.supports_voices and not is_registered_id(voice) and is_voice_name(voice):
            voice = self.store.named_id(owner_key(owner), voice)
        deleted = await self.store.delete(voice, owner)
        if deleted:
            _delete_everywhere(self.devices, voice)
        return deleted

    async def every(self, owner: str | None = None) -> list[VoiceSummary]:
        """Every registered voice, oldest first, with its owner's key (for an admin); only
        those of the owner whose key is `owner` (and its address's pages'), where given."""
        return [v for v in await self.store.every_voice() if owner is None or keyed_under(v.owner, owner)]

    async def delete_owned(self, owner: str) -> list[str]:
        """Delete every voice of the owner whose key is `owner` (for an admin); their ids."""
        deleted = await self.store.delete_owned(owner)
        for voice in deleted:
            _delete_everywhere(self.devices, voice)
        return deleted

    async def _sweep(self) -> None:
        """Expired voices leave the store and every device (a store in this process also
        refuses them at once; this frees their memory). A store not opened yet is tried first,
        until it opens."""
        while not self.store.opened:
            await asyncio.sleep(STORE_RETRY_AFTER_S)
            try:
                await _open_store(self.store, self.devices)
            except StoreUnavailable:
                continue
            log.info("the voice store %s is open", self.store.describe())
        while True:
            await asyncio.sleep(VOICE_SWEEP_S)
            try:
                await self.expire()
            except Refused as err:                      # the store is unavailable: next time
                log.warning("expiring voices: %s", err.message)

    async def expire(self) -> list[str]:
        """Drop the voices whose time is up, from the store and every device; their ids."""
        gone = await self.store.expire()
        for voice in gone:
            _delete_everywhere(self.devices, voice)
        if gone:
            log.info("%d voices expired", len(gone))
        return gone



async def _open_store(store: VoiceStore, devices: Devices) -> None:
    await store.open()
    for voice in await rekey_named(store):
        _delete_everywhere(devices, voice)


def _unknown(devices: Devices, named: str) -> Refused:
    # Door-neutral: a Wyoming client, which cannot register a voice, is told what it may name
    # by its own door (`transports/wyoming.py`).
    return Refused(ErrorKind.INVALID, f"unknown voice {named!r} (built-in: {devices.engine.voices.names()}; "
                                      "or a registered voice's id, or its name)", field="voice")


def _delete_everywhere(devices: Devices, voice: str) -> bool:
    return any([engine.voices.delete(voice) for engine in devices.engines])


def _undo_once_built(building: Future, engine: Engine, voice: str) -> None:
    """A build left (its registration cancelled, or failed) while the voice thread runs it on:
    the voice it builds is deleted from the engine once built, on the event loop. A voice that
    is in the store after all (the same one registered again meanwhile) is built again when
    used (`ensure`)."""
    loop = asyncio.get_running_loop()

    def ended(done: Future) -> None:
        if not done.cancelled() and done.exception() is None:
            with contextlib.suppress(RuntimeError):          # the loop has closed, the engine with it
                loop.call_soon_threadsafe(engine.voices.delete, voice)

    building.add_done_callback(ended)


def _on(worker: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    return asyncio.get_running_loop().run_in_executor(worker, fn, *args)


def checked_registration(transcript: str | None, mode: str | None, name: str | None,
                         max_text_chars: int, public: bool = False) -> tuple[str, str | None]:
    """A registration's mode (its default: "both" with a transcript, else "reference") and its
    transcript (None where blank), or Refused; a `public` one needs a name."""
    if name is not None:
        check_voice_name(name)
    elif public:
        raise nameless_public()
    has_transcript = bool(transcript and transcript.strip())
    mode = mode or ("both" if has_transcript else "reference")
    if mode not in VOICE_MODES:
        raise Refused(ErrorKind.INVALID, f"field 'mode' must be one of {list(VOICE_MODES)}, got {mode!r}")
    if mode != "reference" and not has_transcript:
        raise Refused(ErrorKind.INVALID, f"field 'transcript' is required for mode {mode!r}")
    if transcript is not None and len(transcript) > max_text_chars:
        raise Refused(ErrorKind.TOO_LARGE, f"field 'transcript' is over max_text_chars={max_text_chars}")
    if transcript is not None:
        check_text(transcript, "field 'transcript'")
    return mode, transcript if has_transcript else None


async def decode_reference(audio: bytes, limit_s: float, sample_rate: int | None,
                           run: Callable[..., Awaitable[Any]]) -> tuple[Any, int]:
    """Reference audio to mono samples at `sample_rate` (None: its own), decoded through `run`
    (a worker thread), at most `limit_s` seconds long and at least `MIN_VOICE_AUDIO_S`."""
    try:
        pcm, rate = await run(decode_audio_file, audio, limit_s, sample_rate)
    except AudioTooLong as exc:
        raise Refused(ErrorKind.TOO_LARGE, f"reference {exc} (max_voice_audio_s={limit_s:g})") from None
    except ValueError as exc:
        raise Refused(ErrorKind.INVALID, f"field 'audio': {exc}") from None
    seconds = len(pcm) / rate
    if seconds > limit_s:
        raise Refused(ErrorKind.TOO_LARGE, f"reference audio is {seconds:.1f}s, over max_voice_audio_s={limit_s:g}")
    if seconds < MIN_VOICE_AUDIO_S:
        raise Refused(ErrorKind.INVALID, f"reference audio is {seconds:.2f}s; at least {MIN_VOICE_AUDIO_S}s "
                                         "is needed")
    return pcm, rate
