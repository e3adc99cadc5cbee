"""The slot queue: which request holds a slot, which waits, and which is let go, as plain data.

No thread, no lock, no engine and no sink: the engine loop (`loop.py`) owns the queue, calls it
under its lock and passes the time in (`now`); what the loop must do with a request (prefill
it, step it, end it) comes back as the verbs' answers. The queue never ends anyone itself: it
returns `Ending`s and the loop tells their streams. That keeps the policy testable with plain
requests and a fake clock (`tests/test_queue.py`).

A request's place is its `RequestStatus`, mirrored by the list it is in, and every change of
place goes through `_move`, whose table (`MOVES`) refuses any other:

    NEW -> WAITING -> PREFILLING -> RUNNING -> FINISHED      (RUNNING <-> PARKED; any -> FINISHED)

- WAITING: in line for a slot, oldest first; PARKED: prefilled, gave its slot back (engines
  that can park only), in line again once its reader has caught up;
- PREFILLING: admitted this turn, its prompt going into the engine; it holds a slot;
- RUNNING: holds a slot, stepped every turn its reader keeps up.

The slots may change while serving (`resize`: `--slots auto` measured again); more admit the
waiting at once, fewer take no slot back.

Who gets a slot, who gives one back and whose step comes first is the fair-share policy
(`fair_share.py`); how far each listener is ahead, and whether its reader lags, the loop reads
from the streams (`Readers`) each time the queue asks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from ..engine import EndReason, ErrorKind, GenerationRequest, Refused, RequestStatus
from .fair_share import FairShare

# A stream with no audio yet counts as this far ahead of its listener when the queue picks whom
# to serve (`Readers.ahead_s`): before streams comfortably ahead (first audio matters), after
# those about to run out (a gap in audio already playing matters more).
NEW_STREAM_AHEAD_S = 1.0
# What a retry hint may say: never sooner than this, never later.
MIN_RETRY_AFTER_S = 0.1
MAX_RETRY_AFTER_S = 60.0

_S = RequestStatus
# Every move a request may make, and no other.
MOVES: dict[RequestStatus, frozenset[RequestStatus]] = {
    _S.NEW: frozenset({_S.WAITING}),
    _S.WAITING: frozenset({_S.PREFILLING, _S.FINISHED}),
    _S.PREFILLING: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.RUNNING: frozenset({_S.PARKED, _S.FINISHED}),
    _S.PARKED: frozenset({_S.RUNNING, _S.FINISHED}),
    _S.FINISHED: frozenset(),
}
# The engine holds state for a request in these places: leaving one, it is released.
PREFILLED = frozenset({_S.PREFILLING, _S.RUNNING, _S.PARKED})


class Readers(Protocol):
    """What the queue asks of a request's reader (the stream that takes its audio)."""

    def lagging(self, request: GenerationRequest) -> bool:
        """Its reader has not taken enough of what it was given: stepping it would only pile up audio."""
        ...

    def ahead_s(self, request: GenerationRequest) -> float:
        """Seconds of audio its listener has beyond what it has played (how soon it runs out)."""
        ...


class QueuePace:
    """How fast a queue moves: how long a request holds its slot, on average (a moving mean over
    the requests that left their slots lately, whatever ended them), and from it when a slot
    or a place is likely to free."""

    WEIGHT = 0.2                       # of the newest hold in the mean
    UNMEASURED_HOLD_S = 1.0            # until a hold has been measured

    def __init__(self) -> None:
        self.hold_s: float | None = None
        self.observed = 0

    def observe(self, hold_s: float) -> None:
        self.hold_s = hold_s if self.hold_s is None else self.hold_s + self.WEIGHT * (hold_s - self.hold_s)
        self.observed += 1

    def wait_s(self, holding: list[float], slots: int, after: int = 0) -> float:
        """Seconds until the next of `slots` slots frees (`holding`: how long each taken one has
        been held so far; fewer than `slots`: one is free now), and `after` more after it; the
        retry hint of a refusal, so clamped to [MIN_RETRY_AFTER_S, MAX_RETRY_AFTER_S]."""
        hold = self.hold_s if self.hold_s is not None else self.UNMEASURED_HOLD_S
        slots = max(slots, 1)
        first = 0.0 if len(holding) < slots else min(max(0.0, hold - held) for held in holding)
        estimate = first + max(after, 0) * hold / slots
        return round(min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate)), 2)


@dataclass(frozen=True)
class Ending:
    """A request the queue let go, and what its stream is told: it finished (`reason`), or it
    failed (`kind`, `message`, `retry_after_s`). `prefilled`: the engine holds state for it,
    which the loop releases."""

    request: GenerationRequest
    prefilled: bool
    reason: EndReason | None = None
    kind: ErrorKind | None = None
    message: str = ""
    retry_after_s: float | None = None


class Added(NamedTuple):
    position: int                    # requests ahead of it for a slot (0: one at the next turn)
    pushed_out: Ending | None        # the waiting request failed to make room for it, if any


class Plan(NamedTuple):
    """What one turn does with the queue."""

    admitted: list[GenerationRequest]    # to the free slots, in order: PREFILLING (new) or RUNNING (resumed)
    parked: list[GenerationRequest]      # gave their slots back
    expired: list[Ending]                # waited over max_wait_s for a first slot


class SlotQueue:
    def __init__(self, slots: int, max_queue: int, readers: Readers, *, max_share: int,
                 can_park: bool = False, max_wait_s: float | None = None) -> None:
        self.slots = slots
        self.max_queue = max_queue
        self.max_wait_s = max_wait_s
        self.can_park = can_park
        self.fair = FairShare(max_share)
        self.pace = QueuePace()
        self._readers = readers
        self._lists: dict[RequestStatus, list[GenerationRequest]] = {
            status: [] for status in (_S.WAITING, _S.PREFILLING, _S.RUNNING, _S.PARKED)}

    # ------------------------------------------------------------------ the loop's verbs

    def add(self, request: GenerationRequest, now: float) -> Added:
        """A new request into the line: its position, and the request pushed out of a full queue
        to make room for it, if one was. Raises `Refused` (busy, with its retry hint) when the
        queue is full and no other client outweighs this one's."""
        ahead = self._ahead()
        pushed_out = None
        if ahead >= self.max_queue:
            victim = self.fair.push_out(self._line(), self._holding(), request)
            if victim is None:
                raise Refused(ErrorKind.BUSY, f"all {self.slots} slots busy and {self.max_queue} requests queued",
                              self.place_wait_s(now))
            pushed_out = Ending(victim, self.left(victim, now), kind=ErrorKind.BUSY, message=(
                "pushed out of the full queue by another client's stream: this client has more streams "
                "waiting or running than others"), retry_after_s=self.place_wait_s(now))
            ahead -= 1
        self._move(request, _S.WAITING)
        return Added(max(0, ahead + 1), pushed_out)

    def cancel(self, request: GenerationRequest, now: float) -> Ending | None:
        """The request ends (cancelled) wherever it is; None where it has ended already."""
        if request.status in (_S.NEW, _S.FINISHED):
            return None
        return Ending(request, self.left(request, now), reason=EndReason.CANCELLED)

    def plan(self, now: float) -> Plan:
        """This turn's moves: the waiting requests that waited too long leave the line, slots are
        given back to waiting clients (by streams whose readers lag, then by clients over their
        share), and the free slots are taken, in the fair order."""
        expired_requests = [r for r in self._lists[_S.WAITING]
                            if self.max_wait_s is not None and now - r.submitted_at > self.max_wait_s]
        for request in expired_requests:
            self._move(request, _S.FINISHED)
        parked = self._park()
        free = self.slots - len(self._holding())
        admitted = self.fair.admissions(deque(self._line()), self._holding(), free)
        for request in admitted:
            if request.status is _S.WAITING:
                request.admitted_at = now
                self._move(request, _S.PREFILLING)
            else:
                self._move(request, _S.RUNNING)
        retry_after = self.place_wait_s(now) if expired_requests else None
        expired = [Ending(r, prefilled=False, kind=ErrorKind.BUSY, retry_after_s=retry_after,
                          message=f"waited over {self.max_wait_s:g}s for a slot: every slot stayed busy")
                   for r in expired_requests]
        return Plan(admitted, parked, expired)

    def resize(self, slots: int, max_share: int) -> None:
        """The slots sized again while serving (`--slots auto` measured again), and the share
        one client may hold with them. More: the waiting are admitted at the next plan. Fewer:
        no request loses its slot; those holding one keep it to their end, and none is admitted
        (nor parked for another) until fewer hold one than the new count."""
        self.slots = max(1, slots)
        self.fair.max_share = max(1, max_share)

    def started(self, request: GenerationRequest) -> None:
        """Its prefill is done: it runs."""
        self._move(request, _S.RUNNING)

    def batch(self, rows: int) -> list[GenerationRequest]:
        """The requests the next step carries, and charges them to their clients: every running
        one whose reader keeps up where `rows` carry them all; else the `rows` whose listeners
        run out of audio soonest; with one row, the request whose turn it is."""
        runnable = [r for r in self._lists[_S.RUNNING] if not self._readers.lagging(r)]
        if not runnable or len(runnable) <= rows:
            group = runnable
        elif rows <= 1:
            group = [self.fair.next_turn(runnable, self._readers.ahead_s)]
        else:
            group = self.fair.most_urgent(runnable, rows, self._readers.ahead_s)
        if group:
            self.fair.charge(group)
        return group

    def left(self, request: GenerationRequest, now: float) -> bool:
        """The request is done (finished, failed or cancelled by the loop): it leaves its place,
        its hold of a slot measured into the pace. Whether the engine holds state for it."""
        prefilled = request.status in PREFILLED
        self._move(request, _S.FINISHED)
        if prefilled and request.admitted_at is not None:
            self.pace.observe(now - request.admitted_at)
        return prefilled

    def place_wait_s(self, now: float) -> float:
        """Seconds until the queue has a place for one more request, at the pace measured: the
        next slot to free (the head of the line takes it), and one more for every request
        beyond the queue's bound. The retry hint of a busy refusal."""
        holding = [now - r.admitted_at for r in self._holding() if r.admitted_at is not None]
        return self.pace.wait_s(holding, self.slots, after=self._ahead() - self.max_queue)

    def stats(self) -> dict[str, Any]:
        return {
            "active": len(self._holding()),
            "queued": len(self._line()),
            "parked": len(self._lists[_S.PARKED]),
            "slot_hold_s": None if self.pace.hold_s is None else round(self.pace.hold_s, 3),
            "empty": not any(self._lists.values()),
        }

    def close(self) -> list[GenerationRequest]:
        """Every request still in the queue, each moved to FINISHED (the engine is gone)."""
        everyone = [r for requests in self._lists.values() for r in requests]
        for request in everyone:
            self._move(request, _S.FINISHED)
        return everyone

    # ------------------------------------------------------------------ places

    def _move(self, request: GenerationRequest, to: RequestStatus) -> None:
        """The one place a request's status changes, and its list with it."""
        if to not in MOVES[request.status]:
            allowed = ", ".join(str(s) for s in sorted(MOVES[request.status])) or "nowhere: it has ended"
            raise ValueError(f"request {request.id} cannot move from {request.status} to {to}; "
                             f"from {request.status} it moves to {allowed}")
        if request.status in self._lists:
            self._lists[request.status].remove(request)
        if to is _S.PARKED:
            self._lists[to].insert(0, request)        # the latest parked is the first back
        elif to in self._lists:
            self._lists[to].append(request)
        request.status = to

    def _holding(self) -> list[GenerationRequest]:
        """The requests that hold slots: running, and those being prefilled this turn."""
        return self._lists[_S.RUNNING] + self._lists[_S.PREFILLING]

    def _line(self) -> list[GenerationRequest]:
        """The requests that want a slot, in the order they came back or came: the parked ones
        whose readers have caught up (a lagging one holds no place in the line), then the waiting."""
        return [r for r in self._lists[_S.PARKED] if not self._readers.lagging(r)] + self._lists[_S.WAITING]

    def _ahead(self) -> int:
        """Requests in line beyond the slots that the next turn frees."""
        return len(self._line()) - (self.slots - len(self._holding()))

    def _park(self) -> list[GenerationRequest]:
        """With every slot taken and a request waiting, slots are given back (engines that can
        park only): first by streams whose readers lag (a slot that generates nothing), then by
        clients over their share, to waiting clients that hold fewer."""
        if not self.can_park or len(self._holding()) != self.slots:
            # Fewer held: a slot is free. More (fewer slots since `resize`): parking one would
            # free none, the holders finish first.
            return []
        claimants = len(self._lists[_S.WAITING])
        parked = [r for r in self._lists[_S.RUNNING] if self._readers.lagging(r)][:claimants]
        if len(self._holding()) - len(parked) >= self.slots:
            remaining = [r for r in self._lists[_S.RUNNING] if r not in parked]
            parked += self.fair.to_park(self._lists[_S.WAITING], remaining)
        for request in parked:
            self._move(request, _S.PARKED)
        return parked
