"""What the one bus contract suite needs to know of each backend, beyond the :class:`EventBus` interface.

The contract tests themselves never ask which backend they run on; a test that needs to reach past the
interface (write a malformed entry straight into storage, open a second handle as another process would,
check that nothing of the installation is left after a purge) asks the :class:`Backend` hooks. Each backend
keeps its specifics in its own function here (RabbitMQ's in :mod:`tests.support.rabbitmq`).
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from bridge.bus.base import EventBus
from bridge.bus.embedded import EmbeddedBus
from bridge.bus.redis_streams import RedisStreamsBus
from bridge.core.events import CloudEvent
from bridge.db.engine import create_engine, db_now
from bridge.db.schema import bus_log
from tests.support import clear_redis_namespace

Payload = str | bytes | None


@dataclass
class Backend:
    """One backend under test. ``open()`` opens another handle on the same storage with its own connections
    (as another process would); every handle it made is closed by :meth:`close`."""

    name: str
    open: Callable[[], EventBus]
    #: Writes one entry straight into the backend's storage, bypassing publish (its validation and wake-up):
    #: (bus, partition, payload or None for "no payload field", event id).
    raw_append: Callable[[EventBus, int, Payload, str], None]
    #: Malformed payloads beyond text that this backend can hold (None: an entry without a payload field;
    #: bytes that are not UTF-8).
    raw_extra: tuple[Payload, ...] = ()
    #: Another installation on the same server (another namespace), or None when installations cannot share one.
    neighbour: Callable[[], EventBus] | None = None
    #: The names of everything of ``bus``'s installation still on the server (after a purge: nothing).
    leftovers: Callable[[EventBus], list[str]] | None = None
    _closers: list[Callable[[], object]] = field(default_factory=list)

    def track(self, closer: Callable[[], object]) -> None:
        self._closers.append(closer)

    def close(self) -> None:
        for closer in reversed(self._closers):
            with contextlib.suppress(Exception):
                closer()


def embedded_backend(name: str, url: str, partitions: int) -> Backend:
    closers: list[Callable[[], object]] = []

    def make() -> EventBus:
        engine = create_engine(url)
        bus = EmbeddedBus(engine, partitions=partitions)
        closers.extend((engine.dispose, bus.close))
        return bus

    return Backend(name=name, open=make, raw_append=_embedded_raw_append, _closers=closers)


def _embedded_raw_append(bus: EventBus, partition: int, payload: Payload, event_id: str) -> None:
    assert isinstance(bus, EmbeddedBus)
    text = payload.decode("utf-8", "replace") if isinstance(payload, bytes) else payload or ""
    # On SQLite through a plain SQLAlchemy engine, not pollbridge's: its commit is another process's to the
    # bus's readers (only their file watcher sees it), as a write of another process would be.
    engine = sa.create_engine(bus.engine.url) if bus.engine.dialect.name == "sqlite" else bus.engine
    try:
        with engine.begin() as conn:
            conn.execute(bus_log.insert().values(partition=partition, event_id=event_id[:36], payload=text,
                                                 created_at=db_now(bus.engine.dialect.name)))
    finally:
        if engine is not bus.engine:
            engine.dispose()


def redis_backend(name: str, url: str, namespace: str, partitions: int) -> Backend:
    """A Redis server or a Redis Cluster (the bus detects which from the URL's node); the namespace's keys are
    deleted afterwards."""
    closers: list[Callable[[], object]] = [lambda: clear_redis_namespace(url, namespace)]

    def make(ns: str = namespace) -> EventBus:
        bus = RedisStreamsBus(url, partitions=partitions, namespace=ns)
        closers.append(bus.close)
        return bus

    def neighbour() -> EventBus:
        bus = make(f"pbtest-{uuid.uuid4().hex[:10]}")
        closers.append(bus.purge_all)
        return bus

    def leftovers(bus: EventBus) -> list[str]:
        assert isinstance(bus, RedisStreamsBus)
        return sorted(str(k) for k in bus.client.scan_iter(match=bus.keys.pattern))

    return Backend(name=name, open=make, raw_append=redis_raw_append, raw_extra=(None, b"\xff\xfe not utf-8"),
                   neighbour=neighbour, leftovers=leftovers, _closers=closers)


def redis_raw_append(bus: EventBus, partition: int, payload: Payload, event_id: str) -> None:
    assert isinstance(bus, RedisStreamsBus)
    fields: dict[str, str | bytes] = {"id": event_id}
    if payload is not None:
        fields["payload"] = payload
    bus.client.xadd(bus.keys.stream(partition), fields)
    if bus.cluster:  # a cluster's readers wait on the doorbell, which every pollbridge publish rings
        bus.client.xadd(bus.keys.wake, {"p": str(partition)})


# ------------------------------------------------------------------ hooks for the suites that run on every stack

def lose_bus_data(bus_url: str, bus: EventBus, partition: int | None = None) -> None:
    """What a bus server that lost data leaves behind, on any backend with a server: everything of the bus's
    namespace (``partition`` None: Redis restarted without persistence, a RabbitMQ node rebuilt without its disk),
    or one partition's data (a Redis Cluster shard: its stream and epoch key; RabbitMQ: its stream)."""
    if isinstance(bus, RedisStreamsBus):
        if partition is None:
            clear_redis_namespace(bus_url, bus.keys.namespace)
        else:
            bus.client.delete(bus.keys.stream(partition))
            bus.client.delete(bus.keys.epoch(partition))
        return
    from tests.support import rabbitmq

    if partition is None:
        assert isinstance(bus, rabbitmq.RabbitMQBus)
        rabbitmq.delete_namespace(bus_url, bus.names.namespace, bus.partitions)
    else:
        rabbitmq.lose_partition(bus_url, bus, partition)


def raw_write(bus_url: str, bus: EventBus, partition: int, payload: Payload, event_id: str) -> None:
    """One entry straight into a server bus's storage, as another program would write it (see ``raw_append``)."""
    if isinstance(bus, RedisStreamsBus):
        redis_raw_append(bus, partition, payload, event_id)
    else:
        from tests.support.rabbitmq import raw_append

        raw_append(bus_url, bus, partition, payload, event_id)


def drops_single_entries(bus: EventBus) -> bool:
    """Whether one acknowledged entry can vanish from the bus's storage alone (Redis: ``XDEL``, or a failover to a
    replica that had not received it). A RabbitMQ stream is append-only: it loses a whole stream or nothing."""
    return isinstance(bus, RedisStreamsBus)


class UnderMemoryPressure:
    """A bus that reports ``pressure`` of its memory limit (0.97: above the relay's pause threshold) until told
    otherwise; everything else goes to the bus it wraps."""

    def __init__(self, bus: EventBus, pressure: float = 0.97) -> None:
        self.bus, self.pressure = bus, pressure

    def __getattr__(self, name: str) -> object:
        return getattr(self.bus, name)

    def memory_pressure(self) -> float | None:
        return self.pressure


class Recording:
    """A bus that records the events of every publish, in publish order (one list per call); everything else goes to
    the bus it wraps."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.published: list[list[CloudEvent]] = []

    def __getattr__(self, name: str) -> object:
        return getattr(self.bus, name)

    def publish(self, events: Sequence[CloudEvent]) -> None:
        self.published.append(list(events))
        self.bus.publish(events)

    def publish_in(self, conn: Connection, events: Sequence[CloudEvent]) -> None:
        self.published.append(list(events))
        self.bus.publish_in(conn, events)
