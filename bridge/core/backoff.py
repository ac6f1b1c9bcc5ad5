"""The one retry pause of pollbridge's long-running loops: doubling from ``first`` to ``cap``, reset on success.

A loop that lost its database or bus waits ``next()`` seconds (on its stop event, so a shutdown never
waits for it) and calls ``reset()`` after a cycle that worked.
"""

from __future__ import annotations


class Backoff:
    """0.1 s, 0.2 s, 0.4 s … up to 5 s by default."""

    def __init__(self, first: float = 0.1, cap: float = 5.0) -> None:
        if not 0 < first <= cap:
            raise ValueError(f"backoff needs 0 < first <= cap, got first={first}, cap={cap}")
        self.first = first
        self.cap = cap
        self.current = first

    def next(self) -> float:
        """The pause to take now; the following one doubles, up to ``cap``."""
        pause = self.current
        self.current = min(self.current * 2, self.cap)
        return pause

    def reset(self) -> None:
        self.current = self.first
