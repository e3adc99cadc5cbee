"""The server's log lines: text for people, or one JSON object a line for log shippers
(`--log-format json`). A record may carry fields of its own (`extra={"fields": {...}}`: the
stream's line at its end), which a JSON line holds as its own keys.

No line holds a registered voice's id: both formatters replace any id left in a line (an error
message echoed, a file name in a traceback) by its tag (`vox_ws/voice_tags.py`)."""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone

# All four: `vox_ws.logs`'s names, which the code that imports them by that name reads here.
from ..voice_tags import VOICE_ID, logged_voice, voice_tag, without_voice_ids  # noqa: F401

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return without_voice_ids(super().format(record))


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = getattr(record, "fields", None)
        line = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
                "level": record.levelname.lower(), "logger": record.name,
                "message": record.getMessage() if not isinstance(fields, dict) else record.name.rsplit(".", 1)[-1]}
        if isinstance(fields, dict):
            line.update({key: value for key, value in fields.items() if key not in line})
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        # ASCII only: a client's text may hold U+2028, U+0085 or U+009B, which readers that split
        # lines the Unicode way take for the end of a record.
        return without_voice_ids(json.dumps(line, ensure_ascii=True, default=str, separators=(",", ":")))


def configure(level: str = "info", log_format: str = "text") -> None:
    """Log to standard error at `level` in `log_format` (LOG_FORMATS)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {list(LOG_FORMATS)}, got {log_format!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(getattr(logging, str(level).upper(), logging.INFO))
