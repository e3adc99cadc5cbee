"""What a stream yields to its consumer, in order. Plain data: no wire format, no socket.

`Audio` is always what the consumer receives (the output format's bytes); `Produced` is the
stream's audio before its output stage (`output.py`), never handed to a consumer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

from ..engine import EndReason, ErrorKind


@dataclass(frozen=True, slots=True)
class Audio:
    """One piece of audio, encoded in the stream's output format and rate."""

    data: bytes
    seq: int            # 0, 1, 2, ... per stream
    samples: int        # what a decoder yields for `data`
    seconds: float
    # opus_packets: the raw packets in `data` and their durations; the first chunk also
    # carries the codec's description (the OpusHead) and its pre-skip (48 kHz samples).
    packets: tuple[bytes, ...] = ()
    durations_us: tuple[int, ...] = ()
    description: bytes | None = None
    pre_skip: int = 0


@dataclass(frozen=True, slots=True)
class Produced:
    """Audio as the stream produced it, before its output stage: packed in the output format
    already (raw PCM at speed 1), or float32 at the output rate for a codec or tempo."""

    data: bytes
    samples: int
    seconds: float


@dataclass(frozen=True, slots=True)
class Segment:
    """A segment of the input text has all been spoken: where it lies in the output audio."""

    index: int
    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Word:
    """One word of the input text and when it is spoken in the output audio (seconds)."""

    word: str
    start_s: float
    end_s: float
    # Placed between its neighbours, not heard: the aligner could not find it in the audio.
    estimated: bool = False


@dataclass(frozen=True, slots=True)
class Words:
    """Words whose audio has been yielded, with their times: given only for streams that asked
    for them, by engines that know them (`Engine.word_timings`), else by the aligner (a
    segment's words once the segment is complete, `vox_ws.alignment`)."""

    words: tuple[Word, ...]


@dataclass(frozen=True, slots=True)
class Phoneme:
    """One phoneme (IPA) and when it is spoken in the output audio (seconds)."""

    phoneme: str
    start_s: float
    end_s: float


@dataclass(frozen=True, slots=True)
class Phonemes:
    """Phonemes whose audio has just been yielded, with their times (for lip-sync): given only
    for streams that asked for them, by engines that know them (`Engine.phoneme_timings`)."""

    phonemes: tuple[Phoneme, ...]


@dataclass(frozen=True, slots=True)
class Flushed:
    """The audio of all the text sent before a `flush()` has been yielded."""

    audio_s: float


@dataclass(frozen=True, slots=True)
class Ended:
    """The last event of a stream that ended normally (or was cancelled)."""

    reason: EndReason
    stats: dict[str, Any] = field(default_factory=dict)
    # A file format whose header holds its length (FLAC's STREAMINFO, WAV's sizes), not
    # cancelled: (offset, bytes) to write over the audio sent, now that the length is known
    # (`codecs.Encoded.rewrites`). A consumer holding the whole file writes them; a player ignores them.
    rewrites: tuple[tuple[int, bytes], ...] = ()


@dataclass(frozen=True, slots=True)
class Failed:
    """The last event of a stream that failed."""

    kind: ErrorKind
    message: str
    stats: dict[str, Any] = field(default_factory=dict)
    retry_after_s: float | None = None     # when the same request may pass, where that is known
    field: str | None = None               # the request's field at fault, where one was (`Refused.field`)


Event = Union[Audio, Segment, Words, Phonemes, Flushed, Ended, Failed]
"""What a consumer receives."""

Queued = Union[Produced, Segment, Words, Phonemes, Flushed, Ended, Failed]
"""What waits between a stream's producer and its output stage (`pacing.py`)."""
