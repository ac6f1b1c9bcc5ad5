"""The event-driven scheduler: consumes task events and dispatches ready tasks within milliseconds.

:mod:`event_scheduler.scheduler` runs the loop; :mod:`~event_scheduler.evaluate` decides readiness from
the database; :mod:`~event_scheduler.timers` and :mod:`~event_scheduler.signals` handle due times and
callbacks; partition ownership is a :class:`~event_scheduler.protocols.PartitionLeaseStore`
(:mod:`~event_scheduler.leases`: in the database, or beside a Redis bus through the bus's own
:meth:`~bridge.bus.base.EventBus.leases`).
"""

from __future__ import annotations
