"""The transport-neutral stream service: every front door opens its streams here.

    service.py   StreamService: open streams, voices, LoRA; readiness and draining; timers
    stream.py    Stream: one stream's state machine, consumed as an async iterator of events
    events.py    the events a stream yields (Audio, Segment, Words, Phonemes, Flushed, Ended, Failed)
    validation.py  the rules a request passes at every front door (generation options)
    voice_store.py  registered voices (memory, a directory, Redis): owners, limits, ids
    handoff.py   the scheduler thread's way onto the event loop
"""

from .events import Audio, Ended, Event, Failed, Flushed, Phoneme, Phonemes, Segment, Word, Words
from .service import ANY_OWNER, StreamService
from .stream import AudioOutput, Stream

__all__ = ["ANY_OWNER", "Audio", "AudioOutput", "Ended", "Event", "Failed", "Flushed", "Phoneme", "Phonemes", "Segment",
           "Stream", "StreamService", "Word", "Words"]
