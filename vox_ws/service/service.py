"""The stream service: the one way into the engine loops for every front door.

A front door (protocol v1 over WebSocket, HTTP, a framework adapter) opens streams here and
consumes their events; registers and deletes voices (`service.voices`, `voices/service.py`); asks for
LoRA changes (`service.loras`, `loras.py`). The service checks
what it can before any engine work (readiness, draining, voice, limits), runs engine work on the
engine loop's thread, and watches every live stream's timers. It knows no socket and no wire format:
refusals are `Refused(kind, message)`, and each front door words them its own way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence

from ..config import Limits
from ..engine import Engine, ErrorKind, Readiness, Refused
from ..engine_process.devices import Devices
from ..engine_process.proxy import EngineProxy
from ..engines.lexicon import MAX_LEXICON_BYTES, Lexicon, combined, parse_lexicon
from ..files import read_regular_file
from .generation import Generation
from .handoff import LoopMailbox
from .loras import LoraService
from .markup import parse_ssml, wants_markup
from .metrics import Metrics
from .request import StreamRequest, StreamSetup
from .restores import EngineRestores
from .stream import Stream
from .validation import (
    MAX_SPEED,
    MIN_SPEED,
    check_instructions,
    check_language,
    check_length,
    check_output,
    check_slowing,
    check_text,
)
from .voices.aliases import Alias
from .voices.fetches import VoiceFetches
from .voices.memory_store import MemoryStore
from .voices.names import ResolvedVoice
from .voices.rescans import VoiceRescans
from .voices.service import VoiceService
from .voices.store import ANY_OWNER, StoreLimits, VoiceStore
from .word_timings import WordTimings
from .work import engine_work

log = logging.getLogger("vox_ws.service")

# The model's load is over: a device serves, or every one failed (`until_loaded`).
LOAD_SETTLED = (Readiness.READY, Readiness.FAILED)

# Threads that run output pipelines (codecs, tempo) for every stream. One encodes some 50
# streams in real time here (docs/PERFORMANCE.md); FFmpeg releases the GIL while it encodes.
ENCODING_THREADS = 2


class StreamService:
    """Serves streams on one engine loop per device (one, or several: `Devices`). Create it,
    `await start()` on the loop that will use it."""

    def __init__(self, devices: Devices | EngineProxy, limits: Limits | None = None,
                 metrics: Metrics | None = None, voice_store: VoiceStore | None = None,
                 voice_aliases: dict[str, Alias | None] | None = None,
                 word_timings: WordTimings | None = None) -> None:
        self.devices = devices if isinstance(devices, Devices) else Devices([devices])
        self.limits = limits or Limits()
        # Voices: built-in, aliases, and those registered, kept in the store (`voices/service.py`).
        self.voices = VoiceService(self.devices, self.limits, voice_store or MemoryStore(store_limits(self.limits)),
                                   voice_aliases)
        self.loras = LoraService(self.devices, self.limits, self._end_unloading)
        # The built-in voices read again from disk (SIGHUP, a voices folder that changes).
        self.voice_rescans = VoiceRescans(self.devices, lambda: self.until_loaded(None))
        # Voices fetched by name into the engine's voices folder, and removed (admin).
        self.voice_fetches = VoiceFetches(self.devices, self.voice_rescans)
        self.lexicon = Lexicon()                # the server's pronunciations (`load_lexicon`)
        self.metrics = metrics or Metrics()
        self.accepting = True                   # False while draining: no new streams
        self.mailbox: LoopMailbox | None = None
        self._live: set[Generation] = set()     # the streams still producing
        self._numbers = itertools.count(1)
        self._watchdog: asyncio.Task | None = None
        self._load_settled: asyncio.Event | None = None    # made when a caller first waits (`until_loaded`)
        # Text preparation (normalisation) runs here, one text at a time: beside the engine,
        # never on its thread or the loop.
        self._preparer = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-prepare")
        # Long texts are cut (tokenised) here: never behind a slow normalisation.
        self._splitter = ThreadPoolExecutor(1, thread_name_prefix="vox-ws-split")
        self.encoding = ThreadPoolExecutor(ENCODING_THREADS, thread_name_prefix="vox-ws-encode")
        # Where word times come from: the engine, else the aligner's processes (started at the
        # first stream that asks).
        self.word_timings = word_timings or WordTimings()

    @property
    def engine(self) -> Engine:
        """The engine that speaks for every device (they serve the same model)."""
        return self.devices.engine

    async def start(self) -> None:
        await self.voices.start()
        await self.voice_rescans.start()
        self.mailbox = LoopMailbox(asyncio.get_running_loop())
        self._watchdog = asyncio.create_task(self._watch(), name="vox-ws-stream-watchdog")
        EngineRestores(self.voices, self.loras).watch(self.devices)

    async def close(self, grace_s: float | None = None) -> None:
        """Stop its helpers; the aligner's processes within `grace_s` seconds (None: no bound)."""
        if self._watchdog is not None:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        await self.voice_rescans.close()
        self._preparer.shutdown(wait=False, cancel_futures=True)
        self._splitter.shutdown(wait=False, cancel_futures=True)
        self.encoding.shutdown(wait=False, cancel_futures=True)
        await asyncio.to_thread(self.word_timings.close, grace_s)
        await self.voices.close()

    async def until_loaded(self, timeout_s: float | None) -> Readiness:
        """The model's readiness once its load is over (a device serves, or every one failed),
        or after `timeout_s` seconds (None: no bound), whichever is first. For a client that asks
        once what the server serves and keeps the answer: Home Assistant keeps Wyoming's
        `describe` for the life of its config entry, so an answer given during the load would
        stand until someone reloads the integration; and for what the engine declares once
        loaded (how often to look at its voices on disk, `VoiceRescans`)."""
        if self.devices.status in LOAD_SETTLED:
            return self.devices.status
        if self._load_settled is None:
            # One watcher thread per device, started by the first caller and ended with its
            # device's load: a waiting caller holds no thread of its own.
            settled = self._load_settled = asyncio.Event()
            loop = asyncio.get_running_loop()

            def settle() -> None:
                if self.devices.status in LOAD_SETTLED:
                    settled.set()

            def watch(engine_loop: EngineProxy) -> None:
                engine_loop.ready_event.wait()          # set once the device's load has succeeded or failed
                try:
                    loop.call_soon_threadsafe(settle)
                except RuntimeError:                    # the event loop has closed (stopped while loading)
                    pass

            for engine_loop in self.devices.loops:
                threading.Thread(target=watch, args=(engine_loop,), name="vox-ws-load-watch", daemon=True).start()
        try:
            await asyncio.wait_for(self._load_settled.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass
        return self.devices.status

    # ------------------------------------------------------------------ streams

    @property
    def open_streams(self) -> int:
        return len(self._live)

    def open_stream(self, request: StreamRequest, owners: tuple[str, ...] = (),
                    log_fields: Mapping[str, Any] | None = None) -> Stream:
        """Open a stream for `request` (`request.py`) and start generating. `owners` names the
        clients the stream is for, broadest first (its token or address, its connection), among
        which the slot queue shares its slots fairly; `log_fields` go into its log line. A
        one-shot text too long for one generation is spoken in pieces, each continuing the one
        before. What of the request has no effect here is `Stream.ignored_options`. Raises
        `Refused`."""
        if not self.accepting:
            raise Refused(ErrorKind.GOING_AWAY, "server shutting down: no new streams")
        if self.mailbox is None:
            raise RuntimeError("StreamService.start() was not awaited")
        owner = owners[0] if owners else ANY_OWNER
        resolved = self.voices.resolve(request.voice, owner)
        checked = self._checked(request, resolved)      # a bad request is bad, the model loaded or not
        if self.devices.status != Readiness.READY:
            raise self.devices.not_ready()
        self.voices.check_use_now(checked.voice, owner, resolved.named)
        spoken = self._spoken(checked)
        engine_loop = self.devices.place()          # the stream stays on this device to its end
        generation = lora_pin = None
        voice = checked.voice
        try:
            lora_pin = engine_loop.engine.loras.pin(checked.lora)
            from_store = self.voices.needs_store(voice, engine_loop.engine)
            # The stream keeps its voice until it ends, even if the voice is deleted meanwhile.
            voice_pin = None if from_store else engine_loop.engine.voices.pin(voice)
            aligner = self.word_timings.aligner_for(engine_loop.engine, checked.language) \
                if checked.word_timestamps else None
            if aligner is not None:
                aligner.start()
            setup = StreamSetup(engine_loop, next(self._numbers), owners, dict(log_fields or {}), voice_pin, lora_pin,
                                combined(checked.pronunciations, self.lexicon), self._ignored(request, checked),
                                aligner)
            generation = Generation(self, checked, setup)
            stream = Stream(generation, checked, setup.ignored, self.metrics)
            # A voice from the store is fetched (and built) first; what the stream says waits for it.
            stream.queued = generation.start(None if checked.input_streaming else spoken,
                                             self.voices.ensure(voice, resolved.named, owner) if from_store else None)
        except BaseException:
            self.devices.release(engine_loop)
            if generation is not None:
                generation.release_lora()
            else:
                engine_loop.engine.loras.unpin(lora_pin)
            raise
        self._live.add(generation)
        if isinstance(checked.text, str) and checked.input_streaming and checked.text:
            stream.send_text(checked.text)
        elif checked.streamed_text:
            generation.input.feed(checked.text, lambda: generation.done)
        return stream

    def _checked(self, request: StreamRequest, resolved: ResolvedVoice) -> StreamRequest:
        """`request` through the service's rules, once: its voice resolved (an alias brings its
        instructions and options, the request's own winning), input streaming where the text is
        an iterator, its language's tag canonical, its timestamps those the engine gives."""
        check_output(request.output.speed, request.output.lookahead_s, request.output.volume)
        output = request.output
        if resolved.alias is not None and resolved.alias.speed != 1.0:
            # The alias's speed, times the request's own (an alias "slow-joe" slows any client).
            output = dataclasses.replace(output,
                                         speed=max(MIN_SPEED, min(MAX_SPEED, output.speed * resolved.alias.speed)))
        language = None if request.language is None else check_language(request.language)
        text = request.text
        input_streaming = request.input_streaming or request.streamed_text
        if isinstance(text, str):
            check_text(text)
            check_length(text, self.limits.max_text_chars)
        instructions, options = request.instructions, dict(request.options)
        if resolved.alias is not None:
            instructions = instructions or resolved.alias.instructions
            options = {**resolved.alias.options, **options}
        check_slowing(output.speed, self.engine.text.slowing(options))
        if instructions is not None:
            check_text(instructions, "instructions")
            check_instructions(instructions)
        if not input_streaming and (not isinstance(text, str) or not text.strip()):
            raise Refused(ErrorKind.INVALID, "field 'text' must not be empty: nothing to say", field="text")
        for item in request.pronunciations:
            self.engine.text.check_pronunciation(item)
        if input_streaming and wants_markup("", request.markup):
            raise Refused(ErrorKind.INVALID, "SSML is read in one-shot texts, not in streamed input")
        return dataclasses.replace(
            request, voice=resolved.voice, options=options, instructions=instructions, input_streaming=input_streaming,
            language=language, output=output,
            word_timestamps=request.word_timestamps and self.word_timings.given(self.engine, language),
            phoneme_timestamps=request.phoneme_timestamps and self.engine.phoneme_timings)

    @staticmethod
    def _spoken(request: StreamRequest) -> str | list:
        """A one-shot text as the stream says it: the text, or the parts of its SSML."""
        text = request.one_shot_text
        if text is None:
            return request.text if isinstance(request.text, str) else ""
        if not wants_markup(text, request.markup):
            return text
        spoken = parse_ssml(text)
        if not any(isinstance(part, str) for part in spoken):
            raise Refused(ErrorKind.INVALID, "nothing to say: the SSML has no text")
        return spoken

    def _ignored(self, asked: StreamRequest, checked: StreamRequest) -> tuple[str, ...]:
        """What of the request, as the client `asked` it, has no effect here: options the engine
        does not honour, instructions this voice does not follow, timestamps it cannot give."""
        ignored = sorted(set(checked.options) - self.engine.honoured_options)
        if asked.instructions and self._ignores_instructions(checked.voice):
            ignored.append("instructions")
        if asked.word_timestamps and not checked.word_timestamps:
            ignored.append("word_timestamps")
        if asked.phoneme_timestamps and not checked.phoneme_timestamps:
            ignored.append("phoneme_timestamps")
        return tuple(ignored)

    async def split_text(self, text: str, options: dict[str, Any], voice_pin: Any,
                         language: str | None = None) -> list[str]:
        work = asyncio.get_running_loop().run_in_executor(self._splitter, self.engine.text.split, text, options,
                                                          voice_pin, language)
        return await engine_work(work, "cutting the text failed: ")

    def _ignores_instructions(self, voice: str | None) -> bool:
        """Whether instructions would be ignored with this voice, resolved (the engine cannot
        follow them; a voice still to be fetched from the store counts as followed)."""
        if voice is not None and not self.engine.voices.has(voice):
            return not self.engine.text.follows_instructions(None) if self.engine.supports_voices else True
        return not self.engine.text.follows_instructions(self.engine.voices.pin(voice))

    def forget(self, generation: Generation) -> None:
        """A stream has stopped producing (called by its generation)."""
        if generation in self._live:
            self._live.discard(generation)
            self.devices.release(generation.engine_loop)

    async def off_loop(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the thread that prepares texts: CPU work a stream needs before its next
        segment, which would otherwise hold every other stream's I/O."""
        return await asyncio.get_running_loop().run_in_executor(self._preparer, fn, *args)

    async def prepare_text(self, text: str, options: dict[str, Any], language: str | None = None) -> str:
        work = asyncio.get_running_loop().run_in_executor(self._preparer, self.engine.text.prepare, text, options,
                                                          language)
        return await engine_work(work, "preparing the text failed: ")

    def _end_unloading(self, name: str) -> None:
        """An adapter's unload's time is up: the streams still speaking with it end (an adapter
        loaded again under the name since is another one: its streams go on)."""
        for generation in list(self._live):
            generation.end_if_unloading(name)

    def abort_all(self, kind: ErrorKind, message: str) -> None:
        """End every live stream with an error (the drain time ran out)."""
        for generation in list(self._live):
            generation.fail(Refused(kind, message))

    async def _watch(self) -> None:
        limits = self.limits
        tick = min(1.0, limits.write_stall_timeout_s / 4, limits.stream_timeout_s / 4)
        while True:
            await asyncio.sleep(tick)
            now = time.monotonic()
            for generation in list(self._live):
                generation.check_timers(now)

    # ------------------------------------------------------------------ pronunciations

    async def load_lexicon(self, path: str) -> list[str]:
        """(Re)load the server's lexicon from a file, off the loop. Returns what is wrong with the
        file, a line each: then the lexicon in use is kept as it was."""
        lexicon, problems = await read_lexicon(path)
        return self.use_lexicon(lexicon, path, problems)

    def use_lexicon(self, lexicon: Lexicon, path: str, problems: Sequence[str] = ()) -> list[str]:
        """Serve `lexicon` (read from `path`, with `problems` of form) unless anything is wrong
        with it: what is, a line each, its entries the engine cannot say included (IPA where it
        takes no phonemes, or phonemes its voices do not speak: the engine as it has declared
        itself, which a server's start waits for, `Devices.created`). Then the lexicon in use
        is kept as it was."""
        problems = list(problems)
        for item in lexicon.entries:
            try:
                self.engine.text.check_pronunciation(item)
            except Refused as err:
                problems.append(f"{path}: {err.message}")
        if not problems:
            self.lexicon = lexicon
        return problems


async def read_lexicon(path: str) -> tuple[Lexicon, list[str]]:
    """A lexicon file read (off the loop) and parsed, whatever the engine: the lexicon, and what
    is wrong with the file's form, a line each."""
    try:
        data = await asyncio.to_thread(read_regular_file, path, MAX_LEXICON_BYTES)
    except OSError as exc:
        return Lexicon(), [f"{path}: {exc.strerror or exc}"]
    return parse_lexicon(data, path)


def store_limits(limits: Limits, max_bytes: int = 512 << 20) -> StoreLimits:
    return StoreLimits(per_owner=limits.max_voices_per_owner, max_voices=limits.max_voices, max_bytes=max_bytes,
                       per_address=limits.max_voices_per_address, ttl_s=limits.voice_ttl_s)
