"""The boundary between the server process and an engine process (`engine_process/messages.py`):
every message to bytes and back, a step's rows read as views into its one buffer, and a frame
that is no message refused as such. Bytes in, messages out: no socket, no engine."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from vox_ws.engine_process.messages import (
    AUDIO_DTYPE,
    PREFIX,
    BoundaryError,
    Call,
    Cancel,
    Declared,
    Ended,
    Failed,
    Figures,
    Forget,
    Pin,
    Reader,
    ReaderState,
    Refusal,
    Result,
    Row,
    State,
    Step,
    Stop,
    Submit,
    Unpin,
    decode,
    encode,
    frame,
    read_prefix,
)

EVERY_MESSAGE = [
    Submit(7, "Hello there.", voice="narrator", voice_pin=3, lora_pin=None, options={"seed": 5, "cfg_value": 2.0},
           owners=("token:abc", "connection:4"), prepared=True, context_of=6, keep_continuation=True,
           instructions="calmly", language="en", pronunciations=({"match": "SQL", "say": "sequel", "ipa": None,
                                                                  "case_sensitive": False},),
           reader=ReaderState(True, 3.5, 1234.5, 1.25)),
    Submit(8, "Bare."),
    Cancel(7), Reader(7, False), Pin(3, "voice", "narrator"), Pin(4, "lora", None), Unpin(3), Forget(6),
    Call(1, "voices.register", {"sample_rate": 16000, "transcript": None, "mode": "reference", "voice_id": None},
         np.arange(4, dtype=AUDIO_DTYPE).tobytes()),
    Stop(2.5),
    State("loading", name="piper"), State("failed", "load failed: no weights", refused=True),
    State("loading", name="piper", text={"takes_phonemes": True, "follows_instructions": False,
                                         "portable": ["vox_ws.engines.piper:PiperText", {"phonemes": ["a", "ə"]}]}),
    State("failed", "the device is lost", fatal=True),
    Declared({"name": "piper", "voices": {"names": ["joe"]}, "options": {}}),
    Figures(stats={"active": 1, "queued": 0}), Figures(described={"engine": "piper"}),
    Result(1, value={"voice": "v_abc", "mode": "reference", "audio_s": 1.0}),
    Result(2, refusal=Refusal("busy", "every slot taken", 1.5, "voice")),
    Result(3, error="RuntimeError: boom"),
]


@pytest.mark.parametrize("message", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_survives_its_bytes(message):
    header, payload = encode(message)
    again = decode(header, payload)
    assert type(again) is type(message)
    for field in dataclasses.fields(message):
        if field.name == "payload":
            assert bytes(getattr(again, "payload")) == bytes(message.payload)
        else:
            assert getattr(again, field.name) == getattr(message, field.name), field.name


def test_a_steps_rows_are_views_into_its_one_buffer():
    """Every row's audio crosses in one payload beside the header; the reader takes each row as
    a view into it (no copy per row), words and phonemes beside it."""
    first, second = np.linspace(-1, 1, 480, dtype=AUDIO_DTYPE), np.full(240, 0.25, dtype=AUDIO_DTYPE)
    payload = np.concatenate([first, second])
    step = Step(rows=(Row(1, 0, 480, (("Hello", 0, 200),), None), Row(2, 480, 240, None, (("h", 0, 10),))),
                ended=(Ended(1, "done", continuation=True),), failed=(Failed(3, "internal", "boom", None),),
                step_rows=2, step_s=0.02, period_s=0.025, stats={"active": 2},
                payload=memoryview(payload).cast("B"))
    pieces = frame(step)
    wire = b"".join(bytes(p) for p in pieces)
    header_length, payload_length = read_prefix(wire[:PREFIX.size])
    assert payload_length == payload.nbytes                     # the audio once, raw, beside the header
    header = wire[PREFIX.size:PREFIX.size + header_length]
    received = bytearray(wire[PREFIX.size + header_length:])
    assert payload.tobytes() not in header
    again = decode(header, memoryview(received))
    rows = [again.audio(row) for row in again.rows]
    assert np.array_equal(rows[0], first) and np.array_equal(rows[1], second)
    assert all(np.shares_memory(row, np.frombuffer(received, dtype=np.uint8)) for row in rows)
    assert again.rows[0].words == (("Hello", 0, 200),) and again.rows[1].phonemes == (("h", 0, 10),)
    assert again.ended == (Ended(1, "done", True),) and again.failed == (Failed(3, "internal", "boom", None),)
    assert (again.step_rows, again.step_s, again.period_s, again.stats) == (2, 0.02, 0.025, {"active": 2})


@pytest.mark.parametrize("header", [
    b"\xc1",                                                    # not msgpack
    msgpack.packb({"t": "launch_missiles"}),                    # no such message
    msgpack.packb({"t": "cancel"}),                             # a field missing
    msgpack.packb({"t": "cancel", "request": 1, "why": "x"}),   # a field no message has
    msgpack.packb([1, 2, 3]),                                   # not a map
    msgpack.packb({"t": "step", "rows": [[1, 2]]}),             # a row of the wrong shape
])
def test_a_frame_that_is_no_message_is_a_boundary_error(header):
    with pytest.raises(BoundaryError):
        decode(header)


def test_a_frame_past_its_bounds_is_refused_before_it_is_read():
    with pytest.raises(BoundaryError):
        read_prefix(PREFIX.pack(1 << 31, 0))
    with pytest.raises(BoundaryError):
        read_prefix(PREFIX.pack(10, (1 << 30) + 1))
    assert read_prefix(PREFIX.pack(10, 20)) == (10, 20)
