"""The server's log lines: text for people, or one JSON object a line for log shippers
(`--log-format json`). A record may carry fields of its own (`extra={"fields": {...}}`: the
stream's line at its end), which a JSON line holds as its own keys.

No line holds a registered voice's id: one registered without a name is a capability (whoever
holds its id speaks with it, from anywhere), and logs are read by more people than the voices'
owners. A line names such a voice by its tag (`voice_tag`); where a voice is named on purpose
(the stream's line) the code says the tag, and both formatters replace any id left in a line
(an error message echoed, a file name in a traceback) by its tag too."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import sys
from datetime import datetime, timezone

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# A registered voice's id, as the voice store makes them (`service.voice_store.is_registered_id`).
VOICE_ID = re.compile(r"v_[a-z2-7]{32}")


def voice_tag(voice_id: str) -> str:
    """What a log line says of a registered voice: a short digest of its id. It tells the lines
    of one voice apart, and whoever holds the id (its owner, an admin listing the store) finds
    the voice's lines by it; it cannot be turned back into the id (40 bits of a 160-bit id's
    hash), nor spoken with (no id has its shape)."""
    return "voice#" + hashlib.sha256(b"vox-ws log tag\0" + voice_id.encode()).hexdigest()[:10]


def logged_voice(voice: str | None) -> str | None:
    """A voice as a log line names it: a registered voice by its tag, any other (built-in, an
    alias) as it is."""
    return voice_tag(voice) if voice is not None and VOICE_ID.fullmatch(voice) else voice


def without_voice_ids(text: str) -> str:
    """`text` with every registered voice's id in it replaced by the voice's tag."""
    return VOICE_ID.sub(lambda found: voice_tag(found.group()), text)


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
