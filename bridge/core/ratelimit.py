"""Per-type backpressure both dispatchers apply: the token bucket of a workflow type's ``rate`` and ``burst`` and
its ``max_in_flight`` (``[scheduler.types.T]``), as :class:`TypeLimits`.

One bucket per type per process: the event scheduler keeps one for its dispatches and the reference poller one
for its own (docs/scheduler.md says what that means for a type both dispatch in ``selective``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from bridge.core.settings import SchedulerSettings


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

    def give_back(self, n: int) -> None:
        """Return ``n`` tokens taken for dispatches that did not happen, up to the burst."""
        self.tokens = min(self.burst, self.tokens + n)


#: A task held back by ``max_in_flight`` is looked at again after this many seconds (a rate limit's hold
#: waits exactly for its next token).
IN_FLIGHT_RECHECK = 1.0


class TypeLimits:
    """Per-type admission of ready tasks, the one rule both dispatchers apply: a type's ``max_in_flight``
    (dispatched + running, counted by the caller from the task table) and its token bucket (``rate``,
    ``burst``; one per type in this process). Thread-safe."""

    def __init__(self, settings: SchedulerSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._buckets: dict[str | None, TokenBucket] = {}
        self._unlimited: dict[str | None, bool] = {}

    def capped(self, workflow_type: str | None) -> bool:
        """Whether the type has an in-flight cap (then :meth:`admit` needs the in-flight counts)."""
        return bool(self.settings.for_type(workflow_type).max_in_flight)

    def unlimited(self, workflow_type: str | None) -> bool:
        """Whether :meth:`admit` admits every task of the type (neither ``max_in_flight`` nor ``rate``). Kept per
        type: the settings do not change, and the evaluator asks for every type it has seen, at every batch."""
        known = self._unlimited.get(workflow_type)
        if known is None:
            ts = self.settings.for_type(workflow_type)
            known = self._unlimited[workflow_type] = not ts.max_in_flight and not ts.rate > 0
        return known

    def admit(self, workflow_type: str | None, in_flight: dict[str | None, int]) -> tuple[str, float] | None:
        """``None``: dispatch a task of the type now (counted into ``in_flight``, so the rest of a round sees
        it). Else why it waits and for how long: ``("in_flight", IN_FLIGHT_RECHECK)`` or ``("rate", seconds
        until its next token)``."""
        ts = self.settings.for_type(workflow_type)
        if ts.max_in_flight and in_flight.get(workflow_type, 0) >= ts.max_in_flight:
            return "in_flight", IN_FLIGHT_RECHECK
        if ts.rate > 0:
            with self._lock:
                wait = self._buckets.setdefault(workflow_type, TokenBucket(ts.rate, ts.burst)).take()
            if wait > 0:
                return "rate", wait
        in_flight[workflow_type] = in_flight.get(workflow_type, 0) + 1
        return None

    def refund(self, workflow_types: Iterable[str | None]) -> None:
        """Give back the tokens :meth:`admit` took for tasks that were not dispatched after all, one per entry: a
        lost race (another dispatcher took the task) or a dispatch that failed and rolled back. Without it a type's
        rate fell short of its setting until the bucket refilled (up to ``burst / rate`` seconds after a failed
        batch). A failure whose outcome is unknown (the connection lost during the commit) counts as not
        dispatched: the type may then go over its rate once, by at most ``burst``."""
        counts: dict[str | None, int] = {}
        for workflow_type in workflow_types:
            counts[workflow_type] = counts.get(workflow_type, 0) + 1
        with self._lock:
            for workflow_type, n in counts.items():
                bucket = self._buckets.get(workflow_type)
                if bucket is not None:
                    bucket.give_back(n)
