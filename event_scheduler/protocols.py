"""The event scheduler's interfaces.

:class:`PartitionLeaseStore` decides which scheduler process consumes which bus partition. Three
implementations keep the same contract and run the same tests: :class:`event_scheduler.leases.
PartitionLeases` (database tables; the choice with the embedded bus on PostgreSQL or SQLite in memory),
:class:`event_scheduler.leases.FileLockPartitionLeases` (lock files beside a SQLite database file) and
:class:`event_scheduler.leases.BusPartitionLeases` (beside a bus that keeps leases,
:meth:`bridge.bus.base.EventBus.leases`: Redis Streams). :func:`event_scheduler.leases.lease_store` picks the
one that goes with a bus and a database, through the bus interface.
"""

from __future__ import annotations

from typing import Any, Protocol


class PartitionLeaseStore(Protocol):
    """Partition leases of one scheduler process (``holder``).

    Contract every implementation keeps:

    * ``refresh`` heartbeats this member, renews its leases for ``ttl`` seconds and rebalances: with
      ``n`` live members (heartbeat within ``ttl``) each holds at most ``ceil(partitions / n)``; a member
      above that gives the excess back, one below takes free or expired partitions (a dead member's
      after its ``ttl``; with lock files at once, since the kernel releases a dead process's locks, and a
      stalled member keeps what it holds until it resumes or dies). It returns ``(acquired, lost)`` since
      the previous refresh and leaves :attr:`owned` equal to what the store now records for this holder.
      A partition another member took while this one stalled is reported lost, never kept.
    * At most one live holder per partition at any time; all members compare one clock (the store's).
    * ``release_all`` gives every lease back and removes the member, so the others take over on their
      next round instead of after the ttl.
    * ``refresh`` may be called from a thread other than the consumer's; calls are not concurrent.
    """

    holder: str
    partitions: int
    ttl: float
    owned: set[int]

    def refresh(self, conn: Any = None) -> tuple[set[int], set[int]]:
        """One round; ``conn``: a kept database connection the store may use for a cheap round."""
        ...

    def release_all(self) -> None: ...

    def holders(self) -> dict[int, Any]:
        """Each partition's recorded holder (``None``: free), expired or not."""
        ...
