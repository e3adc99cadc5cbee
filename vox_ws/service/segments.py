"""How a stream's segments start: its text cut where the engine says it must be (off the loop
where long), its pronunciations put in, normalised where the engine prepares text, and each
segment's engine request built. A stream's `Generation` decides when; this says how.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Protocol

from ..config import Limits
from ..engine import Engine, ErrorKind, GenerationRequest, Refused
from ..engine_process.view import Held
from ..engines.lexicon import Lexicon, found_in, respell
from ..text import text_words
from .markup import Part
from .request import StreamRequest, StreamSetup
from .silence import SilenceBudget
from .sink import SegmentSink
from .text_plan import Pause, TextPlan

# A one-shot text longer than this is cut into pieces (`Engine.text.split`) off the loop.
SPLIT_ON_LOOP_CHARS = 300


class TextWork(Protocol):
    """The service's threads for text work (`StreamService`): never the loop, never the engine's."""

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any: ...

    async def prepare_text(self, text: str, options: dict[str, Any], language: str | None = None) -> str: ...

    async def split_text(self, text: str, options: dict[str, Any], voice_pin: Any,
                         language: str | None = None) -> list[str]: ...


class SegmentStarter:
    """One stream's segments, from text to engine request. `voice_pin` is set anew once a voice
    fetched from the store is built."""

    def __init__(self, work: TextWork, engine: Engine, request: StreamRequest, setup: StreamSetup,
                 limits: Limits) -> None:
        self._work = work
        self._engine = engine
        self._request = request
        self.voice_pin = setup.voice_pin
        self._owners = setup.owners
        self._lexicon = setup.lexicon if setup.lexicon is not None and len(setup.lexicon) else None
        # An engine that takes phonemes applies the entries itself: those its text matches
        # (found off the loop as the text is prepared), for the pieces that text is cut into.
        self._found: Lexicon | None = None
        self._options = dict(request.options)
        self._limits = limits
        self._written_chars = 0               # of the segments so far, as sent
        self._pronounced_chars = 0            # ... and with their pronunciations put in
        self._silence = SilenceBudget(request.output.speed)

    def release_voice(self) -> None:
        """The stream has stopped: its voice is held no longer (where the engine holds it)."""
        pin, self.voice_pin = self.voice_pin, None
        if isinstance(pin, Held):
            pin.release()

    def use_voice(self, voice: str) -> None:
        """Speak with `voice` rather than the one the request named (resolved by the store after
        the stream opened, before any segment was made)."""
        self._request = dataclasses.replace(self._request, voice=voice)

    # ------------------------------------------------------------------ added silence

    def spend_silence(self, parts: list[Part]) -> None:
        """A one-shot text's breaks and the silence the engine adds to its texts, all counted
        before anything is queued: Refused (TOO_LARGE) over the bound, as a whole."""
        self._silence.spend(sum(p.seconds for p in parts if isinstance(p, Pause)),
                            sum(self._engine_silence(p) for p in parts if isinstance(p, str)))

    def _engine_silence(self, text: str) -> float:
        request = self._request
        return self._engine.text.added_silence_s(text, self._options, request.voice, request.language)

    # ------------------------------------------------------------------ cutting

    def cuts_off_loop(self, parts: list[Part]) -> bool:
        return self._engine.cuts_texts and sum(len(p) for p in parts if isinstance(p, str)) > SPLIT_ON_LOOP_CHARS

    def cut_on_loop(self, parts: list[Part]) -> list[Part]:
        if not self._engine.cuts_texts:
            return parts
        return [piece for part in parts
                for piece in ([part] if isinstance(part, Pause) else self._split(part))]

    async def cut(self, parts: list[Part]) -> list[Part]:
        """`parts` cut where one generation could not carry them, off the loop when long
        (tokenising thousands of characters would hold up every stream)."""
        if not self.cuts_off_loop(parts):
            return self.cut_on_loop(parts)
        request = self._request
        pieces: list[Part] = []
        for part in parts:
            pieces += [part] if isinstance(part, Pause) else \
                await self._work.split_text(part, self._options, self.voice_pin, request.language)
        return pieces

    def _split(self, text: str, options: dict[str, Any] | None = None) -> list[str]:
        return self._engine.text.split(text, options or self._options, self.voice_pin, self._request.language)

    # ------------------------------------------------------------------ preparing

    def needs_preparing(self) -> bool:
        """Whether a segment's text is worked on off the loop before it is queued: it has
        pronunciations to find (a lexicon of 20,000 phrases over a 5,000-character text is some
        35 ms of matching), or the engine prepares (normalises) it."""
        return self._lexicon is not None or self._engine.text.needs_preparing(self._options, self._request.language)

    async def prepared(self, text: str, stopped: Callable[[], bool]) -> list[tuple[str, str, bool]] | None:
        """`text` ready for the engine, off the loop: [(text as the segment reports it, text the
        engine is given, whether the engine prepared it)], more than one where normalising made
        it too long for one generation (those pieces report their normalised text); None where
        the stream `stopped` meanwhile. Engines that do not take phonemes are given the text with
        its pronunciations respelled, before normalisation."""
        engine_text = await self._respelled(text)
        if stopped():
            return None
        if not self._engine.text.needs_preparing(self._options, self._request.language):
            await self._find_pronunciations(engine_text)
            return [(text, engine_text, False)]
        normalised = await self._work.prepare_text(engine_text, self._options, self._request.language)
        if stopped():
            return None
        await self._find_pronunciations(normalised)
        pieces = self._split(normalised, {**self._options, "normalize": False})
        if len(pieces) > 1:
            return [(piece, piece, True) for piece in pieces]
        return [(text, normalised, True)]

    async def _find_pronunciations(self, engine_text: str) -> None:
        """For an engine that takes phonemes: the entries `engine_text` matches (all it, or any
        piece it is cut into, needs), off the loop, as its requests carry them to the engine (a
        lexicon of 20,000 phrases never crosses to its process, nor is matched on the loop)."""
        if self._lexicon is None or not self._engine.takes_phonemes:
            return
        self._found = await self._work.off_loop(_matched, engine_text, self._lexicon)

    async def _respelled(self, text: str) -> str:
        """The text the engine is given, its pronunciations put in. IPA entries are only taken by
        engines that take phonemes, which are given the text as sent: one respelling serves the
        bound (IPA counted where it applies) and, for the other engines, is the text they get."""
        if self._lexicon is None:
            return text
        takes_phonemes = self._engine.takes_phonemes
        said = await self._work.off_loop(respell, text, self._lexicon, takes_phonemes)
        self._check_pronounced(len(text), len(said))
        return text if takes_phonemes else said

    def _check_pronounced(self, written: int, said: int) -> None:
        """What `max_text_chars` bounds is the text as it will be said, pronunciations put in
        (an entry may say a one-letter word as 100 characters): a one-shot text in all; a
        streamed one, whose length has no bound, may grow by at most that much over its life."""
        self._written_chars += written
        self._pronounced_chars += said
        limit = self._limits.max_text_chars
        if not self._request.input_streaming and self._pronounced_chars > limit:
            raise Refused(ErrorKind.TOO_LARGE, f"with its pronunciations the text is {self._pronounced_chars} "
                                               f"characters, over max_text_chars={limit}", field="pronunciations")
        if self._pronounced_chars - self._written_chars > limit:
            raise Refused(ErrorKind.TOO_LARGE, "its pronunciations have made the streamed text "
                                               f"{self._pronounced_chars - self._written_chars} characters longer, "
                                               f"over max_text_chars={limit}", field="pronunciations")

    # ------------------------------------------------------------------ the engine's request

    def engine_request(self, engine_text: str, prepared: bool, sink: SegmentSink, lora_pin: Any, context: Any,
                       plan: TextPlan) -> GenerationRequest:
        """The next segment's request, checked by the engine: the stream's instructions go with
        its first segment only (the others continue it, from `context`)."""
        request = self._request
        if request.input_streaming:           # a one-shot text spent its silence before it began
            self._silence.spend(engine_s=self._engine_silence(engine_text))
        first, continues = not plan.segments, plan.continues
        built = GenerationRequest(text=engine_text, sink=sink, voice=request.voice, voice_pin=self.voice_pin,
                                  lora_pin=lora_pin, options=dict(self._options), owners=self._owners,
                                  prepared=prepared, context=context, keep_continuation=continues,
                                  instructions=request.instructions if first else None, language=request.language,
                                  pronunciations=self._found if self._engine.takes_phonemes else None)
        self._engine.check(built)
        return built


def _matched(text: str, lexicon: Lexicon) -> Lexicon:
    """The entries of `lexicon` that `text`'s words match, as a lexicon of their own."""
    return Lexicon(found_in(text_words(text), lexicon))
