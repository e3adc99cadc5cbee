"""How a log line names a registered voice: by its tag, never by its id.

A voice registered without a name is a capability (whoever holds its id speaks with it, from
anywhere), and logs are read by more people than the voices' owners. A line names such a voice
by its tag (`voice_tag`); where a voice is named on purpose (the stream's line) the code says the
tag, and the log formatters (`commands/logs.py`) replace any id left in a line by its tag too.
Shared by the service and the engines that log a voice, so it sits at the package root."""

from __future__ import annotations

import hashlib
import re

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
