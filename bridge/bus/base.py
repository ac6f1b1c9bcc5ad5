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
* **Handling inside the take.** ``read_handled(group, consumer, partitions, count, block, handle, acks)``
  is ``ack_and_read`` with the caller's handler: where ``handles_in_take(engine)`` (the embedded bus on
  the SQLite file of ``engine``), ``handle(conn, entries)`` runs inside the take's write transaction, on its
  connection, and returns the entries it handled; its writes, the take and the acknowledgement of those
  entries commit together, and they are never pending. The entries it did not return are pending, as a
  ``read``'s are. It returns the entries and whether they were handled in the take: ``False`` (any other
  bus, or a ``handle`` that raised: its writes rolled back with the take, which is then made as ``read``
  makes it) leaves every entry pending for the caller to handle and ``ack``. Nothing is lost or taken twice
  either way, and ``acks`` are made before it returns or raises, as ``ack_and_read``'s are.
* **Redelivery.** ``claim_stale(group, consumer, partitions, min_idle, count)`` hands the caller
  pending entries idle for at least ``min_idle`` seconds (their consumer died), incrementing their
  delivery count. ``ack`` removes entries from pending; acknowledging twice is harmless.
* **Malformed entries** are still delivered: ``Delivery.event`` is ``None`` and ``Delivery.error``
  says why, so the consumer can dead-letter them instead of losing or looping on them.
* **Dead letters.** ``dead_letter(group, delivery, reason)`` stores the entry's payload with the
  reason and acknowledges it; ``dead_letters()`` lists them; ``remove_dead_letters(ids)`` deletes.
* **Trimming.** ``trim(retention)`` removes entries older than ``retention`` seconds that every
  group has acknowledged; it never removes a pending or undelivered entry.
* **Loss detection.** ``epochs()`` returns, per partition, a token that changes when the bus lost
  that partition's data (Redis flushed or restarted without persistence, one shard of a cluster lost,
  or a failover that dropped acknowledged writes); the relay compares each with the one it stored and
  republishes the retained outbox rows of the partitions whose token changed, and only those.
  ``epoch()`` is one token over all of them.
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
* **Looking up one event (read-only).** ``delivery_states(group, events)`` answers, per
  :class:`EventRef`, where that event is for ``group`` as an :class:`EventDelivery`:
  ``not_found`` (not on the bus, or not where the bounded search looked: ``detail`` says which
  it may be), ``undelivered`` (on the bus, never read by the group, or the group does not exist),
  ``pending`` (read, not acknowledged: ``consumer`` and ``deliveries``, the delivery count),
  ``acknowledged`` or ``dead_lettered`` (the group dead-lettered it: ``reason``; it wins over
  ``pending`` should a crash leave it both). An event published more than once is looked up by
  its earliest entry found. Nothing is read through a group: no offset, lag or pending entry moves.
  ``delivery_state(group, event)`` is the same for one event. A backend that cannot tell raises
  ``NotImplementedError``.
* **dead_letter_count()** is how many dead letters the bus holds (all groups), without listing them.
* **purge_all()** deletes everything the bus holds for this installation (entries of every partition,
  consumer groups and their pending entries, dead letters; on Redis also the epoch and the scheduler's
  leases: every key of the namespace, and nothing outside it) and returns how many keys (Redis) or rows
  (embedded) it removed; purging an empty bus returns 0. Afterwards the bus is as new: a consumer
  calls ``ensure_group`` again. ``pollbridge uninstall`` uses it.
* **placement()** says where each partition lives when the bus spreads them over several servers (a Redis
  Cluster: ``{partition: "host:port"}`` of the primary holding its slot, read from the cluster's slot map),
  or ``None`` when the bus keeps every partition in one place. Read-only; ``status`` shows it.
* **Partition leases beside the bus.** ``leases()`` returns a :class:`BusLeases` when the bus keeps
  the event scheduler's partition leases itself (atomic on its server, by its clock: Redis), or
  ``None`` (the embedded bus): the scheduler then keeps them in its database. The scheduler's
  store over it is ``event_scheduler.leases.BusPartitionLeases``.
"""

from __future__ import annotations

import zlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy.engine import Connection, Engine

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


#: A consumer's handler run inside a take (:meth:`EventBus.read_handled`): the take's connection and the entries
#: taken; returns the entries it handled.
Handler = Callable[[Connection, list[Delivery]], list[Delivery]]


@dataclass(frozen=True)
class DeadLetter:
    id: str
    group: str
    entry_id: str
    partition: int
    payload: str
    reason: str


#: The states :meth:`EventBus.delivery_states` answers (see the contract).
NOT_FOUND = "not_found"
UNDELIVERED = "undelivered"
PENDING = "pending"
ACKNOWLEDGED = "acknowledged"
DEAD_LETTERED = "dead_lettered"
DELIVERY_STATES = (NOT_FOUND, UNDELIVERED, PENDING, ACKNOWLEDGED, DEAD_LETTERED)


@dataclass(frozen=True)
class EventRef:
    """One event to look up on the bus: its id, its partition key (where the bus placed it) and when it
    was published, by the publisher's clock (``None``: unknown; a backend may use it to bound its search)."""

    event_id: str
    partition_key: str
    published_at: datetime | None = None

    @classmethod
    def of(cls, event: CloudEvent, published_at: datetime | None = None) -> EventRef:
        return cls(event.id, event.partitionkey, published_at)


@dataclass(frozen=True)
class EventDelivery:
    """Where one event is for one consumer group (:meth:`EventBus.delivery_states`)."""

    state: str  # one of DELIVERY_STATES
    partition: int
    entry_id: str | None = None  # None only when not_found
    deliveries: int | None = None  # pending: how many times it was delivered
    consumer: str | None = None  # pending: the consumer that has it
    reason: str | None = None  # dead_lettered: the reason it was dead-lettered with
    detail: str = ""  # not_found: why the bus may not have it


@dataclass(frozen=True)
class LeaseSnapshot:
    """What a lease store records, read without writing (status, preflight, benchmarks). Times are aware
    UTC; ``now`` is the store's clock (the bus server's, or this host's for the database store, whose
    members write their hosts' UTC clocks)."""

    now: datetime
    members: dict[str, datetime]  # holder -> last heartbeat
    leases: dict[int, tuple[str | None, datetime | None]]  # partition -> (holder, expires)
    #: Held by locks (lock files beside a SQLite database): a member's heartbeat is the time it last touched its
    #: lock file, and a lease lasts while its lock is held (its expiry is "now" plus a second); a dead process
    #: leaves no record behind.
    locks: bool = False

    def live_members(self, within: float) -> dict[str, datetime]:
        return {h: t for h, t in self.members.items() if (self.now - t).total_seconds() <= within}

    def settled(self, members: int, partitions: int) -> bool:
        """Exactly ``members`` processes registered, each holding leases, and every partition leased."""
        holders = {h for h, _ in self.leases.values() if h}
        leased = {p for p, (h, _) in self.leases.items() if h}
        return len(self.members) == members == len(holders) and leased >= set(range(partitions))

    def held_by(self, holders: set[str] | dict[str, datetime]) -> set[int]:
        """Partitions leased, unexpired, by one of ``holders``."""
        return {p for p, (h, exp) in self.leases.items()
                if h is not None and h in holders and exp is not None and exp > self.now}


class BusLeases(ABC):
    """The event scheduler's partition leases kept beside the bus (:meth:`EventBus.leases`): the steps of
    ``event_scheduler.protocols.PartitionLeaseStore``, each atomic on the bus's server and timed by its clock."""

    partitions: int

    @abstractmethod
    def round(self, holder: str, ttl: float) -> set[int]:
        """Heartbeat ``holder``, forget members silent for ``ttl`` seconds, renew ``holder``'s leases for
        ``ttl``, give back what exceeds the fair share ``ceil(partitions / live members)`` and take free
        or expired partitions up to it, as one atomic step. The partitions ``holder`` now holds."""

    @abstractmethod
    def release(self, holder: str) -> None:
        """Give every lease of ``holder`` back and forget the member."""

    @abstractmethod
    def snapshot(self) -> LeaseSnapshot:
        """Members and leases as recorded, with the server's clock as ``now`` (read only)."""


class EventBus(ABC):
    partitions: int
    #: Whether the bus lives in pollbridge's database (embedded): its ``publish_in`` writes through the caller's
    #: transaction, so a publish apart from one (the relay's publish of a notified event) gains nothing.
    in_database = False

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
        acknowledgements are made before the call returns, whatever it returns or raises: before the read
        waits, or (the embedded bus on SQLite, where each is a write transaction) with the take that ends the
        wait, never later than the ``block`` it waits."""
        self.ack(group, acks)
        return self.read(group, consumer, partitions, count, block)

    def handles_in_take(self, engine: Engine) -> bool:
        """Whether :meth:`read_handled` runs its handler inside the take, on a connection to ``engine``'s
        database (see the contract). By default it does not."""
        return False

    def read_handled(self, group: str, consumer: str, partitions: Sequence[int], count: int, block: float,
                     handle: Handler, acks: Sequence[Delivery] = ()) -> tuple[list[Delivery], bool]:
        """:meth:`ack_and_read` with ``handle`` run inside the take where the bus can (see the contract). By
        default: the entries, pending, and ``False`` (the caller handles and acknowledges them)."""
        return self.ack_and_read(group, acks, consumer, partitions, count, block), False

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

    def epochs(self) -> dict[int, str]:
        """Per partition, its epoch token (see the contract). By default one token for all: a bus that loses
        its data loses it whole."""
        token = self.epoch()
        return {p: token for p in range(self.partitions)}

    @abstractmethod
    def close(self) -> None: ...

    def end_positions(self, partitions: Sequence[int]) -> dict[int, str]:
        """Per partition, the id of its newest entry (``"0"`` when empty): where a tail of new entries starts."""
        raise NotImplementedError(f"{type(self).__name__} cannot be tailed")

    def tail(self, after: Mapping[int, str], count: int, block: float) -> list[Delivery]:
        """Entries after each partition's position, read-only (see the contract); ``[]`` after ``block`` seconds."""
        raise NotImplementedError(f"{type(self).__name__} cannot be tailed")

    def _checked(self, partitions: Sequence[int]) -> list[int]:
        """``partitions`` without repeats, in order; ``ValueError`` for one out of ``0..partitions-1`` (every
        backend's reads, claims and tails check their partitions the same way)."""
        out: list[int] = []
        for p in partitions:
            if not 0 <= p < self.partitions:
                raise ValueError(f"partition {p} out of range 0..{self.partitions - 1}")
            if p not in out:
                out.append(p)
        return out

    def partition_of(self, event: CloudEvent) -> int:
        return partition_for(event.partitionkey, self.partitions)

    # ------------------------------------------------------------------ looking at the bus (read-only)

    def delivery_states(self, group: str, events: Sequence[EventRef]) -> dict[str, EventDelivery]:
        """Per event id, where each event is for ``group`` (see the contract); read-only."""
        raise NotImplementedError(f"{type(self).__name__} cannot tell")

    def delivery_state(self, group: str, event: EventRef) -> EventDelivery:
        """:meth:`delivery_states` for one event."""
        return self.delivery_states(group, [event])[event.event_id]

    def dead_letter_count(self) -> int:
        """How many dead letters the bus holds (every group). By default by listing them; backends count."""
        return len(self.dead_letters(100_000))

    def purge_all(self) -> int:
        """Delete everything this bus holds (see the contract); how many keys or rows were removed."""
        raise NotImplementedError(f"{type(self).__name__} cannot be purged")

    def placement(self) -> dict[int, str] | None:
        """Where each partition lives, when the bus spreads them over servers (see the contract); ``None``."""
        return None

    def leases(self) -> BusLeases | None:
        """The scheduler's partition leases kept beside this bus, or ``None``: keep them in the database."""
        return None
