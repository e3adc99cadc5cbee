"""The silence a stream adds to its speech, one bound however it is asked for: SSML breaks and
what the engine adds of its own (Piper's `sentence_silence` after each sentence), counted as
heard, after the output's speed stretches it.

Silence is audio a client gets for no characters: unbounded, 990 characters of short sentences
with `sentence_silence` 5 made 501 s of silence (599 s of audio), and 330 characters at speed
0.25 made 723 s of it. Breaks alone were bounded at 30 s (before the speed: 125 s heard at
0.25); now every kind counts against the same 30 s, as heard.
"""

from __future__ import annotations

from ..engine import ErrorKind, Refused

MAX_SILENCE_S = 30.0        # added silence one request may ask for, as heard (breaks and the engine's)


class SilenceBudget:
    """One stream's added silence. A one-shot text spends it all before anything is queued (a
    request over it is refused); streamed input spends it segment by segment as each is
    queued (the segment that would pass it ends the stream). Event loop only."""

    def __init__(self, speed: float, max_s: float = MAX_SILENCE_S) -> None:
        self._speed = speed
        self._max_s = max_s
        self.spent_s = 0.0                  # as heard

    def spend(self, breaks_s: float = 0.0, engine_s: float = 0.0) -> None:
        """`breaks_s` of marked-up breaks and `engine_s` the engine adds, at the engine's pace;
        Refused (TOO_LARGE) where the stream's added silence would then be over the bound."""
        heard = self.spent_s + (breaks_s + engine_s) / self._speed
        if heard > self._max_s + 1e-9:
            asked = [f"{seconds:g} s of {what}" for seconds, what in
                     ((breaks_s, "SSML breaks"), (engine_s, "sentence silence (options)")) if seconds]
            said = " and ".join(asked) + (f" at speed {self._speed:g}" if self._speed != 1.0 else "")
            if self.spent_s or self._speed != 1.0:
                said += f" would make {heard:g} s of added silence in all"
            raise Refused(ErrorKind.TOO_LARGE,
                          f"{said}: over {self._max_s:g} s of added silence in one request")
        self.spent_s = heard
