"""One stream of a session: its state, and the scheduler's hand-off point for its audio.

The scheduler thread calls `deliver`, `finish` and `fail` (the RequestSink); audio is encoded
there (resampling, packing: off the event loop) and handed to the session's loop with
`call_soon_threadsafe`. Everything else runs on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np

from . import protocol as p
from .audio import StreamEncoder, bytes_per_sample
from .engine import GenerationRequest
from .text import StreamSegmenter

if TYPE_CHECKING:
    from .session import Session


class Stream:
    """One stream of a session; also the scheduler's RequestSink for its requests.

    A plain stream has one generation request. An input-streaming stream (`stream_input`) has
    one per text segment, generated one after another on the same stream: the same resampler,
    the same `seq` counter, so segments join without a seam.
    """

    def __init__(self, session: "Session", sid: str, start: p.Start, encoder: StreamEncoder) -> None:
        self.session = session
        self.id = sid
        self.start = start
        self.encoder = encoder
        self.request: GenerationRequest | None = None   # the request generating now
        self.closed = False            # loop side: its end or error has been queued
        self.started_at = time.monotonic()
        self.first_audio_at: float | None = None
        self.chunks = 0                # chunks handed to the send path
        self.audio_s = 0.0
        self.buffered_s = 0.0          # audio queued but not yet written to the socket
        self.backlog_since: float | None = None
        self.last_chunk_at = 0.0
        self._seq = itertools.count()  # scheduler thread while generating; loop for the final tail
        # Segments: texts waiting, and those spoken ({text, start_s, end_s} in the output audio).
        self.segmenter = StreamSegmenter()
        self.pending: deque[str] = deque()
        self.segments: list[dict[str, Any]] = []
        self.segment_start_s = 0.0
        self.input_closed = not start.stream_input
        self.flush_marks: deque[int] = deque()   # segments that must be spoken before a `flushed`
        self.last_input_at = time.monotonic()
        self.delay_timer: asyncio.TimerHandle | None = None
        self.context: Any = None                 # the previous segment's continuation
        self.capped = False                      # a segment hit max_len

    # -------------------------------------------------------------- RequestSink (scheduler thread)

    def deliver(self, pcm: np.ndarray) -> None:
        self._post_audio(self.encoder.encode(pcm))

    def finish(self, reason: str) -> None:
        self.session.call_soon(self.session.request_finished, self, self.request, reason)

    def fail(self, code: str, message: str) -> None:
        self.session.call_soon(self.session.stream_failed, self, code, message)

    def backlogged(self) -> bool:
        return self.buffered_s >= self.session.limits.max_buffered_audio_s

    def _post_audio(self, data: bytes) -> None:
        if data:
            self.session.call_soon(self.session.stream_audio, self, *self._chunk(data))

    def _chunk(self, data: bytes) -> tuple[bytes, float]:
        """The next `chunk` frame of this stream, and the seconds of audio it carries."""
        frame = p.encode({"type": "chunk", "id": self.id, "seq": next(self._seq), "audio": data})
        return frame, len(data) / (self.encoder.out_rate * bytes_per_sample(self.encoder.format))

    # -------------------------------------------------------------- loop side

    def tail_frame(self) -> tuple[bytes, float] | None:
        """The resampler's last samples, at the very end of the stream (no request is running)."""
        data = self.encoder.flush()
        return self._chunk(data) if data else None

    def end_stats(self) -> dict[str, Any]:
        now = time.monotonic()
        ttfa = None if self.first_audio_at is None else round((self.first_audio_at - self.started_at) * 1000, 1)
        wall = now - self.started_at
        return {
            "chunks": self.chunks,
            "audio_s": round(self.audio_s, 4),
            "ttfa_ms": ttfa,
            "rtf": round(wall / self.audio_s, 4) if self.audio_s > 0 else None,
            "segments": self.segments,
        }
