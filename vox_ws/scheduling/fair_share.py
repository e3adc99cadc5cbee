"""Who gets the slots and turns: the fair-share policy, apart from the queue that applies it
(`queue.py`).

Every request names the clients it is for (`GenerationRequest.owners`), broadest first: an
owner (a token, or an address), then one of its connections. Clients are compared level by
level, so connections that share an owner are told apart by what each holds.

- **Admission**: a free slot goes to the waiting request whose clients hold the fewest slots
  (oldest first among equals).
- **Parking**: with every slot taken, a client holding more than `max_share` slots while a
  client holding at least two fewer waits gives one back, where the engine can pause a
  prefilled request (`Engine.can_park`).
- **Push-out**: a full queue makes room for a newcomer by failing the newest waiting request
  of a client that holds at least two more (slots and places).
- **Rows** (a batching engine with more slots than one step carries): by slack, the listener
  closest to running out of audio first, then the client served the fewest steps lately.
- **Turns** (engines that step one request at a time): the owner served the fewest steps
  lately (each step counts for less as others follow), then, of its requests, the one whose
  listener is closest to running out of audio (a new stream counts as 1 s ahead: before
  streams comfortably ahead, after those about to run out), then its connections in turn,
  then the oldest.

Not thread-safe, and needs nothing that is: the slot queue calls it, under the engine loop's lock.
How far ahead each listener is (`ahead_s`) is given by the caller: the policy reads no sink.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Callable, Iterable

from ..engine import GenerationRequest

# How much a step still counts against its client one step later.
SERVICE_DECAY = 0.9


class FairShare:
    def __init__(self, max_share: int) -> None:
        self.max_share = max_share
        self._served: dict[str, float] = {}       # steps per client, decayed step by step

    # ------------------------------------------------------------------ slots

    def admissions(self, waiting: deque[GenerationRequest], active: list[GenerationRequest],
                   free: int) -> list[GenerationRequest]:
        """Take up to `free` requests out of `waiting` for the free slots, in the order they get them."""
        held = _held(active)
        admitted = []
        while waiting and len(admitted) < free:
            best = min(range(len(waiting)), key=lambda i: (_load(waiting[i], held), i))
            request = waiting[best]
            del waiting[best]
            admitted.append(request)
            held.update(request.owners)
        return admitted

    def to_park(self, waiting: Iterable[GenerationRequest], active: list[GenerationRequest]) -> list[GenerationRequest]:
        """Active requests whose slots go to waiting clients that hold fewer (the caller parks them)."""
        held = _held(active)
        remaining = list(active)
        victims = []
        for request in [r for r in waiting if not r.parked]:
            candidates = [r for r in remaining if _outweighs(r, request, held, self.max_share)]
            if not candidates:
                continue
            victim = max(reversed(candidates), key=lambda r: _load(r, held))   # latest of the busiest
            remaining.remove(victim)
            victims.append(victim)
            held.subtract(victim.owners)
            held.update(request.owners)           # the slot it frees goes to this one
        return victims

    def push_out(self, waiting: Iterable[GenerationRequest], active: list[GenerationRequest],
                 newcomer: GenerationRequest) -> GenerationRequest | None:
        """The waiting request to fail so that `newcomer` fits in a full queue, if any client outweighs its own."""
        waiting = list(waiting)
        held = _held(active + waiting)
        candidates = [r for r in waiting if not r.parked and _outweighs(r, newcomer, held, 0)]
        return max(reversed(candidates), key=lambda r: _load(r, held)) if candidates else None

    # ------------------------------------------------------------------ turns

    def next_turn(self, runnable: list[GenerationRequest],
                  ahead_s: Callable[[GenerationRequest], float]) -> GenerationRequest:
        """Owners take turns; within an owner, the listener closest to running out goes first;
        then the owner's connections take turns; then the oldest."""
        def key(r: GenerationRequest) -> tuple:
            served = [self._served.get(k, 0.0) for k in r.owners]
            return (served[:1], ahead_s(r), served[1:], r.submitted_at)
        return min(runnable, key=key)

    def most_urgent(self, runnable: list[GenerationRequest], rows: int,
                    ahead_s: Callable[[GenerationRequest], float]) -> list[GenerationRequest]:
        """The `rows` requests one step carries when more are runnable: by slack, the listener
        that will run out of audio soonest first (a new stream counts as 1 s ahead, as for
        turns: after a listener about to run out, before one comfortably ahead), then the
        client served the fewest steps lately, then the oldest. Kept in their order."""
        def key(r: GenerationRequest) -> tuple:
            return (ahead_s(r), [self._served.get(k, 0.0) for k in r.owners], r.submitted_at)
        chosen = set(map(id, sorted(runnable, key=key)[:rows]))
        return [r for r in runnable if id(r) in chosen]

    def charge(self, group: list[GenerationRequest]) -> None:
        """Count a step against the clients it served. Steps, not seconds: two clients then
        take turns, so one with short steps never waits for two of another's long ones."""
        for key in list(self._served):
            self._served[key] *= SERVICE_DECAY
            if self._served[key] < 1e-3:
                del self._served[key]
        for request in group:
            for key in set(request.owners):
                self._served[key] = self._served.get(key, 0.0) + 1.0 / len(group)


def _held(requests: list[GenerationRequest]) -> Counter:
    return Counter(key for r in requests for key in r.owners)


def _load(request: GenerationRequest, held: Counter) -> tuple[int, ...]:
    """What the clients a request is for hold, broadest first."""
    return tuple(held[key] for key in request.owners)


def _outweighs(heavy: GenerationRequest, light: GenerationRequest, held: Counter, share: int) -> bool:
    """Whether `heavy`'s client should give way to `light`'s: at the first level where their
    clients differ, heavy's holds over `share`, and at least two more than light's."""
    for heavy_key, light_key in zip(heavy.owners, light.owners):
        if heavy_key != light_key:
            return held[heavy_key] > share and held[heavy_key] - 1 > held[light_key]
    return False
