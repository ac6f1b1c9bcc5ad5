"""The stacks the integration tests run on (the ``env`` fixture of tests/integration/conftest.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from bridge.bus import EventBus, open_bus
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from bridge.tasktable.tables import reflect_tables
from tests.support import Env, clear_redis_namespace

ENV_PARAMS = [
    "sqlite-embedded",
    pytest.param("postgresql-embedded", marks=pytest.mark.postgres),
    pytest.param("postgresql-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
]
#: The stacks plus PostgreSQL + a Redis Cluster (3 primaries, 3 replicas, started by the tests) and PostgreSQL +
#: RabbitMQ (the test server of tests/support/rabbitmq.py): a module opts in by overriding ``env`` with these params
#: and :func:`make_env`.
ENV_PARAMS_WITH_CLUSTER = [
    *ENV_PARAMS,
    pytest.param("postgresql-rediscluster", marks=[pytest.mark.postgres, pytest.mark.redis]),
    pytest.param("postgresql-rabbitmq", marks=[pytest.mark.postgres, pytest.mark.rabbitmq]),
]


#: The partitions of every bus :func:`make_env` opens.
PARTITIONS = 4


def make_env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The stack ``request.param`` names: SQLite or PostgreSQL, with the embedded bus, Redis, a Redis Cluster or
    RabbitMQ (a namespace of its own per test, deleted afterwards)."""
    db, bus_kind = request.param.split("-")
    if bus_kind == "rabbitmq":  # checked first: an unreachable server skips (fails in CI) before a database is made
        from tests.support.rabbitmq import reachable_rabbitmq

        rabbitmq_url = reachable_rabbitmq()
    url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    engine = create_engine(url)
    buses: list[EventBus] = []
    namespace = None
    bus_url = "embedded"
    if bus_kind == "redis":
        bus_url = request.getfixturevalue("redis_server")
        namespace = request.getfixturevalue("redis_namespace")
    elif bus_kind == "rediscluster":
        bus_url = request.getfixturevalue("redis_cluster")
        namespace = f"pbtest-{uuid.uuid4().hex[:10]}"
    elif bus_kind == "rabbitmq":
        bus_url = rabbitmq_url
        namespace = f"pbtest-{uuid.uuid4().hex[:10]}"

    def opener() -> EventBus:
        bus = open_bus(bus_url, engine=engine, partitions=PARTITIONS, namespace=namespace or "pollbridge")
        buses.append(bus)
        return bus

    yield Env(engine, reflect_tables(engine, TaskTableMapping()), opener, request.param, namespace, url,
              None if bus_url == "embedded" else bus_url)
    for bus in buses:
        bus.close()
    if bus_kind == "rediscluster" and namespace is not None:
        clear_redis_namespace(bus_url, namespace)
    if bus_kind == "rabbitmq" and namespace is not None:
        from tests.support.rabbitmq import delete_namespace

        delete_namespace(bus_url, namespace, PARTITIONS)
    engine.dispose()
