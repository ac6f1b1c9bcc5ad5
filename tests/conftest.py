"""Shared fixtures: one parametrized database fixture runs every database test on SQLite and PostgreSQL.

PostgreSQL tests use a template database built once per session (pollbridge migrated, the reference
legacy schema created) and cloned per test with ``CREATE DATABASE ... TEMPLATE``, which is much
faster than migrating each time. Without a server they skip, with a reason saying how to start one;
under ``POLLBRIDGE_REQUIRE_SERVICES=1`` (CI) they fail instead.
"""

from __future__ import annotations

import itertools
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from bridge.app import install
from bridge.core.mapping import TaskTableMapping
from bridge.db.engine import create_engine
from tests.support import clear_redis_namespace

PG_ADMIN_URL = os.environ.get("POLLBRIDGE_TEST_PG_URL", "postgresql://root@127.0.0.1:5432/postgres")
REQUIRE_SERVICES = os.environ.get("POLLBRIDGE_REQUIRE_SERVICES") == "1"
PG_HINT = (
    "PostgreSQL is not reachable at {url} ({error}); start it (e.g. `pg_ctlcluster 15 main start`) "
    "or point POLLBRIDGE_TEST_PG_URL at a server where you may create databases"
)

_counter = itertools.count()
_RUN = uuid.uuid4().hex[:6]


def _pg_url(dbname: str) -> str:
    base, _, _ = PG_ADMIN_URL.rpartition("/")
    return f"{base}/{dbname}"


def _admin() -> psycopg.Connection[tuple[object, ...]]:
    return psycopg.connect(PG_ADMIN_URL.replace("postgresql+psycopg://", "postgresql://"), autocommit=True,
                           connect_timeout=5)


def service_unavailable(message: str) -> None:
    if REQUIRE_SERVICES:
        pytest.fail(f"{message} (POLLBRIDGE_REQUIRE_SERVICES=1: services are required)", pytrace=False)
    pytest.skip(message)


@pytest.fixture(scope="session")
def pg_server() -> Iterator[None]:
    try:
        with _admin() as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        service_unavailable(PG_HINT.format(url=PG_ADMIN_URL, error=str(exc).strip().splitlines()[0]))
    yield


def _create_db(name: str, template: str | None = None) -> None:
    with _admin() as conn:
        if template:
            conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE {}").format(sql.Identifier(name),
                                                                          sql.Identifier(template)))
        else:
            conn.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))


def _drop_db(name: str) -> None:
    with _admin() as conn:
        # A replication slot (WAL capture) keeps its database from being dropped: a test that failed before its
        # uninstall leaves one; WITH (FORCE) has ended the sessions that could be reading it.
        _drop_slots(conn, name)
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))


def _drop_slots(conn: psycopg.Connection[tuple[object, ...]], database: str) -> int:
    """Drop the replication slots of ``database`` (terminating a session still reading one); how many."""
    conn.execute("SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots "
                 "WHERE database = %s AND active_pid IS NOT NULL", (database,))
    slots = [r[0] for r in conn.execute("SELECT slot_name FROM pg_replication_slots WHERE database = %s",
                                        (database,)).fetchall()]
    for slot in slots:
        for _ in range(50):  # a terminated walsender releases its slot a moment later
            try:
                conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                break
            except psycopg.errors.ObjectInUse:
                time.sleep(0.1)
    return len(slots)


@pytest.fixture(scope="session")
def pg_template(pg_server: None) -> Iterator[str]:
    name = f"pb_template_{_RUN}"
    _create_db(name)
    engine = create_engine(_pg_url(name))
    try:
        install.init(engine, demo_schema=True, mapping=TaskTableMapping())
    finally:
        engine.dispose()
    yield name
    _drop_db(name)


@pytest.fixture
def pg_empty_url(pg_server: None) -> Iterator[str]:
    """A new, empty PostgreSQL database."""
    name = f"pb_test_{_RUN}_{next(_counter)}"
    _create_db(name)
    yield _pg_url(name)
    _drop_db(name)


@pytest.fixture
def pg_sql_ascii_url(pg_server: None) -> Iterator[str]:
    """A new, empty PostgreSQL database whose encoding is ``SQL_ASCII`` (bytes stored as given: legacy
    schedulers' databases are sometimes made so)."""
    name = f"pb_test_{_RUN}_{next(_counter)}"
    with _admin() as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} ENCODING 'SQL_ASCII' LC_COLLATE 'C' LC_CTYPE 'C' TEMPLATE template0")
                     .format(sql.Identifier(name)))
    yield _pg_url(name)
    _drop_db(name)


@pytest.fixture
def pg_url(pg_template: str) -> Iterator[str]:
    """A PostgreSQL database with pollbridge installed and the reference schema, cloned from the template."""
    name = f"pb_test_{_RUN}_{next(_counter)}"
    _create_db(name, template=pg_template)
    yield _pg_url(name)
    _drop_db(name)


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'pollbridge.db'}"
    engine = create_engine(url)
    try:
        install.init(engine, demo_schema=True, mapping=TaskTableMapping())
    finally:
        engine.dispose()
    return url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest) -> str:
    """A database with pollbridge installed and the reference legacy schema: SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return str(request.getfixturevalue("sqlite_url"))
    return str(request.getfixturevalue("pg_url"))


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def empty_db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """An empty database (nothing installed): SQLite and PostgreSQL."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'empty.db'}"
    return str(request.getfixturevalue("pg_empty_url"))


REDIS_URL = os.environ.get("POLLBRIDGE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
REDIS_HINT = (
    "Redis is not reachable at {url} ({error}); start it (e.g. `redis-server --daemonize yes --save ''`) "
    "or point POLLBRIDGE_TEST_REDIS_URL at one"
)


@pytest.fixture(scope="session")
def redis_server() -> str:
    import redis

    client = redis.Redis.from_url(REDIS_URL, socket_connect_timeout=3)
    try:
        client.ping()
    except redis.RedisError as exc:
        service_unavailable(REDIS_HINT.format(url=REDIS_URL, error=exc))
    finally:
        client.close()
    return REDIS_URL


@pytest.fixture
def redis_namespace(redis_server: str) -> Iterator[str]:
    """A namespace of its own for one test; its keys are deleted afterwards."""
    namespace = f"pbtest-{uuid.uuid4().hex[:10]}"
    yield namespace
    clear_redis_namespace(redis_server, namespace)


REDIS_CLUSTER_HINT = (
    "a local Redis Cluster could not be started ({error}); install the redis-server and redis-cli binaries "
    "(Debian: `apt-get install redis-server`)"
)


@pytest.fixture(scope="session")
def redis_cluster_nodes() -> Iterator[Any]:
    """A 3-primary, 3-replica Redis Cluster of this test process (tests/support/redis_cluster.py)."""
    from tests.support.redis_cluster import start_cluster

    try:
        cluster = start_cluster()
    except FileNotFoundError as exc:  # no binaries: a missing service; anything else is a failure
        service_unavailable(REDIS_CLUSTER_HINT.format(error=exc))
        raise AssertionError("unreachable") from exc
    yield cluster
    cluster.stop()


@pytest.fixture
def redis_cluster(redis_cluster_nodes: Any) -> str:
    """The URL of one node of the session's Redis Cluster (any node: the client finds the others)."""
    return str(redis_cluster_nodes.url)
