"""What a listener hears of a stream's timing: a player that starts at the first chunk and plays
at 1x, and the gaps it waits through. Shared by the load tests (`capacity`, `loadtest`) and the
benchmarks that drive the engine loop without a server, so it imports nothing but the standard
library: the device check runs it on a machine with no web stack.
"""

from __future__ import annotations


def playback_gaps(arrivals: list[tuple[float, float]]) -> list[float]:
    """The gaps a player hears that starts at the first chunk and plays at 1x: for each chunk
    that arrives after the audio before it has finished playing, how long the player waited.
    `arrivals`: (arrival time, seconds of audio) per chunk, in order. A chunk within a
    microsecond of its time is on time (float sums of chunk lengths are not exact)."""
    gaps, due = [], None
    for arrived, seconds in arrivals:
        if due is None:
            due = arrived
        elif arrived > due + 1e-6:
            gaps.append(arrived - due)
            due = arrived
        due += seconds
    return gaps


def count_underruns(arrivals: list[tuple[float, float]]) -> int:
    """A player that starts at the first chunk: a chunk arriving after the audio before it has
    finished playing is an underrun (the player then waits and resumes)."""
    return len(playback_gaps(arrivals))
