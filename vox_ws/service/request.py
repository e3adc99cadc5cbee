"""One stream's request, as every front door's parser builds it, and what the service settles
when it opens the stream.

A door parses its wire into a `StreamRequest` and hands it to `StreamService.open_stream`,
which checks it once against the service's rules (`validation.py`) and the engine served,
resolves its voice (aliases, names), and opens a `Stream` that takes the checked request whole,
with a `StreamSetup`: where it runs, for whom, what it holds, and what of the request has no
effect here (`ignored`, for the door to copy to its wire).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Mapping

from ..alignment.pool import WordAligner
from ..engine_process.proxy import EngineProxy
from ..engines.lexicon import Lexicon, Pronunciation
from .output import AudioOutput


@dataclass(frozen=True)
class StreamRequest:
    """What a client asks of one stream.

    `text` a string: say it (with `input_streaming`, it is the first piece and more may follow
    through `Stream.send_text`); an async iterator of strings: read the input from it; None with
    `input_streaming`: the input comes through `send_text`. `instructions` describe the voice or
    style in words, where the engine follows them. `word_timestamps` asks for `Words` events,
    where the engine knows word times, and `phoneme_timestamps` for `Phonemes` events likewise.
    A one-shot text is SSML when `markup` is "ssml", or unsaid and the text starts with
    `<speak`. `pronunciations` come before the server's lexicon. `lora` names a loaded LoRA
    adapter (None: the device's default, or the base model). `language` is the text's (a BCP 47
    tag), where the client knows it: how the text is cut into sentences and normalised."""

    text: str | AsyncIterator[str] | None = None
    voice: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)
    output: AudioOutput = AudioOutput()
    input_streaming: bool = False
    instructions: str | None = None
    word_timestamps: bool = False
    phoneme_timestamps: bool = False
    markup: str | None = None
    pronunciations: tuple[Pronunciation, ...] = ()
    lora: str | None = None
    language: str | None = None

    @property
    def streamed_text(self) -> bool:
        """The input is read from an async iterator."""
        return self.text is not None and not isinstance(self.text, str)

    @property
    def one_shot_text(self) -> str | None:
        """The whole text of a stream not opened for input, else None."""
        return self.text if isinstance(self.text, str) and not self.input_streaming else None


@dataclass(frozen=True)
class StreamSetup:
    """What the service settled as a stream opened: its device's engine loop and its number, the
    clients it is for (broadest first: token or address, then connection; the slot queue shares
    slots among them), its log line's fields, the voice and adapter it holds to its end, its
    pronunciations (the request's before the server's), what of the request is ignored, and
    the aligner that times its words where the engine does not."""

    engine_loop: EngineProxy
    number: int
    owners: tuple[str, ...] = ()
    log_fields: Mapping[str, Any] = field(default_factory=dict)
    voice_pin: Any = None
    lora_pin: Any = None
    lexicon: Lexicon | None = None
    ignored: tuple[str, ...] = ()
    # Where its word times come from, if it asked for them: None, the engine; else this aligner.
    aligner: WordAligner | None = None
