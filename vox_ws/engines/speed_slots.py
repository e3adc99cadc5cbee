"""`--slots auto` for an engine whose streams take turns on the CPU (Piper): as many slots as
how much faster than real time it speaks here allows, measured at start, and measured again,
while serving, where the start's measure was taken on a busy machine.

A measure times speech made by the engine's worker twice over: in wall time (its speed) and in
the worker process's CPU time (`time.process_time`, every thread of it). The CPU time it had,
of what it asked for (wall time x its threads), is its CPU share: about 1 on a quiet machine,
low where other programs took the cores. Started beside Home Assistant and Open WebUI, Piper
measured itself slow and kept 1 slot for good, and an announcement waited 12.2 s behind a long
reply (0.14 s with the 3 slots a quieter start chose). A start's measure with a low share is
kept (the streams served now meet that machine) and taken again later, when the engine is idle
(the engine loop runs a measure a piece at a time between turns, and drops it as soon as a
stream comes: `SlotSizing`), after a back-off; a measure with a full share is final, and
sizes the slots up or down. One that stays busy keeps the best measured, each a lower bound of
what the machine does when quieter, until the tries run out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

# Seconds of speech made, of wall time and of the worker process's CPU time it took (a piece
# or a whole measure).
Timed = tuple[float, float, float]


@dataclass(frozen=True)
class SpeedMeasure:
    speech_s: float
    wall_s: float
    cpu_s: float
    threads: int
    at: float                       # when taken (Unix seconds)

    @classmethod
    def of(cls, timed: Timed, threads: int) -> SpeedMeasure:
        return cls(*timed, threads=max(1, threads), at=time.time())

    @property
    def speed(self) -> float:
        """Seconds of speech per second of wall time."""
        return self.speech_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def cpu_share(self) -> float:
        """The CPU time the worker had, of what it asked for (wall time x its threads), at most 1."""
        return min(1.0, self.cpu_s / (self.wall_s * self.threads)) if self.wall_s > 0 else 0.0


@dataclass
class RemeasurePolicy:
    """When a measure counts as taken on a busy machine, and when to measure again; `clock`
    (monotonic seconds) a test replaces, as it may the threshold."""

    # Piper's worker had 94-100% of the CPU it asked for on this 2-core machine when quiet (1 and
    # 2 threads), and 23-48% beside two busy loops: below 75% its speed is the neighbours' doing.
    contended_below: float = 0.75
    # Seconds after the last measure, each try: a neighbour's busy start (a model loading) is
    # over in a minute or two; seven tries reach 42 minutes, and then the slots stay as they are.
    backoff_s: tuple[float, ...] = (30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)
    clock: Callable[[], float] = time.monotonic

    def contended(self, measure: SpeedMeasure) -> bool:
        return measure.cpu_share < self.contended_below


# The slots a speed allows, and why (after "speaks N x faster than real time here (...); ").
SlotRule = Callable[[float], tuple[int, str]]
# Each piece of a measure, to be spoken and timed one at a time (the first call may phonemize).
Pieces = Callable[[], list[Callable[[], Timed]]]


def _utc(at: float) -> str:
    return time.strftime("%H:%M:%S UTC", time.gmtime(at))


class SpeedSlots:
    """An engine's `slot_sizing` (`engine.SlotSizing`): its slots from its measured speed, and
    the measures again that a busy start calls for. Used by the engine loop's thread alone."""

    def __init__(self, first: SpeedMeasure, rule: SlotRule, pieces: Pieces,
                 policy: RemeasurePolicy | None = None, engine: str = "the engine") -> None:
        self.policy = policy or RemeasurePolicy()
        self.first = first
        self.chosen = first                # the measure the slots are sized by
        self.remeasures = 0                # measures taken again, completed or failed
        self._rule = rule
        self._pieces = pieces
        self._engine = engine
        self._due: float | None = None     # the policy clock's time of the next try; None: no more
        self._due_at: float | None = None  # the same in Unix seconds, for /v1/info
        if self.policy.contended(first):
            self._schedule()

    def wait_s(self) -> float | None:
        """Seconds until a measure is due (0: now, when the engine is idle); None: never again."""
        return None if self._due is None else max(0.0, self._due - self.policy.clock())

    def measure(self) -> Iterator[None]:
        """One measure, a piece of work at each `next` (the last one judges it): the loop runs
        them between turns while the engine is idle. Closed before its end (a stream came),
        it is dropped, counts for nothing and is taken again at the next idle moment."""
        try:
            speech = wall = cpu = 0.0
            for piece in self._pieces():
                s, w, c = piece()
                speech, wall, cpu = speech + s, wall + w, cpu + c
                yield
        except Exception:
            self.remeasures += 1
            self._schedule()                 # a failed try is a try: the next after its back-off
            raise
        self._judge(SpeedMeasure.of((speech, wall, cpu), self.first.threads))

    def slots(self) -> tuple[int, str]:
        slots, why = self._rule(self.chosen.speed)
        speed = self.chosen.speed
        return slots, f"{self._engine} speaks {speed:.1f}x faster than real time here ({self._how()}); {why}"

    def describe(self) -> dict[str, Any]:
        """/v1/info's `slots_measure`."""
        return {"speed": round(self.chosen.speed, 2), "cpu_share": round(self.chosen.cpu_share, 2),
                "contended": self.policy.contended(self.chosen), "measured_at": round(self.chosen.at, 3),
                "remeasures": self.remeasures,
                "next_at": None if self._due_at is None else round(self._due_at, 3)}

    def _judge(self, measure: SpeedMeasure) -> None:
        self.remeasures += 1
        if not self.policy.contended(measure):
            self.chosen, self._due, self._due_at = measure, None, None
            return
        if measure.speed > self.chosen.speed:
            self.chosen = measure
        self._schedule()

    def _schedule(self) -> None:
        """The next try after its back-off, or none when the tries have run out."""
        backoff = self.policy.backoff_s
        if self.remeasures >= len(backoff):
            self._due = self._due_at = None
        else:
            self._due = self.policy.clock() + backoff[self.remeasures]
            self._due_at = time.time() + backoff[self.remeasures]

    def _how(self) -> str:
        """How the speed the slots are sized by was measured, for `slots_reason`."""
        chosen, share = self.chosen, f"{self.chosen.cpu_share:.0%} of the CPU it asked for"
        if chosen is self.first and not self.policy.contended(chosen):
            return f"measured at start, {_utc(chosen.at)}, with {share}"
        if not self.policy.contended(chosen):
            return (f"measured again at {_utc(chosen.at)} with {share}, {self.remeasures} "
                    f"{'try' if self.remeasures == 1 else 'tries'} after a start on a busy machine "
                    f"({self.first.speed:.1f}x with {self.first.cpu_share:.0%} of the CPU), set aside")
        busy = (f"measured at start, {_utc(chosen.at)}, on a busy machine: {share}, under "
                f"{self.policy.contended_below:.0%}" if self.remeasures == 0 else
                f"the best of {1 + self.remeasures} measures, each on a busy machine: under "
                f"{self.policy.contended_below:.0%} of the CPU it asked for, this one's "
                f"{chosen.cpu_share:.0%} at {_utc(chosen.at)}")
        if self._due_at is None:
            return f"{busy}; no more tries"
        return f"{busy}; measured again when idle, from {_utc(self._due_at)}"
