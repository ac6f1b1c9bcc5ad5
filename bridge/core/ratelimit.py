"""The token bucket both dispatchers use for a workflow type's ``rate`` and ``burst`` (``[scheduler.types.T]``).

One bucket per type per process: the event scheduler keeps one for its dispatches and the reference poller one
for its own (docs/scheduler.md says what that means for a type both dispatch in ``selective``).
"""

from __future__ import annotations

import time


class TokenBucket:
    def __init__(self, rate: float, burst: int) -> None:
        self.rate, self.burst = rate, float(burst)
        self.tokens = float(burst)
        self.updated = time.monotonic()

    def take(self) -> float:
        """0 if a token was taken, else the seconds until one is available."""
        now = time.monotonic()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate
