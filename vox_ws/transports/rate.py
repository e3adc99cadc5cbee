"""How many messages a connection may send: one budget for its messages and its pings."""

from __future__ import annotations

import time
from typing import Callable

# The ASGI scope extension through which the app finds its connection's budget.
BUDGET_EXTENSION = "vox_ws.message_budget"
# Messages over the rate in a row after which the connection is closed (1008).
CLOSE_AFTER_REFUSED = 200


class TokenBucket:
    """`rate` a second on average, in bursts up to `burst`."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate = rate
        self.burst = burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self, amount: float = 1.0) -> bool:
        """Whether `amount` more is within the budget (and if so, it is taken)."""
        self._refill()
        if self._tokens >= amount:
            self._tokens -= amount
            return True
        return False

    @property
    def full(self) -> bool:
        self._refill()
        return self._tokens >= self.burst

    @property
    def tokens(self) -> float:
        self._refill()
        return self._tokens

    def _refill(self) -> None:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now


class MessageBudget:
    """A token bucket: `rate` messages a second on average, bursts up to twice that.

    `take()` says whether one more message is within the budget; `exhausted` turns true once
    `CLOSE_AFTER_REFUSED` messages in a row were refused, and the connection is then closed.
    Both protocol v1's messages and WebSocket pings draw from the same budget: a ping costs the
    server a pong to write, so a ping flood is a message flood."""

    def __init__(self, rate: float) -> None:
        self._bucket = TokenBucket(rate, max(1.0, 2 * rate))
        self.refused_in_a_row = 0

    def take(self) -> bool:
        if self._bucket.take():
            self.refused_in_a_row = 0
            return True
        self.refused_in_a_row += 1
        return False

    @property
    def exhausted(self) -> bool:
        return self.refused_in_a_row > CLOSE_AFTER_REFUSED
