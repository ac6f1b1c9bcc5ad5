from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.engine import Engine
from support import Env

from bridge.bus import EventBus, open_bus
from bridge.db import create_engine
from bridge.mapping import TaskTableMapping
from bridge.tasktable import TaskTable, reflect_tables


@pytest.fixture
def engine(db_url: str) -> Iterator[Engine]:
    engine = create_engine(db_url)
    yield engine
    engine.dispose()


@pytest.fixture
def tables(engine: Engine) -> TaskTable:
    return reflect_tables(engine, TaskTableMapping())


@pytest.fixture(params=[
    "sqlite-embedded",
    pytest.param("postgresql-embedded", marks=pytest.mark.postgres),
    pytest.param("postgresql-redis", marks=[pytest.mark.postgres, pytest.mark.redis]),
])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    """The three supported stacks: SQLite + embedded bus, PostgreSQL + embedded bus, PostgreSQL + Redis."""
    db, bus_kind = request.param.split("-")
    url = request.getfixturevalue("sqlite_url" if db == "sqlite" else "pg_url")
    engine = create_engine(url)
    buses: list[EventBus] = []
    namespace = None
    bus_url = "embedded"
    if bus_kind == "redis":
        bus_url = request.getfixturevalue("redis_server")
        namespace = request.getfixturevalue("redis_namespace")

    def opener() -> EventBus:
        bus = open_bus(bus_url, engine=engine, partitions=4, namespace=namespace or "pollbridge")
        buses.append(bus)
        return bus

    yield Env(engine, reflect_tables(engine, TaskTableMapping()), opener, request.param, namespace, url)
    for bus in buses:
        bus.close()
    engine.dispose()
