"""Phases and routes: what each dispatch path may do for a workflow type.

The flag router (stored flags, percentages, the guardian) decides the phase of each workflow type;
the event scheduler only asks, for one task's type and instance, which *route* the event path takes:

* ``off``: the event path does nothing (``polling``, or an instance outside a ``selective`` percentage);
* ``shadow``: record the decision the event path would make, never dispatch (``dual_write``);
* ``dispatch``: dispatch through the shared compare-and-set (``selective`` and ``cutover``).

Every implementation of :class:`EventRouter` must answer quickly from memory (it is asked for every
ready task) and must reflect a phase change within one poll interval.
"""

from __future__ import annotations

from typing import Literal, Protocol

Phase = Literal["polling", "dual_write", "selective", "cutover"]
PHASES: tuple[Phase, ...] = ("polling", "dual_write", "selective", "cutover")
EventRoute = Literal["off", "shadow", "dispatch"]

ROUTE_OF_PHASE: dict[Phase, EventRoute] = {
    "polling": "off",
    "dual_write": "shadow",
    "selective": "dispatch",
    "cutover": "dispatch",
}


class EventRouter(Protocol):
    def event_route(self, workflow_type: str | None, instance_id: str) -> EventRoute:
        """The event path's route for one task of ``workflow_type`` in ``instance_id``."""
        ...


class FixedRouter:
    """Every type in one phase: for tests, benchmarks and deployments that have not enabled flags."""

    def __init__(self, phase: Phase) -> None:
        if phase not in PHASES:
            raise ValueError(f"unknown phase {phase!r}; expected one of {', '.join(PHASES)}")
        self.phase = phase

    def event_route(self, workflow_type: str | None, instance_id: str) -> EventRoute:
        return ROUTE_OF_PHASE[self.phase]
