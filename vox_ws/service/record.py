"""A stream's record: the metrics counted as it produces, and, once its last event is handed to
the consumer, its usage and its one log line, from the very figures the consumer got in `end`
(or `error`): the two never disagree, whatever a codec or a tempo did to the audio.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Iterable

from ..engine import EndReason, ErrorKind
from ..voice_tags import logged_voice, without_voice_ids
from .events import Ended, Failed, Produced
from .metrics import Metrics
from .request import StreamRequest, StreamSetup

stream_log = logging.getLogger("vox_ws.stream")


class StreamRecord:
    def __init__(self, metrics: Metrics, request: StreamRequest, setup: StreamSetup, engine_name: str,
                 sample_rate: int) -> None:
        self._metrics = metrics
        self._owner = setup.owners[0] if setup.owners else "none"     # the broadest: its token or address
        # A registered voice by its tag: its id is a capability (`logs.voice_tag`).
        self._line = {"event": "stream", "id": setup.number, **setup.log_fields, "engine": engine_name,
                      "voice": logged_voice(request.voice), "format": request.output.format,
                      "input": request.input_streaming, "sample_rate": sample_rate}
        self._language = request.language
        self.started_at = time.monotonic()
        self._first_at: float | None = None
        self._last_at = 0.0
        self.written = False

    def produced(self, chunks: Iterable[Produced]) -> Iterable[tuple[Produced, float]]:
        """Count chunks as they are produced (first audio, the gaps between chunks, audio
        seconds); each with the time it was counted at."""
        metrics = self._metrics
        for chunk in chunks:
            now = time.monotonic()
            if self._first_at is None:
                self._first_at = now
                metrics.first_audio.observe(now - self.started_at)
            else:
                metrics.chunk_gap.observe(now - self._last_at)
            self._last_at = now
            metrics.audio_seconds.inc(chunk.seconds)
            yield chunk, now

    def ended(self, reason: EndReason | ErrorKind) -> None:
        """The stream stopped producing, done, cancelled or failed."""
        self._metrics.streams.labels(reason.value).inc()
        if reason is EndReason.CANCELLED:
            self._metrics.cancellations.inc()

    def handed(self, last: Ended | Failed, characters: int, segments: int) -> None:
        """The consumer got (or was due) the stream's last event, `last`, with its final figures:
        its usage goes under its owner's series (a keyed hash of it: `Metrics.owner_label`) and
        its line into the log."""
        if self.written:
            return
        self.written = True
        stats = last.stats
        usage = stats.get("usage", {})
        self._metrics.count_usage(self._owner, characters, max(usage.get("audio_s", 0.0), 0.0))
        # A failure's message may name the voice it failed for: the client is told it, not the log.
        outcome: dict[str, Any] = {"reason": last.reason.value} if isinstance(last, Ended) else \
            {"error": last.kind.value, "error_message": without_voice_ids(last.message)}
        figures = {name: stats[name] for name in ("chunks", "audio_s", "ttfa_ms", "rtf") if name in stats}
        record = {**self._line, "segments": segments, "language": self._language, "text_chars": characters,
                  **outcome, **figures, **({"heard": stats["heard"]} if stats.get("heard") else {})}
        stream_log.info(json.dumps(record, separators=(",", ":")), extra={"fields": record})
