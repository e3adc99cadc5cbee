"""When an engine process that died is started again: at once the first time, then after a
back-off that doubles; and never again once it has died `max_deaths` times within `window_s`
seconds (a fault that comes back at each start: the server stops, exit code non-zero, and says
why, for its supervisor). Plain data, the clock passed in (`tests/test_restarts.py`)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class RestartPolicy:
    max_deaths: int = 5
    window_s: float = 600.0
    first_delay_s: float = 0.5
    max_delay_s: float = 30.0


class Restarts:
    def __init__(self, policy: RestartPolicy | None = None) -> None:
        self.policy = policy or RestartPolicy()
        self._deaths: deque[float] = deque()
        self.count = 0                        # restarts so far

    def after_death(self, now: float) -> float | None:
        """Seconds to wait before the next start, or None: too many deaths, start no more."""
        policy = self.policy
        self._deaths.append(now)
        while self._deaths and now - self._deaths[0] > policy.window_s:
            self._deaths.popleft()
        if len(self._deaths) >= policy.max_deaths:
            return None
        self.count += 1
        return min(policy.max_delay_s, policy.first_delay_s * 2 ** (len(self._deaths) - 1))

    def why_not(self) -> str:
        return (f"the engine process died {len(self._deaths)} times within {self.policy.window_s:g} s: "
                "not started again")
