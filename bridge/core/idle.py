"""How often a poller looks again while nothing happens: busy, every ``base`` seconds; idle, a tenth of
the time it has been idle, at most :data:`MAX_IDLE_POLL` (the embedded bus's readers and the relay on
SQLite, which have no cross-process wake-up)."""

from __future__ import annotations

#: The longest wait between checks of an idle poller (seconds).
MAX_IDLE_POLL = 0.1


def idle_poll(base: float, idle_for: float, cap: float = MAX_IDLE_POLL) -> float:
    """The wait before the next check: ``base`` while busy, a tenth of the idle time after, up to ``cap``."""
    return max(base, min(cap, idle_for / 10.0))
