"""The transport-neutral stream service: every front door opens its streams here.

    request.py   StreamRequest: one stream's request as every door builds it; StreamSetup
    service.py   StreamService: open streams; readiness and draining; timers
    voices/      VoiceService and the rest of the voices: names, aliases, registrations, sharing,
                 rescans, fetches, the voice store (one module per backend); see its __init__
    loras.py     LoraService: LoRA adapters loaded, unloaded and the default, on every device
    work.py      engine work awaited from the loop (a device's thread, a worker), typed failures
    stream.py    Stream: the consumer's handle (StreamState), owner of the pieces below
    generation.py  Generation: a stream's production on the loop; the service's side of it
    text_plan.py   TextPlan: what is still to be said, in which pieces, and what was (pure)
    stream_input.py  StreamInput: a stream's text input, its pause and its time-out
    segments.py  SegmentStarter: a segment's text cut, respelled, prepared; its engine request
    silence.py   SilenceBudget: a stream's added silence (breaks, the engine's), one bound as heard
    record.py    StreamRecord: a stream's metrics, usage and log line
    sink.py      SegmentSink: a request's results on the engine thread, posted to the loop
    pacing.py    Pacing: events waiting for the consumer, back-pressure, the playback clock
    output.py    OutputStage: engine audio -> what the consumer receives, and the figures
    events.py    the events a stream yields (Audio, Segment, Words, Phonemes, Flushed, Ended, Failed)
    validation.py  the rules a request passes at every front door (text, speed, options)
    aligner_end_wait.py  AlignerEndWait: a stream's end held for the aligner's words
    handoff.py   the engine loop's way onto the event loop
"""

from .events import Audio, Ended, Event, Failed, Flushed, Phoneme, Phonemes, Segment, Word, Words
from .generation import StreamState
from .output import AudioOutput
from .request import StreamRequest
from .service import ANY_OWNER, StreamService
from .stream import Stream

__all__ = ["ANY_OWNER", "Audio", "AudioOutput", "Ended", "Event", "Failed", "Flushed", "Phoneme", "Phonemes", "Segment",
           "Stream", "StreamRequest", "StreamService", "StreamState", "Word", "Words"]
