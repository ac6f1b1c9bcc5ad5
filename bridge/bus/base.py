"""The event-bus interface. Every backend passes the one contract suite in tests/integration/test_bus_contract.py.

The contract, for every implementation:

* **Partitions.** The bus has ``partitions`` numbered ``0..P-1``. An event goes to
  ``partition_for(event.partitionkey, P)`` (a stable hash of the instance id), so one instance's
  events keep their publish order within one partition.
* **publish(events)** returns only when every event is durably on the bus (Redis: the server
  acknowledged the pipeline; embedded: the transaction committed). It either raises or has
  published them all; publishing the same event twice is allowed (consumers dedupe by ``id``).
  **publish_in(conn, events)** is the same from inside a caller's open transaction on pollbridge's
  database: a bus that lives in that database (embedded) writes through ``conn``, so the events
  are durable exactly when the caller commits; any other bus publishes at once as ``publish`` does.
* **Entry ids** are unique within a partition only: a delivery is identified by
  ``(partition, entry_id)``.
* **Consumer groups.** ``ensure_group(group)`` creates the group on every partition if missing
  (idempotent; a new group starts at the beginning of the retained log). ``read(group, consumer,
  partitions, count, block)`` returns up to ``count`` entries never delivered to this group,
  oldest first per partition, blocking up to ``block`` seconds when there are none; each returned
  entry becomes *pending* for that consumer until ``ack``. An entry is never delivered by
  ``read`` twice to the same group.
* **Redelivery.** ``claim_stale(group, consumer, partitions, min_idle, count)`` hands the caller
  pending entries idle for at least ``min_idle`` seconds (their consumer died), incrementing their
  delivery count. ``ack`` removes entries from pending; acknowledging twice is harmless.
* **Malformed entries** are still delivered: ``Delivery.event`` is ``None`` and ``Delivery.error``
  says why, so the consumer can dead-letter them instead of losing or looping on them.
* **Dead letters.** ``dead_letter(group, delivery, reason)`` stores the entry's payload with the
  reason and acknowledges it; ``dead_letters()`` lists them; ``remove_dead_letters(ids)`` deletes.
* **Trimming.** ``trim(retention)`` removes entries older than ``retention`` seconds that every
  group has acknowledged; it never removes a pending or undelivered entry.
* **Loss detection.** ``epoch()`` returns a token that changes when the bus lost its data (Redis
  flushed or restarted without persistence); the relay compares it to the one it stored.
* **memory_pressure()** is the fraction of its memory limit the bus uses (Redis: ``used_memory /
  maxmemory``), or ``None`` without a limit; the relay pauses publishing above a threshold.
* **close()** closes only what the bus opened (a client passed in stays open).
* **Tailing (read-only).** ``end_positions(partitions)`` gives, per partition, the id of its newest
  entry (``"0"`` when it has none): a tail started there sees only what is published afterwards.
  ``tail(after, count, block)`` returns the entries after ``after[p]`` for each partition ``p`` in
  ``after`` (``"0"``: from the start of the retained log), oldest first per partition, at most
  ``count`` per partition, blocking up to ``block`` seconds when there are none. A tail belongs to
  no consumer group: nothing becomes pending and no group's offset or lag moves, so a reader that
  only tails (the SSE feed of ``pollbridge serve``) can never take an entry from the scheduler.
  Within a partition, :func:`entry_order` sorts entry ids in publish order.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy.engine import Connection

from bridge.core.events import CloudEvent


def partition_for(partition_key: str, partitions: int) -> int:
    """The frozen partitioning function: CRC-32 of the UTF-8 key, modulo the partition count."""
    return zlib.crc32(partition_key.encode("utf-8")) % partitions


def entry_order(entry_id: str) -> tuple[int, int]:
    """The sort key of an entry id within one partition: embedded ids are integers, Redis ids ``ms-seq``.

    ``"0"`` (the position before every entry) sorts first. Raises ``ValueError`` for anything else."""
    head, _, tail = entry_id.partition("-")
    if not head.isdigit() or not (tail.isdigit() or tail == ""):
        raise ValueError(f"not a bus entry id: {entry_id!r}")
    return int(head), int(tail or 0)


@dataclass(frozen=True)
class Delivery:
    entry_id: str
    partition: int
    payload: str
    event: CloudEvent | None
    deliveries: int = 1
    error: str | None = None


@dataclass(frozen=True)
class DeadLetter:
    id: str
    group: str
    entry_id: str
    partition: int
    payload: str
    reason: str


class EventBus(ABC):
    partitions: int

    @abstractmethod
    def publish(self, events: Sequence[CloudEvent]) -> None: ...

    def publish_in(self, conn: Connection, events: Sequence[CloudEvent]) -> None:
        """Publish from inside the caller's transaction (see the contract); by default, at once."""
        self.publish(events)

    def memory_pressure(self) -> float | None:
        """Used memory as a fraction of the bus's memory limit, or ``None`` when it has no limit."""
        return None

    @abstractmethod
    def ensure_group(self, group: str) -> None: ...

    @abstractmethod
    def read(self, group: str, consumer: str, partitions: Sequence[int], count: int, block: float) -> list[Delivery]:
        ...

    @abstractmethod
    def ack(self, group: str, deliveries: Sequence[Delivery]) -> None: ...

    def ack_and_read(self, group: str, acks: Sequence[Delivery], consumer: str, partitions: Sequence[int],
                     count: int, block: float) -> list[Delivery]:
        """:meth:`ack` then :meth:`read`, as one call: a consumer that drains its partitions acknowledges a
        batch with the request for the next one (one round trip fewer per batch on Redis). The
        acknowledgements are made before the read waits, whatever it returns."""
        self.ack(group, acks)
        return self.read(group, consumer, partitions, count, block)

    @abstractmethod
    def claim_stale(self, group: str, consumer: str, partitions: Sequence[int], min_idle: float,
                    count: int) -> list[Delivery]: ...

    @abstractmethod
    def pending_count(self, group: str) -> int:
        """Entries delivered to the group and not yet acknowledged."""

    @abstractmethod
    def lag(self, group: str) -> dict[int, int]:
        """Per partition, entries not yet delivered to the group."""

    @abstractmethod
    def dead_letter(self, group: str, delivery: Delivery, reason: str) -> None: ...

    @abstractmethod
    def dead_letters(self, limit: int = 100) -> list[DeadLetter]: ...

    @abstractmethod
    def remove_dead_letters(self, ids: Sequence[str]) -> int: ...

    @abstractmethod
    def trim(self, retention: float) -> int: ...

    @abstractmethod
    def epoch(self) -> str: ...

    @abstractmethod
    def close(self) -> None: ...

    def end_positions(self, partitions: Sequence[int]) -> dict[int, str]:
        """Per partition, the id of its newest entry (``"0"`` when empty): where a tail of new entries starts."""
        raise NotImplementedError(f"{type(self).__name__} cannot be tailed")

    def tail(self, after: Mapping[int, str], count: int, block: float) -> list[Delivery]:
        """Entries after each partition's position, read-only (see the contract); ``[]`` after ``block`` seconds."""
        raise NotImplementedError(f"{type(self).__name__} cannot be tailed")

    def partition_of(self, event: CloudEvent) -> int:
        return partition_for(event.partitionkey, self.partitions)
