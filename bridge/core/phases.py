"""Phases and routes: what each dispatch path may do for one task, given its type's flag.

The phase table (``../shared/DESIGN.md``) as code. For a task of type *T* in instance *I*:

=============  ==========================================  ==========================================
phase          event path (:data:`EventRoute`)             legacy poller (:data:`PollerRoute`)
=============  ==========================================  ==========================================
``polling``    ``off``                                     ``authoritative``
``dual_write`` ``shadow``: record the decision only        ``authoritative``
``selective``  *I* in the percentage: ``dispatch``;        *I* in the percentage: ``fallback`` (only
               otherwise ``off``                           once ready longer than the grace period,
                                                           path ``fallback``); otherwise
                                                           ``authoritative``
``cutover``    ``dispatch``                                ``sweep``: left out of the scan; only the slow
                                                           safety sweep dispatches it, as ``fallback``
=============  ==========================================  ==========================================

A type without a flag is ``polling``. The percentage uses a **frozen** hash, :func:`bucket`: the first
32 bits of ``md5(workflow_type + "/" + instance_id)`` modulo 10,000; an instance is in a percentage
*p* when its bucket is below ``round(p * 100)``. Raising *p* therefore only adds instances, and an
instance never flips back and forth. PostgreSQL has the same function as ``pollbridge_bucket(text,
text)`` (migration 0005) and SQLite connections opened by pollbridge register it, so scans filter in
SQL. Never change the hash: it would move instances across the boundary.

Every :class:`EventRouter` must answer from memory (it is asked for every ready task) and reflect a
phase change within one poll interval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Literal, Protocol

Phase = Literal["polling", "dual_write", "selective", "cutover"]
PHASES: tuple[Phase, ...] = ("polling", "dual_write", "selective", "cutover")
EventRoute = Literal["off", "shadow", "dispatch"]
PollerRoute = Literal["authoritative", "fallback", "sweep"]

BUCKETS = 10_000

ROUTE_OF_PHASE: dict[Phase, EventRoute] = {
    "polling": "off",
    "dual_write": "shadow",
    "selective": "dispatch",
    "cutover": "dispatch",
}


def bucket(workflow_type: str | None, instance_id: str) -> int:
    """The frozen hash of (type, instance) into 0..9999. See the module docstring; never change it."""
    digest = hashlib.md5(f"{workflow_type or ''}/{instance_id}".encode(), usedforsecurity=False).hexdigest()
    return int(digest[:8], 16) % BUCKETS


def percent_threshold(percent: float | None) -> int:
    """Buckets below this are in the percentage (``None``: every instance)."""
    return BUCKETS if percent is None else round(percent * 100)


@dataclass(frozen=True)
class Flag:
    """The stored phase of one workflow type."""

    workflow_type: str
    phase: Phase = "polling"
    percent: float | None = None
    grace_seconds: float = 5.0
    thresholds: dict[str, float] = field(default_factory=dict, compare=False, hash=False)
    updated_at: datetime | None = None
    updated_by: str | None = None

    def in_percentage(self, instance_id: str) -> bool:
        return self.percent is None or bucket(self.workflow_type, instance_id) < percent_threshold(self.percent)

    def event_route(self, instance_id: str) -> EventRoute:
        if self.phase == "selective" and not self.in_percentage(instance_id):
            return "off"
        return ROUTE_OF_PHASE[self.phase]

    def uniform_event_route(self) -> EventRoute | None:
        """The event route of every instance of the type, or None when it depends on the instance (a
        ``selective`` percentage below 100)."""
        if self.phase == "selective" and percent_threshold(self.percent) < BUCKETS:
            return None
        return ROUTE_OF_PHASE[self.phase]

    def poller_route(self, instance_id: str) -> PollerRoute:
        if self.phase == "cutover":
            return "sweep"
        if self.phase == "selective" and self.in_percentage(instance_id):
            return "fallback"
        return "authoritative"


def poller_should_handle(flag: Flag | None, instance_id: str, ready_since: datetime | None,
                         now: datetime) -> bool:
    """Whether a poller (yours or ours) should dispatch this ready task now.

    The Python twin of the SQL function ``pollbridge_poller_should_handle``: ``True`` for a type in
    ``polling`` or ``dual_write`` and for instances outside a ``selective`` percentage; for a canary
    instance only once it has been ready longer than the grace period (the event path missed it);
    never in ``cutover`` (the safety sweep handles those)."""
    route = (flag or Flag("")).poller_route(instance_id)
    if route == "authoritative":
        return True
    if route == "sweep":
        return False
    assert flag is not None
    return ready_since is None or ready_since <= now - timedelta(seconds=flag.grace_seconds)


class EventRouter(Protocol):
    """Where the event path sends a type's tasks. A router may also offer ``uniform_route(workflow_type)``:
    the route of every instance of the type, or None when it depends on the instance (the evaluator's
    one-statement dispatch asks it once per type instead of once per type and instance)."""

    def event_route(self, workflow_type: str | None, instance_id: str) -> EventRoute:
        """The event path's route for one task of ``workflow_type`` in ``instance_id``."""
        ...

    def thresholds(self, workflow_type: str | None) -> Mapping[str, float]:
        """The type's threshold overrides from its flag (the guards' limits among them), shared by every
        process through the flag store; empty when there are none."""
        ...


class FixedRouter:
    """Every type in one phase: for tests, benchmarks and ``scheduler run --phase``."""

    def __init__(self, phase: Phase) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
        self.phase = phase

    def event_route(self, workflow_type: str | None, instance_id: str) -> EventRoute:
        return ROUTE_OF_PHASE[self.phase]

    def uniform_route(self, workflow_type: str | None) -> EventRoute | None:
        return ROUTE_OF_PHASE[self.phase]

    def thresholds(self, workflow_type: str | None) -> Mapping[str, float]:
        return {}
