"""The RabbitMQ backend's hooks for the bus contract suite (tests/support/buses.py) and its server checks.

The server: ``POLLBRIDGE_TEST_RABBITMQ_URL`` (default ``amqp://guest:guest@127.0.0.1:5672/%2F``), RabbitMQ 3.9 or
newer (streams). Every test gets its own namespace, deleted afterwards with everything in it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import uuid
from collections.abc import Callable
from urllib.parse import urlsplit

import pika  # type: ignore[import-untyped]
import pytest

from bridge.bus.base import EventBus
from bridge.bus.rabbitmq import HEADER_ID, RabbitMQBus, RabbitMQNames
from bridge.core.urls import mask_url
from tests.support.buses import Backend, Payload

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"


def rabbitmq_url() -> str:
    return os.environ.get("POLLBRIDGE_TEST_RABBITMQ_URL", DEFAULT_URL)


def reachable_rabbitmq() -> str:
    """The test server's URL, or ``service_unavailable`` (a failure under POLLBRIDGE_REQUIRE_SERVICES=1, else a
    skip) saying how to provide one."""
    from tests.conftest import service_unavailable

    url = rabbitmq_url()
    try:
        params = pika.URLParameters(url)
        params.socket_timeout = 3.0
        params.connection_attempts = 1
        pika.BlockingConnection(params).close()
    except Exception as exc:
        service_unavailable(
            f"no RabbitMQ at {mask_url(url)} ({type(exc).__name__}): start one (3.9+, for streams) or set "
            "POLLBRIDGE_TEST_RABBITMQ_URL=amqp://user:password@host:5672/vhost")
    return url


def new_namespace() -> str:
    return f"pbtest-{uuid.uuid4().hex[:10]}"


def rabbitmq_backend(request: pytest.FixtureRequest, partitions: int) -> Backend:
    url = reachable_rabbitmq()
    namespace = new_namespace()
    closers: list[Callable[[], None]] = []

    def make(ns: str = namespace) -> EventBus:
        bus = RabbitMQBus(url, partitions=partitions, namespace=ns)
        closers.append(bus.close)
        return bus

    def neighbour() -> EventBus:
        ns = new_namespace()
        bus = make(ns)
        closers.append(lambda: delete_namespace(url, ns, partitions))
        return bus

    def leftovers(bus: EventBus) -> list[str]:
        assert isinstance(bus, RabbitMQBus)
        return names_on_server(url, bus.names, partitions)

    closers.append(lambda: delete_namespace(url, namespace, partitions))
    return Backend(name="rabbitmq", open=make, raw_append=lambda b, p, payload, event_id:
                   raw_append(url, b, p, payload, event_id),
                   raw_extra=(b"\xff\xfe not utf-8",), neighbour=neighbour, leftovers=leftovers, _closers=closers)


def raw_append(url: str, bus: EventBus, partition: int, payload: Payload, event_id: str) -> None:
    """One entry straight into the partition's stream over a connection of its own, as another program would
    write it: only the ``id`` header, none of the bus's own, and no wake-up beyond the broker's push."""
    assert isinstance(bus, RabbitMQBus)
    body = payload if isinstance(payload, bytes) else (payload or "").encode("utf-8")
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        ch.confirm_delivery()
        ch.basic_publish("", bus.names.stream(partition), body,
                         pika.BasicProperties(headers={HEADER_ID: event_id}, delivery_mode=2), mandatory=True)
    finally:
        conn.close()


def names_on_server(url: str, names: RabbitMQNames, partitions: int) -> list[str]:
    """Every queue or stream of the namespace on the server: listed by ``rabbitmqctl`` when the server is this
    machine's (catches names outside the layout too), else each name of the layout looked up."""
    prefix = f"{names.namespace}."
    ctl = shutil.which("rabbitmqctl")
    host = urlsplit(url).hostname or ""
    if ctl and host in ("127.0.0.1", "localhost", "::1"):
        vhost = pika.URLParameters(url).virtual_host
        out = subprocess.run([ctl, "-q", "list_queues", "-p", vhost, "name"], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return sorted(line.strip() for line in out.splitlines() if line.strip().startswith(prefix))
    conn = pika.BlockingConnection(pika.URLParameters(url))
    found = []
    try:
        for name in names.all(partitions):
            ch = conn.channel()
            try:
                ch.queue_declare(name, passive=True)
                found.append(name)
            except pika.exceptions.ChannelClosedByBroker:
                continue
            if ch.is_open:
                ch.close()
    finally:
        conn.close()
    return sorted(found)


def delete_namespace(url: str, namespace: str, partitions: int) -> None:
    """Delete every stream and queue of a namespace (a test's cleanup)."""
    names = RabbitMQNames(namespace)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        for name in names.all(partitions):
            ch = conn.channel()
            ch.queue_delete(name)
            if ch.is_open:
                ch.close()
    finally:
        conn.close()


def lose_partition(url: str, bus: EventBus, partition: int) -> None:
    """One partition's stream lost while the state document survives (AMQP ``queue.delete``)."""
    assert isinstance(bus, RabbitMQBus)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        conn.channel().queue_delete(bus.names.stream(partition))
    finally:
        conn.close()
