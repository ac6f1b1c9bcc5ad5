"""Timers without scanning the task table: an in-memory delay queue, rebuilt from the database at start.

A timer is ``(when, kind, key)``; one timer per ``(kind, key)`` is kept (the earliest wins), so
re-evaluating an instance many times does not pile timers up. A single thread sleeps until the next
timer is due (or a new earlier one arrives) and calls the handler, outside its lock. A handler that
raises is logged and the timer is retried a little later: a timer is never silently dropped.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

log = logging.getLogger(__name__)

RETRY_AFTER_ERROR = 1.0


@dataclass(order=True, frozen=True)
class Timer:
    when: float  # epoch seconds
    kind: str = field(compare=False)
    key: str = field(compare=False)
    data: tuple[object, ...] = field(default=(), compare=False)


class TimerQueue:
    def __init__(self, handler: Callable[[Timer], None], clock: Callable[[], float] = time.time) -> None:
        self._handler = handler
        self._clock = clock
        self._heap: list[Timer] = []
        self._current: dict[tuple[str, str], Timer] = {}
        self._cond = threading.Condition()
        self._stop = False
        self._thread: threading.Thread | None = None

    def schedule(self, when: datetime | float, kind: str, key: str, data: tuple[object, ...] = ()) -> bool:
        """Add a timer unless one for ``(kind, key)`` fires earlier already. True if this one was added."""
        at = when.astimezone(UTC).timestamp() if isinstance(when, datetime) else float(when)
        timer = Timer(at, kind, key, data)
        with self._cond:
            existing = self._current.get((kind, key))
            if existing is not None and existing.when <= at:
                return False
            self._current[(kind, key)] = timer
            heapq.heappush(self._heap, timer)
            if self._heap[0] is timer:
                self._cond.notify()
            return True

    def cancel(self, kind: str, key: str) -> None:
        with self._cond:
            self._current.pop((kind, key), None)  # the heap entry becomes stale and is skipped

    def __len__(self) -> int:
        with self._cond:
            return len(self._current)

    def due(self) -> list[Timer]:
        """Pop every timer due now (for a caller driving the queue without the thread)."""
        out = []
        with self._cond:
            now = self._clock()
            while self._heap and self._heap[0].when <= now:
                timer = heapq.heappop(self._heap)
                if self._current.get((timer.kind, timer.key)) is timer:
                    del self._current[(timer.kind, timer.key)]
                    out.append(timer)
        return out

    def _is_current(self, timer: Timer) -> bool:
        return self._current.get((timer.kind, timer.key)) is timer

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stop:
                    while self._heap and not self._is_current(self._heap[0]):
                        heapq.heappop(self._heap)  # cancelled or superseded
                    if self._heap and self._heap[0].when <= self._clock():
                        break
                    timeout = None if not self._heap else max(0.0, self._heap[0].when - self._clock())
                    self._cond.wait(timeout if timeout is None else min(timeout, 1.0))
                if self._stop:
                    return
            for timer in self.due():
                try:
                    self._handler(timer)
                except Exception:
                    log.exception("timer %s/%s failed; retrying in %.0f s", timer.kind, timer.key, RETRY_AFTER_ERROR)
                    self.schedule(self._clock() + RETRY_AFTER_ERROR, timer.kind, timer.key, timer.data)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="pollbridge-timers", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(10)
