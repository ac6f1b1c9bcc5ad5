"""The event-driven scheduler: consumes task events and dispatches ready tasks within milliseconds.

Not built yet: this package is reserved by the foundation so the distribution's layout is stable;
the consumer, readiness evaluation, timers and signals arrive with the event-scheduler issue.
"""

from __future__ import annotations
