"""What only the RabbitMQ bus has: its names, its URLs, losing the broker's data, losing the connection, and the
lock-and-document scheme behind its consumer groups. The contract itself is tests/integration/test_bus_contract.py."""

from __future__ import annotations

import json
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

import pika  # type: ignore[import-untyped]
import pytest

from bridge.bus.base import Delivery, partition_for
from bridge.bus.factory import open_bus
from bridge.bus.rabbitmq import HEADER_MARKER, RabbitMQBus, RabbitMQNames
from bridge.core.errors import ConfigError
from bridge.core.events import TASK_STATUS_CHANGED, CloudEvent
from bridge.core.urls import validate_bus_url
from tests.support.rabbitmq import delete_namespace, names_on_server, new_namespace, reachable_rabbitmq

P = 4
ALL = list(range(P))


@pytest.fixture
def server() -> str:
    return reachable_rabbitmq()


@pytest.fixture
def namespace(server: str) -> Iterator[str]:
    ns = new_namespace()
    yield ns
    delete_namespace(server, ns, P)


@pytest.fixture
def bus(server: str, namespace: str) -> Iterator[RabbitMQBus]:
    b = RabbitMQBus(server, partitions=P, namespace=namespace)
    yield b
    b.close()


def _event(key: str, n: int) -> CloudEvent:
    return CloudEvent(id=str(uuid.uuid4()), type=TASK_STATUS_CHANGED, subject=f"task-{n}", partitionkey=key,
                      time=datetime.now(UTC), data={"n": n})


def _read_n(bus: RabbitMQBus, group: str, consumer: str, n: int, timeout: float = 10.0) -> list[Delivery]:
    got: list[Delivery] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        assert time.monotonic() < deadline, f"only {len(got)} of {n} entries delivered"
        got.extend(bus.read(group, consumer, ALL, n - len(got), 0.2))
    assert len(got) == n
    return got


def _delete_everything(url: str, names: RabbitMQNames) -> None:
    """What a broker that lost its data (a node rebuilt without its disk) looks like to this namespace."""
    delete_namespace(url, names.namespace, P)


# ---------------------------------------------------------------------------------------------- names and URLs

def test_names_are_namespaced_and_in_one_place(bus: RabbitMQBus, server: str) -> None:
    names = RabbitMQNames("pollbridge")
    assert names.stream(3) == "pollbridge.events.p3"
    assert names.all(2) == ["pollbridge.events.p0", "pollbridge.events.p1", "pollbridge.state", "pollbridge.dead",
                            "pollbridge.lock"]
    for bad in ("", "a b", "x{y}", "ns*", "a:b"):
        with pytest.raises(ConfigError):
            RabbitMQNames(bad)
    # Everything a working installation creates on the server is in the layout, and nothing else.
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(P * 2)])
    got = _read_n(bus, "g", "c", P * 2)
    bus.dead_letter("g", got[0], "poison")
    assert bus.lag("g") == dict.fromkeys(ALL, 0)
    assert names_on_server(server, bus.names, P) == sorted(bus.names.all(P))


def test_url_password_is_never_shown(server: str) -> None:
    url = "amqp://pbuser:s3cret-pw@127.0.0.1:1/%2F"  # nothing listens on port 1
    bus = RabbitMQBus(url, partitions=P, namespace=new_namespace(), socket_timeout=2.0)
    try:
        assert "s3cret-pw" not in repr(bus) and "pbuser:***@" in repr(bus)
        with pytest.raises(ConnectionError) as info:
            bus.epoch()
        assert "s3cret-pw" not in str(info.value) and "***" in str(info.value)
    finally:
        bus.close()
    for bad in ("amqp://u:s3cret-pw@host:notaport/%2F", "amqp://u:s3cret-pw@host:5672/%2F?heartbeat=soon"):
        with pytest.raises((ConfigError, ValueError)) as caught:
            RabbitMQBus(bad)
        assert "s3cret-pw" not in str(caught.value)
    with pytest.raises(ConfigError) as unsupported:
        validate_bus_url("amqpx://u:s3cret-pw@host/")
    assert "s3cret-pw" not in str(unsupported.value) and "amqp://" in str(unsupported.value)
    opened = open_bus("amqps://u:s3cret-pw@127.0.0.1:5671/vhost", partitions=P)
    try:
        assert isinstance(opened, RabbitMQBus) and "s3cret-pw" not in repr(opened)
    finally:
        opened.close()


# ---------------------------------------------------------------------------------------------- losing things

def test_broker_data_loss_changes_the_epoch_and_a_read_recreates_what_is_needed(bus: RabbitMQBus,
                                                                                server: str) -> None:
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(3)])
    before = _read_n(bus, "g", "c", 3)
    epoch = bus.epoch()
    _delete_everything(server, bus.names)

    assert bus.epoch() != epoch
    assert bus.epoch() == bus.epoch()
    assert bus.read("g", "c", ALL, 10, 0.2) == []  # streams, documents and the group made again
    bus.ack("g", before)  # acknowledging what vanished is harmless
    assert bus.pending_count("g") == 0 and bus.claim_stale("g", "c", ALL, 0.0, 10) == []
    event = _event("inst-after", 1)
    bus.publish([event])
    assert [d.payload for d in bus.read("g", "c", ALL, 10, 2.0)] == [event.to_json()]

    _delete_everything(server, bus.names)
    bus.publish([event])  # the stream comes back before the documents and the group do
    assert [d.payload for d in bus.read("g", "c", ALL, 10, 2.0)] == [event.to_json()]


def test_a_stale_copy_of_the_state_document_never_wins(bus: RabbitMQBus, server: str) -> None:
    """A holder that died between confirming the next version and acknowledging the old one leaves both in the
    queue: the next holder keeps the highest version, whichever comes first."""
    bus.ensure_group("g")
    bus.publish([_event(f"inst-{i}", i) for i in range(4)])
    got = _read_n(bus, "g", "c", 4)
    stale = {"v": 0, "epoch": "stale", "floors": {}, "groups": {"g": {"next": {}, "pending": {}}}}
    conn = pika.BlockingConnection(pika.URLParameters(server))
    try:  # under the lock, as a holder would: the stale copy first in the queue, the real one behind it
        lock = conn.channel()
        tag = lock.basic_consume(bus.names.lock, lambda *_: None, exclusive=True)
        ch = conn.channel()
        ch.confirm_delivery()
        method, _, real = ch.basic_get(bus.names.state)
        assert method is not None and method.message_count == 0
        for body in (json.dumps(stale).encode(), real):
            ch.basic_publish("", bus.names.state, body, pika.BasicProperties(delivery_mode=2))
        ch.basic_ack(method.delivery_tag)
        lock.basic_cancel(tag)
    finally:
        conn.close()
    assert bus.pending_count("g") == 4  # the real document, not the stale one (which has nothing pending)
    assert bus.epoch() != "stale"
    assert bus.read("g", "c", ALL, 10, 0) == []  # the stale offsets would hand everything out again
    bus.ack("g", got)
    assert bus.pending_count("g") == 0


def test_a_lock_holder_that_fails_or_dies_releases_the_lock_and_its_half_made_change(
        bus: RabbitMQBus, server: str, namespace: str) -> None:
    bus.ensure_group("g")
    bus.publish([_event("inst-1", 1)])
    p = partition_for("inst-1", P)
    other = RabbitMQBus(server, partitions=P, namespace=namespace)
    try:
        # An error mid-change: nothing of the change is written, and the lock is free again.
        with pytest.raises(RuntimeError, match="failed mid-change"), other._documents(create=True) as docs:
            assert docs.state is not None
            docs.state["groups"]["g"]["next"] = {str(q): 99 for q in ALL}  # would skip every entry
            docs.state_changed = True
            raise RuntimeError("failed mid-change")
        assert bus.lag("g")[p] == 1
        # A crash while holding the lock and the documents: the broker drops the connection, and the lock and
        # the documents come back to everyone else.
        held = other._documents(create=True)
        held.__enter__()
        _close_server_side(other)
    finally:
        other.close()
    start = time.monotonic()
    assert [d.event.data["n"] for d in _read_n(bus, "g", "c", 1) if d.event] == [1]
    assert time.monotonic() - start < 5.0
    assert bus.pending_count("g") == 1


def _close_server_side(bus: RabbitMQBus) -> None:
    """Close this bus's connection from the broker's side (as a restart or an operator would)."""
    ctl = shutil.which("rabbitmqctl")
    if ctl is None:
        from tests.conftest import service_unavailable

        service_unavailable("rabbitmqctl is not on this machine: cannot close a connection server-side (install the "
                            "broker's CLI tools beside the test server, e.g. `apt-get install rabbitmq-server`)")
        raise AssertionError("unreachable: service_unavailable fails or skips")
    out = subprocess.run([ctl, "-q", "list_connections", "pid", "client_properties"], capture_output=True,
                         text=True, timeout=60, check=True).stdout
    pids = [line.split("\t", 1)[0] for line in out.splitlines() if bus.connection_name in line]
    assert pids, f"connection {bus.connection_name!r} not found"
    for pid in pids:
        subprocess.run([ctl, "-q", "close_connection", pid, "pollbridge test: server-side close"],
                       capture_output=True, text=True, timeout=60, check=True)


def test_reconnecting_after_the_broker_closed_the_connection_loses_nothing(bus: RabbitMQBus, server: str,
                                                                           namespace: str) -> None:
    bus.ensure_group("g")
    events = [_event(f"inst-{i}", i) for i in range(8)]
    bus.publish(events)
    first = bus.read("g", "c", ALL, 3, 0)
    assert len(first) == 3
    _close_server_side(bus)

    bus.ack("g", first)  # the first call after the drop reconnects
    assert bus.pending_count("g") == 0
    rest = _read_n(bus, "g", "c", 5)  # exactly the others: none lost, none twice
    assert sorted(d.payload for d in first + rest) == sorted(e.to_json() for e in events)

    # The watches came back: a publish from elsewhere wakes a blocking read at once.
    _close_server_side(bus)
    late = _event("inst-late", 9)
    publisher = RabbitMQBus(server, partitions=P, namespace=namespace)
    try:
        timer = threading.Timer(0.3, lambda: publisher.publish([late]))
        timer.start()
        start = time.monotonic()
        got = bus.read("g", "c", ALL, 10, 10.0)
        timer.join(10)
        assert [d.payload for d in got] == [late.to_json()]
        assert time.monotonic() - start < 3.0
    finally:
        publisher.close()
    bus.ack("g", [*rest, *got])
    assert bus.lag("g") == dict.fromkeys(ALL, 0) and bus.pending_count("g") == 0


# ---------------------------------------------------------------------------------------------- sync markers

def test_sync_markers_are_never_delivered_tailed_counted_or_trimmed_as_entries(bus: RabbitMQBus, server: str,
                                                                               namespace: str) -> None:
    """Every bus object that reads or tails a partition writes one marker into it; nothing may see them."""
    bus.ensure_group("g")
    key = "inst-markers"
    p = partition_for(key, P)
    events = [_event(key, i) for i in range(3)]
    for e in events:
        others = [RabbitMQBus(server, partitions=P, namespace=namespace) for _ in range(2)]
        try:
            for o in others:  # each writes its marker between the entries
                assert o.end_positions([p])[p] != "" and o.lag("g")[p] >= 0
        finally:
            for o in others:
                o.close()
        bus.publish([e])
    conn = pika.BlockingConnection(pika.URLParameters(server))
    try:  # the markers really are in the stream
        ch = conn.channel()
        ch.basic_qos(prefetch_count=100)
        seen: list[dict[str, object]] = []
        ch.basic_consume(bus.names.stream(p), lambda c, m, props, b: seen.append(dict(props.headers or {})),
                         arguments={"x-stream-offset": "first"})
        deadline = time.monotonic() + 5
        while len(seen) < 9 and time.monotonic() < deadline:
            conn.process_data_events(0.05)
        assert sum(1 for h in seen if HEADER_MARKER in h) >= 6
    finally:
        conn.close()
    assert bus.lag("g")[p] == 3
    assert [d.payload for d in bus.tail({p: "0"}, 100, 0)] == [e.to_json() for e in events]
    got = _read_n(bus, "g", "c", 3)
    assert [d.payload for d in got] == [e.to_json() for e in events]
    assert bus.lag("g")[p] == 0
    bus.ack("g", got)
    assert bus.trim(0.0) == 3
    assert bus.read("late", "c", ALL, 10, 0) == []


# ---------------------------------------------------------------------------------------------- one stream lost

def _delete_stream(url: str, name: str) -> None:
    """One partition's stream gone while the state document survives (AMQP ``queue.delete``, as an operator or a
    lost stream member would leave it)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_delete(name)
    finally:
        conn.close()


def test_one_streams_loss_renews_only_its_epoch_and_its_groups_restart_at_the_new_stream(
        bus: RabbitMQBus, server: str, namespace: str) -> None:
    bus.ensure_group("g")
    key = "inst-lost"
    p = partition_for(key, P)
    bus.publish([_event(key, i) for i in range(5)] + [_event(f"inst-{i}", i) for i in range(8)])
    bus.ack("g", _read_n(bus, "g", "c", 13))
    before = bus.epochs()
    assert len(set(before.values())) == 1
    tailer = RabbitMQBus(server, partitions=P, namespace=namespace)  # as ``serve`` tails: positions of its own
    at = tailer.end_positions([p])[p]
    assert tailer.tail({p: at}, 10, 0) == []
    _delete_stream(server, bus.names.stream(p))

    # Another process, with no memory of the stream: the state document knows of offsets beyond its end.
    other = RabbitMQBus(server, partitions=P, namespace=namespace)
    try:
        after = other.epochs()
        assert after[p] != before[p]
        assert {q: t for q, t in after.items() if q != p} == {q: t for q, t in before.items() if q != p}
        assert other.epochs() == after  # found once
        assert bus.epochs() == after  # bus saw its watch cancelled: the renewal above covers it, no second one
        late = _event(key, 99)
        other.publish([late])
        assert other.lag("g") == {q: (1 if q == p else 0) for q in ALL}
        assert [d.payload for d in bus.read("g", "c", ALL, 10, 5.0)] == [late.to_json()]
        # A tail from a position of the old stream starts again at the new one.
        assert [d.payload for d in tailer.tail({p: at}, 10, 5.0)] == [late.to_json()]
    finally:
        other.close()
        tailer.close()


def test_a_stream_made_again_by_a_publish_is_found_however_long_it_grows(bus: RabbitMQBus, server: str,
                                                                        namespace: str) -> None:
    """The publisher made the stream again (its publish came back unroutable) and published more than the old
    stream held before anyone looked: the length alone cannot tell, the publisher's own notice does."""
    key = "inst-regrown"
    p = partition_for(key, P)
    publisher = RabbitMQBus(server, partitions=P, namespace=namespace)
    try:
        bus.ensure_group("g")
        publisher.publish([_event(key, i) for i in range(3)])
        bus.ack("g", _read_n(bus, "g", "c", 3))
        before = publisher.epochs()
        bus.close()  # the reader is gone: no watch of its own sees the stream go
        _delete_stream(server, publisher.names.stream(p))
        regrown = [_event(key, 100 + i) for i in range(10)]
        publisher.publish(regrown)
        after = publisher.epochs()
        assert after[p] != before[p] and all(after[q] == before[q] for q in ALL if q != p)
        reader = RabbitMQBus(server, partitions=P, namespace=namespace)
        try:
            got = _read_n(reader, "g", "c", 10)
            assert [d.payload for d in got] == [e.to_json() for e in regrown]
        finally:
            reader.close()
    finally:
        publisher.close()
