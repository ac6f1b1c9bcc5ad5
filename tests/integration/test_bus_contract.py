"""The one event-bus contract suite (see bridge/bus/base.py), run against every backend.

The ``bus`` fixture is parametrized over the embedded bus on SQLite and on PostgreSQL and the
Redis Streams bus; every test in the first part runs on all three, so "same semantics" is a
tested fact, not a claim. Each test fails if the backend breaks the clause it names. Waits are
deadline-bounded; the only sleeps are the idle times a test is about (``claim_stale``'s
``min_idle``) and the delay that makes a publish land inside a blocking read.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

import pytest
import sqlalchemy as sa
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bridge.bus.base import (
    DELIVERY_STATES,
    Delivery,
    EventBus,
    EventDelivery,
    EventRef,
    entry_order,
    partition_for,
)
from bridge.bus.embedded import EmbeddedBus
from bridge.bus.keys import BusKeys
from bridge.bus.redis_streams import RedisStreamsBus
from bridge.core.errors import ConfigError
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent
from bridge.db.engine import create_engine
from tests.support import when_waiting
from tests.support.buses import Backend, embedded_backend, redis_backend
from tests.support.rabbitmq import rabbitmq_backend

P = 4
ALL = list(range(P))


BACKENDS = [
    "embedded-sqlite",
    pytest.param("embedded-postgresql", marks=pytest.mark.postgres),
    pytest.param("redis", marks=pytest.mark.redis),
    pytest.param("redis-cluster", marks=pytest.mark.redis),
    pytest.param("rabbitmq", marks=pytest.mark.rabbitmq),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The backend under test and its hooks (tests/support/buses.py); every handle it opened is closed after."""
    name = request.param
    made: Backend
    if name in ("redis", "redis-cluster"):
        url = str(request.getfixturevalue("redis_server" if name == "redis" else "redis_cluster"))
        made = redis_backend(name, url, f"pbtest-{uuid.uuid4().hex[:10]}", P)
    elif name == "rabbitmq":
        made = rabbitmq_backend(request, P)
    else:
        made = embedded_backend(name, str(request.getfixturevalue("sqlite_url" if name == "embedded-sqlite"
                                                                   else "pg_url")), P)
    yield made
    made.close()


@pytest.fixture
def bus(backend: Backend) -> EventBus:
    return backend.open()


@pytest.fixture
def twin(backend: Backend) -> Callable[[], EventBus]:
    """Opens more bus objects on the same storage, each with its own connections (like other processes)."""
    return backend.open


# ---------------------------------------------------------------------------------------------- helpers

def _event(key: str, n: int, **data: Any) -> CloudEvent:
    return CloudEvent(id=str(uuid.uuid4()), type=TASK_STATUS_CHANGED, subject=f"task-{n}", partitionkey=key,
                      time=datetime.now(UTC), data={"n": n, **data}, traceid=uuid.uuid4().hex, depth=n % 3)


def _keys_on_distinct_partitions(count: int) -> list[str]:
    keys: dict[int, str] = {}
    i = 0
    while len(keys) < count:
        keys.setdefault(partition_for(f"inst-{i}", P), f"inst-{i}")
        i += 1
    return list(keys.values())


def _raw_append(backend: Backend, bus: EventBus, partition: int, payload: str | bytes | None,
                event_id: str = "raw") -> None:
    """Write an entry straight into the backend's storage, bypassing publish (and its validation and wake-up)."""
    backend.raw_append(bus, partition, payload, event_id)


def _read_n(bus: EventBus, group: str, consumer: str, n: int, partitions: list[int] = ALL,
            timeout: float = 10.0) -> list[Delivery]:
    """Read until ``n`` entries arrived (failing after ``timeout``), then check that no more come."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} entries delivered"
        got.extend(bus.read(group, consumer, partitions, n - len(got), 0.2))
    assert len(got) == n
    return got


def _ref(d: Delivery) -> tuple[int, str]:
    """An entry's identity: entry ids are unique per partition only (a Redis stream id per stream)."""
    return d.partition, d.entry_id


def _total(lag: dict[int, int]) -> int:
    return sum(lag.values())


# ---------------------------------------------------------------------------------------------- the contract

def test_round_trip_preserves_events_and_per_partition_order(bus: EventBus) -> None:
    bus.ensure_group("g")
    key = "instance-ordered"
    mine = [_event(key, i, note="ünïcødé ✓", nested={"list": [1, 2.5, None], "flag": True}) for i in range(25)]
    others = [_event(f"instance-{i}", i) for i in range(15)]
    # Two batches, interleaved keys: order must hold per partition key across batches.
    bus.publish(mine[:10] + others[:8])
    bus.publish(others[8:] + mine[10:])
    got = _read_n(bus, "g", "c", 40)

    assert len({_ref(d) for d in got}) == 40  # entry ids are unique per partition (Redis stream ids)
    for d in got:
        assert d.event is not None and d.error is None and d.deliveries == 1
        assert d.partition == partition_for(d.event.partitionkey, P) == bus.partition_of(d.event)
        assert d.payload == d.event.to_json()
    by_id = {e.id: e for e in mine + others}
    assert {d.event.id for d in got if d.event} == set(by_id)
    assert all(d.event.to_json() == by_id[d.event.id].to_json() for d in got if d.event)
    assert [d.event.id for d in got if d.event and d.event.partitionkey == key] == [e.id for e in mine]


def test_each_entry_is_delivered_once_per_group_and_to_every_group(bus: EventBus) -> None:
    bus.ensure_group("a")
    bus.ensure_group("a")  # idempotent
    bus.ensure_group("b")
    events = [_event(f"inst-{i % 7}", i) for i in range(20)]
    bus.publish(events)

    a = _read_n(bus, "a", "a1", 20)
    assert bus.read("a", "a1", ALL, 100, 0) == []
    assert bus.read("a", "a2", ALL, 100, 0) == []  # another consumer of the group gets nothing either
    b = _read_n(bus, "b", "b1", 20)
    assert {d.event.id for d in a if d.event} == {d.event.id for d in b if d.event} == {e.id for e in events}

    # ``count`` is an upper bound over all partitions together, and nothing is lost by honouring it.
    first = bus.read("c", "c1", ALL, 3, 0)  # a group that was never ensured starts at the beginning
    assert len(first) == 3
    rest = _read_n(bus, "c", "c1", 17)
    assert len({_ref(d) for d in first + rest}) == 20

    # Reading a subset of the partitions returns only those.
    only = partition_for("inst-0", P)
    subset = bus.read("d", "d1", [only], 100, 0)
    assert subset and {d.partition for d in subset} == {only}
    assert len(subset) == sum(1 for e in events if partition_for(e.partitionkey, P) == only)


def test_consumers_of_one_group_never_receive_the_same_entry(bus: EventBus,
                                                             twin: Callable[[], EventBus]) -> None:
    n, consumers = 240, 3
    bus.ensure_group("g")
    events = [_event(f"inst-{i % 13}", i) for i in range(n)]
    bus.publish(events)
    buses = [twin() for _ in range(consumers)]
    barrier = threading.Barrier(consumers)
    lock = threading.Lock()
    received: list[str] = []
    errors: list[BaseException] = []

    def consume(name: str, b: EventBus) -> None:
        try:
            barrier.wait(10)
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:
                with lock:
                    if len(received) >= n:
                        return
                batch = b.read("g", name, ALL, 7, 0.05)
                with lock:
                    received.extend(d.event.id for d in batch if d.event)
                b.ack("g", batch)
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=consume, args=(f"c{i}", b)) for i, b in enumerate(buses)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors
    duplicates = [k for k, c in Counter(received).items() if c > 1]
    assert duplicates == []
    assert set(received) == {e.id for e in events}
    assert bus.pending_count("g") == 0


def test_reading_while_others_publish_loses_nothing(bus: EventBus, twin: Callable[[], EventBus]) -> None:
    """Entries must become readable in id order per partition: a reader that moved past an id that a
    slower publisher had not committed yet would never see that entry."""
    publishers, per_publisher = 6, 40
    bus.ensure_group("g")
    buses = [twin() for _ in range(publishers)]
    published: list[str] = []
    received: list[str] = []
    lock = threading.Lock()
    done = threading.Event()
    errors: list[BaseException] = []

    def publish(b: EventBus, n: int) -> None:
        try:
            for i in range(per_publisher):
                event = _event("inst-hot", n * 1000 + i)  # one partition, where the race would be
                b.publish([event])
                with lock:
                    published.append(event.id)
        except BaseException as exc:
            errors.append(exc)

    def consume() -> None:
        try:
            while not done.is_set():
                batch = bus.read("g", "c", ALL, 50, 0.02)
                received.extend(d.event.id for d in batch if d.event)
                bus.ack("g", batch)
        except BaseException as exc:
            errors.append(exc)

    reader = threading.Thread(target=consume)
    reader.start()
    writers = [threading.Thread(target=publish, args=(b, n)) for n, b in enumerate(buses)]
    for t in writers:
        t.start()
    for t in writers:
        t.join(30)
    deadline = time.monotonic() + 10
    while len(received) < len(published) and time.monotonic() < deadline and not errors:
        time.sleep(0.02)
    done.set()
    reader.join(10)
    assert not errors, errors
    assert len(published) == publishers * per_publisher
    assert sorted(received) == sorted(published)
    assert _total(bus.lag("g")) == 0


def test_unacknowledged_entries_are_redelivered_by_claim_stale_after_min_idle(bus: EventBus) -> None:
    key_a, key_b = _keys_on_distinct_partitions(2)
    pa = partition_for(key_a, P)
    bus.ensure_group("g")
    bus.publish([_event(key_a, i) for i in range(3)] + [_event(key_b, 9)])
    first = _read_n(bus, "g", "crashed", 4)
    on_a = sorted((d for d in first if d.partition == pa), key=lambda d: d.event.id if d.event else "")

    assert bus.claim_stale("g", "rescuer", ALL, 30.0, 10) == []  # not idle long enough yet
    time.sleep(0.4)  # the idle time under test
    claimed = bus.claim_stale("g", "rescuer", [pa], 0.3, 10)
    assert {_ref(d) for d in claimed} == {_ref(d) for d in on_a}  # only the partition asked for
    assert all(d.deliveries == 2 and d.error is None for d in claimed)
    assert sorted(d.payload for d in claimed) == sorted(d.payload for d in on_a)
    assert bus.claim_stale("g", "other", [pa], 0.3, 10) == []  # claiming reset the idle time
    assert bus.read("g", "crashed", ALL, 10, 0) == []  # read never redelivers
    assert bus.pending_count("g") == 4

    time.sleep(0.4)
    again = bus.claim_stale("g", "third", ALL, 0.3, 2)
    assert len(again) == 2  # count is honoured
    twice = {_ref(d) for d in claimed}
    assert all(d.deliveries == (3 if _ref(d) in twice else 2) for d in again)
    assert bus.pending_count("g") == 4


def test_ack_removes_from_pending_and_acking_twice_is_harmless(bus: EventBus) -> None:
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(5)])
    got = _read_n(bus, "g", "c", 5)
    assert bus.pending_count("g") == 5
    bus.ack("g", got[:2])
    assert bus.pending_count("g") == 3
    bus.ack("g", got[:2])
    bus.ack("g", [])
    assert bus.pending_count("g") == 3
    bus.ack("g", got)
    assert bus.pending_count("g") == 0
    assert bus.claim_stale("g", "other", ALL, 0.0, 10) == []  # acknowledged entries are never redelivered
    assert bus.pending_count("other-group") == 0


def test_ack_and_read_acknowledges_before_reading_the_next_batch(bus: EventBus) -> None:
    """The acknowledgements are made whatever the read returns (nothing new, or the next batch), and the
    read returns only what was never delivered."""
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(4)])
    first = _read_n(bus, "g", "c", 4)
    assert bus.ack_and_read("g", first[:3], "c", ALL, 10, 0.0) == []  # nothing new ...
    assert bus.pending_count("g") == 1  # ... and three acknowledged
    bus.publish([_event("inst-9", 9)])
    nxt = bus.ack_and_read("g", first[3:], "c", ALL, 10, 0.0)
    assert [d.event.data["n"] for d in nxt if d.event is not None] == [9]
    assert bus.pending_count("g") == 1  # the new one, delivered and not yet acknowledged
    assert bus.ack_and_read("g", nxt, "c", ALL, 10, 0.0) == []
    assert bus.pending_count("g") == 0


def test_read_handled_commits_what_its_handler_handled_or_leaves_every_entry_pending(
        bus: EventBus, backend: Backend) -> None:
    """Inside the take (the embedded bus on SQLite), the entries the handler returned are acknowledged with the
    take and the rest pending; elsewhere, or when the handler raises, every entry is pending for the caller.
    Nothing is lost or delivered twice by ``read`` either way."""
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(4)])
    batches: list[list[Delivery]] = []

    def evens(_conn: Any, got: list[Delivery]) -> list[Delivery]:
        batches.append(list(got))
        return [d for d in got if d.event is not None and d.event.data["n"] % 2 == 0]

    got: list[Delivery] = []
    deadline = time.monotonic() + 10
    inside = False
    while len(got) < 4:
        assert time.monotonic() < deadline, f"only {len(got)} of 4 entries delivered"
        more, inside = bus.read_handled("g", "c", ALL, 10, 0.2, evens)
        got.extend(more)
    assert sorted(d.event.data["n"] for d in got if d.event is not None) == [0, 1, 2, 3]
    engine = getattr(bus, "engine", None)
    expected = backend.name == "embedded-sqlite"
    assert (engine is not None and bus.handles_in_take(engine)) is expected
    assert inside is expected
    assert bus.read("g", "c", ALL, 10, 0.0) == []  # never delivered twice by a read
    stale = {d.event.data["n"] for d in bus.claim_stale("g", "c2", ALL, 0.0, 10) if d.event is not None}
    if expected:
        assert sorted(d.event.data["n"] for b in batches for d in b if d.event is not None) == [0, 1, 2, 3]
        assert stale == {1, 3} and bus.pending_count("g") == 2  # the two it did not return
    else:
        assert batches == []  # the caller handles them
        assert stale == {0, 1, 2, 3} and bus.pending_count("g") == 4

    bus.publish([_event("inst-9", 9)])

    def broken(_conn: Any, _got: list[Delivery]) -> list[Delivery]:
        raise RuntimeError("the handler failed")

    late: list[Delivery] = []
    deadline = time.monotonic() + 10
    while not late:
        assert time.monotonic() < deadline, "the late entry was not delivered"
        late, inside = bus.read_handled("g", "c", ALL, 10, 0.2, broken, acks=got)
    assert [d.event.data["n"] for d in late if d.event is not None] == [9] and inside is False
    assert bus.pending_count("g") == 1  # acknowledged what was given; the late one pending for the caller
    assert [d.event.data["n"] for d in bus.claim_stale("g", "c3", ALL, 0.0, 10) if d.event is not None] == [9]


@pytest.mark.parametrize("via", ["read", "ack_and_read"])
@pytest.mark.parametrize("how", ["publish", "raw"])
def test_blocking_read_returns_promptly_when_an_event_arrives(bus: EventBus, twin: Callable[[], EventBus],
                                                              backend: Backend, how: str, via: str) -> None:
    """``publish`` from another bus object; ``raw`` writes the storage directly, as another process would.
    ``ack_and_read`` blocks the same way, its acknowledgements made before it returns."""
    bus.ensure_group("g")
    earlier: list[Delivery] = []
    if via == "ack_and_read":
        bus.publish([_event("inst-earlier", 0)])
        earlier = _read_n(bus, "g", "c", 1)
    publisher = twin()
    event = _event("inst-wake", 1)
    published_at: list[float] = []

    def publish() -> None:
        if how == "publish":
            publisher.publish([event])
        else:
            _raw_append(backend, publisher, publisher.partition_of(event), event.to_json(), event.id)
        published_at.append(time.monotonic())

    timer = threading.Timer(0.3, publish)  # lands inside the block below
    start = time.monotonic()
    timer.start()
    got = bus.read("g", "c", ALL, 10, 10.0) if via == "read" else bus.ack_and_read("g", earlier, "c", ALL, 10, 10.0)
    returned = time.monotonic()
    timer.join(10)
    assert [d.payload for d in got] == [event.to_json()]
    assert returned - start < 5.0
    assert returned - published_at[0] < 1.0
    assert bus.pending_count("g") == 1  # the new entry; the earlier one was acknowledged


def test_a_read_registers_a_group_nobody_ensured_even_when_nothing_is_there(bus: EventBus) -> None:
    """A consumer that reads an empty log without ``ensure_group`` is a group from then on: a trim keeps
    what it has not read, even after every other group read and acknowledged it."""
    bus.ensure_group("g")
    assert bus.read("late", "c", ALL, 10, 0.0) == []
    bus.publish([_event("inst-late", n) for n in range(3)])
    bus.ack("g", _read_n(bus, "g", "c", 3))
    bus.trim(0.0)
    assert len(_read_n(bus, "late", "c", 3)) == 3


def test_blocking_read_returns_nothing_after_the_block_when_nothing_comes(bus: EventBus) -> None:
    bus.ensure_group("g")
    start = time.monotonic()
    assert bus.read("g", "c", ALL, 10, 0.5) == []
    elapsed = time.monotonic() - start
    assert 0.45 <= elapsed < 3.0
    start = time.monotonic()
    assert bus.read("g", "c", ALL, 10, 0) == []  # block 0: no wait at all
    assert time.monotonic() - start < 1.0


def test_malformed_entries_are_delivered_with_an_error(bus: EventBus, backend: Backend) -> None:
    bus.ensure_group("g")
    bad: list[str | bytes | None] = ["not json {", '{"specversion": "1.0", "id": "x"}', "[1, 2]", ""]
    bad += backend.raw_extra  # e.g. no payload field; bytes that are not UTF-8
    for i, payload in enumerate(bad):
        _raw_append(backend, bus, i % P, payload, f"bad-{i}")
    good = _event("inst-good", 0)
    bus.publish([good])

    got = _read_n(bus, "g", "c", len(bad) + 1)
    broken = [d for d in got if d.event is None]
    assert len(broken) == len(bad)
    assert all(d.error for d in broken)
    texts = {p for p in bad if isinstance(p, str)}
    assert texts <= {d.payload for d in broken}
    fine = [d for d in got if d.event is not None]
    assert [d.event.to_json() for d in fine if d.event] == [good.to_json()] and fine[0].error is None

    for d in broken:
        bus.dead_letter("g", d, d.error or "")
    assert bus.pending_count("g") == 1
    assert sorted((dl.partition, dl.entry_id) for dl in bus.dead_letters()) == sorted(_ref(d) for d in broken)


def test_dead_letter_round_trip(bus: EventBus) -> None:
    bus.ensure_group("g")
    event = _event("inst-dead", 7)
    bus.publish([event])
    [d] = _read_n(bus, "g", "c", 1)
    assert bus.dead_letters() == []

    bus.dead_letter("g", d, "handler exploded: ValueError")
    assert bus.pending_count("g") == 0  # dead-lettering acknowledges
    [dl] = bus.dead_letters()
    assert (dl.group, dl.entry_id, dl.partition, dl.payload, dl.reason) == (
        "g", d.entry_id, d.partition, event.to_json(), "handler exploded: ValueError")
    assert CloudEvent.from_json(dl.payload) == event

    bus.publish([_event("inst-dead", 8)])
    [d2] = _read_n(bus, "g", "c", 1)
    bus.dead_letter("g", d2, "second")
    assert [x.reason for x in bus.dead_letters(limit=1)] == ["handler exploded: ValueError"]
    assert bus.remove_dead_letters([dl.id]) == 1
    assert [x.reason for x in bus.dead_letters()] == ["second"]
    assert bus.remove_dead_letters([dl.id]) == 0
    assert bus.remove_dead_letters([]) == 0


def test_trim_removes_only_old_entries_every_group_acknowledged(bus: EventBus) -> None:
    key = "inst-trim"
    p = partition_for(key, P)
    bus.ensure_group("g")
    bus.ensure_group("slow")
    events = [_event(key, i) for i in range(6)]
    bus.publish(events)
    got = bus.read("g", "c", [p], 4, 0)
    assert len(got) == 4
    bus.ack("g", got[:2])  # g: 2 acknowledged, 2 pending, 2 undelivered

    assert bus.trim(3600.0) == 0  # nothing is old enough
    assert bus.trim(0.0) == 0  # "slow" has read nothing: everything is undelivered to it
    slow = _read_n(bus, "slow", "s", 6, [p])
    bus.ack("slow", slow)
    assert bus.trim(0.0) == 2  # exactly g's two acknowledged entries
    assert bus.trim(0.0) == 0

    # The pending and undelivered entries survived, intact.
    claimed = bus.claim_stale("g", "c2", [p], 0.0, 10)
    assert sorted(d.payload for d in claimed) == sorted(d.payload for d in got[2:])
    rest = bus.read("g", "c", [p], 10, 0)
    assert [d.payload for d in rest] == [e.to_json() for e in events[4:]]
    # A group created now starts at the beginning of what is retained.
    late = _read_n(bus, "late", "l", 4, [p])
    assert [d.payload for d in late] == [e.to_json() for e in events[2:]]


def test_lag_counts_undelivered_entries(bus: EventBus) -> None:
    key_a, key_b = _keys_on_distinct_partitions(2)
    pa, pb = partition_for(key_a, P), partition_for(key_b, P)
    bus.ensure_group("g")
    assert bus.lag("g") == dict.fromkeys(ALL, 0)
    bus.publish([_event(key_a, i) for i in range(5)] + [_event(key_b, i) for i in range(2)])
    lag = bus.lag("g")
    assert (lag[pa], lag[pb], _total(lag)) == (5, 2, 7)

    got = bus.read("g", "c", [pa], 3, 0)
    assert len(got) == 3
    lag = bus.lag("g")
    assert (lag[pa], lag[pb], _total(lag)) == (2, 2, 4)
    bus.ack("g", got)  # acknowledging does not change what is undelivered
    assert bus.lag("g") == lag
    _read_n(bus, "g", "c", 4)
    assert bus.lag("g") == dict.fromkeys(ALL, 0)
    assert _total(bus.lag("never-created")) == 7  # a new group would get all of them


def test_epoch_is_stable_while_the_data_is(bus: EventBus, twin: Callable[[], EventBus]) -> None:
    first = bus.epoch()
    assert first and bus.epoch() == first
    bus.publish([_event("inst-epoch", 1)])
    assert twin().epoch() == first


# ---------------------------------------------------------------------------------------------- looking up events

def _state(bus: EventBus, group: str, event: CloudEvent, published_at: datetime | None = None) -> EventDelivery:
    return bus.delivery_state(group, EventRef.of(event, published_at))


def test_delivery_state_follows_an_event_from_publish_to_acknowledgement(bus: EventBus) -> None:
    bus.ensure_group("g")
    bus.ensure_group("h")
    before = datetime.now(UTC)
    event = _event("inst-look", 1)
    bus.publish([event])
    p = partition_for("inst-look", P)

    on_bus = _state(bus, "g", event, before)
    assert (on_bus.state, on_bus.partition, on_bus.deliveries, on_bus.consumer) == ("undelivered", p, None, None)
    assert on_bus.entry_id is not None
    assert _state(bus, "g", event) == on_bus  # no publish time: the whole retained log is searched
    assert _state(bus, "never-created", event).state == "undelivered"

    [d] = _read_n(bus, "g", "c", 1)
    assert d.entry_id == on_bus.entry_id
    pending = _state(bus, "g", event, before)
    assert (pending.state, pending.entry_id, pending.consumer, pending.deliveries) == ("pending", d.entry_id, "c", 1)
    time.sleep(0.05)
    [again] = bus.claim_stale("g", "c2", ALL, 0.01, 10)
    assert again.deliveries == 2
    assert (_state(bus, "g", event).consumer, _state(bus, "g", event).deliveries) == ("c2", 2)

    bus.ack("g", [again])
    done = _state(bus, "g", event, before)
    assert (done.state, done.entry_id, done.partition, done.reason) == ("acknowledged", d.entry_id, p, None)
    assert _state(bus, "h", event).state == "undelivered"  # per group

    # Looking is read-only: no group's offset, lag or pending entries moved.
    assert bus.lag("h") == {q: int(q == p) for q in ALL}
    assert bus.pending_count("g") == bus.pending_count("h") == 0
    assert bus.read("h", "c", ALL, 10, 0)[0].entry_id == d.entry_id


def test_delivery_state_of_a_dead_letter_and_of_an_event_the_bus_never_had(bus: EventBus) -> None:
    bus.ensure_group("g")
    poison, fine = _event("inst-x", 1), _event("inst-y", 2)
    bus.publish([poison, fine])
    got = {d.event.id: d for d in _read_n(bus, "g", "c", 2) if d.event is not None}
    bus.dead_letter("g", got[poison.id], "handler exploded: ValueError")
    bus.ack("g", [got[fine.id]])
    never = _event("inst-x", 3)

    answers = bus.delivery_states("g", [EventRef.of(e) for e in (poison, fine, never)])
    assert set(answers) == {poison.id, fine.id, never.id}
    dead = answers[poison.id]
    assert (dead.state, dead.entry_id, dead.partition, dead.reason) == (
        "dead_lettered", got[poison.id].entry_id, partition_for("inst-x", P), "handler exploded: ValueError")
    assert answers[fine.id].state == "acknowledged"
    missing = answers[never.id]
    assert (missing.state, missing.entry_id, missing.partition) == ("not_found", None, partition_for("inst-x", P))
    assert missing.detail  # says why the bus may not have it
    assert {a.state for a in answers.values()} <= set(DELIVERY_STATES)
    assert answers == {e.id: _state(bus, "g", e) for e in (poison, fine, never)}  # one at a time: the same
    assert bus.delivery_states("g", []) == {}


def test_delivery_state_of_an_event_published_twice_is_its_earliest_entry(bus: EventBus) -> None:
    bus.ensure_group("g")
    event = _event("inst-twice", 1)
    bus.publish([event])
    bus.publish([event])
    first, second = _read_n(bus, "g", "c", 2)
    assert entry_order(first.entry_id) < entry_order(second.entry_id)
    bus.ack("g", [first])
    state = _state(bus, "g", event)
    assert (state.state, state.entry_id) == ("acknowledged", first.entry_id)


def test_dead_letter_count_matches_the_dead_letters(bus: EventBus) -> None:
    assert bus.dead_letter_count() == 0
    bus.ensure_group("g")
    bus.ensure_group("h")
    bus.publish([_event(f"inst-{i}", i) for i in range(3)])
    for group in ("g", "h"):
        got = _read_n(bus, group, "c", 3)
        for d in got[:2]:
            bus.dead_letter(group, d, f"poison for {group}")
    assert bus.dead_letter_count() == 4 == len(bus.dead_letters())
    assert bus.remove_dead_letters([bus.dead_letters()[0].id]) == 1
    assert bus.dead_letter_count() == 3


def test_purge_all_empties_the_bus_and_leaves_it_usable(bus: EventBus, twin: Callable[[], EventBus],
                                                         backend: Backend) -> None:
    """purge_all removes entries, groups, pending entries and dead letters (and, on a server, everything of the
    installation and nothing of another's); a purged bus works as new, and purging it again removes nothing."""
    neighbour = None
    if backend.neighbour is not None:  # another installation on the same server stays
        neighbour = backend.neighbour()
        neighbour.publish([_event("inst-n", 0)])
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(6)])
    got = _read_n(bus, "g", "c", 6)
    bus.ack("g", got[:2])
    bus.dead_letter("g", got[2], "poison")  # 3 left pending, 1 dead letter
    removed = bus.purge_all()
    assert removed > 0
    assert bus.dead_letters() == [] and bus.dead_letter_count() == 0
    assert bus.pending_count("g") == 0 and _total(bus.lag("g")) == 0
    assert bus.purge_all() == 0
    other = twin()  # what another process sees: nothing either
    assert other.dead_letter_count() == 0 and other.tail({p: "0" for p in ALL}, 10, 0.0) == []
    if backend.leftovers is not None:
        assert backend.leftovers(bus) == []
    bus.ensure_group("g")  # as new: publish and read again
    bus.publish([_event("inst-x", 1)])
    (fresh,) = _read_n(bus, "g", "c", 1)
    assert fresh.event is not None and fresh.event.data["n"] == 1
    if neighbour is not None:
        assert len(neighbour.tail({p: "0" for p in ALL}, 10, 0.0)) == 1


def test_leases_kept_beside_the_bus_split_the_partitions_fairly(bus: EventBus) -> None:
    """A bus either keeps the scheduler's partition leases (Redis) or says it does not (embedded: None)."""
    leases = bus.leases()
    if leases is None:  # e.g. the embedded bus  # the scheduler keeps them in the database
        return
    assert leases is not None and leases.partitions == P
    half = set(range(P // 2))
    assert leases.round("a", 10.0) == set(ALL)  # alone: everything
    assert leases.round("b", 10.0) == set()  # a holds its share and more: b waits for a's next round
    assert leases.round("a", 10.0) == half  # a sees b and gives back the excess
    assert leases.round("b", 10.0) == set(ALL) - half
    snap = leases.snapshot()
    assert set(snap.members) == {"a", "b"} and snap.settled(2, P)
    assert abs((snap.now - datetime.now(UTC)).total_seconds()) < 5  # the server's clock
    assert snap.held_by({"a"}) == half and {h for h, _ in snap.leases.values()} == {"a", "b"}
    assert all(exp is not None and exp > snap.now for _, exp in snap.leases.values())
    leases.release("a")
    assert set(leases.snapshot().members) == {"b"}
    assert leases.round("b", 10.0) == set(ALL)  # no ttl to wait for
    other = bus.leases()  # a new handle on the same leases
    assert other is not None and other.snapshot().held_by({"b"}) == set(ALL)


def _tail_all(bus: EventBus, after: dict[int, str], n: int, count: int = 1000,
              timeout: float = 10.0) -> list[Delivery]:
    """Tail from ``after`` (advancing it) until ``n`` entries arrived, then check that no more come."""
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} entries tailed"
        batch = bus.tail(after, count, 0.2)
        for d in batch:
            assert entry_order(d.entry_id) > entry_order(after[d.partition]), "a tail went backwards"
            after[d.partition] = d.entry_id
        got.extend(batch)
    assert bus.tail(after, count, 0) == []
    return got


def test_tail_reads_everything_in_order_and_takes_nothing_from_any_group(bus: EventBus) -> None:
    """The SSE feed's read path: no group, so the scheduler's group still gets every entry."""
    keys = _keys_on_distinct_partitions(P)
    bus.ensure_group("sched")
    assert bus.end_positions(ALL) == dict.fromkeys(ALL, "0")
    events = [_event(keys[n % P], n) for n in range(20)]
    bus.publish(events)
    lag_before = bus.lag("sched")
    got = _tail_all(bus, dict.fromkeys(ALL, "0"), 20, count=3)  # small pages: positions resume exactly
    assert sorted(d.payload for d in got) == sorted(e.to_json() for e in events)
    for p in ALL:  # per partition: publish order, ids increasing
        mine = [d for d in got if d.partition == p]
        assert [d.event.id for d in mine if d.event] == [e.id for e in events if bus.partition_of(e) == p]
    assert bus.lag("sched") == lag_before and _total(lag_before) == 20
    assert bus.pending_count("sched") == 0
    assert len(_read_n(bus, "sched", "c", 20)) == 20  # the group still receives every entry


def test_tail_from_end_positions_sees_only_later_entries_and_wakes_promptly(
        bus: EventBus, twin: Callable[[], EventBus]) -> None:
    bus.publish([_event("inst-old", n) for n in range(3)])
    end = bus.end_positions(ALL)
    assert sum(1 for p in ALL if end[p] != "0") >= 1
    start = time.monotonic()
    assert bus.tail(end, 10, 0) == []  # block 0: no wait
    assert time.monotonic() - start < 1.0
    event = _event("inst-new", 1)
    timer = threading.Timer(0.3, lambda: twin().publish([event]))
    timer.start()
    start = time.monotonic()
    got = bus.tail(end, 10, 10.0)
    timer.join(10)
    assert [d.payload for d in got] == [event.to_json()]
    assert time.monotonic() - start < 5.0
    assert entry_order(got[0].entry_id) > entry_order(end[got[0].partition])
    moved = bus.end_positions([got[0].partition])
    assert moved == {got[0].partition: got[0].entry_id}
    start = time.monotonic()
    assert bus.tail({got[0].partition: got[0].entry_id}, 10, 0.3) == []
    assert time.monotonic() - start >= 0.25


def test_tail_rejects_bad_positions_and_partitions(bus: EventBus) -> None:
    with pytest.raises(ValueError):
        bus.tail({0: "not-an-id"}, 10, 0)
    with pytest.raises(ValueError):
        bus.tail({P: "0"}, 10, 0)
    with pytest.raises(ValueError):
        bus.tail({0: "0"}, 0, 0)
    assert entry_order("0") < entry_order("1") < entry_order("2-0") < entry_order("2-1") < entry_order("10")


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("publish"), st.integers(1, 4), st.integers(0, 5)),  # how many, which instance
        st.tuples(st.just("read"), st.integers(0, 1), st.integers(1, 6)),  # consumer, count
        st.tuples(st.just("ack"), st.integers(0, 1), st.integers(1, 6)),  # consumer, how many it holds
        st.tuples(st.just("claim"), st.integers(0, 1), st.integers(1, 6)),  # consumer, count (min_idle 0)
    ),
    max_size=25,
)


def _drain(bus: EventBus, group: str) -> list[Delivery]:
    """Take over and acknowledge everything pending or undelivered in ``group``."""
    out: list[Delivery] = []
    deadline = time.monotonic() + 20
    while True:
        assert time.monotonic() < deadline, "drain did not finish"
        claimed = bus.claim_stale(group, "drain", ALL, 0.0, 1000)
        fresh = bus.read(group, "drain", ALL, 1000, 0)
        bus.ack(group, claimed + fresh)
        out += claimed + fresh
        if not claimed and not fresh and bus.pending_count(group) == 0:
            return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS)
def test_random_operations_deliver_everything_and_never_to_two_consumers(bus: EventBus,
                                                                         ops: list[tuple[str, int, int]]) -> None:
    group = f"h-{uuid.uuid4().hex[:8]}"
    bus.ensure_group(group)
    _drain(bus, group)  # earlier examples' entries: a new group starts at the beginning of the log
    owner: dict[tuple[int, str], int] = {}  # pending entry -> the one consumer holding it
    held: dict[tuple[int, str], Delivery] = {}
    read_before: set[tuple[int, str]] = set()
    published: set[str] = set()
    delivered: set[str] = set()

    for op, a, b in ops:
        if op == "publish":
            events = [_event(f"hyp-{b}", i) for i in range(a)]
            bus.publish(events)
            published.update(e.id for e in events)
        elif op == "read":
            got = bus.read(group, f"c{a}", ALL, b, 0)
            assert len(got) <= b
            for d in got:
                assert _ref(d) not in read_before, "read delivered an entry twice to one group"
                assert _ref(d) not in owner, "an entry pending for one consumer was read by another"
                assert d.deliveries == 1
                read_before.add(_ref(d))
                owner[_ref(d)], held[_ref(d)] = a, d
                delivered.add(d.event.id if d.event else d.payload)
        elif op == "ack":
            mine = [held[e] for e, c in owner.items() if c == a][:b]
            bus.ack(group, mine)
            for d in mine:
                del owner[_ref(d)], held[_ref(d)]
        else:
            expected = min(b, len(owner))
            got = bus.claim_stale(group, f"c{a}", ALL, 0.0, b)
            assert len(got) == expected
            for d in got:
                assert _ref(d) in owner, "claim_stale handed out an entry that was not pending"
                assert d.deliveries >= 2
                owner[_ref(d)], held[_ref(d)] = a, d
                delivered.add(d.event.id if d.event else d.payload)
        assert bus.pending_count(group) == len(owner)

    for d in _drain(bus, group):
        assert _ref(d) not in read_before or _ref(d) in owner, "an acknowledged entry came back"
        delivered.add(d.event.id if d.event else d.payload)
    assert published <= delivered


# ---------------------------------------------------------------------------------------------- embedded only

def test_embedded_publish_in_the_callers_transaction(db_url: str) -> None:
    """The outbox relay's case: it holds a write transaction on the same database (on SQLite a second
    writer would wait for it until the busy timeout), and the log append must commit or roll back with it."""
    engine = create_engine(db_url)
    try:
        bus = EmbeddedBus(engine, partitions=P)
        bus.ensure_group("g")
        lost, kept = _event("inst-tx", 1), _event("inst-tx", 2)
        with engine.connect() as conn:
            bus.publish_in(conn, [lost])
            conn.rollback()
        with engine.begin() as conn:
            bus.publish_in(conn, [kept])
        assert [d.payload for d in bus.read("g", "c", ALL, 10, 1.0)] == [kept.to_json()]
    finally:
        engine.dispose()


def test_embedded_on_sqlite_takes_the_write_lock_only_to_deliver_or_acknowledge(sqlite_url: str) -> None:
    """SQLite has one write lock for every process: an idle read takes it never, a draining consumer's
    acknowledgements and next batch take it once together."""
    engine = create_engine(sqlite_url)
    writes: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        if statement.startswith("BEGIN IMMEDIATE"):
            writes.append(statement)

    try:
        bus = EmbeddedBus(engine, partitions=P)
        bus.ensure_group("g")
        sa.event.listen(engine, "before_cursor_execute", seen)
        assert bus.read("g", "c", ALL, 10, 0.3) == []
        assert writes == []  # looked (read-only) several times during the block, never took the lock
        bus.publish([_event("inst-1", 1), _event("inst-2", 2)])
        writes.clear()
        first = bus.read("g", "c", ALL, 1, 0.0)
        assert len(first) == 1 and len(writes) == 1
        writes.clear()
        second = bus.ack_and_read("g", first, "c", ALL, 10, 0.0)
        assert [d.event.data["n"] for d in second if d.event is not None] == [2] and len(writes) == 1
        assert bus.pending_count("g") == 1
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
        engine.dispose()


def test_embedded_on_sqlite_a_reader_woken_by_a_publish_takes_without_looking_first(
        sqlite_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader of every partition, woken by a publish (a commit about the bus, surely), takes at once: the
    lock-free look before the take would only find what the wake-up already said (before: a look per event)."""
    engine = create_engine(sqlite_url)
    statements: list[str] = []

    def seen(_conn: object, _cursor: object, statement: str, *_rest: object) -> None:
        statements.append(statement)

    try:
        bus = EmbeddedBus(engine, partitions=P)
        bus.ensure_group("g")
        assert bus.read("g", "c", ALL, 10, 0.2) == []  # the watcher is running, its start-up wake-up taken
        waiting = when_waiting(monkeypatch, bus._wakeup)
        sa.event.listen(engine, "before_cursor_execute", seen)
        # Up to three publishes: the file watcher may sample the file between a commit of this process and the
        # note of it as its own, and a descheduled committer then makes that commit a stranger's (a wake-up
        # that only may be a publish: a look first, rightly). The code before looked at every one.
        attempts = []
        for n in range(1, 4):
            waiting.clear()
            got: list[Any] = []
            reader = threading.Thread(target=lambda out=got: out.extend(bus.read("g", "c", ALL, 10, 10.0)))
            reader.start()
            assert waiting.wait(5.0), "the reader did not wait"
            at = len(statements)
            bus.publish([_event(f"inst-{n}", n)])
            reader.join(15)
            assert [d.event.data["n"] for d in got if d.event is not None] == [n]
            after = statements[at:]
            takes = [i for i, s in enumerate(after) if s.startswith("BEGIN IMMEDIATE")]
            assert len(takes) >= 2, after  # the publish, then the take
            looks = [s for s in after[takes[0] + 1:takes[1]] if "pollbridge_bus_groups" in s and "count" in s]
            attempts.append(looks)
            if not looks:
                break
        assert [] in attempts, attempts
    finally:
        sa.event.remove(engine, "before_cursor_execute", seen)
        engine.dispose()


# ---------------------------------------------------------------------------------------------- Redis only

@pytest.mark.redis
def test_redis_data_loss_changes_the_epoch_and_read_recreates_the_group(redis_server: str,
                                                                        redis_namespace: str) -> None:
    bus = RedisStreamsBus(redis_server, partitions=P, namespace=redis_namespace)
    try:
        bus.ensure_group("g")
        bus.publish([_event(f"inst-{i}", i) for i in range(3)])
        before = _read_n(bus, "g", "c", 3)
        epoch = bus.epoch()
        # What FLUSHALL (or a restart without persistence) does to this namespace, without
        # flushing a shared server: every key of the namespace disappears.
        keys = list(bus.client.scan_iter(match=bus.keys.pattern, count=1000))
        assert keys
        bus.client.delete(*keys)

        assert bus.epoch() != epoch
        assert bus.epoch() == bus.epoch()
        assert bus.read("g", "c", ALL, 10, 0.2) == []  # recreated, not NOGROUP
        bus.ack("g", before)  # acknowledging what vanished is harmless
        assert bus.pending_count("g") == 0
        assert bus.claim_stale("g", "c", ALL, 0.0, 10) == []
        event = _event("inst-after", 1)
        bus.publish([event])
        assert [d.payload for d in bus.read("g", "c", ALL, 10, 2.0)] == [event.to_json()]

        bus.client.delete(*bus.client.scan_iter(match=bus.keys.pattern, count=1000))
        bus.publish([event])  # the stream comes back before the group does
        assert [d.payload for d in bus.read("g", "c", ALL, 10, 2.0)] == [event.to_json()]
    finally:
        bus.close()


@pytest.mark.redis
def test_redis_publish_survives_a_flushed_script_cache_and_adds_each_event_once(redis_server: str,
                                                                                 redis_namespace: str) -> None:
    """The batch script runs by EVALSHA; a Redis that lost its script cache (a restart) answers NOSCRIPT
    without running anything, and the publish loads the script and runs every batch once more."""
    bus = RedisStreamsBus(redis_server, partitions=P, namespace=redis_namespace)
    try:
        bus.ensure_group("g")
        events = [_event(key, i) for i, key in enumerate(_keys_on_distinct_partitions(P))]
        bus.publish(events[:1])
        bus.client.script_flush()
        bus.publish(events[1:])
        got = _read_n(bus, "g", "c", len(events))
        assert sorted(d.payload for d in got) == sorted(e.to_json() for e in events)
        assert bus.read("g", "c", ALL, 10, 0.2) == []  # nothing twice
    finally:
        bus.close()


@pytest.mark.redis
def test_redis_ack_and_read_is_one_round_trip_whether_the_entry_waits_or_comes_later(
        redis_server: str, redis_namespace: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The scheduler's read after each batch: the acknowledgements and one blocking ``XREADGROUP`` over every
    stream in one pipeline (at 500 completions/s it was a pipeline of an ``XREADGROUP`` per stream that came
    back empty, then the blocking read: two round trips, 10 commands)."""
    import redis
    import redis.connection

    bus = RedisStreamsBus(redis_server, partitions=P, namespace=redis_namespace)
    bus.ensure_group("g")
    bus.publish([_event("inst-1", 1)])
    first = _read_n(bus, "g", "c", 1)
    sent: list[int] = []  # round trips of this thread's (the reader's)
    reader = threading.get_ident()
    real = redis.connection.AbstractConnection.send_packed_command

    def counting(self: Any, command: Any, check_health: bool = True) -> None:
        if threading.get_ident() == reader:
            sent.append(1)
        real(self, command, check_health)

    monkeypatch.setattr(redis.connection.AbstractConnection, "send_packed_command", counting)
    bus.publish([_event("inst-2", 2)])
    sent.clear()
    got = bus.ack_and_read("g", first, "c", ALL, 5000, 5.0)  # the entry waits
    assert [d.event.data["n"] for d in got if d.event is not None] == [2]
    assert len(sent) == 1 and bus.pending_count("g") == 1
    watcher = redis.Redis.from_url(redis_server)

    def publish_once_blocked() -> None:  # a blocked client (this test's reader, or another test's) first
        deadline = time.monotonic() + 5
        while int(watcher.info("clients")["blocked_clients"]) < 1 and time.monotonic() < deadline:
            time.sleep(0.005)
        bus.publish([_event("inst-3", 3)])

    later = threading.Thread(target=publish_once_blocked)
    sent.clear()
    later.start()
    try:
        got2 = bus.ack_and_read("g", got, "c", ALL, 5000, 5.0)  # it comes while the read blocks
    finally:
        later.join()
        watcher.close()
    assert [d.event.data["n"] for d in got2 if d.event is not None] == [3]
    assert len(sent) == 1 and bus.pending_count("g") == 1
    bus.close()


@pytest.mark.redis
def test_redis_a_backlog_on_one_partition_still_comes_count_at_a_time(redis_server: str,
                                                                     redis_namespace: str) -> None:
    """A read asks each stream for its share of ``count`` in one command; a stream that filled its share is read
    again for the rest, so a fan-out of one instance (one partition) is not read a share at a time."""
    bus = RedisStreamsBus(redis_server, partitions=P, namespace=redis_namespace)
    try:
        bus.ensure_group("g")
        bus.publish([_event("inst-fan", n) for n in range(30)])
        got = bus.read("g", "c", ALL, 16, 1.0)
        assert [d.event.data["n"] for d in got if d.event is not None] == list(range(16))
        rest = bus.read("g", "c", ALL, 16, 1.0)
        assert [d.event.data["n"] for d in rest if d.event is not None] == list(range(16, 30))
    finally:
        bus.close()


@pytest.mark.redis
def test_redis_a_read_blocked_on_a_stream_deleted_meanwhile_recreates_it_and_goes_on(
        redis_server: str, redis_namespace: str) -> None:
    """Redis answers a read blocked on a stream that is deleted meanwhile (``FLUSHALL``, a namespace cleaned up)
    with ``UNBLOCKED``: the data is gone, as with ``NOGROUP``, so the read recreates the group and goes on."""
    import redis

    bus = RedisStreamsBus(redis_server, partitions=P, namespace=redis_namespace)
    admin = redis.Redis.from_url(redis_server)
    try:
        bus.ensure_group("g")

        def delete_then_publish() -> None:
            deadline = time.monotonic() + 5
            while int(admin.info("clients")["blocked_clients"]) < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            admin.delete(*(bus.keys.stream(p) for p in ALL))
            bus.publish([_event("inst-after", 7)])

        side = threading.Thread(target=delete_then_publish)
        side.start()
        try:
            got = bus.read("g", "c", ALL, 100, 5.0)
            if not got:  # the publish came after the recreated group's read returned: it is there now
                got = bus.read("g", "c", ALL, 100, 5.0)
        finally:
            side.join()
        assert [d.event.data["n"] for d in got if d.event is not None] == [7]
    finally:
        admin.close()
        bus.close()


@pytest.mark.redis
def test_redis_blocking_read_longer_than_the_socket_timeout(redis_server: str, redis_namespace: str) -> None:
    bus = RedisStreamsBus(redis_server, partitions=P, namespace=redis_namespace, socket_timeout=0.4)
    try:
        bus.ensure_group("g")
        start = time.monotonic()
        assert bus.read("g", "c", ALL, 10, 1.0) == []  # several waits, each shorter than the timeout
        assert 0.95 <= time.monotonic() - start < 4.0
    finally:
        bus.close()


@pytest.mark.redis
def test_redis_bus_uses_a_client_it_is_given_and_leaves_it_open(redis_server: str, redis_namespace: str) -> None:
    import redis

    client = redis.Redis.from_url(redis_server, decode_responses=True, socket_timeout=10)
    try:
        bus = RedisStreamsBus(client, partitions=P, namespace=redis_namespace)
        event = _event("inst-client", 1)
        bus.publish([event])
        [d] = bus.read("g", "c", ALL, 10, 1.0)
        assert d.event == event
        bus.close()
        assert client.ping()
    finally:
        client.close()


def test_redis_key_layout_is_namespaced_and_hash_tagged_per_partition() -> None:
    from redis.crc import key_slot

    keys = BusKeys()
    streams = keys.streams(8)
    assert streams[3] == "pollbridge:events:{pollbridge:p3}"
    assert all(k.startswith("pollbridge:") for k in [*streams, keys.dead, keys.epoch(0), keys.wake])
    assert len({key_slot(s.encode()) for s in streams}) == 8  # each partition on its own slot
    for bad in ("", "a b", "x{y}", "ns*", "a:b"):
        with pytest.raises(ConfigError):
            BusKeys(bad)


def test_redis_url_password_is_never_shown() -> None:
    for url in ("redis://:s3cret@127.0.0.1:6379/0", "rediss://user:s3cret@127.0.0.1:6380/1",
                "unix:///tmp/redis.sock?password=s3cret"):
        bus = RedisStreamsBus(url)  # connects lazily: no server needed
        try:
            assert "s3cret" not in repr(bus)
        finally:
            bus.close()
