"""The stream service: the one way into the scheduler for every front door.

A front door (protocol v1 over WebSocket, HTTP, a framework adapter) opens streams here and
consumes their events; registers and deletes voices; asks for LoRA changes. The service checks
what it can before any engine work (readiness, draining, voice, limits), runs engine work on the
scheduler thread, and watches every live stream's timers. It knows no socket and no wire format:
refusals are `Refused(kind, message)`, and each front door words them its own way.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable

from ..audio import AudioTooLong, decode_audio_file
from ..config import Limits
from ..devices import Devices
from ..engine import VOICE_MODES, Engine, ErrorKind, Readiness, Refused
from ..files import read_regular_file
from ..lexicon import MAX_LEXICON_BYTES, Lexicon, Pronunciation, combined, parse_lexicon
from ..memory import release_memory
from ..metrics import Metrics
from ..scheduler import Scheduler
from .handoff import LoopMailbox
from .markup import parse_ssml, wants_markup
from .registrations import Registration, RegistrationQueue
from .output import AudioOutput
from .generation import Generation
from .stream import Stream
from .validation import check_instructions, check_language, check_length, check_output, check_text
from .voice_aliases import Alias
from .voice_names import ResolvedVoice, VoiceNames
from .voice_store import (ANY_OWNER, MemoryStore, StoreLimits, VoiceStore, VoiceSummary, check_voice_name,
                          is_registered_id, is_voice_name, named_voice_id, new_voice)

# Reference audio shorter than this cannot carry a voice.
MIN_VOICE_AUDIO_S = 0.2
# Reference audio files decoded and encoded at once: CPU work beside the engine's.
log = logging.getLogger("vox_ws.service")

MAX_CONCURRENT_VOICE_JOBS = 1
# Seconds between two sweeps of expired voices.
VOICE_SWEEP_S = 60.0
# Threads that run output pipelines (codecs, tempo) for every stream. One encodes some 50
# streams in real time here (docs/PERFORMANCE.md); FFmpeg releases the GIL while it encodes.
ENCODING_THREADS = 2


class StreamService:
    """Serves streams on one scheduler per device (one, or several: `Devices`). Create it,
    `await start()` on the loop that will use it."""

    def __init__(self, devices: Devices | Scheduler, limits: Limits | None = None,
                 metrics: Metrics | None = None, voice_store: VoiceStore | None = None,
                 voice_aliases: dict[str, Alias] | None = None) -> None:
        self.devices = devices if isinstance(devices, Devices) else Devices([devices])
        self.limits = limits or Limits()
        # Registered voices: their reference audio, owners and limits (`voice_store.py`).
        self.store = voice_store or MemoryStore(store_limits(self.limits))
        self.registrations = RegistrationQueue(self.limits.max_pending_voices_per_owner,
                                               self.limits.max_pending_voices)
        self._fetching: dict[str, asyncio.Future] = {}      # voices being rebuilt from the store
        # Aliases and names (`voice_names.py`); None: the defaults (`voice_aliases.py`).
        self.names = VoiceNames(voice_aliases)
        self.lexicon = Lexicon()                # the server's pronunciations (`load_lexicon`)
        self.metrics = metrics or Metrics()
        self.accepting = True                   # False while draining: no new streams
        self.mailbox: LoopMailbox | None = None
        self._live: set[Generation] = set()     # the streams still producing
        self._numbers = itertools.count(1)
        self._watchdog: asyncio.Task | None = None
        self._sweeper: asyncio.Task | None = None
        self._voice_jobs: asyncio.Semaphore | None = None
        # Text preparation (normalisation) runs here, one text at a time: beside the engine,
        # never on its thread or the loop.
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-prepare")
        # Long texts are cut (tokenised) here: never behind a slow normalisation.
        self._splitter = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-split")
        # Reference audio is decoded and encoded on one thread of its own: its peaks come from one
        # malloc arena, which is trimmed after each voice (a pool of threads keeps a peak per arena).
        self._voice_worker = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-voice")
        self.encoding = ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="vox-ws-encode")

    @property
    def engine(self) -> Engine:
        """The engine that speaks for every device (they serve the same model)."""
        return self.devices.engine

    async def start(self) -> None:
        opening = getattr(self.store, "open", None)
        if opening is not None:
            await opening()
        self.mailbox = LoopMailbox(asyncio.get_running_loop())
        self._voice_jobs = asyncio.Semaphore(MAX_CONCURRENT_VOICE_JOBS)
        self._watchdog = asyncio.create_task(self._watch(), name="vox-ws-stream-watchdog")
        self._sweeper = asyncio.create_task(self._sweep_voices(), name="vox-ws-voice-sweeper")

    async def close(self) -> None:
        for task in (self._watchdog, self._sweeper):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._splitter.shutdown(wait=False, cancel_futures=True)
        self._voice_worker.shutdown(wait=False, cancel_futures=True)
        self.encoding.shutdown(wait=False, cancel_futures=True)
        await self.store.close()

    # ------------------------------------------------------------------ streams

    @property
    def open_streams(self) -> int:
        return len(self._live)

    def open_stream(self, text: str | AsyncIterator[str] | None = None, *, voice: str | None = None,
                    options: dict[str, Any] | None = None, output: AudioOutput = AudioOutput(),
                    input_streaming: bool = False, log_fields: dict[str, Any] | None = None,
                    owners: tuple[str, ...] = (), instructions: str | None = None,
                    word_timestamps: bool = False, phoneme_timestamps: bool = False,
                    markup: str | None = None, pronunciations: tuple[Pronunciation, ...] = (),
                    lora: str | None = None, language: str | None = None) -> Stream:
        """Open a stream and start generating.

        `text` a string: say it (with `input_streaming`, it is the first piece and more may
        follow through `send_text`); an async iterator of strings: read the input from it;
        None with `input_streaming`: the input comes through `send_text`. `owners` names the
        clients the stream is for, broadest first (its token or address, its connection),
        among which the scheduler shares its slots fairly. `instructions` describe the voice or
        style in words, where the engine follows them (`ignores_instructions`). `word_timestamps`
        asks for `Words` events, where the engine knows word times (`Engine.word_timings`), and
        `phoneme_timestamps` for `Phonemes` events likewise (`Engine.phoneme_timings`). A
        one-shot text is SSML (`markup.py`) when `markup` is "ssml", or unsaid and the text
        starts with `<speak`; its breaks are exact silence. `pronunciations` come before the
        server's lexicon (`lexicon.py`). `lora` names a loaded LoRA adapter to speak with
        (None: the device's default adapter, or the base model); the stream keeps it to its end.
        `language` is the text's (a BCP 47 tag), where the client knows it: how the text is cut
        into sentences and normalised. A one-shot text too long for one generation is spoken in pieces, each continuing the one
        before. Raises `Refused`.
        """
        if not self.accepting:
            raise Refused(ErrorKind.GOING_AWAY, "server shutting down: no new streams")
        if self.devices.status != Readiness.READY:
            raise self.devices.not_ready()
        if self.mailbox is None:
            raise RuntimeError("StreamService.start() was not awaited")
        resolved = self.resolve_voice(voice, owners[0] if owners else ANY_OWNER)
        voice = resolved.voice
        if resolved.alias is not None:
            instructions = instructions or resolved.alias.instructions
            options = {**resolved.alias.options, **(options or {})}
        streamed_text = text is not None and not isinstance(text, str)
        input_streaming = input_streaming or streamed_text
        check_output(output.speed, output.lookahead_s, output.volume)
        if language is not None:
            language = check_language(language)
        if isinstance(text, str):
            check_text(text)
            check_length(text, self.limits.max_text_chars)
        if instructions is not None:
            check_text(instructions, "instructions")
            check_instructions(instructions)
        if not input_streaming and (not isinstance(text, str) or not text.strip()):
            raise Refused(ErrorKind.INVALID, "nothing to say: the text is empty")
        spoken: str | list = text if isinstance(text, str) else ""
        for item in pronunciations:
            self.engine.text.check_pronunciation(item)
        if input_streaming and wants_markup("", markup):
            raise Refused(ErrorKind.INVALID, "SSML is read in one-shot texts, not in streamed input")
        if isinstance(text, str) and not input_streaming and wants_markup(text, markup):
            spoken = parse_ssml(text)
            if not any(isinstance(part, str) for part in spoken):
                raise Refused(ErrorKind.INVALID, "nothing to say: the SSML has no text")
        scheduler = self.devices.place()          # the stream stays on this device to its end
        stream = lora_pin = None
        try:
            lora_pin = scheduler.engine.loras.pin(lora)
            from_store = self.needs_store(voice, scheduler.engine)
            if from_store and self.store.known_now(voice) is False:
                # Refused now, as any unknown voice, by the name the client gave.
                scheduler.engine.voices.check(resolved.named or voice)
            # The stream keeps its voice until it ends, even if the voice is deleted meanwhile.
            voice_pin = None if from_store else scheduler.engine.voices.pin(voice)
            stream = Stream(self, scheduler, next(self._numbers), voice, dict(options or {}), output,
                            input_streaming, dict(log_fields or {}),
                            text_chars=len(text) if isinstance(text, str) and not input_streaming else 0,
                            voice_pin=voice_pin,
                            owners=owners, instructions=instructions,
                            word_timestamps=word_timestamps and self.engine.word_timings,
                            phoneme_timestamps=phoneme_timestamps and self.engine.phoneme_timings,
                            lexicon=combined(pronunciations, self.lexicon), lora_pin=lora_pin, language=language)
            # A voice from the store is fetched (and built) first; what the stream says waits for it.
            stream.queued = stream.generation.start(None if input_streaming else spoken,
                                                    self.ensure_voice(voice, resolved.named) if from_store else None)
        except BaseException:
            self.devices.release(scheduler)
            if stream is not None:
                stream.generation.release_lora()
            else:
                scheduler.engine.loras.unpin(lora_pin)
            raise
        self._live.add(stream.generation)
        if isinstance(text, str) and input_streaming and text:
            stream.send_text(text)
        elif streamed_text:
            stream.generation.feed(text)
        return stream

    async def split_text(self, text: str, options: dict[str, Any], voice_pin: Any,
                         language: str | None = None) -> list[str]:
        work = asyncio.get_running_loop().run_in_executor(self._splitter, self.engine.text.split, text, options,
                                                          voice_pin, language)
        return await _engine_work(work, "cutting the text failed: ")

    def ignores_instructions(self, voice: str | None) -> bool:
        """Whether instructions would be ignored with this voice (the engine cannot follow them;
        a voice still to be fetched from the store counts as followed)."""
        voice = self.resolve_voice(voice).voice
        if voice is not None and not self.engine.voices.has(voice):
            return not self.engine.text.follows_instructions(None) if self.engine.supports_voices else True
        return not self.engine.text.follows_instructions(self.engine.voices.pin(voice))

    def forget(self, generation: Generation) -> None:
        """A stream has stopped producing (called by its generation)."""
        if generation in self._live:
            self._live.discard(generation)
            self.devices.release(generation.scheduler)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the thread that prepares texts: CPU work a stream needs before its next
        segment, which would otherwise hold every other stream's I/O."""
        return await asyncio.get_running_loop().run_in_executor(self._preparer, fn, *args)

    async def prepare_text(self, text: str, options: dict[str, Any], language: str | None = None) -> str:
        work = asyncio.get_running_loop().run_in_executor(self._preparer, self.engine.text.prepare, text, options,
                                                          language)
        return await _engine_work(work, "preparing the text failed: ")

    def abort_all(self, kind: ErrorKind, message: str) -> None:
        """End every live stream with an error (the drain time ran out)."""
        for generation in list(self._live):
            generation.abort(kind, message)

    async def _watch(self) -> None:
        limits = self.limits
        tick = min(1.0, limits.write_stall_timeout_s / 4, limits.stream_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for generation in list(self._live):
                generation.check_timers(now)

    async def _sweep_voices(self) -> None:
        """Expired voices leave the store and every device (a store in this process also
        refuses them at once; this frees their memory)."""
        while True:
            await asyncio.sleep(VOICE_SWEEP_S)
            try:
                await self.expire_voices()
            except Refused as err:                      # the store is unavailable: next time
                log.warning("expiring voices: %s", err.message)

    async def expire_voices(self) -> list[str]:
        """Drop the voices whose time is up, from the store and every device; their ids."""
        gone = await self.store.expire()
        for voice in gone:
            self._delete_everywhere(voice)
        if gone:
            log.info("%d voices expired", len(gone))
        return gone

    # ------------------------------------------------------------------ pronunciations

    async def load_lexicon(self, path: str) -> list[str]:
        """(Re)load the server's lexicon from a file, off the loop. Returns what is wrong with the
        file, a line each: then the lexicon in use is kept as it was."""
        try:
            data = await asyncio.to_thread(read_regular_file, path, MAX_LEXICON_BYTES)
        except OSError as exc:
            return [f"{path}: {exc.strerror or exc}"]
        lexicon, problems = parse_lexicon(data, path)
        for item in lexicon.entries:
            try:
                self.engine.text.check_pronunciation(item)
            except Refused as err:
                problems.append(f"{path}: {err.message}")
        if not problems:
            self.lexicon = lexicon
        return problems

    # ------------------------------------------------------------------ voices and LoRA

    def voices(self) -> list[str]:
        return self.engine.voices.names() if self.devices.status == Readiness.READY else []

    def aliases(self) -> dict[str, Alias]:
        return self.names.aliases(self.engine, self.devices.status)

    def resolve_voice(self, voice: str | None, owner: str = ANY_OWNER) -> ResolvedVoice:
        """What the voice a client named is, for `owner` (whose voice names count)."""
        return self.names.resolve(self.engine, self.devices.status, voice, owner)

    async def voices_of(self, owner: str) -> list[VoiceSummary]:
        """The voices `owner` registered, oldest first (none where the engine cannot clone)."""
        if not self.engine.supports_voices:
            return []
        return await self.store.owned_by(owner)

    def admit_registration(self, owner: str = ANY_OWNER) -> Registration:
        """A place among the voice registrations waiting (`registrations.py`), taken before the
        reference audio is read; raises Refused(BUSY) when `owner`, or everyone, has too many
        waiting. `register_voice` releases it."""
        if not self.engine.supports_voices:
            raise Refused(ErrorKind.UNSUPPORTED, f"engine {self.engine.name} cannot clone voices")
        return self.registrations.admit(owner)

    async def register_voice(self, audio: bytes, transcript: str | None = None, mode: str | None = None,
                             owner: str = ANY_OWNER, registration: Registration | None = None,
                             name: str | None = None) -> dict:
        """Clone a voice from reference audio (WAV, FLAC or OGG bytes) for `owner`; returns
        {voice, mode, audio_s} (and `name`, where given). The same audio, transcript and mode
        from the same owner give the same id; a `name` (unique per owner: another voice of
        that name is refused) gives an id made from it, and streams may name the voice by it. The voice is kept in the store (the rules of `voice_store.py`: an owner at its
        cap loses its own oldest voice; a full store refuses) and built on every device. It
        waits its turn among the owners' registrations (`admit_registration`, here unless the
        caller did it first)."""
        registration = registration or self.admit_registration(owner)
        try:
            return await self._register_voice(audio, transcript, mode, owner, registration, name)
        finally:
            registration.release()

    async def _register_voice(self, audio: bytes, transcript: str | None, mode: str | None, owner: str,
                              registration: Registration, name: str | None) -> dict:
        if name is not None:
            check_voice_name(name)
            if self.engine.voices.has(name) or name in self.aliases():
                raise Refused(ErrorKind.INVALID, f"{name!r} is a voice of the server's: name yours otherwise",
                              field="name")
        has_transcript = bool(transcript and transcript.strip())
        mode = mode or ("both" if has_transcript else "reference")
        if mode not in VOICE_MODES:
            raise Refused(ErrorKind.INVALID, f"field 'mode' must be one of {list(VOICE_MODES)}, got {mode!r}")
        if mode != "reference" and not has_transcript:
            raise Refused(ErrorKind.INVALID, f"field 'transcript' is required for mode {mode!r}")
        if transcript is not None and len(transcript) > self.limits.max_text_chars:
            raise Refused(ErrorKind.TOO_LARGE, f"field 'transcript' is over max_text_chars={self.limits.max_text_chars}")
        if transcript is not None:
            check_text(transcript, "field 'transcript'")
        if self.devices.status != Readiness.READY:
            raise self.devices.not_ready()
        assert self._voice_jobs is not None, "StreamService.start() was not awaited"
        # Hashing megabytes would hold the loop for milliseconds; hashlib lets go of the GIL.
        stored = await asyncio.to_thread(new_voice, owner, audio, transcript if has_transcript else None, mode, name,
                                         self.limits.voice_ttl_s, self.store.clock)
        if name is not None:
            existing = await self.store.get(stored.id)
            if existing is not None and (existing.audio, existing.transcript, existing.mode) != \
                    (stored.audio, stored.transcript, stored.mode):
                raise Refused(ErrorKind.INVALID, f"you have a voice named {name!r} already: delete it first, or "
                                                 "choose another name", field="name")
        await self.store.check_room(stored)
        # One reference at a time is decoded and encoded, on a worker thread: beside the
        # engine's steps (which go on), never between them; owners take turns.
        async with registration, self._voice_jobs:
            result = await self._build_voice(audio, stored.transcript, mode, stored.id)
        if name is not None:
            result["name"] = name
        try:
            retired = await self.store.put(stored)
        except BaseException:
            self._delete_everywhere(stored.id)
            raise
        for old in retired:
            self._delete_everywhere(old)
        return result

    def may_be_registered(self, voice: str) -> bool:
        """Whether `voice` could name a registered voice (only the store can tell whether it does)."""
        return self.engine.supports_voices and is_registered_id(voice)

    def needs_store(self, voice: str | None, engine: Engine) -> bool:
        """Whether a stream with this voice must first ask the store: a registered voice this
        device has not built (registered through another server, or before a restart), or, with
        a store shared by several servers, any registered voice (it may have been deleted)."""
        if voice is None or not self.engine.supports_voices or not is_registered_id(voice):
            return False
        return self.store.shared or not engine.voices.has(voice) or self.store.known_now(voice) is False

    async def ensure_voice(self, voice: str, named: str | None = None) -> None:
        """Make a registered voice ready on every device, from the store; Refused (INVALID)
        when the store has no such voice (naming it as the client did: `named`, or its id).
        Concurrent callers share one build."""
        pending = self._fetching.get(voice)
        if pending is None:
            pending = asyncio.ensure_future(self._fetch_voice(voice, named or voice))
            self._fetching[voice] = pending
            pending.add_done_callback(lambda _: self._fetching.pop(voice, None))
        await asyncio.shield(pending)

    async def _fetch_voice(self, voice: str, named: str) -> None:
        missing = [e for e in self.devices.engines if not e.voices.has(voice)]
        if not missing:
            if (self.store.shared or self.store.known_now(voice) is False) and not await self.store.has(voice):
                self._delete_everywhere(voice)            # deleted through another server, or expired
                raise Refused(ErrorKind.INVALID, f"unknown voice {named!r}")
            return
        stored = await self.store.get(voice)
        if stored is None:
            raise Refused(ErrorKind.INVALID, f"unknown voice {named!r} (built-in: {self.engine.voices.names()}; "
                                             "or register one)")
        assert self._voice_jobs is not None, "StreamService.start() was not awaited"
        async with self._voice_jobs:
            await self._build_voice(stored.audio, stored.transcript, stored.mode, voice)

    async def _build_voice(self, audio: bytes, transcript: str | None, mode: str, voice: str) -> dict:
        """Decode a reference and build its voice everywhere, on the voice thread, whose freed
        memory then goes back to the system (the decode's peak is not kept)."""
        try:
            pcm, rate = await self._decode(audio)
            return await self._build_everywhere(pcm, rate, transcript, mode, voice)
        finally:
            pcm = None                         # the samples are let go before the trim, not after
            await self._on_voice_worker(release_memory)

    async def _build_everywhere(self, pcm: Any, rate: int, transcript: str | None, mode: str, voice: str) -> dict:
        """The voice's prompt on every device that lacks it, under its id."""
        built = []
        try:
            for engine in self.devices.engines:
                if not engine.voices.has(voice):
                    await _engine_work(self._on_voice_worker(engine.voices.register, pcm, rate, transcript, mode,
                                                             voice))
                    built.append(engine)
        except BaseException:
            for engine in built:
                engine.voices.delete(voice)
            raise
        return {"voice": voice, "mode": mode, "audio_s": round(len(pcm) / rate, 3)}

    def _delete_everywhere(self, voice: str) -> bool:
        return any([engine.voices.delete(voice) for engine in self.devices.engines])

    async def _decode(self, audio: bytes) -> tuple[Any, int]:
        """Reference audio to mono samples at the engine's rate."""
        limit = self.limits.max_voice_audio_s
        try:
            pcm, rate = await self._on_voice_worker(decode_audio_file, audio, limit, self.engine.voice_sample_rate)
        except AudioTooLong as exc:
            raise Refused(ErrorKind.TOO_LARGE, f"reference {exc} (max_voice_audio_s={limit:g})") from None
        except ValueError as exc:
            raise Refused(ErrorKind.INVALID, f"field 'audio': {exc}") from None
        seconds = len(pcm) / rate
        if seconds > limit:
            raise Refused(ErrorKind.TOO_LARGE, f"reference audio is {seconds:.1f}s, over max_voice_audio_s={limit:g}")
        if seconds < MIN_VOICE_AUDIO_S:
            raise Refused(ErrorKind.INVALID, f"reference audio is {seconds:.2f}s; at least {MIN_VOICE_AUDIO_S}s "
                                             "is needed")
        return pcm, rate

    async def delete_voice(self, voice: str, owner: str = ANY_OWNER) -> bool:
        """Delete a registered voice; False if there is none by that id that `owner` may delete
        (another owner's voice looks like no voice at all); `voice` may be its name. Streams
        using it keep it to their end."""
        if self.engine.supports_voices and not is_registered_id(voice) and is_voice_name(voice):
            voice = named_voice_id(owner, voice)
        deleted = await self.store.delete(voice, owner)
        if deleted:
            self._delete_everywhere(voice)
        return deleted

    async def every_voice(self, owner: str | None = None) -> list[VoiceSummary]:
        """Every registered voice, oldest first, with its owner's key (for an admin); only
        those of the owner whose key is `owner`, where given."""
        return [v for v in await self.store.every_voice() if owner is None or v.owner == owner]

    async def delete_voices_of(self, owner: str) -> list[str]:
        """Delete every voice of the owner whose key is `owner` (for an admin); their ids."""
        deleted = await self.store.delete_owned(owner)
        for voice in deleted:
            self._delete_everywhere(voice)
        return deleted

    async def lora(self, op: str, name: str | None) -> dict[str, Any]:
        """A LoRA operation on every device, between two of its steps: `load` an adapter (read
        from disk once, off the engines' threads) into a free slot, `unload` it (streams using
        it finish first), `enable` it as the default of streams that name none, `disable` that.
        A load refused by one device is undone on the others."""
        if self.devices.status != Readiness.READY:
            raise self.devices.not_ready()
        adapter_file = await self._off_thread(self.engine.loras.read, name) if op == "load" else None
        ready = self.devices.ready
        if not ready:
            raise self.devices.not_ready()
        verbs = {"load": lambda engine: engine.loras.load(adapter_file),
                 "unload": lambda engine: engine.loras.unload(name),
                 "enable": lambda engine: engine.loras.set_default(name),
                 "disable": lambda engine: engine.loras.clear_default()}
        if op not in verbs:
            raise Refused(ErrorKind.INVALID, f"field 'op' must be load, unload, enable or disable, got {op!r}",
                          field="op")
        outcomes = await _on_each(self.devices, ready, verbs[op])
        refusals = [o for o in outcomes if isinstance(o, BaseException)]
        if refusals:
            if op == "load":
                loaded = [s for s, o in zip(ready, outcomes) if not isinstance(o, BaseException)]
                await _on_each(self.devices, loaded, lambda engine: engine.loras.unload(name))
            raise refusals[0]
        result = {"op": op, **outcomes[0], "lora": self.loras()}
        if op == "unload":       # each device frees its slot once its own streams have ended
            result.update(unloaded=all(o["unloaded"] for o in outcomes),
                          streams_using=sum(o["streams_using"] for o in outcomes))
            if not result["unloaded"]:
                asyncio.get_running_loop().call_later(self.limits.lora_unload_timeout_s, self._end_unloading,
                                                      result["name"])
        return result

    def _end_unloading(self, name: str) -> None:
        """An unload's time is up: the streams still speaking with that adapter end (an adapter
        loaded again under the name since is another one: its streams go on)."""
        for generation in list(self._live):
            generation.end_if_unloading(name)

    def loras(self) -> dict[str, Any]:
        """The adapters loaded (the same on every device), the slots and what a slot costs; an
        adapter's streams counted on every device, and unloading while any device has it so."""
        each = [engine.loras.describe() for engine in self.devices.engines]
        first = each[0]
        if not first.get("configured"):
            return first
        merged: dict[str, dict[str, Any]] = {}
        for described in each:
            for adapter in described["adapters"]:
                seen = merged.setdefault(adapter["name"], {**adapter, "streams": 0})
                seen["streams"] += adapter["streams"]
                if adapter["state"] == "unloading":
                    seen["state"] = "unloading"
        return {**first, "adapters": sorted(merged.values(), key=lambda a: a["slot"])}

    def _on_voice_worker(self, fn: Any, *args: Any) -> Awaitable[Any]:
        return asyncio.get_running_loop().run_in_executor(self._voice_worker, fn, *args)

    async def _off_thread(self, fn: Any, *args: Any) -> Any:
        """Run thread-safe engine work on a worker thread."""
        return await _engine_work(asyncio.to_thread(fn, *args))


def store_limits(limits: Limits, max_bytes: int = 512 << 20) -> StoreLimits:
    return StoreLimits(per_owner=limits.max_voices_per_owner, max_voices=limits.max_voices, max_bytes=max_bytes,
                       per_address=limits.max_voices_per_address, ttl_s=limits.voice_ttl_s)


async def _on_each(devices: Devices, schedulers: list[Scheduler], fn: Any) -> list[Any]:
    """`fn(engine)` on each scheduler's thread, between two steps: each one's result or refusal."""
    calls = [_engine_work(asyncio.wrap_future(done)) for done in devices.call_each(fn, schedulers)]
    return await asyncio.gather(*calls, return_exceptions=True)


async def _engine_work(work: Awaitable[Any], failed: str = "") -> Any:
    """Await engine work: refusals pass as they are; any other error becomes INTERNAL (the
    engine's failure is this request's, not the server's)."""
    try:
        return await work
    except Refused:
        raise
    except Exception as exc:  # noqa: BLE001 - report it; the service goes on
        raise Refused(ErrorKind.INTERNAL, f"{failed}{type(exc).__name__}: {exc}") from exc
