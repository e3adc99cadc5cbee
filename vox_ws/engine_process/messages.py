"""The boundary between the server process and an engine process: every message each way, as a
frozen dataclass, and their bytes. Defined once, here; both sides read and write these classes,
never a type string.

    server ──▶ engine   Submit, Cancel, Reader, Pin, Unpin, Forget, Call, Stop
    engine ──▶ server   State, Declared, Figures, Step, Result

A frame is 8 bytes (the header's length and the payload's, big-endian 32-bit), the header (one
msgpack map: the message's type under "t", its fields by name) and the payload: raw bytes beside
the header, never inside it, so that a step's audio (every row's, float32, in one buffer) is
written and read without a copy per row (`Step.rows` are offsets into it), as vLLM's engine core
sends its tensors beside the message. A voice's reference audio travels the same way (`Call`).

The channel is a local socket between two processes of one server, not a client's: a frame that
does not decode is a bug or a dead peer (`BoundaryError`), and the side that reads it ends the
channel.
"""

from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import msgpack
import numpy as np

PREFIX = struct.Struct(">II")
# No header is near this; the payload of a step at 64 rows of 1 s of 48 kHz float32 is 12 MB.
MAX_HEADER_BYTES = 64 << 20
MAX_PAYLOAD_BYTES = 1 << 30
AUDIO_DTYPE = np.dtype("<f4")


class BoundaryError(Exception):
    """A frame that is not one of these messages: the channel is broken."""


# --------------------------------------------------------------------------- server -> engine


@dataclass(frozen=True)
class ReaderState:
    """What the slot queue asks of a request's reader, as its stream stands when it is queued:
    whether it has enough audio not taken (`backlogged`: skip its steps), and how far ahead of a
    real-time listener it is: `produced_s` of audio (divided by `speed`) since `first_at` (a
    `time.monotonic()` instant, one clock for every process of a machine; None: no audio yet)."""

    backlogged: bool = False
    produced_s: float = 0.0
    first_at: float | None = None
    speed: float = 1.0


@dataclass(frozen=True)
class Submit:
    """One generation request (`GenerationRequest`, its sink replaced by its id)."""

    TYPE: ClassVar[str] = "submit"
    request: int
    text: str
    voice: str | None = None
    voice_pin: int | None = None          # a `Pin` sent before it
    lora_pin: int | None = None
    options: dict[str, Any] = field(default_factory=dict)
    owners: tuple[str, ...] = ()
    prepared: bool = False
    context_of: int | None = None         # continue from that request's continuation (`Forget` frees one unused)
    keep_continuation: bool = False
    instructions: str | None = None
    language: str | None = None
    # Pronunciations (engines that take phonemes): the entries found in the text, as maps.
    pronunciations: tuple[dict[str, Any], ...] | None = None
    reader: ReaderState = ReaderState()


@dataclass(frozen=True)
class Cancel:
    TYPE: ClassVar[str] = "cancel"
    request: int


@dataclass(frozen=True)
class Reader:
    """A request's reader now has (`backlogged`) or no longer has too much audio not taken."""

    TYPE: ClassVar[str] = "reader"
    request: int
    backlogged: bool


@dataclass(frozen=True)
class Pin:
    """Hold a voice (`kind` "voice") or a LoRA adapter ("lora") for a stream until `Unpin`: a
    voice deleted meanwhile still speaks to the stream's end, an adapter stays loaded."""

    TYPE: ClassVar[str] = "pin"
    pin: int
    kind: str
    name: str | None


@dataclass(frozen=True)
class Unpin:
    TYPE: ClassVar[str] = "unpin"
    pin: int


@dataclass(frozen=True)
class Forget:
    """The continuation a finished request left is not wanted any more (its stream ended)."""

    TYPE: ClassVar[str] = "forget"
    request: int


@dataclass(frozen=True)
class Call:
    """One of the engine's verbs besides generating (`CALL_VERBS`), answered by a `Result`."""

    TYPE: ClassVar[str] = "call"
    call: int
    verb: str
    args: dict[str, Any] = field(default_factory=dict)
    payload: bytes | memoryview = b""      # a voice's reference audio (float32)


@dataclass(frozen=True)
class Stop:
    """End the engine within `within_s` seconds: its helper processes still running then are killed."""

    TYPE: ClassVar[str] = "stop"
    within_s: float


# The verbs a `Call` may name: each a role's verb of the engine contract (`vox_ws/engine.py`).
CALL_VERBS = ("voices.register", "voices.delete", "voices.rescan", "voices.disk_stamp",
              "loras.load", "loras.unload", "loras.set_default", "loras.clear_default")


# --------------------------------------------------------------------------- engine -> server


@dataclass(frozen=True)
class State:
    """The engine's readiness (`Readiness`'s value) changed: first "loading" once the engine is
    built (`name`: the engine `auto` chose), or "failed" with `refused` where it could not be
    built from its settings (the server's start fails, saying why); `fatal`: it failed after its
    load (an `EngineFailure`, the device lost), and the process ends."""

    TYPE: ClassVar[str] = "state"
    status: str
    error: str | None = None
    loading_phase: str | None = None
    fatal: bool = False
    refused: bool = False
    name: str | None = None
    # With the first "loading": how the engine, as built, takes text (`declaration.declare_text`),
    # which the server's start checks its lexicon against before the engine has loaded.
    text: dict[str, Any] | None = None


@dataclass(frozen=True)
class Declared:
    """What the engine is (`declaration.py`): sent once loaded, and again whenever it changes (a
    voice registered or deleted, a rescan, a LoRA adapter loaded)."""

    TYPE: ClassVar[str] = "declared"
    declaration: dict[str, Any]


@dataclass(frozen=True)
class Figures:
    """The engine loop's figures (`EngineLoop.stats`) and the engine's `describe()`, where either
    changed: sent after every step, and between steps where something moved."""

    TYPE: ClassVar[str] = "figures"
    stats: dict[str, Any] | None = None
    described: dict[str, Any] | None = None


@dataclass(frozen=True)
class Row:
    """One request's audio in a step's payload: `length` samples from sample `offset`, and the
    words and phonemes spoken in them ((text, first sample, end sample), from its start)."""

    request: int
    offset: int
    length: int
    words: tuple[tuple[str, int, int], ...] | None = None
    phonemes: tuple[tuple[str, int, int], ...] | None = None


@dataclass(frozen=True)
class Ended:
    request: int
    reason: str                            # `EndReason`'s value
    continuation: bool = False             # it left a continuation (`Submit.context_of` names it)


@dataclass(frozen=True)
class Failed:
    request: int
    kind: str                              # `ErrorKind`'s value
    message: str
    retry_after_s: float | None = None


@dataclass(frozen=True)
class Step:
    """What one turn of the engine loop produced, in order: every row's audio (the payload), then
    the requests that ended or failed. `step_rows`/`step_s`: the step it ran (0: none), and the
    seconds since the one before (`period_s`)."""

    TYPE: ClassVar[str] = "step"
    rows: tuple[Row, ...] = ()
    ended: tuple[Ended, ...] = ()
    failed: tuple[Failed, ...] = ()
    step_rows: int = 0
    step_s: float = 0.0
    period_s: float | None = None
    stats: dict[str, Any] | None = None
    payload: bytes | memoryview = b""

    def audio(self, row: Row) -> np.ndarray:
        """A row's samples: a view into the payload, no copy."""
        return np.frombuffer(self.payload, dtype=AUDIO_DTYPE, count=row.length, offset=row.offset * 4)


@dataclass(frozen=True)
class Refusal:
    """A `Refused` as it crosses: its kind's value, message, retry hint and field."""

    kind: str
    message: str
    retry_after_s: float | None = None
    field: str | None = None


@dataclass(frozen=True)
class Result:
    """A `Call`'s answer: its value, or the refusal (`refusal`) or other error (`error`: its type
    and message) that ended it."""

    TYPE: ClassVar[str] = "result"
    call: int
    value: Any = None
    refusal: Refusal | None = None
    error: str | None = None


ToEngine = Union[Submit, Cancel, Reader, Pin, Unpin, Forget, Call, Stop]
ToServer = Union[State, Declared, Figures, Step, Result]
Message = Union[ToEngine, ToServer]

_TYPES: dict[str, type] = {cls.TYPE: cls for cls in (Submit, Cancel, Reader, Pin, Unpin, Forget, Call, Stop,
                                                     State, Declared, Figures, Step, Result)}
# Fields that hold other dataclasses, read back by their class.
_NESTED = {(Submit, "reader"): ReaderState, (Result, "refusal"): Refusal}
_NESTED_ROWS = {(Step, "rows"): Row, (Step, "ended"): Ended, (Step, "failed"): Failed}


# --------------------------------------------------------------------------- bytes


def encode(message: Message) -> tuple[bytes, bytes | memoryview]:
    """(header, payload) of a message."""
    fields: dict[str, Any] = {"t": message.TYPE}
    payload: bytes | memoryview = b""
    for f in dataclasses.fields(message):
        value = getattr(message, f.name)
        if f.name == "payload":
            payload = value
            continue
        if dataclasses.is_dataclass(value):
            value = dataclasses.asdict(value)
        elif isinstance(value, tuple) and value and dataclasses.is_dataclass(value[0]):
            value = [dataclasses.astuple(item) for item in value]
        fields[f.name] = value
    return msgpack.packb(fields, use_bin_type=True), payload


def frame(message: Message) -> list[bytes | memoryview]:
    """The bytes of one frame, in pieces (a socket's `sendmsg` writes them without joining them)."""
    header, payload = encode(message)
    return [PREFIX.pack(len(header), len(payload)), header, payload]


def decode(header: bytes | memoryview, payload: bytes | memoryview = b"") -> Message:
    """The message of a frame's header and payload; BoundaryError for anything else."""
    try:
        fields = msgpack.unpackb(header, raw=False, strict_map_key=False)
        cls = _TYPES[fields.pop("t")]
        kwargs = {}
        for f in dataclasses.fields(cls):
            if f.name == "payload":
                kwargs["payload"] = payload
                continue
            if f.name not in fields:
                continue
            value = fields.pop(f.name)
            nested = _NESTED.get((cls, f.name))
            rows = _NESTED_ROWS.get((cls, f.name))
            if nested is not None and value is not None:
                value = nested(**value)
            elif rows is not None:
                value = tuple(_row(rows, item) for item in value)
            elif isinstance(value, list):
                value = tuple(value)
            kwargs[f.name] = value
        if fields:
            raise BoundaryError(f"{cls.__name__}: unknown fields {sorted(fields)}")
        return cls(**kwargs)
    except BoundaryError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever msgpack or a constructor says: one error
        raise BoundaryError(f"a frame that is no message: {type(exc).__name__}: {exc}") from None


def _row(cls: type, item: tuple) -> Any:
    if cls is Row:
        request, offset, length, words, phonemes = item
        return Row(request, offset, length, _spans(words), _spans(phonemes))
    return cls(*item)


def _spans(spans: tuple | None) -> tuple[tuple[str, int, int], ...] | None:
    return None if spans is None else tuple((str(a), int(b), int(c)) for a, b, c in spans)


def read_prefix(prefix: bytes | memoryview) -> tuple[int, int]:
    """(header length, payload length) of a frame; BoundaryError past the bounds."""
    header, payload = PREFIX.unpack(prefix)
    if header > MAX_HEADER_BYTES or payload > MAX_PAYLOAD_BYTES:
        raise BoundaryError(f"a frame of {header} + {payload} bytes: over the bounds")
    return header, payload
